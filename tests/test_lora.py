"""LoRA through peft: no reference copy, the adapter saves and loads, the merged model loads as a plain model,
exact resume, and every stage."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_jsonl, write_jsonl, with_sections

import tidyrl

peft = pytest.importorskip("peft")

LORA = {"enabled": True, "r": 4, "alpha": 8.0}


def letters(prompts, completions, word, **_):
    return [sum(c in w for c in t) / len(t) if t else 0.0 for t, w in zip(completions, word)]


def rl_config(model_dir, prompt_file, out, **sections):
    cfg = {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 5,
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": letters}],
        "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 4, "max_new_tokens": 6},
        "train": {"rollouts": 2, "epochs_per_rollout": 1, "minibatches_per_epoch": 2, "micro_batch_size": 4,
                  "learning_rate": 5e-2},
        "grpo": {"kl_coef": 0.1},
        "lora": dict(LORA),
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


def count_loads(monkeypatch):
    from transformers import AutoModelForCausalLM

    loads = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(str(args[0]))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    return loads


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_grpo_with_lora_holds_no_reference_copy_and_saves_a_loadable_adapter(tiny_model_dir, prompt_file, tmp_path,
                                                                            monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from tidyrl.config import load_config
    from tidyrl.loops.rl.learner import RLRun

    loads = count_loads(monkeypatch)
    out = tmp_path / "run"
    run = RLRun(load_config(rl_config(tiny_model_dir, prompt_file, out, lora={"save_merged": True})), None)
    result = run.run()
    # One from_pretrained for the whole run: the policy. The reference is the same object, adapter disabled.
    assert loads == [str(tiny_model_dir)]
    assert run.use_reference and run.ref_model is None
    policy = run.accelerator.unwrap_model(run.trainee.model)
    assert isinstance(policy, peft.PeftModel)
    assert "LoRA: training" in capsys.readouterr().out

    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the adapter starts at B = 0: policy == reference
    assert rows[-1]["kl"] > 0  # after updates the policy differs from the adapter-disabled reference

    final = result.final_dir
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()  # only the adapter, not a copy of the base weights
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)

    ids = torch.tensor([[3, 7, 9, 11, 4, 5]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    base_logits = logits_of(base, ids)
    adapted = peft.PeftModel.from_pretrained(base, final).eval()
    adapted_logits = logits_of(adapted, ids)
    assert (adapted_logits - base_logits).abs().max() > 1e-4  # the adapter was trained
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert torch.allclose(logits_of(merged, ids), adapted_logits, atol=1e-5)
    # transformers loads the adapter folder itself (base + adapter) when peft is installed.
    direct = AutoModelForCausalLM.from_pretrained(final).eval()
    assert torch.allclose(logits_of(direct, ids), adapted_logits, atol=1e-5)
    # So does tidyrl wherever a model path is read (e.g. `model:` of the next stage, `tidyrl eval`).
    from tidyrl.models.loading import load_causal_lm, load_model_config

    assert torch.allclose(logits_of(load_causal_lm(str(final)), ids), adapted_logits, atol=1e-5)
    assert load_model_config(str(final)).hidden_size == base.config.hidden_size


def test_lora_reference_log_probs_are_the_base_models(tiny_model_dir, prompt_file, tmp_path):
    """The KL of the last step against a separately loaded base model: the adapter-disabled policy IS the base."""
    from transformers import AutoModelForCausalLM

    from tidyrl.config import load_config
    from tidyrl.loops.rl.learner import RLRun
    from tidyrl.models.lora import reference_of
    from tidyrl.rollouts import score_logprobs

    run = RLRun(load_config(rl_config(tiny_model_dir, prompt_file, tmp_path / "ref", train={"rollouts": 1})), None)
    run.run()
    policy = run.accelerator.unwrap_model(run.trainee.model)
    with reference_of(policy, run.ref_model) as reference:
        assert reference is policy  # the same object: no copy
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    rollout, _, _ = run.take_rollout(1)  # a rollout after training: the adapter is no longer zero
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = score_logprobs(base, rollout, 1.0, 64)
    mask = rollout.completion_mask.bool()
    assert torch.allclose(rollout.ref_logprobs[mask], expected[mask], atol=1e-5)
    policy_lp = score_logprobs(run.accelerator.unwrap_model(run.trainee.model), rollout, 1.0, 64)
    assert (policy_lp[mask] - expected[mask]).abs().max() > 1e-4  # ... and the adapter is back on afterwards


def test_lora_resume_matches_the_uninterrupted_run(tiny_model_dir, prompt_file, tmp_path):
    from safetensors.torch import load_file

    whole = tidyrl.train(rl_config(tiny_model_dir, prompt_file, tmp_path / "whole"))
    out = tmp_path / "resumed"
    cfg = rl_config(tiny_model_dir, prompt_file, out, log={"save_every": 2})
    tidyrl.train(cfg)
    assert (out / "checkpoint-2" / "adapter_config.json").is_file()  # a checkpoint is an adapter folder too
    tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-2")])
    assert read_jsonl(out / "metrics.jsonl") == [
        {**r, "time_s": s["time_s"]} | {k: s[k] for k in s if k.startswith("time/")}
        for r, s in zip(read_jsonl(whole.output_dir / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl"))]
    a = load_file(whole.final_dir / "adapter_model.safetensors")
    b = load_file(out / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ppo_with_lora_trains_a_full_critic_beside_the_adapter(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    loads = count_loads(monkeypatch)
    result = tidyrl.train(rl_config(tiny_model_dir, prompt_file, tmp_path / "ppo", algorithm="ppo",
                                    train={"rollouts": 1}, grpo={"kl_coef": 0.0}, ppo={"kl_coef": 0.05}))
    assert loads == [str(tiny_model_dir)]  # the critic is a token classifier, loaded by its own class
    assert (result.final_dir / "adapter_config.json").is_file()
    assert (result.final_dir / "critic" / "model.safetensors").is_file()
    assert read_jsonl(result.output_dir / "metrics.jsonl")[0]["kl"] == pytest.approx(0.0, abs=1e-7)


def test_sft_and_dpo_with_lora(tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    sft_data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{w}:", "completion": w[::-1]}
                                                    for w in ["apple", "pear", "fig", "kiwi"]])
    sft = tidyrl.train({"algorithm": "sft", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "sft"),
                        "data": {"path": str(sft_data)}, "lora": dict(LORA),
                        "train": {"dataset_epochs": 2, "batch_size": 2, "micro_batch_size": 2,
                                  "learning_rate": 1e-2}, "log": {"progress_bar": False}})
    assert (sft.final_dir / "adapter_config.json").is_file()

    # DPO from the SFT adapter: `model:` may be an adapter folder (loaded as base + adapter, folded in); the
    # reference is that model with the new adapter disabled, never a second load.
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{w}:", "chosen": w[::-1], "rejected": w}
                                                   for w in ["apple", "pear", "fig", "kiwi"]])
    loads = count_loads(monkeypatch)
    dpo = tidyrl.train({"algorithm": "dpo", "model": str(sft.final_dir), "output_dir": str(tmp_path / "dpo"),
                        "data": {"path": str(pairs)}, "lora": {**LORA, "save_merged": True},
                        "train": {"max_steps": 3, "batch_size": 2, "micro_batch_size": 1, "learning_rate": 1e-2},
                        "log": {"progress_bar": False}})
    assert loads == [str(tiny_model_dir)]  # the SFT adapter's base, once
    rows = read_jsonl(dpo.output_dir / "metrics.jsonl")
    assert rows[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert rows[-1]["rewards/margin"] != pytest.approx(0.0, abs=1e-6)
    AutoModelForCausalLM.from_pretrained(dpo.final_dir / "merged")


def test_reward_model_with_lora_trains_its_score_head_and_merges(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from tidyrl.rewards.reward_models import RewardModel, RewardModelError

    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{w}:", "chosen": w[::-1], "rejected": w}
                                                   for w in ["apple", "pear", "fig", "kiwi"]])
    result = tidyrl.train({"algorithm": "reward", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "rm"),
                           "data": {"path": str(pairs)}, "lora": {**LORA, "save_merged": True},
                           "train": {"max_steps": 2, "batch_size": 2, "micro_batch_size": 2, "learning_rate": 1e-2},
                           "log": {"progress_bar": False}})
    with pytest.raises(RewardModelError, match="LoRA adapter folder.*final/merged"):
        RewardModel(str(result.final_dir))
    merged = AutoModelForSequenceClassification.from_pretrained(result.final_dir / "merged")
    assert merged.config.num_labels == 1
    scores = RewardModel(str(result.final_dir / "merged")).load()(prompts=["fig:"], completions=["gif"])
    assert len(scores) == 1


def test_lora_options_are_checked(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(rl_config(tiny_model_dir, prompt_file, tmp_path, lora={"r": 0, "dropout": 1.0,
                                                                           "target_modules": []}))
    text = str(err.value)
    assert "lora.r: must be >= 1" in text and "lora.dropout" in text and "lora.target_modules" in text
    with pytest.raises(ConfigError, match="unknown key `lora.rank`"):
        load_config(rl_config(tiny_model_dir, prompt_file, tmp_path, lora={"rank": 8}))


def test_missing_peft_is_said_before_any_work(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'tidyrl\[lora\]'"):
        tidyrl.train(rl_config(tiny_model_dir, prompt_file, tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_lora_with_gradient_checkpointing_gives_the_same_adapter(tiny_model_dir, prompt_file, tmp_path):
    from safetensors.torch import load_file

    adapters = []
    for name, ckpt in (("plain", False), ("ckpt", True)):
        result = tidyrl.train(rl_config(tiny_model_dir, prompt_file, tmp_path / name,
                                        train={"rollouts": 1, "gradient_checkpointing": ckpt}))
        adapters.append(load_file(result.final_dir / "adapter_model.safetensors"))
    assert max((adapters[0][k] - adapters[1][k]).abs().max().item() for k in adapters[0]) < 1e-6
    assert max(adapters[0][k].abs().max().item() for k in adapters[0] if "lora_B" in k) > 0  # it did train


def test_ppo_critic_from_an_adapter_folder_is_refused_with_the_fix(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.models.loading import ModelLoadError

    adapter = tidyrl.train(rl_config(tiny_model_dir, prompt_file, tmp_path / "a", train={"rollouts": 1})).final_dir
    with pytest.raises(ModelLoadError, match=r"critic.model \(default: the policy\)=.*LoRA adapter folder.*final/merged"):
        tidyrl.train(rl_config(adapter, prompt_file, tmp_path / "ppo", algorithm="ppo", train={"rollouts": 1},
                               lora={"enabled": False}))
    assert not (tmp_path / "ppo").exists()  # refused before any output or weights


def test_forward_parameters_are_the_transformers_models_under_peft_and_module_wrappers(tiny_model_dir):
    """Which keywords (e.g. position_ids) a forward takes is read from the model under every wrapper, in any
    order: a peft adapter inside a DDP-like `.module` wrapper, and the other way round."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from tidyrl.models.sequences import forward_parameters

    class Wrapper(torch.nn.Module):  # DDP's shape: the wrapped model as `.module`, a forward of its own
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    own = forward_parameters(model)
    assert {"input_ids", "position_ids", "attention_mask"} <= own
    adapted = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    assert forward_parameters(adapted) == own
    assert forward_parameters(Wrapper(adapted)) == own
    assert forward_parameters(Wrapper(Wrapper(model))) == own
    assert forward_parameters(Wrapper(torch.nn.Linear(2, 2))) == {"self", "input"}


