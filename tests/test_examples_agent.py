"""examples/agent: an agent written only against the `openai` client (calculator_agent.py, a tool loop around a
multiply it implements itself) trained unchanged through tidyrl's endpoint; the reward and the share of episodes
that call the tool rise."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_jsonl

import tidyrl

pytest.importorskip("openai")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agent"


def test_the_agent_example_learns_its_task_through_the_endpoint(tmp_path):
    """The example's steps with 600 SFT steps instead of 2000 and 20 GRPO rollouts instead of 60 (about 40 s on 2
    CPU cores): over the last 5 rollouts against the first 5, the reward (only the tool's result gives the product)
    and turns_mean (1 + the share of episodes that called the tool) rise beyond 3 standard errors (binomial, 64
    episodes a rollout); no episode failed and none edited its history (the agent sends back what it was
    answered)."""
    work = tmp_path / "work"
    done = subprocess.run([sys.executable, str(EXAMPLE / "prepare.py"), str(work)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    tidyrl.train(str(EXAMPLE / "sft.yaml"), [f"model={work / 'base-model'}", f"data.path={work / 'sft.jsonl'}",
                                             f"output_dir={work / 'sft'}", "train.max_steps=600"])
    tidyrl.train(str(EXAMPLE / "grpo.yaml"), [f"model={work / 'sft' / 'final'}", f"data.path={work / 'tasks.jsonl'}",
                                              f"output_dir={work / 'grpo'}", "train.rollouts=20"])
    rows = read_jsonl(work / "grpo" / "metrics.jsonl")
    assert len(rows) == 20
    assert all(r["env/error_fraction"] == 0.0 and r["agent/segments_mean"] == 1.0 for r in rows)
    for key in ("reward_mean", "turns_mean"):
        first = sum(r[key] for r in rows[:5]) / 5
        last = sum(r[key] for r in rows[-5:]) / 5
        p1, p2 = (first - 1, last - 1) if key == "turns_mean" else (first, last)  # a share in [0, 1]
        se = math.sqrt(max(p1 * (1 - p1), 0) / 320 + max(p2 * (1 - p2), 0) / 320)
        assert last - first > 3 * max(se, 0.01), (key, first, last)
