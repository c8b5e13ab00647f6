"""The import rules of DESIGN §6, each checked on every module (imports at top level and inside functions alike):

    face (cli, api, demo, evaluate, plot)
      learner loops: rl/, offline/ above run/         -> plan, config, checkpoint, metrics (the run's support)
        memory plan (beside the batch plan; no torch)
        rollouts (episodes -> Rollout record)
          engines   environments   rewards   data
            models
              algorithms (pure tensor maths)

A part may use the parts below it, never the ones above; the run's support modules use only each other and the
algorithm table; every part but the algorithms may print through tidyrl.console and mark the work it has done in
tidyrl.liveness, which import no part; and no module reaches itself through its imports (no circles).
docs/architecture.md draws the same picture. Model code also tests no engine or algorithm name and takes no config:
it takes arguments.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "tidyrl"
FACE = {"api", "cli", "demo", "evaluate", "plot", "__init__", "__main__"}
SUPPORT = {"config", "plan", "checkpoint", "metrics", "trackers", "run_lock"}

ALLOWED = {  # part -> the parts it may import (besides itself); console: tidyrl.console, the one printing
    # helper; liveness: tidyrl.liveness, the record of the work last done
    "algorithms": set(),
    "models": {"algorithms", "console", "liveness"},
    "engines": {"models", "algorithms", "console", "liveness"},
    "environments": {"console", "liveness"},
    "rewards": {"models", "algorithms", "console", "liveness"},
    "data": {"console", "liveness"},
    "rollouts": {"engines", "environments", "rewards", "data", "models", "algorithms", "console", "liveness"},
    "loops": {"memory", "rollouts", "engines", "environments", "rewards", "data", "models", "algorithms", "support",
              "console", "liveness"},
    "memory": {"engines", "models", "algorithms", "support", "console", "liveness"},
    "support": {"algorithms", "console", "liveness"},
    "console": set(),
    "liveness": set(),
}
WHY = {
    "algorithms": "algorithms are pure tensor maths: they import no other tidyrl part and take no config",
    "models": "models take arguments, not the config; they know no rollout, loop or engine",
    "engines": "engines know no rollout record, no loop, no environment",
    "environments": "environments never generate (no engine, no model): they answer a turn's text",
    "rewards": "rewards know no loop, rollout or engine",
    "data": "data take a tokenizer and load no model",
    "rollouts": "rollouts know no learner (loops) and no run support: they are handed what they need",
    "loops": "the learner loops are below the face",
    "memory": "the memory plan reads the config and the model's config.json, before any loop or rollout exists",
    "support": "the run's support (config, plan, checkpoint, metrics) imports only itself and the algorithm table: "
               "engine-, tracker- and model-specific checks live with those parts",
    "console": "tidyrl.console prints; every part but the algorithms may use it, so it imports no part",
    "liveness": "tidyrl.liveness records the last piece of work done; every part but the algorithms marks it, so it "
                "imports no part",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(["tidyrl", *parts])


def imported_modules(path: Path) -> set[str]:
    """Every tidyrl module `path` imports, at top level or inside functions (`from tidyrl.x import y` counts as
    tidyrl.x.y where that is a module, and as tidyrl.x where y is not)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            names.update(modules)
            if len(modules) < len(node.names):  # a name of the module itself (`from tidyrl import liveness`: none)
                names.add(node.module)
    return {n for n in names if n == "tidyrl" or n.startswith("tidyrl.")}


def part_of(module: str) -> str:
    """The part a module belongs to: its folder under tidyrl/, or face/support for the top-level modules."""
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] in FACE:
        return "face"
    if parts[1] in SUPPORT:
        return "support"
    return parts[1]


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(MODULES), ids=str)
def test_a_part_imports_only_the_parts_below_it(module):
    part = part_of(module)
    if part == "face":
        return
    assert part in ALLOWED, f"{module}: the part {part!r} is not in DESIGN §6's picture; add it to this test and the docs"
    wrong = sorted(m for m in imported_modules(MODULES[module])
                   if part_of(m) != part and part_of(m) not in ALLOWED[part])
    assert not wrong, f"{module} imports {wrong}: {WHY[part]}"


