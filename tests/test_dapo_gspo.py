"""DAPO's overlong shaping and filtering and GSPO's sequence-level ratio: hand-worked numbers, then runs."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import read_jsonl

import tidyrl
from tidyrl.algorithms.losses import aggregate_loss, loss_normaliser, overlong_penalty, sequence_clipped_policy_loss


def test_gspo_ratio_is_the_geometric_mean_and_clips_whole_sequences():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    # log-ratios: sequence 0 (0.1 + 0.3) / 2 = 0.2 (the pad's 5.0 is ignored); sequence 1 (-0.3 + 0 + 0.3) / 3 = 0.
    logprobs = torch.tensor([[0.1, 0.3, 5.0], [-0.3, 0.0, 0.3]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    loss_BT, clipped_BT = sequence_clipped_policy_loss(logprobs, old, adv, mask, clip_eps=0.1)
    # s_0 = e^0.2 = 1.2214 > 1.1 with A > 0: clipped, loss -1.1 * 1; s_1 = 1: loss -1 * -2 = 2.
    assert torch.allclose(loss_BT, torch.tensor([[-1.1, -1.1, 0.0], [2.0, 2.0, 2.0]]))
    assert clipped_BT.tolist() == [[True, True, False], [False, False, False]]
    # The paper's mean over completions: (-1.1 + 2) / 2. Gradient: sequence 0 clipped -> 0; sequence 1:
    # d/dlogp_t of -s A = -A s / |y| = 2 / 3 per token, halved by the mean over 2 completions.
    loss = aggregate_loss(loss_BT, mask, "sequence_mean", loss_normaliser("sequence_mean", num_tokens=5,
                                                                           num_sequences=2, max_new_tokens=3))
    assert loss.item() == pytest.approx(0.45)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


def test_gspo_upper_range_and_its_refusal_of_token_advantages():
    mask = torch.ones(1, 2)
    logprobs = torch.full((1, 2), math.log(1.15))
    loss_BT, clipped_BT = sequence_clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([1.0]), mask,
                                                        clip_eps=0.1, clip_eps_high=0.2)
    assert not clipped_BT.any() and torch.allclose(loss_BT, torch.full((1, 2), -1.15))  # 1.15 < 1 + 0.2
    with pytest.raises(ValueError, match="one advantage per completion"):
        sequence_clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.ones(1, 2), mask, 0.1)


def test_dapo_overlong_penalty_ramps_over_the_buffer():
    lengths = torch.tensor([5, 6, 7, 9, 10])
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4, reaching -1 at 10; times 0.5.
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, 10, 11)


def grpo_config(model_dir, prompt_file, out, grpo: dict, **rollout):
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 3,
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "grpo": grpo,
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6, **rollout},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "log": {"progress_bar": False},
    }


def test_a_gspo_run_clips_whole_completions(tiny_model_dir, prompt_file, tmp_path):
    result = tidyrl.train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "run",
                                      {"policy_loss": "sequence", "clip_eps": 3e-4, "clip_eps_high": 4e-4,
                                       "loss_aggregation": "sequence_mean"}))
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert rows[0]["clip_fraction"] == 0.0  # the first step's ratio is exactly 1
    assert any(r["clip_fraction"] > 0 for r in rows[1:])  # later, whole completions leave the tiny range
    with pytest.raises(tidyrl.config.ConfigError, match="ppo.policy_loss: sequence .GSPO. needs one advantage"):
        tidyrl.config.load_config({"algorithm": "ppo", "model": "m", "data": {"path": "p.jsonl"},
                                   "rewards": [{"function": "m:f"}], "train": {"rollouts": 1},
                                   "ppo": {"policy_loss": "sequence"}})


def test_overlong_shaping_is_part_of_the_reward_and_filtering_leaves_truncated_completions_out(
        tiny_model_dir, prompt_file, tmp_path):
    # The tiny random model rarely ends a word in 6 tokens: most completions are truncated.
    shaped = tidyrl.train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "shaped",
                                      {"overlong_buffer": 3, "overlong_penalty": 0.5}))
    plain = tidyrl.train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "plain", {}))
    first_shaped, first_plain = (read_jsonl(r.output_dir / "metrics.jsonl")[0] for r in (shaped, plain))
    assert first_shaped["overlong_penalty_mean"] < 0
    assert first_shaped["reward_mean"] == pytest.approx(
        first_shaped["reward/anagram_reward"] + first_shaped["overlong_penalty_mean"], abs=1e-6)
    assert first_shaped["reward/anagram_reward"] == first_plain["reward/anagram_reward"]  # same completions

    # min_new_tokens = max_new_tokens bans EOS: every completion is truncated, filtering leaves no token.
    filtered = tidyrl.train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "filtered", {"mask_truncated": True},
                                        min_new_tokens=6))
    rows = read_jsonl(filtered.output_dir / "metrics.jsonl")
    assert all(r["truncated_fraction"] == 1.0 for r in rows)
    assert all(r["loss"] == 0.0 and r["grad_norm"] == 0.0 for r in rows)


# Words of the first half always score 0 (every group of them is uninformative); the others score by letters.
HALF_FLAT = '''
def half_flat(completions, word, **kwargs):
    return [0.0 if word[i] in ("apple", "pear", "fig", "kiwi", "lime") else sum(c in word[i] for c in t) / 8
            for i, t in enumerate(completions)]

def flat(completions, **kwargs):
    return [0.5 for _ in completions]
'''


def dynamic_config(model_dir, prompt_file, tmp_path, name, function, **rollout):
    (tmp_path / "flat_rewards.py").write_text(HALF_FLAT)
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(tmp_path / name), "seed": 7,
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": f"{tmp_path / 'flat_rewards.py'}:{function}"}],
        "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 3, "max_new_tokens": 5, "dynamic_sampling": True,
                    **rollout},
        "train": {"rollouts": 3, "micro_batch_size": 4, "learning_rate": 1e-2},
        "log": {"progress_bar": False, "samples_per_rollout": 12},
    }


def test_dynamic_sampling_keeps_only_groups_whose_rewards_differ(tiny_model_dir, prompt_file, tmp_path, capsys):
    cfg = dynamic_config(tiny_model_dir, prompt_file, tmp_path, "dyn", "half_flat", max_sampling_rounds=8)
    result = tidyrl.train(cfg)
    summary = capsys.readouterr().out
    plain = tidyrl.train({**cfg, "output_dir": str(tmp_path / "plain"),
                          "rollout": {**cfg["rollout"], "dynamic_sampling": False}})
    assert result.plan == plain.plan  # the plan does not know about filtering: same steps, episodes, schedule
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 3 and [r["lr"] for r in rows] == [r["lr"] for r in read_jsonl(plain.output_dir / "metrics.jsonl")]
    for row in rows:
        assert row["groups/kept"] == 4 and row["groups/filled"] == 0
        assert row["groups/generated"] == 4 * row["sampling/rounds"] and row["groups/dropped"] == row["groups/generated"] - 4
    assert sum(r["sampling/rounds"] for r in rows) > 3  # some rollouts needed more than one round
    generated = sum(r["groups/generated"] for r in rows)
    assert (f"groups (dynamic sampling): {generated} generated, 12 kept, 0 filled, {generated - 12} dropped"
            in summary)
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    assert len(samples) == 36  # every episode of the 3 rollouts
    flat_words = ("apple:", "pear:", "fig:", "kiwi:", "lime:")
    assert not any(s["prompt"] in flat_words for s in samples)  # no always-0 group was trained on
    assert any(s["prompt"] in flat_words for s in read_jsonl(plain.output_dir / "samples.jsonl"))

    # Resumed from a checkpoint inside the run, the same rounds and groups are drawn again.
    cfg["log"]["save_every"] = 1
    tidyrl.train({**cfg, "output_dir": str(tmp_path / "saved")})
    tidyrl.train({**cfg, "output_dir": str(tmp_path / "saved")}, ["resume_from=" + str(tmp_path / "saved" / "checkpoint-1")])
    drop = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")
    strip = lambda rs: [{k: v for k, v in r.items() if k not in drop} for r in rs]  # noqa: E731
    assert strip(read_jsonl(tmp_path / "saved" / "metrics.jsonl")) == strip(rows)


def test_when_the_rounds_run_out_fill_keeps_the_plan_and_error_stops(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.loops.rl.learner import DynamicSamplingError

    filled = tidyrl.train(dynamic_config(tiny_model_dir, prompt_file, tmp_path, "fill", "flat", max_sampling_rounds=2))
    rows = read_jsonl(filled.output_dir / "metrics.jsonl")
    assert len(rows) == filled.plan.total_optimizer_steps == 3
    assert all((r["sampling/rounds"], r["groups/kept"], r["groups/filled"], r["groups/dropped"]) == (2, 0, 4, 4)
               for r in rows)
    with pytest.raises(DynamicSamplingError, match=r"rollout 1: 2 rounds .* gave 0 groups whose 3 rewards differ"):
        tidyrl.train(dynamic_config(tiny_model_dir, prompt_file, tmp_path, "error", "flat", max_sampling_rounds=2,
                                    on_sampling_cap="error"))


def test_dynamic_sampling_options_are_checked():
    base = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "m:f"}], "train": {"rollouts": 1}}
    with pytest.raises(tidyrl.config.ConfigError) as info:
        tidyrl.config.load_config({**base, "algorithm": "ppo",
                                   "rollout": {"dynamic_sampling": True, "max_sampling_rounds": 0,
                                               "on_sampling_cap": "skip"}})
    assert [p.split(":")[0] for p in info.value.problems] == [
        "rollout.dynamic_sampling", "rollout.max_sampling_rounds", "rollout.on_sampling_cap"]
    assert "only a group baseline" in info.value.problems[0]
