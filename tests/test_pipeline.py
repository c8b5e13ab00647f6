"""The pipeline example (examples/pipeline): SFT -> reward model -> GRPO (and PPO), and SFT -> SimPO, each stage starting from the
previous stage's final/. The fast test runs run.sh's own commands in this process, with small sizes; the slow one
runs run.sh itself at full size."""

from __future__ import annotations

import os
import runpy
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import read_jsonl

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pipeline"

QUICK = {  # stage config -> overrides that make it a few optimizer steps
    "sft.yaml": ["train.dataset_epochs=null", "train.max_steps=3", "train.warmup_steps=0"],
    "reward.yaml": ["train.dataset_epochs=null", "train.max_steps=2", "train.warmup_steps=0"],
    "simpo.yaml": ["train.dataset_epochs=null", "train.max_steps=2", "train.warmup_steps=0", "log.eval_every=1"],
    "grpo.yaml": ["train.rollouts=1", "rollout.prompts_per_rollout=4", "rollout.samples_per_prompt=2",
                  "train.micro_batch_size=4", "train.warmup_steps=0"],
    "ppo.yaml": ["train.rollouts=1", "rollout.prompts_per_rollout=4", "train.epochs_per_rollout=1",
                 "train.minibatches_per_epoch=1", "train.micro_batch_size=8", "train.warmup_steps=0"],
}


def run_sh_commands(work: Path) -> list[list[str]]:
    """The commands of run.sh (the optional PPO one included), with $HERE and $WORK filled in."""
    commands = []
    for line in (EXAMPLE / "run.sh").read_text().splitlines():
        line = line.strip()
        if line.startswith(("python ", "tidyrl ")):
            line = line.replace("$HERE", str(EXAMPLE)).replace("$WORK", str(work))
            commands.append(shlex.split(line))
    return commands




def test_pipeline_stages_chain(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tidyrl.cli import main

    work = tmp_path / "work"
    commands = run_sh_commands(work)
    assert [c[0] for c in commands] == ["python", "tidyrl", "tidyrl", "tidyrl", "tidyrl", "tidyrl"]
    monkeypatch.setattr("sys.argv", [commands[0][1], *commands[0][2:]])
    runpy.run_path(commands[0][1], run_name="__main__")  # prepare.py: tiny model and data
    for command in commands[1:]:
        assert command[1] == "train"
        stage = Path(command[2]).name
        quick = [*QUICK[stage], "log.progress_bar=false", "log.log_every=1"]
        assert main([*command[1:], *quick]) == 0, capsys.readouterr().err

    # Each stage read the previous stage's final/ ...
    configs = {name: yaml.safe_load((work / name / "config.yaml").read_text())
               for name in ("sft", "reward", "simpo", "grpo", "ppo")}
    assert configs["sft"]["model"] == str(work / "base-model")
    for stage in ("reward", "simpo", "grpo", "ppo"):
        assert configs[stage]["model"] == str(work / "sft" / "final")
    assert configs["grpo"]["rewards"][1]["model"] == configs["ppo"]["rewards"][1]["model"] == str(work / "reward" / "final")
    # ... and wrote exactly the steps it was asked for.
    assert len(read_jsonl(work / "sft" / "metrics.jsonl")) == 3
    assert len(read_jsonl(work / "reward" / "metrics.jsonl")) == 2
    simpo_rows = read_jsonl(work / "simpo" / "metrics.jsonl")  # SFT -> SimPO: held-out pairs scored each step
    assert [r["step"] for r in simpo_rows] == [1, 2] and all("eval/accuracy" in r for r in simpo_rows)
    best = yaml.safe_load((work / "simpo" / "best.json").read_text())
    assert best["metric"] == "eval/accuracy" and best["step"] in (1, 2)
    AutoModelForCausalLM.from_pretrained(work / "simpo" / "best")
    grpo_rows = read_jsonl(work / "grpo" / "metrics.jsonl")
    assert len(grpo_rows) == 2  # 1 rollout * minibatches_per_epoch 2
    assert grpo_rows[0]["reward/reversal"] is not None and grpo_rows[0]["reward/reward_model"] is not None
    # The finals load as what the next stage needs.
    AutoModelForCausalLM.from_pretrained(work / "sft" / "final")
    rm = AutoModelForSequenceClassification.from_pretrained(work / "reward" / "final")
    assert rm.config.num_labels == 1 and rm.config.pad_token_id is not None
    AutoModelForCausalLM.from_pretrained(work / "grpo" / "final")
    AutoModelForCausalLM.from_pretrained(work / "ppo" / "final")
    assert len(read_jsonl(work / "ppo" / "metrics.jsonl")) == 1
    assert (work / "ppo" / "final" / "critic").is_dir()  # the critic (by default it starts from the reward model)


@pytest.mark.slow
def test_run_sh_at_full_size(tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(["bash", str(EXAMPLE / "run.sh"), str(tmp_path / "work")], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(tmp_path / "work" / "grpo" / "metrics.jsonl")
    first, last = rows[0]["reward/reversal"], sum(r["reward/reversal"] for r in rows[-6:]) / 6
    assert last > first, (first, last)  # GRPO improves on the SFT model's reversals
    simpo = read_jsonl(tmp_path / "work" / "simpo" / "metrics.jsonl")
    assert simpo[-1]["rewards/margin"] > simpo[0]["rewards/margin"]  # SimPO separates chosen from rejected
