"""Golden runs (tests/golden_runs.py): every kind of stage, replayed against the numbers recorded before the
rollout/learner refactor (issue 24). A change that moves one number fails here.

Where the machine matches the recording's (processor, torch, transformers, threads), every metrics row
(wall-clock fields aside), every samples.jsonl row and every final weight must be bit-identical. Elsewhere the
last bits may round differently: rows and weights must then agree to 1e-4 (relative, metrics) and 1e-4
(absolute, weights of order 0.01-1). A real change of behaviour moves them far more: one optimizer step of these
runs moves weights by ~1e-3 (learning rates 1e-3 to 1e-2) and a changed sample or advantage moves rewards and
losses in the first digits. Re-record only on purpose: `python scripts/record_golden.py NAME`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from golden_runs import GOLDEN_DIR, RUNS, environment, run_golden


def close(got, want, rel: float) -> bool:
    """Two JSON values equal, numbers within `rel` (relative, with an absolute floor of rel / 10)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(close(got[k], want[k], rel) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(close(g, w, rel) for g, w in zip(got, want))
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return math.isclose(got, want, rel_tol=rel, abs_tol=rel / 10) or (math.isnan(got) and math.isnan(want))
    return got == want


@pytest.mark.parametrize("name", list(RUNS))
def test_a_golden_run_gives_the_recorded_numbers(name, tmp_path):
    from safetensors.torch import load_file

    recorded = json.loads((GOLDEN_DIR / f"{name}.json").read_text())
    want_weights = load_file(GOLDEN_DIR / f"{name}.safetensors")
    got = run_golden(name, tmp_path)
    exact = recorded["environment"] == environment()
    assert got["weights"].keys() == want_weights.keys()
    if exact:  # the recording's machine and versions: bit for bit
        assert got["metrics"] == recorded["metrics"]
        assert got["samples"] == recorded["samples"]
        for key, want in want_weights.items():
            assert torch.equal(got["weights"][key], want), key
    else:
        assert len(got["metrics"]) == len(recorded["metrics"])
        for row, want in zip(got["metrics"], recorded["metrics"]):
            assert close(row, want, 1e-4), (row, want)
        assert close(got["samples"], recorded["samples"], 1e-4)
        for key, want in want_weights.items():
            torch.testing.assert_close(got["weights"][key], want, rtol=0, atol=1e-4, msg=key)


def test_the_golden_runs_are_recorded():
    """Every run has its record, and every record its run (a renamed run must be re-recorded, not left)."""
    recorded = {p.stem for p in GOLDEN_DIR.glob("*.json")}
    assert recorded == set(RUNS) == {p.stem for p in GOLDEN_DIR.glob("*.safetensors")}