def test_engines_receive_the_adapter_alone_where_vllms_lora_can_serve_it(tiny_model_dir, tmp_path, monkeypatch):
    """`lora_sync_plan`: adapter-only sync for an adapter of linear layers (vLLM's max_lora_rank covering its rank);
    the merged weights, with the reason, for an adapter vLLM's LoRA cannot apply, or with the switch off."""
    from transformers import AutoModelForCausalLM

    from tidyrl.engines import base
    from tidyrl.models.lora import save_adapter_only

    def adapted(**kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        return peft.get_peft_model(model, peft.LoraConfig(**{"r": 4, "target_modules": "all-linear", **kw}))

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert base.lora_sync_plan(plain).mode == "full"
    policy = adapted()
    plan = base.lora_sync_plan(policy)
    assert (plan.mode, plan.rank, plan.max_lora_rank) == ("adapter", 4, 8)
    assert base.LoRASync("adapter", rank=1).max_lora_rank == 1  # rank 1 is one vLLM takes
    size = save_adapter_only(policy, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.suffix != ".md") == [
        "adapter_config.json", "adapter_model.safetensors"]
    lora_params = sum(p.numel() * p.element_size() for n, p in policy.named_parameters() if "lora_" in n)
    assert lora_params <= size < lora_params + 4096  # the adapter's weights and a header, nothing of the base

    why = {
        "embeddings": base.lora_sync_plan(adapted(target_modules=["q_proj", "embed_tokens"])).why,
        "head": base.lora_sync_plan(adapted(target_modules=["q_proj", "lm_head"])).why,
        "dora": base.lora_sync_plan(adapted(use_dora=True)).why,
        "rank": base.lora_sync_plan(adapted(r=600)).why,
    }
    assert "embeddings or the output layer (model.embed_tokens)" in why["embeddings"]
    assert "embeddings or the output layer" in why["head"]
    assert "DoRA" in why["dora"]
    assert why["rank"] == "the adapter's rank 600 is above vLLM's largest max_lora_rank 512"
    monkeypatch.setattr(base, "ADAPTER_SYNC", False)
    plan = base.lora_sync_plan(policy)
    assert plan.mode == "merged" and "ADAPTER_SYNC" in plan.note("vllm")
