"""Mixture-of-experts models trained end to end (tiny Qwen3-MoE and OLMoE folders built here): GRPO with the
built-in engine's routes carried in the rollout and replayed in the trainer's forwards, the expert load and the
changed router decisions in the metrics; replay checked by corrupting the recorded routes."""

from __future__ import annotations

import json

import pytest
import torch

import tidyrl
from tidyrl.models.tiny import MOE_FAMILIES, save_tiny_model
from tidyrl.rollouts import producer as producer_module

from conftest import grpo_config, read_jsonl as rows


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_dir(request, tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp(request.param) / "model", seed=0, hidden_size=32, num_layers=2,
                           num_heads=2, family=request.param)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """One family for the multi-process runs (a launch each: the families differ in no collective)."""
    return save_tiny_model(tmp_path_factory.mktemp("qwen3_moe_one") / "model", seed=0, hidden_size=32, num_layers=2,
                           num_heads=2, family="qwen3_moe")


def test_grpo_trains_a_mixture_of_experts_with_its_routes_replayed(moe_dir, prompt_file, tmp_path):
    """Two rollouts, the trainer's log-probs recomputed (tis_cap 2): the sampler's routes replayed, the expert load
    per layer in the metrics (each layer's shares summing to 1), the trainer's router agreeing with the sampler's
    here (one device, float32), and the weights moved."""
    out = tmp_path / "run"
    result = tidyrl.train(grpo_config(moe_dir, prompt_file, out, 2, rollout={"tis_cap": 2.0}))
    metrics = [m for m in rows(out / "metrics.jsonl") if "moe/max_over_mean" in m]
    assert [m["rollout"] for m in metrics] == [1, 1, 2, 2]  # (a rollout's metrics in each of its 2 steps' rows)
    for m in metrics:
        for layer in (0, 1):
            load = m[f"moe/layer_{layer}/load"]
            assert len(load) == 4 and abs(sum(load) - 1) < 1e-6
            assert m[f"moe/layer_{layer}/max_over_mean"] == pytest.approx(max(load) * 4)
        assert m["routing/changed_fraction"] <= 0.01
        assert m["mismatch/logprob_abs_max"] < 1e-4
    from safetensors.torch import load_file

    before, after = load_file(moe_dir / "model.safetensors"), load_file(result.final_dir / "model.safetensors")
    gates = [n for n in before if ".gate." in n or n.endswith(".gate.weight")]
    assert gates and all(not torch.equal(before[n], after[n]) for n in gates)  # the routers learn


@pytest.mark.parametrize("replay", [True, False])
def test_replay_takes_the_recorded_routes_and_without_it_they_are_only_compared(moe_dir, prompt_file, tmp_path,
                                                                                monkeypatch, replay):
    """Routes shifted to other experts after sampling: replayed, the trainer's log-probs move away from the
    sampler's and its own router would have changed nearly every decision; not replayed, the same decisions are
    counted as changed while the log-probs stay the sampler's."""
    as_episodes = producer_module.as_episodes

    def shifted(*args, **kwargs):
        episodes = as_episodes(*args, **kwargs)
        for name in ("prompt_routes", "completion_routes"):
            routes = getattr(episodes, name)
            setattr(episodes, name, torch.where(routes >= 0, (routes + 1) % 4, routes))
        return episodes

    monkeypatch.setattr(producer_module, "as_episodes", shifted)
    out = tmp_path / "run"
    tidyrl.train(grpo_config(moe_dir, prompt_file, out, 1, rollout={"tis_cap": 2.0, "routing_replay": replay}))
    m = next(m for m in rows(out / "metrics.jsonl") if "routing/changed_fraction" in m)
    assert m["routing/changed_fraction"] > 0.2
    if replay:
        assert m["mismatch/logprob_abs_mean"] > 1e-3
    else:
        assert m["mismatch/logprob_abs_max"] < 1e-4


