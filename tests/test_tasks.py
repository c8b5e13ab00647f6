"""reasoning-gym tasks as a prompt source and their own scorer, named in the YAML."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import read_jsonl

import tidyrl
from tidyrl.data import DataError
from tidyrl.data.reasoning_gym import reasoning_gym_dataset, reasoning_gym_score


# In the [test] extra (CI installs it); a machine without it (a GPU image, say) skips these instead of failing them.
needs_reasoning_gym = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                         reason="needs reasoning-gym: pip install -e '.[test]'")


@needs_reasoning_gym
def test_a_task_becomes_chat_prompts_with_answers_and_scores_by_its_own_rules():
    ds = reasoning_gym_dataset("basic_arithmetic", size=4, seed=3, options={"max_terms": 3, "max_digits": 2})
    assert len(ds) == 4 and set(ds.column_names) == {"prompt", "answer", "reasoning_gym_entry"}
    first = ds[0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and "<answer>" in first["prompt"][0]["content"]
    entry = json.loads(first["reasoning_gym_entry"])
    assert entry["question"] == first["prompt"][1]["content"] and str(entry["answer"]) == first["answer"]
    right = f"Let me compute. <answer>{first['answer']}</answer>"
    wrong = f"<answer>{int(first['answer']) + 1}</answer>"
    assert reasoning_gym_score([right, wrong, first["answer"]], [first["reasoning_gym_entry"]] * 3) == [1.0, 0.0, 0.0]
    # The same seed gives the same problems (a resumed or repeated run trains on the same prompts).
    assert reasoning_gym_dataset("basic_arithmetic", 4, 3, {"max_terms": 3, "max_digits": 2})[:] == ds[:]


@needs_reasoning_gym
def test_unknown_tasks_and_options_are_refused_with_the_fix():
    with pytest.raises(DataError, match="'basic_arithmetik' is not a reasoning-gym task; did you mean basic_arithmetic"):
        reasoning_gym_dataset("basic_arithmetik", 2, 0, {})
    with pytest.raises(DataError, match="do not configure 'basic_arithmetic'"):
        reasoning_gym_dataset("basic_arithmetic", 2, 0, {"no_such_option": 1})


@needs_reasoning_gym
def test_a_grpo_run_on_a_reasoning_gym_task(tiny_model_dir, tmp_path):
    result = tidyrl.train({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 1,
        "data": {"reasoning_gym": "basic_arithmetic", "reasoning_gym_size": 12, "eval_fraction": 0.25,
                 "reasoning_gym_options": {"max_terms": 2, "max_digits": 1},
                 "overlong_prompts": "truncate"},  # the tiny model has 256 positions; the system prompt is long
        "rewards": [{"function": "tidyrl.data.reasoning_gym:reasoning_gym_score"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        "train": {"rollouts": 2, "micro_batch_size": 4},
        "log": {"progress_bar": False},
    })
    assert result.plan.num_prompts == 9  # 12 generated, 3 held out
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert [r["reward/reasoning_gym_score"] for r in rows] == [0.0, 0.0]  # a random tiny model answers nothing
    assert "eval/reward_mean" in rows[-1]
    with pytest.raises(tidyrl.config.ConfigError, match="data.reasoning_gym: the prompts come from data.path or"):
        tidyrl.config.load_config({"model": "m", "data": {"path": "p.jsonl", "reasoning_gym": "basic_arithmetic"},
                                   "rewards": [{"function": "m:f"}], "train": {"rollouts": 1}})
