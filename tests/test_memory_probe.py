"""The worst case first (loops.rl.probe, train.memory_probe) and an out-of-memory error mid-run
(loops.run.out_of_memory): the probe runs each phase at its largest shapes and changes no number of the run
(weights, metrics and samples bit-identical with and without it, on the paths that keep state between calls: a
lag's frozen copy, several epochs, PPO's critic, LoRA); an out-of-memory error, injected where a phase runs or
raised for real by the host's allocator under an address-space limit, stops the run with the phase, its shapes,
the planned and measured peak and the knob, the checkpoints written before it intact, and the resume finishing
as the run would have."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import grpo_config, read_jsonl


@pytest.fixture
def long_prompt_file(tmp_path):
    """prompt_file's words and one prompt three times longer than the others."""
    path = tmp_path / "prompts.jsonl"
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]
    rows = [{"prompt": f"{w}:", "word": w} for w in words]
    rows[5]["prompt"] = "a longer prompt about plums:"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def finished(cfg: dict):
    """(metrics rows without wall-clock fields, samples rows, final weights) of `tidyrl.train(cfg)`."""
    from safetensors.torch import load_file

    from tidyrl import train

    result = train(cfg)
    rows = [{k: v for k, v in row.items() if not k.startswith("time") and k != "time_s"}
            for row in read_jsonl(result.output_dir / "metrics.jsonl")]
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    weights = load_file(next((result.final_dir).glob("*.safetensors")))
    return rows, samples, weights


