"""Golden runs (tests/golden_runs.py): every kind of stage, replayed against the numbers recorded in
tests/golden/. A change that moves one number fails here.

Where the machine matches the recording's (processor, torch, transformers, threads), every metrics row
(wall-clock fields aside), every samples.jsonl row and every final weight must be bit-identical. Elsewhere the
last bits may round differently: rows and weights must then agree to 1e-4 (relative, metrics) and 1e-4
(absolute, weights of order 0.01-1). A real change of behaviour moves them far more: one optimizer step of these
runs moves weights by ~1e-3 (learning rates 1e-3 to 1e-2) and a changed sample or advantage moves rewards and
losses in the first digits. Rounding can also flip a discrete outcome on another processor (a sampled token, a
clipped token: seen on a GPU machine's Intel CPU with torch 2.11), after which nothing is comparable: then, and
only then, the test skips there, naming the first difference. Re-record only on purpose:
`python scripts/record_golden.py NAME`.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from golden_runs import GOLDEN_DIR, RUNS, environment, run_golden


def close(got, want, rel: float) -> bool:
    """Two JSON values equal, numbers within `rel` (relative, with an absolute floor of rel / 10)."""
    return first_difference(got, want, rel) is None


def first_difference(got, want, rel: float, path: str = "") -> str | None:
    """Where two JSON values first differ beyond `rel` ("path: got X, recorded Y"), or None."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or got.keys() != want.keys():
            return f"{path or 'keys'}: got {sorted(got) if isinstance(got, dict) else got}, recorded {sorted(want)}"
        return next((d for k in want if (d := first_difference(got[k], want[k], rel, f"{path}.{k}"))), None)
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"{path}: got {got}, recorded {want}"
        return next((d for i, (g, w) in enumerate(zip(got, want))
                     if (d := first_difference(g, w, rel, f"{path}[{i}]"))), None)
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        same = math.isclose(got, want, rel_tol=rel, abs_tol=rel / 10) or (math.isnan(got) and math.isnan(want))
        return None if same else f"{path}: got {got!r}, recorded {want!r}"
    return None if got == want else f"{path}: got {got!r}, recorded {want!r}"


def discrete_outcome_flipped(got: dict, recorded: dict) -> str | None:
    """The first sampled completion or clipped fraction that differs (rounding on another processor can flip
    either; every number after it then differs by more than rounding), or None."""
    for i, (g, w) in enumerate(zip(got["samples"], recorded["samples"])):
        if g.get("completion") != w.get("completion"):
            return f"samples[{i}].completion: got {g.get('completion')!r}, recorded {w.get('completion')!r}"
    for i, (g, w) in enumerate(zip(got["metrics"], recorded["metrics"])):
        for key in w:
            if key.endswith("fraction") and isinstance(w[key], float) and g.get(key) != w[key]:
                return f"metrics[{i}].{key}: got {g.get(key)!r}, recorded {w[key]!r}"
    return None


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
        assert len(got["samples"]) == len(recorded["samples"])
        assert [row.keys() for row in got["metrics"]] == [row.keys() for row in recorded["metrics"]]
        if flipped := discrete_outcome_flipped(got, recorded):
            pytest.skip(f"another machine ({environment()}; recorded on {recorded['environment']}) flipped a "
                        f"discrete outcome by rounding, {flipped}: compared bit for bit on the recording's machine")
        for i, (row, want) in enumerate(zip(got["metrics"], recorded["metrics"])):
            assert (d := first_difference(row, want, 1e-4, f"metrics[{i}]")) is None, d
        assert (d := first_difference(got["samples"], recorded["samples"], 1e-4, "samples")) is None, d
        for key, want in want_weights.items():
            torch.testing.assert_close(got["weights"][key], want, rtol=0, atol=1e-4, msg=key)


def test_the_golden_runs_are_recorded():
    """Every run has its record, and every record its run (a renamed run must be re-recorded, not left)."""
    recorded = {p.stem for p in GOLDEN_DIR.glob("*.json")}
    assert recorded == set(RUNS) == {p.stem for p in GOLDEN_DIR.glob("*.safetensors")}
