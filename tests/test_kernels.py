"""The choice of kernels (tidyrl.models.kernels): the config's `kernels` section carried by every model a run loads
and found through peft, DDP and FSDP2; the TIDYRL_* developer overrides, said at the run's start, in plan.json and in
its summary, and refused before anything loads where their value is not one they take."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from conftest import bf16_grpo_metrics, llama

import tidyrl
from tidyrl.config import ConfigError, KernelsConfig
from tidyrl.models import kernels as kernels_module
from tidyrl.models.kernels import OVERRIDES, Kernels, attach, kernels_of, override_problems, overrides


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    """Every test here starts from an environment without overrides (a developer's shell may hold some)."""
    for variable in OVERRIDES.values():
        monkeypatch.delenv(variable, raising=False)


def test_overrides_parse_their_values_and_name_the_key_where_a_value_is_wrong():
    environ = {"TIDYRL_CHUNKED_HEAD": "0", "TIDYRL_RECOMPUTE": "true", "TIDYRL_DECODE_ATTENTION": "SDPA",
               "TIDYRL_FUSED_DECODE": " "}  # (empty: unset)
    assert [(o.key, o.value) for o in overrides(environ)] == [
        ("chunked_head", False), ("decode_attention", "sdpa"), ("recompute", True)]
    assert kernels_module.with_overrides(Kernels(), environ) == Kernels(chunked_head=False, decode_attention="sdpa",
                                                                        recompute=True)
    assert overrides({}) == [] and override_problems({}) == []
    wrong = {"TIDYRL_FUSED_LOGPROBS": "off", "TIDYRL_LAYER_KERNELS": "fast"}
    assert override_problems(wrong) == [
        "TIDYRL_FUSED_LOGPROBS='off' (a developer override of kernels.fused_logprobs): expected 1 or 0; unset it and "
        "set kernels.fused_logprobs in the config instead",
        "TIDYRL_LAYER_KERNELS='fast' (a developer override of kernels.layer_kernels): expected compile or none; unset "
        "it and set kernels.layer_kernels in the config instead"]
    with pytest.raises(ValueError, match="TIDYRL_FUSED_LOGPROBS='off'"):
        overrides(wrong)


def test_a_choice_is_checked_and_converts_from_the_config_section():
    assert Kernels.of(KernelsConfig(fused_decode=False)) == Kernels(fused_decode=False)
    with pytest.raises(ValueError, match="kernels.decode_attention: 'flash' is not one of kernel, sdpa"):
        Kernels(decode_attention="flash")
    with pytest.raises(ValueError, match="kernels.recompute: must be true or false, got 1"):
        Kernels(recompute=1)
    with pytest.raises(TypeError, match="lacks chunked_head"):
        Kernels.of(object())


def test_the_choice_is_found_through_peft_ddp_fsdp2_and_a_deep_copy(monkeypatch):
    """`attach` sets it on the transformers model; `kernels_of` finds it under a LoRA adapter (peft), inside DDP,
    after FSDP2's fully_shard (in place) and on a deep copy (rollout.lag's behaviour copy). A model tidyrl did not
    load has the defaults, with an override set when asked."""
    peft = pytest.importorskip("peft")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from conftest import free_port

    chosen = Kernels(chunked_head=False, recompute=True)
    model = attach(llama(), chosen)
    assert kernels_of(model) == chosen and kernels_of(llama()) == Kernels()
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert kernels_of(adapted) == chosen and kernels_of(copy.deepcopy(adapted)) == chosen
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert kernels_of(DistributedDataParallel(adapted)) == chosen
        sharded = attach(llama(), chosen)
        fully_shard(sharded)
        assert kernels_of(sharded) == chosen
    finally:
        dist.destroy_process_group()
    monkeypatch.setenv("TIDYRL_CHUNKED_HEAD", "0")
    assert kernels_of(llama()) == Kernels(chunked_head=False)  # (the defaults, overridden now)
    assert kernels_of(attach(llama(), Kernels(recompute=True))) == chosen  # (an override on every choice attached)


def test_the_loading_functions_attach_the_choice(tiny_model_dir, monkeypatch):
    from tidyrl.models.loading import load_causal_lm, load_critic, load_policy

    section = KernelsConfig(layer_kernels="none", fused_logprobs=False)
    want = Kernels.of(section)
    assert kernels_of(load_causal_lm(str(tiny_model_dir), kernels=section)) == want
    assert kernels_of(load_causal_lm(str(tiny_model_dir))) == Kernels()
    assert kernels_of(load_critic(str(tiny_model_dir), kernels=section)) == want
    pytest.importorskip("peft")
    from tidyrl.config import LoRAConfig

    lora = load_policy(str(tiny_model_dir), "float32", LoRAConfig(enabled=True, r=2), kernels=section)
    assert hasattr(lora, "peft_config") and kernels_of(lora) == want
    monkeypatch.setenv("TIDYRL_RECOMPUTE", "1")
    assert kernels_of(load_causal_lm(str(tiny_model_dir), kernels=section)).recompute


def _counting_head(monkeypatch) -> list:
    """The chunked head on CPU (it serves CUDA), each of its applications by `completion_logprobs` counted."""
    from tidyrl.models import chunked_head, forward

    calls = []
    real = chunked_head.head_logprobs
    monkeypatch.setattr(chunked_head, "HEAD_DEVICES", ("cpu",))
    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))
    monkeypatch.setattr(forward, "head_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_an_override_is_said_at_the_start_in_plan_json_and_in_the_summary_and_computes_as_the_config_key(
        monkeypatch, tiny_model_dir, prompt_file, tmp_path, capsys):
    """A bf16 GRPO run with kernels.chunked_head: false in its config, and one with TIDYRL_CHUNKED_HEAD=0 in the
    environment and the default config: neither takes the chunked head, both report the same numbers; the second
    says so before anything loads, in plan.json (`kernel_overrides`) and in its summary, and its config.yaml holds
    the configured value."""
    calls = _counting_head(monkeypatch)
    configured = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "configured", kernels={"chunked_head": False})
    assert calls == []
    plan = json.loads((tmp_path / "configured" / "plan.json").read_text())
    assert "kernel_overrides" not in plan and "developer override" not in capsys.readouterr().out
    monkeypatch.setenv("TIDYRL_CHUNKED_HEAD", "0")
    overridden = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "overridden")
    assert calls == [] and len(overridden) == len(configured) == 2
    for got, want in zip(overridden, configured):  # (bit for bit: the same path; the timings aside)
        assert {k: v for k, v in got.items() if "time" not in k} == {k: v for k, v in want.items() if "time" not in k}
    out = capsys.readouterr().out.splitlines()
    line = ("developer override: TIDYRL_CHUNKED_HEAD=0 sets kernels.chunked_head to false (config.yaml: true); set "
            "kernels.chunked_head in the config to make it the run's")
    assert out[0] == f"tidyrl: {line}"  # the run's first line
    finished = next(i for i, text in enumerate(out) if text.startswith("tidyrl: finished "))
    assert out[finished + 1] == f"  {line}"
    plan = json.loads((tmp_path / "overridden" / "plan.json").read_text())
    assert plan["kernel_overrides"] == {"kernels.chunked_head": {"variable": "TIDYRL_CHUNKED_HEAD=0", "value": False,
                                                                 "configured": True}}
    assert yaml.safe_load((tmp_path / "overridden" / "config.yaml").read_text())["kernels"]["chunked_head"] is True


