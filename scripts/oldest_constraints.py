"""Print pip constraints that pin every dependency of tidyrl (and of its `test` extra) to the oldest release
pyproject.toml declares: `name>=X.Y` becomes `name==X.Y.*` (the floor's latest patch release).

CI installs with them in a second environment and runs the default suite there, so that each declared floor
is a tested version, not a guess:

    python scripts/oldest_constraints.py > oldest.txt
    pip install torch==2.13.0 && pip install -c oldest.txt -e ".[test]" && python -m pytest -q

The torch floor, 2.11, is the version GPU images ship (2.11.0+cu130 on this workplace's H100s and H200s, where the
CUDA tests pass: docs/benchmarks.md). PyPI's torch 2.11.0 for Linux is a CUDA build, which also runs on a CPU:
with these constraints pip replaces the CPU torch 2.13 installed first by it (a larger download, no other change).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def floors(extras: tuple[str, ...] = ("test",)) -> dict[str, str]:
    """{package: floor version} of the core dependencies and the given extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    found = {}
    for requirement in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9.]+)", requirement.strip())
        if match is None:
            sys.exit(f"{requirement!r}: every dependency needs a plain `name>=version` floor to be tested")
        found[match.group(1)] = match.group(2)
    return found


if __name__ == "__main__":
    print("\n".join(f"{name}=={version}.*" for name, version in floors().items()))