VARIANTS = {
    # a lag's frozen copy generates; two epochs: old log-probs scored, importance weights carried
    "grpo-lag-epochs": dict(grpo={"kl_coef": 0.05}, rollout={"lag": 1, "generation_batch_size": 3,
                                                             "forward_batch_size": 3},
                            train={"epochs_per_rollout": 2}),
    "ppo-critic": dict(algorithm="ppo"),
    "grpo-lora": dict(lora={"enabled": True, "r": 4}, grpo={"kl_coef": 0.05}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_probe_changes_no_number_of_the_run(variant, tiny_model_dir, long_prompt_file, tmp_path):
    sections = VARIANTS[variant]
    runs = {}
    for probe in (True, False):
        cfg = grpo_config(tiny_model_dir, long_prompt_file, tmp_path / f"probe-{probe}", rollouts=3, **sections)
        cfg["train"] = {**cfg["train"], "memory_probe": probe}
        runs[probe] = finished(cfg)
    (rows, samples, weights), (rows0, samples0, weights0) = runs[True], runs[False]
    assert rows == rows0 and samples == samples0
    assert weights.keys() == weights0.keys()
    assert all(torch.equal(weights[k], weights0[k]) for k in weights)
    plan = json.loads((tmp_path / "probe-True" / "plan.json").read_text())
    assert set(plan["memory_probe"]["phases"]) == {"generation", "scoring", "update"}
    assert "memory_probe" not in json.loads((tmp_path / "probe-False" / "plan.json").read_text())


def test_the_probe_runs_each_phase_at_its_largest_shapes(tiny_model_dir, long_prompt_file, tmp_path, monkeypatch):
    """The generation decodes all of max_new_tokens for generation_batch_size distinct prompts as long as the
    longest; the scoring chunk and the update's micro-batch are that long too (seen by the run's own functions)."""
    from tidyrl.loops.rl import update
    from tidyrl.models import generation
    from tidyrl.models.loading import load_tokenizer
    from tidyrl.rollouts import scoring

    seen = {"generate": [], "score": [], "update": []}
    chunk, score, micro = generation._generate_chunk, scoring.completion_logprobs, update._micro_batch

    def generate_chunk(model, prompts, keys, **kw):
        out = chunk(model, prompts, keys, **kw)
        seen["generate"].append((len(prompts), len({tuple(p) for p in prompts}), max(map(len, prompts)),
                                 out[0].shape[1]))
        return out

    def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *a, **kw):
        seen["score"].append((prompt_ids.shape[0], prompt_ids.shape[1], int(completion_mask.sum(1).max())))
        return score(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *a, **kw)

    def micro_batch(rollout, idx, *a, **kw):
        part = rollout.select(idx)
        seen["update"].append((len(idx), part.prompt_ids.shape[1], part.completion_ids.shape[1]))
        return micro(rollout, idx, *a, **kw)

    monkeypatch.setattr(generation, "_generate_chunk", generate_chunk)
    monkeypatch.setattr(scoring, "completion_logprobs", completion_logprobs)
    monkeypatch.setattr(update, "_micro_batch", micro_batch)
    cfg = grpo_config(tiny_model_dir, long_prompt_file, tmp_path / "run", rollouts=1, grpo={"kl_coef": 0.05},
                      rollout={"generation_batch_size": 6, "forward_batch_size": 3, "max_new_tokens": 7},
                      train={"micro_batch_size": 2})
    from tidyrl import train

    train(cfg)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    longest = len(tokenizer("a longer prompt about plums:")["input_ids"])  # (a plain prompt: no chat template)
    assert longest > len(tokenizer("lemon:")["input_ids"])
    # the probe's calls come first: 6 distinct prompts of the longest's length, each decoding all 7 tokens
    assert seen["generate"][0] == (6, 6, longest, 7)
    assert seen["score"][0] == (3, longest, 7)  # a chunk of forward_batch_size (the reference's)
    assert seen["update"][0] == (2, longest, 7)
    assert all(n <= 7 for *_, n in seen["generate"][1:])  # (the run's own calls after it)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["memory_probe"]["phases"]["update"]["shapes"] == f"2 episodes of {longest} prompt + 7 completion tokens"


def test_an_out_of_memory_error_mid_run_says_where_and_the_resume_finishes(tiny_model_dir, prompt_file, tmp_path,
                                                                           monkeypatch):
    from safetensors.torch import load_file

    from tidyrl import train
    from tidyrl.loops.rl import update
    from tidyrl.loops.run.out_of_memory import OutOfMemory

    sections = dict(train={"minibatches_per_epoch": 1, "micro_batch_size": 4, "memory_probe": False},
                    log={"save_every": 1, "progress_bar": False})
    whole = train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "whole", rollouts=3, **sections))
    calls, micro = [], update._micro_batch

    def fails_in_step_3(rollout, idx, step, *a, **kw):
        calls.append(step)
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                         "capacity of 79.11 GiB of which 1.2 GiB is free.")
        return micro(rollout, idx, step, *a, **kw)

    monkeypatch.setattr(update, "_micro_batch", fails_in_step_3)
    out = tmp_path / "run"
    with pytest.raises(OutOfMemory) as caught:
        train(grpo_config(tiny_model_dir, prompt_file, out, rollouts=3, **sections))
    message = str(caught.value)
    assert ("out of memory on process 0 in the update phase (micro-batch 1 of 2 of optimizer step 3: 4 episodes of "
            "up to ") in message
    assert "CUDA out of memory. Tried to allocate 2.00 GiB." in message
    assert "The memory plan predicted " in message and "measured: " in message
    assert "Lower train.micro_batch_size (now 4) or set it to auto, or set train.gradient_checkpointing: true" \
        in message
    assert f"The last good checkpoint is {out / 'checkpoint-2'} (resume_from=latest)." in message
    assert len(read_jsonl(out / "metrics.jsonl")) == 2
    monkeypatch.setattr(update, "_micro_batch", micro)
    resumed = train(grpo_config(tiny_model_dir, prompt_file, out, rollouts=3, resume_from="latest", **sections))
    a, b = load_file(whole.final_dir / "model.safetensors"), load_file(resumed.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


LIMITED = """import os, resource, sys
import torch, transformers, accelerate  # noqa: F401  (mapped before the limit)
from transformers import LlamaForCausalLM  # noqa: F401
from tidyrl.cli import main
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
limit = size + 1024 * 2**20
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="an address-space limit (RLIMIT_AS) on Linux")
def test_the_host_refusing_memory_stops_the_run_in_the_probe_or_with_its_checkpoints(tmp_path):
    """Under an address-space limit 1 GiB above the imports, a prompt of 8 000 tokens drawn in the third rollout
    cannot be prefilled (its attention scores alone are 1 GiB): with the probe the run stops before its first
    rollout, naming the generation phase; without it, in the third rollout, with the two checkpoints before it
    complete."""
    import yaml

    from tidyrl.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "model", seed=0, hidden_size=32, num_layers=2, num_heads=4,
                            max_position_embeddings=8192)
    rows = [{"prompt": f"what is {i}+{i + 1}?", "word": "abc"} for i in range(16)]
    rows[6]["prompt"] = "x" * 8000 + " what is 6+7?"  # (PromptStream(16, 0): row 6 is drawn in rollout 3)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"algorithm": "grpo", "model": str(model), "output_dir": str(tmp_path / "run"), "seed": 0,
           "data": {"path": str(tmp_path / "data.jsonl")}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
           "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "max_new_tokens": 8},
           "train": {"rollouts": 4, "micro_batch_size": 4}, "grpo": {"kl_coef": 0.0},
           "log": {"save_every": 1, "progress_bar": False}, "overwrite": True}
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "limited.py").write_text(LIMITED)
    env = {**__import__("os").environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}

    def run(*overrides):
        return subprocess.run([sys.executable, str(tmp_path / "limited.py"), "train", str(tmp_path / "grpo.yaml"),
                               *overrides], capture_output=True, text=True, env=env, timeout=300)

    probed = run()
    assert probed.returncode == 2, probed.stderr[-3000:]
    assert "out of memory on process 0 in the generation phase (sequences 1-8 of 8: prompts of up to 8" in probed.stderr
    assert "of the worst-case probe, before the first rollout: " in probed.stderr
    assert "DefaultCPUAllocator: can't allocate memory" in probed.stderr
    assert ("Lower rollout.generation_batch_size (now 64, 8 at once: each process's episodes) or set it to auto"
            in probed.stderr)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # (stopped before the steps began)
    late = run("train.memory_probe=false")
    assert late.returncode == 2, late.stderr[-3000:]
    assert "out of memory on process 0 in the generation phase" in late.stderr
    assert "worst-case probe" not in late.stderr
    assert f"The last good checkpoint is {tmp_path / 'run' / 'checkpoint-2'} (resume_from=latest)." in late.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    from tidyrl.checkpoint import complete_checkpoints

    assert [step for step, _ in complete_checkpoints(tmp_path / "run")] == [1, 2]


def test_an_out_of_memory_error_in_an_offline_stage_says_where(tiny_model_dir, tmp_path, monkeypatch):
    from test_sft import WORDS, sft_config

    from conftest import write_jsonl
    from tidyrl import train
    from tidyrl.loops.offline import sft
    from tidyrl.loops.run.out_of_memory import OutOfMemory

    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{w}:", "completion": w[::-1]} for w in WORDS])
    calls, micro = [], sft.SFTStage.micro_batch

    def fails_in_the_sixth(self, idx):
        calls.append(idx)
        if len(calls) == 6:  # the worst-case probe's micro-batch, then two a step: step 3's first
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 1027587136 bytes. Error code 12 (Cannot allocate memory)")
        return micro(self, idx)

    monkeypatch.setattr(sft.SFTStage, "micro_batch", fails_in_the_sixth)
    out = tmp_path / "run"
    with pytest.raises(OutOfMemory) as caught:
        train(sft_config(tiny_model_dir, data, out, log={"save_every": 1, "progress_bar": False}))
    message = str(caught.value)
    assert "out of memory on process 0 in the update phase (micro-batch 1 of 2 of optimizer step 3: 2 examples of " \
           "up to " in message
    assert "DefaultCPUAllocator: can't allocate memory" in message
    # (auto is for the RL stages)
    assert "Lower train.micro_batch_size (now 2), or set train.gradient_checkpointing: true" in message
    assert f"The last good checkpoint is {out / 'checkpoint-2'} (resume_from=latest)." in message
    # the probe's micro-batch: the 2 longest examples (the reversed words after "word:", the stage's lengths)
    longest = sorted(WORDS, key=len, reverse=True)[:2]
    assert sorted(len(WORDS[i]) for i in calls[0]) == sorted(len(w) for w in longest)


def test_other_errors_are_not_out_of_memory():
    from tidyrl.models.peak_memory import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory."))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))  # (only the allocator's)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_the_probe_changes_no_number_on_two_processes(sharding, tiny_model_dir, long_prompt_file, tmp_path):
    """Under DDP (the probe's micro-batch keeps its gradient local) and FSDP2 (its generation gathers the weights,
    its scoring and its two micro-batches run the collectives every process runs): the same weights and metrics
    with and without the probe, on 2 gloo processes."""
    import yaml
    from safetensors.torch import load_file
    from test_faults import FSDP_YAML

    from conftest import free_port, gloo_cpu_env

    got = {}
    for probe in (True, False):
        out = tmp_path / f"probe-{probe}"
        cfg = grpo_config(tiny_model_dir, long_prompt_file, out, rollouts=2, grpo={"kl_coef": 0.05},
                          train={"micro_batch_size": 1, "memory_probe": probe})
        cfg["rewards"] = [{"function": "tidyrl.demo:anagram_reward"}]
        path = tmp_path / f"probe-{probe}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        launcher = (["-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML), "--num_processes", "2",
                     "--main_process_port", str(free_port())] if sharding == "fsdp2" else
                    ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())])
        done = subprocess.run([sys.executable, *launcher, "-m", "tidyrl", "train", str(path)], capture_output=True,
                              text=True, timeout=300, env=gloo_cpu_env())
        assert done.returncode == 0, done.stderr[-3000:]
        assert ("memory probe: the worst case" in done.stdout) is probe
        rows = [{k: v for k, v in r.items() if not k.startswith("time")} for r in read_jsonl(out / "metrics.jsonl")]
        got[probe] = rows, load_file(next((out / "final").glob("*.safetensors")))
    (rows, weights), (rows0, weights0) = got[True], got[False]
    assert rows == rows0
    assert all(torch.equal(weights[k], weights0[k]) for k in weights0)
