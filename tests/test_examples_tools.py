"""examples/tools: SFT on tool-call conversations, then multi-turn GRPO with a ToolEnvironment (multiply, capital)
through the tiny byte-level model's chat template; the share of turns that call a tool and the reward rise."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tools"


@pytest.mark.slow
def test_the_tools_example_learns_to_call_its_tools(tmp_path):
    """The example as run.sh runs it, with 40 GRPO rollouts instead of 100 (about 45 s on 2 CPU cores): over the
    last 15 rollouts against the first 5, turns_mean (1 + the share of episodes that called a tool, as each call is
    followed by the answer) and the reward (only a tool's result can give it) rise beyond 3 standard errors
    (binomial, 64 episodes a rollout)."""
    work = tmp_path / "work"
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    tidyrl = [sys.executable, "-m", "tidyrl", "train"]

    def run(*command):
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=900, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    run(sys.executable, EXAMPLE / "prepare.py", work)
    run(*tidyrl, EXAMPLE / "sft.yaml", f"model={work / 'base-model'}", f"data.path={work / 'sft.jsonl'}",
        f"output_dir={work / 'sft'}")
    run(*tidyrl, EXAMPLE / "grpo.yaml", f"model={work / 'sft' / 'final'}", f"data.path={work / 'tasks.jsonl'}",
        f"output_dir={work / 'grpo'}", "train.rollouts=40")
    rows = read_jsonl(work / "grpo" / "metrics.jsonl")
    assert len(rows) == 40 and all(r["env/error_fraction"] == 0.0 for r in rows)

    def rise(key, first, last):
        p1 = sum(r[key] for r in rows[:first]) / first
        p2 = sum(r[key] for r in rows[-last:]) / last
        p1b, p2b = (p1 - 1, p2 - 1) if key == "turns_mean" else (p1, p2)  # a share in [0, 1]
        se = math.sqrt(max(p1b * (1 - p1b), 0) / (64 * first) + max(p2b * (1 - p2b), 0) / (64 * last))
        return p2 - p1, 3 * max(se, 0.01), (p1, p2)

    for key in ("turns_mean", "reward_mean"):
        gain, margin, means = rise(key, 5, 15)
        assert gain > margin, (key, means, margin)