def test_a_run_s_choice_is_in_its_config_yaml_and_its_checkpoints(tiny_model_dir, prompt_file, tmp_path):
    from conftest import grpo_config

    from tidyrl.checkpoint import complete_checkpoints, load_trainer_state

    out = tmp_path / "run"
    tidyrl.train(grpo_config(tiny_model_dir, prompt_file, out, rollouts=1, kernels={"decode_attention": "sdpa"},
                             log={"save_every": 1, "progress_bar": False}))
    want = dict(vars(KernelsConfig(decode_attention="sdpa")))
    assert yaml.safe_load((out / "config.yaml").read_text())["kernels"] == want
    (_, checkpoint), *_ = complete_checkpoints(out)
    assert load_trainer_state(checkpoint)["state"]["config"]["kernels"] == want


def test_an_invalid_override_is_refused_before_anything_loads(monkeypatch, tiny_model_dir, prompt_file, tmp_path):
    """`tidyrl train` and `tidyrl eval` with TIDYRL_FUSED_DECODE=maybe: a ConfigError naming the variable and the
    key, before any weights load or the output folder is made."""
    from conftest import grpo_config
    from transformers import AutoModelForCausalLM

    from tidyrl.evaluate import evaluate

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setenv("TIDYRL_FUSED_DECODE", "maybe")
    out = tmp_path / "run"
    for start in (lambda: tidyrl.train(grpo_config(tiny_model_dir, prompt_file, out, rollouts=1)),
                  lambda: evaluate(model=str(tiny_model_dir), data=str(prompt_file), rewards=["tidyrl.demo:anagram_reward"],
                                   output_dir=tmp_path / "eval")):
        with pytest.raises(ConfigError) as err:
            start()
        assert err.value.problems == [
            "TIDYRL_FUSED_DECODE='maybe' (a developer override of kernels.fused_decode): expected 1 or 0; unset it and "
            "set kernels.fused_decode in the config instead"]
    assert not out.exists() and not (tmp_path / "eval").exists()