def test_the_load_balancing_loss_is_added_where_set_in_grpo_sft_and_dpo(moe_dir, prompt_file, tmp_path):
    """train.router_aux_loss_coef: moe/aux_loss in every stage's step metrics, near 1 for a near-balanced router
    (E x sum over e of 1/E x 1/E = 1 at uniform load and probabilities); unset, the tiny checkpoints' own weight
    (their output_router_logits is false) is 0 and no such loss is added."""
    tidyrl.train(grpo_config(moe_dir, prompt_file, tmp_path / "grpo", 1, train={"router_aux_loss_coef": 0.01}))
    steps = [m for m in rows(tmp_path / "grpo" / "metrics.jsonl") if "loss" in m]
    assert steps and all(0.5 < m["moe/aux_loss"] < 4.0 for m in steps)
    tidyrl.train(grpo_config(moe_dir, prompt_file, tmp_path / "plain", 1))
    assert not any("moe/aux_loss" in m for m in rows(tmp_path / "plain" / "metrics.jsonl"))
    sft_data, pairs = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    with open(sft_data, "w") as f:
        for w in ("apple", "pear", "fig", "kiwi"):
            f.write(json.dumps({"prompt": f"{w}:", "completion": w}) + "\n")
    with open(pairs, "w") as f:
        for w in ("apple", "pear", "fig", "kiwi"):
            f.write(json.dumps({"prompt": f"{w}:", "chosen": w, "rejected": w[::-1]}) + "\n")
    for stage, data in (("sft", sft_data), ("dpo", pairs)):
        out = tmp_path / stage
        tidyrl.train({"algorithm": stage, "model": str(moe_dir), "output_dir": str(out), "data": {"path": str(data)},
                      "train": {"dataset_epochs": 1, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-3,
                                "router_aux_loss_coef": 0.01},
                      "log": {"progress_bar": False}})
        steps = [m for m in rows(out / "metrics.jsonl") if "loss" in m and "step" in m]
        assert len(steps) == 2 and all(0.5 < m["moe/aux_loss"] < 4.0 for m in steps), (stage, steps)


def multi_process_config(model_dir, tmp_path) -> dict:
    """The GRPO run the multi-process tests launch: routes replayed, the mismatch scored, the load-balancing loss.
    AdamW's epsilon is 1e-5, not 1e-8: an element whose gradient cancels to near 0 moves by lr g / (|g| + eps),
    so float32 rounding of its gradient between summation orders reaches the weights multiplied by lr / eps
    (measured on transformers 4.56's per-expert modules: 6.4e-5 apart at 1e-8, 3.8e-6 at 1e-6, 1.2e-7 at 1e-4)."""
    words = ["apple", "pear", "fig", "kiwi"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in words))
    return {"algorithm": "grpo", "model": str(model_dir), "seed": 1, "data": {"path": str(prompts)},
            "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 5, "tis_cap": 2.0},
            "train": {"rollouts": 2, "minibatches_per_epoch": 2, "micro_batch_size": 1, "learning_rate": 1e-3,
                      "adam_epsilon": 1e-5, "router_aux_loss_coef": 0.01},
            "log": {"progress_bar": False, "samples_per_rollout": 4}}


def test_grpo_on_a_mixture_of_experts_under_fsdp2_matches_one_process(qwen3_moe_dir, tmp_path):
    """FSDP2 shards every expert's weights and the routers (2 gloo processes): the same completions and, with the
    routes replayed in the scoring and the update, the one-process run's weights to float32 rounding."""
    import yaml
    from test_fsdp import TOL, _accelerate_launches_fsdp2, completions, max_diff, train

    if not _accelerate_launches_fsdp2():
        pytest.skip("this accelerate launches FSDP1 only")
    cfg = multi_process_config(qwen3_moe_dir, tmp_path)
    config = tmp_path / "moe.yaml"
    config.write_text(yaml.safe_dump(cfg))
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    train(config, one, 1)
    train(config, sharded, 2)
    assert json.loads((sharded / "plan.json").read_text())["distribution"] == "fsdp2, 2 shards"
    assert completions(one) == completions(sharded)
    a, b = rows(one / "metrics.jsonl"), rows(sharded / "metrics.jsonl")
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/max_over_mean", "routing/changed_fraction"):
            assert x[key] == pytest.approx(y[key], abs=TOL), key
    assert max_diff(one / "final" / "model.safetensors", sharded / "final" / "model.safetensors") < TOL


