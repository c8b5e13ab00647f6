"""The package's floors: model code and the modules beside it never import the training loops, and model code
never imports the rollout record. An upward import is how loading code ended up inside loops/common.py."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tidyrl"
ABOVE_THE_LOOPS = {"api.py", "cli.py", "__init__.py", "__main__.py", "demo.py"}  # they start the loops


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def below_the_loops() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py"))
            if "loops" not in p.relative_to(SRC).parts and p.name not in ABOVE_THE_LOOPS or
            p.parent.name == "models"]


@pytest.mark.parametrize("path", below_the_loops(), ids=lambda p: str(p.relative_to(SRC)))
def test_nothing_below_the_loops_imports_them(path):
    upward = sorted(m for m in imported_modules(path) if m == "tidyrl.loops" or m.startswith("tidyrl.loops."))
    assert not upward, f"{path.relative_to(SRC)} imports {upward}: move what it needs below the loops"


@pytest.mark.parametrize("path", sorted((SRC / "models").glob("*.py")), ids=lambda p: p.name)
def test_model_code_does_not_import_the_rollout_record(path):
    assert "tidyrl.rollout" not in imported_modules(path), \
        f"models/{path.name} imports tidyrl.rollout: model code takes tensors, not a Rollout"


def test_the_check_sees_an_upward_import(tmp_path):
    """The checker itself: an upward import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tidyrl.loops.common import TrainResult\n")
    assert "tidyrl.loops.common" in imported_modules(module)
