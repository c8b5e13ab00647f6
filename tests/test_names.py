"""Every name the code uses is defined, in the paths CI cannot run too: TRL's side of bench_vs_trl.py (TRL is an
extra), the CUDA-only branches, the GPU scripts. A name copied from one function into another where it is not
defined fails only when that path runs, which may be on a GPU lent for minutes (tidyrl's phase clocks wrap code
inside TRL's benchmark child, where `producer`, `rl_rollout` and `rl` do not exist). pyflakes reads the code
without running it."""

from __future__ import annotations

from pathlib import Path

import pytest

# (part of the [test] extra; a machine with only the runtime's packages, such as a lent GPU's image, skips)
pytest.importorskip("pyflakes", reason="needs pyflakes: pip install -e '.[test]'")
from pyflakes import api, messages, reporter  # noqa: E402

ROOT = Path(__file__).parent.parent


class _Collect(reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
            self.found.append(str(message))

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: {msg}")


def test_no_module_uses_a_name_it_does_not_define():
    collect = _Collect()
    files = [p for folder in ("src", "benchmarks", "scripts", "tests", "examples") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 100
    for path in files:
        api.checkPath(str(path), collect)
    assert collect.found == []


def test_the_check_sees_a_name_used_where_it_is_not_defined(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def child():\n    return producer.Producer.round\n")
    collect = _Collect()
    api.checkPath(str(bad), collect)
    assert len(collect.found) == 1 and "undefined name 'producer'" in collect.found[0]