def test_lora_adapts_the_attention_and_the_experts_of_a_mixture_of_experts(moe_dir, prompt_file, tmp_path):
    """LoRA on the attention's q/v and on every expert (transformers 5's stacked experts through peft's
    target_parameters; 4.x's expert linears through target_modules), routes replayed: the adapter holds both
    kinds and both moved; where the installed peft has no target_parameters, the run is refused before loading."""
    import transformers
    from safetensors.torch import load_file

    from tidyrl.models.lora import MissingPeftError, require_target_parameters

    stacked = int(transformers.__version__.split(".")[0]) >= 5
    lora = {"enabled": True, "r": 4, "alpha": 8}
    if stacked:
        lora |= {"target_modules": ["q_proj", "v_proj"], "target_parameters": ["experts.gate_up_proj",
                                                                              "experts.down_proj"]}
        try:
            require_target_parameters()
        except MissingPeftError as err:
            with pytest.raises(MissingPeftError, match="peft >= 0.17"):
                tidyrl.train(grpo_config(moe_dir, prompt_file, tmp_path / "old", 1, lora=lora))
            pytest.skip(str(err))
    else:
        lora |= {"target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}
    out = tmp_path / "run"
    tidyrl.train(grpo_config(moe_dir, prompt_file, out, 2, lora=lora, rollout={"tis_cap": 2.0}))
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    experts = [n for n in adapter if "experts" in n and "lora_B" in n]
    attention = [n for n in adapter if "q_proj" in n and "lora_B" in n]
    assert experts and attention
    assert all(adapter[n].abs().sum() > 0 for n in experts + attention)  # (lora_B starts at 0: trained)
    m = next(m for m in rows(out / "metrics.jsonl") if "routing/changed_fraction" in m)
    assert m["routing/changed_fraction"] <= 0.01 and m["mismatch/logprob_abs_max"] < 1e-4


def test_an_engine_that_returns_no_routes_is_said_and_the_trainer_routes_itself(moe_dir, prompt_file, tmp_path,
                                                                               monkeypatch, capsys):
    import dataclasses

    from tidyrl.engines import builtin

    monkeypatch.setattr(builtin.BuiltinEngine, "capabilities",
                        dataclasses.replace(builtin.CAPABILITIES, records_routes=False))
    out = tmp_path / "run"
    tidyrl.train(grpo_config(moe_dir, prompt_file, out, 1, rollout={"tis_cap": 2.0}))
    assert "routing replay: off, the builtin engine returns no routes" in capsys.readouterr().out
    metrics = rows(out / "metrics.jsonl")
    assert not any("routing/changed_fraction" in m or "moe/max_over_mean" in m for m in metrics)
    assert all(m["mismatch/logprob_abs_max"] < 1e-4 for m in metrics if "mismatch/logprob_abs_max" in m)


@pytest.mark.extended  # (the FSDP2 case, in the default suite, replays routes across processes too)
def test_grpo_on_a_mixture_of_experts_under_ddp_matches_one_process(qwen3_moe_dir, tmp_path):
    """2 gloo processes under DDP (torchrun): each process replays its share's routes through the shared-prompt
    passes or the one-pass forward (DDP takes no lean pass), and the run is the one-process run's to float32
    rounding."""
    from conftest import torchrun_train
    from test_fsdp import TOL, completions, max_diff

    cfg = multi_process_config(qwen3_moe_dir, tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    tidyrl.train({**cfg, "output_dir": str(one)})
    torchrun_train({**cfg, "output_dir": str(two)}, tmp_path, world=2)
    assert completions(one) == completions(two)
    for x, y in zip(rows(one / "metrics.jsonl"), rows(two / "metrics.jsonl")):
        for key in ("loss", "grad_norm", "moe/aux_loss", "moe/max_over_mean", "routing/changed_fraction"):
            assert x[key] == pytest.approx(y[key], abs=TOL), key
    assert max_diff(one / "final" / "model.safetensors", two / "final" / "model.safetensors") < TOL
