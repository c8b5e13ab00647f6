"""PPO with a value model, REINFORCE++, end to end on tiny local models."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import expected_lrs, with_sections

import tidyrl
from tidyrl.checkpoint import complete_checkpoints
from tidyrl.models.tiny import build_char_tokenizer, save_tiny_reward_model


@pytest.fixture(scope="module")
def other_rm(tmp_path_factory):
    """A reward model with its own vocabulary and chat template (unlike the policy's)."""
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "other", seed=4)


@pytest.fixture(scope="module")
def same_vocab_rm(tmp_path_factory):
    """A reward model that shares the policy's tokenizer, so it can also initialise the critic."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = tmp_path_factory.mktemp("rm") / "same"
    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(9)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def ppo_config(model_dir, rm_dir, prompt_file, out, **sections):
    cfg = {
        "algorithm": "ppo", "model": str(model_dir), "output_dir": str(out), "seed": 2,
        "data": {"path": str(prompt_file)},
        "rewards": [{"model": str(rm_dir), "weight": 1.0}, {"function": "tidyrl.demo:anagram_reward", "weight": 0.5}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 6, "forward_batch_size": 3},
        "train": {"rollouts": 3, "epochs_per_rollout": 2, "minibatches_per_epoch": 2, "micro_batch_size": 1,
                  "learning_rate": 1e-3, "lr_scheduler": "linear", "warmup_steps": 2},
        "critic": {"model": str(model_dir), "learning_rate": 3e-3, "lr_scheduler": "cosine"},
        "ppo": {"kl_coef": 0.05},
        "log": {"progress_bar": False, "samples_per_rollout": 4},
    }
    return with_sections(cfg, sections)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]




def test_ppo_with_a_reward_model_of_another_tokenizer_writes_everything(tiny_model_dir, other_rm, prompt_file,
                                                                        tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    out = tmp_path / "ppo"
    result = tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, out, log={"save_every": 6}))
    plan = json.loads((out / "plan.json").read_text())
    # R = 2*2 = 4, E*M = 4 steps per rollout, 3 rollouts -> 12 steps; accumulation 4/(2*1*1) = 2.
    assert (plan["total_optimizer_steps"], plan["total_episodes"], plan["gradient_accumulation_steps"]) == (12, 12, 2)
    rows = read_rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["episodes"] == 12
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(12, 2, "linear", 1e-3), abs=1e-12)
    # The critic: its own rate and schedule, on the same optimizer-step count and warmup.
    assert [r["critic_lr"] for r in rows] == pytest.approx(expected_lrs(12, 2, "cosine", 3e-3), abs=1e-12)
    for r in rows:
        assert r["value_loss"] >= 0 and 0 <= r["value_clip_fraction"] <= 1 and r["kl_coef"] == 0.05
        assert r["kl"] is not None and "reward/other" in r and "explained_variance" in r
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before any update
    assert (out / "config.yaml").exists() and len(read_rows(out / "samples.jsonl")) == 12
    AutoModelForCausalLM.from_pretrained(result.final_dir)
    critic = AutoModelForTokenClassification.from_pretrained(result.final_dir / "critic")
    assert critic.config.num_labels == 1
    assert [s for s, _ in complete_checkpoints(out)] == [6]
    AutoModelForTokenClassification.from_pretrained(out / "checkpoint-6" / "critic")


def test_the_default_critic_is_the_reward_model_when_it_shares_the_tokenizer(tiny_model_dir, same_vocab_rm,
                                                                           other_rm, prompt_file, tmp_path, capsys):
    """README: critic.model defaults to the reward model if it shares the policy's tokenizer, else the policy;
    plan.json, `tidyrl plan` and the log say which was taken and why."""
    from safetensors.torch import load_file

    from tidyrl.cli import main

    cfg = ppo_config(tiny_model_dir, same_vocab_rm, prompt_file, tmp_path / "a", critic={"model": None},
                     train={"rollouts": 1, "learning_rate": 0.0, "warmup_steps": 0})
    cfg["critic"]["learning_rate"] = 0.0
    tidyrl.train(cfg)
    # With learning rate 0 the critic is what it was initialised from: the reward model's score head.
    rm = load_file(same_vocab_rm / "model.safetensors")
    critic = load_file(tmp_path / "a" / "final" / "critic" / "model.safetensors")
    assert torch.equal(critic["score.weight"], rm["score.weight"])
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["critic_model"] == str(same_vocab_rm)
    assert plan["critic_model_reason"] == "the first reward model sharing the policy's vocabulary"

    # A reward model of another vocabulary cannot read the policy's tokens: the critic starts from the policy.
    cfg = ppo_config(tiny_model_dir, other_rm, prompt_file, tmp_path / "b", critic={"model": None},
                     train={"rollouts": 1, "learning_rate": 0.0, "warmup_steps": 0})
    cfg["critic"]["learning_rate"] = 0.0
    capsys.readouterr()
    tidyrl.train(cfg)
    why = f"the policy: the reward model {other_rm} reads another vocabulary"
    assert f"tidyrl: critic initialised from {tiny_model_dir} ({why})" in capsys.readouterr().out
    plan = json.loads((tmp_path / "b" / "plan.json").read_text())
    assert (plan["critic_model"], plan["critic_model_reason"]) == (str(tiny_model_dir), why)
    policy = load_file(tiny_model_dir / "model.safetensors")
    critic = load_file(tmp_path / "b" / "final" / "critic" / "model.safetensors")
    assert torch.equal(critic["model.embed_tokens.weight"], policy["model.embed_tokens.weight"])
    config = tmp_path / "b.yaml"
    config.write_text(yaml.safe_dump({**cfg, "output_dir": str(tmp_path / "c")}))
    assert main(["plan", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["critic_model_reason"] == why

    # Named explicitly, a model of another vocabulary is an error, before any weights load.
    with pytest.raises(RuntimeError, match=r"critic.model=.*has another vocabulary"):
        tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, tmp_path / "d", critic={"model": str(other_rm)}))


def test_ppo_resumes_exactly_with_the_critic_and_the_adaptive_kl(tiny_model_dir, other_rm, prompt_file, tmp_path):
    from safetensors.torch import load_file

    extra = {"ppo": {"adaptive_kl": True, "kl_coef": 0.2, "kl_target": 0.001, "kl_horizon": 10}}
    tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, tmp_path / "whole", **extra))
    out = tmp_path / "resumed"
    tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, out, log={"save_every": 5, "progress_bar": False,
                                                                             "samples_per_rollout": 4}, **extra))
    # Continue from checkpoint-5 (inside rollout 2): steps 6..12 again, rows past 5 replaced.
    tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, out, resume_from=str(out / "checkpoint-5"),
                            log={"save_every": 5, "progress_bar": False, "samples_per_rollout": 4}, **extra))
    timing = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    whole, resumed = read_rows(tmp_path / "whole" / "metrics.jsonl"), read_rows(out / "metrics.jsonl")
    assert strip(resumed) == strip(whole)
    for part in ("model.safetensors", "critic/model.safetensors"):
        a, b = load_file(tmp_path / "whole" / "final" / part), load_file(out / "final" / part)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # The adaptive controller moved beta after each rollout (Ziegler et al. 2019), the same in both runs.
    betas = [r["kl_coef"] for r in whole[::4]]
    assert betas[0] == 0.2 and betas[1] != betas[0] and betas[2] != betas[1]


def test_adaptive_kl_follows_the_controller(tiny_model_dir, other_rm, prompt_file, tmp_path):
    from tidyrl.algorithms.ppo import AdaptiveKLController

    out = tmp_path / "akl"
    tidyrl.train(ppo_config(tiny_model_dir, other_rm, prompt_file, out,
                            ppo={"adaptive_kl": True, "kl_coef": 0.1, "kl_target": 0.5, "kl_horizon": 100}))
    per_rollout = read_rows(out / "metrics.jsonl")[::4]
    control = AdaptiveKLController(0.1, 0.5, 100)
    for row in per_rollout:
        assert row["kl_coef"] == pytest.approx(control.value, rel=1e-12)
        control.update(row["rollout_kl"], n_steps=4)


@pytest.mark.parametrize("algorithm", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_end_to_end(algorithm, tiny_model_dir, other_rm, prompt_file, tmp_path):
    out = tmp_path / algorithm
    cfg = ppo_config(tiny_model_dir, other_rm, prompt_file, out, algorithm=algorithm,
                     reinforce_pp={"kl_coef": 0.02})
    del cfg["critic"], cfg["ppo"]
    tidyrl.train(cfg)
    rows = read_rows(out / "metrics.jsonl")
    assert len(rows) == 12 and all(r["kl_coef"] == 0.02 and "value_loss" not in r for r in rows)
    assert not (out / "final" / "critic").exists()
