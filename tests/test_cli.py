"""The command line as a user types it: plan, train from YAML, mistakes caught with a suggestion."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from tidyrl.cli import main
from tidyrl.plan import make_plan

REWARD_FILE = textwrap.dedent('''
    def has_vowel(prompts, completions, **kwargs):
        return [float(any(c in "aeiou" for c in text)) for text in completions]
''')


@pytest.fixture
def yaml_run(tmp_path, tiny_model_dir, prompt_file):
    """A YAML config whose reward function is a file given relative to the YAML's folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(REWARD_FILE)
    cfg = {
        "algorithm": "grpo",
        "model": str(tiny_model_dir),
        "output_dir": str(tmp_path / "out"),
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": "my_rewards.py:has_vowel", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"rollouts": 2, "micro_batch_size": 4, "minibatches_per_epoch": 2, "learning_rate": 1e-3},
        "log": {"progress_bar": False},
    }
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_plan_prints_the_plan_as_json(yaml_run, capsys):
    assert main(["plan", str(yaml_run), "rollout.prompts_per_rollout=4", "--num-processes", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == make_plan(prompts_per_rollout=4, samples_per_prompt=4, minibatches_per_epoch=2,
                                micro_batch_size=4, world_size=2, rollouts=2, num_prompts=10).to_dict()
    assert printed["gradient_accumulation_steps"] == 1 and printed["total_optimizer_steps"] == 4


def test_plan_rejects_sizes_that_do_not_divide(yaml_run, capsys):
    # R = 2*4 = 8 episodes; M = 3 does not divide 8.
    assert main(["plan", str(yaml_run), "train.minibatches_per_epoch=3"]) == 2
    err = capsys.readouterr().err
    assert "train.minibatches_per_epoch" in err and "1, 2, 4, 8" in err


def test_mistyped_key_is_caught_with_a_suggestion(yaml_run, capsys):
    assert main(["train", str(yaml_run), "rollout.prompts_per_rolout=8"]) == 2
    err = capsys.readouterr().err
    assert "rollout.prompts_per_rolout" in err and "rollout.prompts_per_rollout" in err
    assert not (yaml_run.parent.parent / "out").exists()  # refused before anything was written


def test_train_from_yaml_on_the_command_line(yaml_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidyrl", "train", str(yaml_run), "seed=1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "4 optimizer steps, 16 episodes" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "reward/has_vowel" in rows[0]
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["seed"] == 1
