"""Record the golden runs (tests/golden_runs.py) into tests/golden/: run on purpose only, when a change of
behaviour is meant, and say so in the commit.

    python scripts/record_golden.py [NAME ...]      (default: every run)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from golden_runs import GOLDEN_DIR, RUNS, environment, run_golden  # noqa: E402


def main(names: list[str]) -> None:
    from safetensors.torch import save_file

    GOLDEN_DIR.mkdir(exist_ok=True)
    for name in names or list(RUNS):
        with tempfile.TemporaryDirectory() as tmp:
            got = run_golden(name, Path(tmp))
        save_file({k: v.contiguous() for k, v in got["weights"].items()}, GOLDEN_DIR / f"{name}.safetensors")
        record = {"environment": environment(), "metrics": got["metrics"], "samples": got["samples"]}
        (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {len(got['metrics'])} metrics rows, {len(got['weights'])} tensors", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
