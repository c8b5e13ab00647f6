"""The benchmark scripts run and print what the speed issue asks for (tidyrl alone: TRL is an optional extra)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path


BENCH = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def number(row: str, text: str) -> float:
    """The first number on the table row that starts with `row`."""
    match = re.search(rf"^{re.escape(row)}\s+([0-9.]+)", text, re.MULTILINE)
    assert match, (row, text)
    return float(match.group(1))


def test_bench_vs_trl_prints_the_table_and_the_run_has_the_time_split(tmp_path):
    out = run("bench_vs_trl.py", "--workload", "tiny", "--repeats", "1", "--steps", "2", "--warmup", "1",
              "--libraries", "tidyrl", "--keep", str(tmp_path))
    for row in ("episodes/s", "completion tokens/s", "s / optimizer step", "rollout: generate s",
                "rollout: score s", "rollout: update s", "peak RSS MiB", "nominal GFLOP/s"):
        assert number(row, out) >= 0
    assert number("episodes/s", out) > 0 and number("peak RSS MiB", out) > 100
    assert re.search(r"measured float32 GEMM peak: [0-9.]+ GFLOP/s", out)
    rows = [json.loads(line) for line in (tmp_path / "tiny" / "tidyrl-0" / "run" / "metrics.jsonl").open()]
    assert len(rows) == 3  # 1 warm-up rollout + 2 measured optimizer steps (E = 1)
    for row in rows:
        assert all(row[f"time/{k}_s"] > 0 for k in ("generate", "update"))


def test_bench_update_compares_both_paths_and_they_agree():
    out = run("bench_update.py", "--workload", "tiny", "--repeats", "1")
    assert re.search(r"lean pass\s+forward\s+[0-9.]+ ms\s+backward\s+[0-9.]+ ms", out)
    assert re.search(r"HF forward\s+forward\s+[0-9.]+ ms", out)
    lp = float(re.search(r"max \|log-prob difference\| ([0-9.e+-]+)", out).group(1))
    grad = float(re.search(r"max gradient difference \(relative to the tensor's largest\) ([0-9.e+-]+)", out).group(1))
    assert lp < 1e-5 and grad < 1e-4
    saved = float(re.search(r"saved-tensor memory ([0-9.]+)x", out).group(1))
    assert saved < 1.0  # the lean pass keeps fewer bytes for backward than the model's own forward