def model_code_problems(path: Path, names: set[str]) -> list[str]:
    """Where the code of `path` tests a name from `names` (a string literal equal to one, docstrings aside) or takes
    the run's config (a parameter `cfg`, a read `cfg.x`, the name `Config`)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names | {"Config"}
                and id(node) not in docstrings):  # ("Config": a quoted annotation)
            found.append(f"line {node.lineno}: the name {node.value!r}")
        elif isinstance(node, ast.arg) and node.arg == "cfg":
            found.append(f"line {node.lineno}: a parameter `cfg`")
        elif isinstance(node, ast.Name) and (node.id == "Config"
                                             or node.id == "cfg" and isinstance(node.ctx, ast.Load)):
            found.append(f"line {node.lineno}: `{node.id}`")
    return sorted(set(found))


MODEL_MODULES = sorted(m for m in MODULES if part_of(m) == "models")


@pytest.mark.parametrize("module", MODEL_MODULES, ids=str)
def test_model_code_takes_arguments_not_engine_or_algorithm_names_or_the_config(module):
    """Models take arguments: which engine or algorithm a run uses, and what its config says, the caller (an engine,
    a loop) turns into the arguments it passes. The names are read from their owners, the engine and algorithm
    tables."""
    from tidyrl.config import ALGORITHMS
    from tidyrl.engines import ENGINES

    found = model_code_problems(MODULES[module], set(ENGINES) | set(ALGORITHMS))
    assert not found, (f"{module} tests an engine or algorithm name or takes the config ({'; '.join(found)}): "
                       f"{WHY['models']}; pass what the code needs as arguments")


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "tidyrl.models.families"), ids=str)
def test_only_the_family_declarations_name_a_family(module):
    """A model family is a declaration (tidyrl.models.families): every other module reads its fields, and none
    tests a family's name or one of its architectures' class names (as the fast paths once chose by class name)."""
    from tidyrl.models.families import FAMILIES

    names = {f.name for f in FAMILIES} | {f.model_type for f in FAMILIES if f.model_type} | {
        a for f in FAMILIES for a in f.architectures}
    found = [f for f in model_code_problems(MODULES[module], names) if "the name" in f and "'Config'" not in f]
    assert not found, f"{module} names a model family ({'; '.join(found)}): read its declaration instead"


def test_the_model_code_check_sees_a_name_test_and_a_config(tmp_path):
    """The checker itself: a name compared, a config taken or read are found; the same words in a docstring are not."""
    module = tmp_path / "m.py"
    module.write_text('"""Runs under vllm."""\n\ndef f(engine, cfg):\n    """For grpo."""\n'
                      '    return engine == "vllm" or cfg.rollout.lag\n\ndef g(c: "Config"):\n    return c\n')
    assert model_code_problems(module, {"vllm", "grpo"}) == [
        "line 3: a parameter `cfg`", "line 5: `cfg`", "line 5: the name 'vllm'", "line 7: the name 'Config'"]
    module.write_text('def g(c: Config):\n    return c\n')
    assert model_code_problems(module, set()) == ["line 1: `Config`"]


def test_no_module_reaches_itself_through_its_imports():
    graph = {m: {i for i in imported_modules(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    for module, path in MODULES.items():  # a module's package (its __init__) is not an import of it
        graph[module] -= {m for m in graph[module] if module.startswith(m + ".")}
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_an_import_inside_a_function(tmp_path):
    """The checker itself: an import inside a function is found, and a module's part is its folder."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tidyrl.loops.run.setup import TrainResult\n")
    assert "tidyrl.loops.run.setup" in imported_modules(module)
    assert (part_of("tidyrl.loops.rl.learner"), part_of("tidyrl.config"), part_of("tidyrl.cli")) == \
        ("loops", "support", "face")
    assert part_of("tidyrl.models.lora") == "models" and part_of("tidyrl.rollouts") == "rollouts"


SECOND_LEVEL = [  # (modules of a folder, modules they never import, why)
    ("tidyrl.loops.run", ("tidyrl.loops.rl", "tidyrl.loops.offline", "tidyrl.loops.stage_plan"),
     "the run machinery is shared by the learners, below them: it knows neither"),
    ("tidyrl.loops.rl", ("tidyrl.loops.offline",), "the RL learner and the offline learners are siblings"),
    ("tidyrl.loops.offline", ("tidyrl.loops.rl",), "the RL learner and the offline learners are siblings"),
    ("tidyrl.models.forward", ("tidyrl.models.generation",),
     "the training forward shares helpers with decoding (models.sequences), not the decode loop"),
]


@pytest.mark.parametrize("folder,never,why", SECOND_LEVEL, ids=[s[0] for s in SECOND_LEVEL])
def test_the_second_level_keeps_its_parts_apart(folder, never, why):
    wrong = sorted(f"{m} -> {i}" for m, p in MODULES.items() if m == folder or m.startswith(folder + ".")
                   for i in imported_modules(p) if any(i == n or i.startswith(n + ".") for n in never))
    assert not wrong, f"{'; '.join(wrong)}: {why}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part_of(m) == "memory" or m == "tidyrl.plan"),
                         ids=str)
def test_the_plans_import_no_torch(module):
    """The batch plan and the memory plan are config in, numbers out: `tidyrl plan` runs them without torch (a
    CUDA device's size is read from torch only where a run has imported it already: `sys.modules`)."""
    heavy = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        heavy.update(n for n in names if n.split(".")[0] in ("torch", "transformers", "accelerate"))
    assert not heavy, f"{module} imports {sorted(heavy)}"
