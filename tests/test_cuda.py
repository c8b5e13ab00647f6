"""What only a CUDA GPU can show: generation, training and launch checks on the device.

    python -m pytest -q -m cuda tests/test_cuda.py      # on a machine with an NVIDIA GPU and a CUDA torch

Skipped where CUDA is not available (this project's CPU machines and CI): run them where a GPU is, e.g. with
`scripts/gpu_check.sh`, which runs them before the benchmarks of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import (bf16_grpo_metrics, bf16_units, free_port, llama, load_measuring_host_peak, read_jsonl,
                      within_bf16_units)

import tidyrl
from tidyrl.models.kernels import Kernels, attach

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m cuda there)")]


def test_keyed_generation_on_cuda_repeats_and_the_lean_step_samples_the_same_tokens():
    from tidyrl.models.generation import generate

    model = llama().to("cuda")
    prompts = [[1, 5, 7, 9], [1, 6], [1, 8, 8, 3, 2, 4]]
    kwargs = dict(sample_keys=[3, 4, 5], max_new_tokens=12, eos_ids=[2], pad_id=0, batch_size=3)
    lean = generate(model, prompts, fast_path=True, **kwargs)
    again = generate(model, prompts, fast_path=True, **kwargs)
    eager = generate(model, prompts, fast_path=False, **kwargs)
    assert torch.equal(lean[0], again[0])  # keyed: the same samples on the device
    assert torch.equal(lean[0], eager[0]) and torch.equal(lean[1], eager[1])  # the lean step is the model's maths


def test_cuda_graph_decoding_draws_what_the_growing_cache_draws():
    """On CUDA the lean step runs with fixed shapes, one captured graph replayed per token (the default there),
    the draw of the next token inside it: the same tokens as the step with a growing cache, log-probs equal to
    rounding."""
    from tidyrl.models import generation
    from tidyrl.models.generation import generate

    model = llama().to("cuda")
    prompts = [[1, 5, 7, 9], [1, 6], [1, 8, 8, 3, 2, 4]] * 4
    kwargs = dict(sample_keys=list(range(12)), max_new_tokens=24, eos_ids=[2], pad_id=0, batch_size=12,
                  return_logprobs=True)
    built = []
    real = generation.Replayed
    generation.Replayed = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        graphed = generate(model, prompts, **kwargs)
    finally:
        generation.Replayed = real
    growing = generate(model, prompts, static_cache=False, **kwargs)
    assert len(built) == 1 and built[0].use_graph and built[0].graph is not None
    assert torch.equal(graphed[0].cpu(), growing[0].cpu()) and torch.equal(graphed[1].cpu(), growing[1].cpu())
    torch.testing.assert_close(graphed[3], growing[3], atol=1e-5, rtol=0)


def test_bf16_decoding_runs_fused_kernels_in_the_graph_and_agrees_with_the_unfused_step():
    """A bf16 Llama-layout model decodes with tidyrl.models.fused_decode's compiled Triton kernels and the
    memory-efficient attention, inside the captured graph: one step's logits and cache equal the unfused step's
    to bf16 rounding (as in Triton's interpreter on CPU), and a whole graphed generation draws what the growing
    cache's unfused loop draws, but for rare rounding flips."""
    from test_lean_decode import fused_and_plain_steps_agree

    from tidyrl.models import fused_decode
    from tidyrl.models.generation import generate

    model = llama(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512).to(
        "cuda", torch.bfloat16)
    assert fused_decode.wanted(torch.device("cuda"), torch.bfloat16, 64, on=True)
    fused_and_plain_steps_agree(model, "cuda", copied=True)  # (a small model: the step works on its copies)
    prompts = [[1, 5, 7, 9], [1, 6], [1, 8, 8, 3, 2, 4]] * 8
    kwargs = dict(sample_keys=list(range(24)), max_new_tokens=40, eos_ids=[2], pad_id=0, batch_size=24,
                  return_logprobs=True)
    graphed = generate(model, prompts, **kwargs)
    growing = generate(model, prompts, static_cache=False, **kwargs)
    assert torch.equal(graphed[0][:, 0], growing[0][:, 0])  # the first draw: the same prompt logits, both draws
    same = (graphed[0] == growing[0]).all(-1)
    assert same.float().mean() >= 0.5, same  # a bf16 rounding flip at a draw's boundary changes the rest of its row
    torch.testing.assert_close(graphed[3][same], growing[3][same], atol=0.05, rtol=0)


def test_the_compiled_attention_kernel_equals_rope_cache_and_sdpa_at_qwen_shapes():
    """fused_decode.rope_cache_attend compiled, at Qwen2.5-0.5B's and 1.5B's attention shapes (7 and 6 query heads
    per key/value head, head size 64 and 128) and a rollout's 128 rows: the cache written as rope_and_cache writes
    it, SDPA's output to bf16 rounding, nothing read past the position written (as in Triton's interpreter)."""
    from test_lean_decode import attention_kernel_agrees

    from tidyrl.models import fused_decode

    for R, D in ((7, 64), (6, 128)):
        for at in (0, 63, 64, 200):
            attention_kernel_agrees(fused_decode, "cuda", B=128, Hkv=2, R=R, D=D, C=272, at=at)


def test_a_grpo_run_on_cuda_trains_on_the_gpu_with_exact_counts(tiny_model_dir, prompt_file, tmp_path):
    env_cpu = os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        result = tidyrl.train({
            "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
            "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6},
            "train": {"rollouts": 3, "epochs_per_rollout": 2, "micro_batch_size": 2},
            "grpo": {"kl_coef": 0.04}, "log": {"progress_bar": False},
        })
    finally:
        if env_cpu is not None:
            os.environ["ACCELERATE_USE_CPU"] = env_cpu
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps == 6
    assert all(r["kl"] is not None and r["grad_norm"] > 0 for r in rows[1:])


def test_a_model_loaded_for_cuda_holds_the_files_weights_there_tied_and_never_copied_on_the_host(tmp_path):
    """`load_causal_lm(device="cuda")` (what the stages do, `loops.run.setup.weights_device`): the weights of the host
    load, bit for bit, on the GPU; tied weights still one Parameter; the host's peak RSS rises by the file's mapped
    pages at most, one model's size (a host copy first, then the move, peaked at two)."""
    from tidyrl.models.loading import load_causal_lm

    llama(tie_word_embeddings=True, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
          vocab_size=32000).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    host = load_causal_lm(str(tmp_path / "m"), "bfloat16")
    size = sum(p.numel() * p.element_size() for p in host.parameters())  # ~83 MB
    load_causal_lm(str(tmp_path / "m"), "bfloat16", device="cuda")  # CUDA's context and lazy parts, first
    on_gpu, peak_above = load_measuring_host_peak(lambda: load_causal_lm(str(tmp_path / "m"), "bfloat16",
                                                                         device="cuda"))
    assert peak_above < 1.5 * size, (peak_above, size)
    assert {p.device.type for p in on_gpu.parameters()} == {"cuda"}
    assert on_gpu.lm_head.weight is on_gpu.model.embed_tokens.weight
    assert all(torch.equal(a.cpu(), b) for a, b in zip(on_gpu.state_dict().values(), host.state_dict().values()))


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_more_processes_than_gpus_is_refused_before_anything_loads(tiny_model_dir, prompt_file, tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"),
        "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2}, "train": {"rollouts": 1}}))
    env = {k: v for k, v in os.environ.items() if k not in ("ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "tidyrl", "train", str(config)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "2 processes were started on this machine, but it has 1 CUDA device" in done.stderr
    assert "invalid device ordinal" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_lean_pass_attends_with_a_fused_kernel_over_grouped_heads():
    """Masked SDPA over grouped key/value heads would fall back to the unfused math kernel on CUDA; with that kernel
    ruled out the lean pass still runs (its heads are repeated first), forward and backward, and gives the model's
    logits (float32) and runs in bfloat16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tidyrl.models.lean_forward import completion_logits

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    prompts = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [7, 8, 9, 10], [7, 8, 9, 10]])
    pmask = (prompts != 0).long()
    completions = torch.tensor([[11, 12, 2, 0, 0, 0], [13, 14, 15, 16, 17, 18]] * 2)
    cmask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]] * 2).float()
    for dtype in (torch.float32, torch.bfloat16):
        model = llama(num_attention_heads=4, num_key_value_heads=2).to("cuda", dtype).train()
        with sdpa_kernel(fused):
            got = completion_logits(model, prompts, pmask, completions, cmask)
            got.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        if dtype == torch.float32:
            ids = torch.cat([prompts, completions], 1).cuda()
            mask = torch.cat([pmask, cmask.long()], 1).cuda()
            with torch.no_grad():
                want = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=False).logits[:, prompts.shape[1] - 1: -1]
            read = cmask.cuda()[..., None]
            torch.testing.assert_close(got.detach() * read, want * read, atol=1e-4, rtol=1e-4)


def test_cuda_scores_and_trains_with_the_model_s_own_forward_and_the_same_numbers(monkeypatch):
    """On CUDA the training forward takes the layout measured fastest there (models.forward.LAYOUTS: the model's own
    forward over whole rows, not the lean pass), forward and backward, with the lean pass's log-probs (float32)."""
    from tidyrl.models import forward
    from tidyrl.models.lean_forward import completion_logits

    assert forward.layouts_for("cuda") == ("onepass",)
    prompts = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [7, 8, 9, 10], [7, 8, 9, 10]])
    pmask = (prompts != 0).long()
    completions = torch.tensor([[11, 12, 2, 0, 0, 0], [13, 14, 15, 16, 17, 18]] * 2)
    cmask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]] * 2).float()
    model = llama(num_attention_heads=4, num_key_value_heads=2).to("cuda").train()
    calls = []
    real = forward.logits_if_lean
    monkeypatch.setattr(forward, "logits_if_lean", lambda *a: calls.append(1) or real(*a))
    logprobs, entropy = forward.completion_logprobs(model, prompts, pmask, completions, cmask, 1.0,
                                                    with_entropy=True)
    logprobs.sum().backward()
    assert calls == [] and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        lean = torch.log_softmax(completion_logits(model, prompts, pmask, completions, cmask).float(), -1)
    want = lean.gather(-1, completions.cuda()[..., None])[..., 0]
    read = cmask.cuda()
    torch.testing.assert_close(logprobs.detach() * read, want * read, atol=1e-4, rtol=1e-4)


def test_the_update_and_scoring_never_wait_for_the_gpu_inside_their_loops(tiny_model_dir, prompt_file, tmp_path,
                                                                          monkeypatch):
    """torch.cuda.set_sync_debug_mode("error") raises at any host synchronisation: it is on from the start of each
    optimizer step to its one reduction of the metric sums (the micro-batch loop), and around every scoring
    forward. tests/test_host_syncs.py checks the same on the meta device, without a GPU."""
    from tidyrl.rollouts import scoring as rollout_module
    from tidyrl.loops.rl import learner as rl
    from tidyrl.models.collectives import Sums

    real_step, real_reduced, real_forward = rl.optimizer_step, Sums.reduced, rollout_module.completion_logprobs
    checked = {"steps": 0, "scoring": 0}

    def step(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_step(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def reduced(self, accelerator):
        if torch.cuda.get_sync_debug_mode() == 2:
            checked["steps"] += 1
        torch.cuda.set_sync_debug_mode("default")
        return real_reduced(self, accelerator)

    def scoring(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = real_forward(*a, **kw)
            checked["scoring"] += 1
            return result
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(rl, "optimizer_step", step)
    monkeypatch.setattr(Sums, "reduced", reduced)
    monkeypatch.setattr(rollout_module, "completion_logprobs", scoring)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    result = tidyrl.train({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 3, "samples_per_prompt": 4, "max_new_tokens": 6, "tis_cap": 2.0,
                    "forward_batch_size": 4},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 4},
        "grpo": {"kl_coef": 0.04}, "log": {"progress_bar": False},
    })
    assert checked["steps"] == result.plan.total_optimizer_steps == 4
    assert checked["scoring"] == 2 * 3  # the reference pass of each rollout, in chunks of 4 of its 12 episodes


def test_on_cuda_log_probs_and_their_gradient_take_the_fused_kernels_with_the_row_by_row_numbers(monkeypatch):
    """bf16 logits on CUDA go through the Triton kernels (models.fused_logprobs: one pass over the vocabulary);
    log-probs, entropies and the gradient equal the row-by-row float32 path's up to float32 rounding, at Qwen's
    vocabulary size, on a strided view, with a masked vocabulary."""
    from tidyrl.models import fused_logprobs, ops

    assert fused_logprobs._kernels() is not None, "Triton did not import: the CUDA path would be the slow one"
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, V = 4, 33, 151936
    logits = (3 * torch.randn(B, T + 1, V, generator=g, device="cuda")).bfloat16()
    logits[1, 2, 1000:90000] = float("-inf")
    view = logits[:, :-1]
    ids = torch.randint(0, V, (B, T), generator=g, device="cuda")
    weights = torch.randn(B, T, generator=g, device="cuda")
    used = []
    real = fused_logprobs.logprob_stats
    monkeypatch.setattr(fused_logprobs, "logprob_stats", lambda *a: used.append(1) or real(*a))
    mine = view.detach().requires_grad_(True)
    logprobs, entropy = ops.gather_logprobs_and_entropy(mine, ids)
    (logprobs * weights).sum().backward()
    ref = view.detach().requires_grad_(True)
    want, want_entropy = ops.gather_logprobs_and_entropy(ref, ids, fused=False)  # kernels.fused_logprobs: false
    (want * weights).sum().backward()
    assert used == [1]
    torch.testing.assert_close(logprobs, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(entropy, want_entropy, atol=5e-5, rtol=0)
    ulp = torch.finfo(torch.bfloat16).eps * ref.grad.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    assert mine.grad.dtype == torch.bfloat16 and ((mine.grad.float() - ref.grad.float()).abs() <= ulp).all()


def test_a_lagged_grpo_run_on_cuda_generates_beside_training_with_exact_counts(tiny_model_dir, prompt_file, tmp_path):
    """rollout.lag 1 on CUDA: the engine generates on a background thread (its CUDA graph captured there each
    rollout) while the learner trains; every rollout arrives, with the lag the config fixes."""
    from tidyrl.rollouts import ahead

    assert ahead.BACKGROUND
    env_cpu = os.environ.pop("ACCELERATE_USE_CPU", None)
    try:
        result = tidyrl.train({
            "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
            "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6, "lag": 1},
            "train": {"rollouts": 4, "epochs_per_rollout": 1, "micro_batch_size": 4},
            "log": {"progress_bar": False},
        })
    finally:
        if env_cpu is not None:
            os.environ["ACCELERATE_USE_CPU"] = env_cpu
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps
    first = {}
    for row in rows:
        first.setdefault(row["rollout"], row)
    assert [first[r]["async/policy_lag"] for r in sorted(first)] == [0, 1, 1, 1]


def test_on_cuda_the_output_layer_in_chunks_keeps_the_numbers_and_not_the_logits():
    """bf16 at Qwen2.5-0.5B's head (896 x 151 936), an update micro-batch's 16 x 257 positions: the chunked head
    (models.chunked_head) gives the whole logits' log-probs and entropies (the same products and kernels), the
    gradients to bf16 units of their scale, without a host synchronisation, at a peak a fraction of theirs."""
    from tidyrl.models import chunked_head
    from tidyrl.models.ops import gather_logprobs_and_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, V = 16, 257, 896, 151936
    hidden = torch.randn(B, T, H, generator=g, device="cuda").bfloat16()
    weight = (torch.randn(V, H, generator=g, device="cuda") / H ** 0.5).bfloat16()
    ids = torch.randint(0, V, (B, T), generator=g, device="cuda")
    weights = torch.randn(B, T, generator=g, device="cuda")
    results, peaks = [], []
    for chunked in (True, False):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        if chunked:
            torch.cuda.set_sync_debug_mode("error")
            try:
                lp, ent = chunked_head.head_logprobs(h, w, ids, 0.7, True)
                (lp * weights).sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            lp, ent = gather_logprobs_and_entropy(F.linear(h, w) / 0.7, ids, True)
            (lp * weights).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - held)
        results.append((lp.detach(), ent, h.grad, w.grad))
    (lp, ent, gh, gw), (wlp, went, wgh, wgw) = results
    torch.testing.assert_close(lp, wlp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, went, atol=5e-5, rtol=0)
    assert within_bf16_units(gw, wgw, 2) and within_bf16_units(gh, wgh, 2)
    logits_bytes = B * T * V * 2
    # whole: the logits, their / 0.7 and their gradient; chunked: the weight's gradient and a chunk's logits or so
    assert peaks[1] > 2 * logits_bytes and peaks[0] < logits_bytes / 2, (peaks, logits_bytes)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_grpo_run_on_cuda_scores_and_trains_through_the_chunked_head(tiny_model_dir, prompt_file, tmp_path,
                                                                              monkeypatch, lora):
    """On CUDA a bf16 run's reference scoring and updates take the chunked head (models.chunked_head), and its
    first two steps report what the model's whole logits give, to rounding (the same samples: one rollout, two
    epochs); a LoRA run's too (peft's forward around the model, the output layer frozen)."""
    from tidyrl.models import chunked_head, forward

    if lora:
        pytest.importorskip("peft")

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setitem(forward.LEAN_FROM_SHARE, "cuda", 2.0)  # (this test's short rows: the one-pass forward)
    calls = []
    real = chunked_head.head_logprobs
    monkeypatch.setattr(forward, "head_logprobs", lambda *a, **k: calls.append(a[0].requires_grad) or real(*a, **k))

    chunked = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "chunked", lora)
    assert calls == [False, False, True, True, True, True], calls
    whole = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "whole", lora, kernels={"chunked_head": False})
    assert len(calls) == 6 and len(chunked) == len(whole) == 2
    for got, want in zip(chunked, whole):
        for key in ("loss", "kl", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (got["step"], key)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.05)


def test_on_cuda_inside_ddp_the_update_takes_the_chunked_head_and_the_recompute(monkeypatch):
    """As on CPU (tests/test_chunked_head.py): a bf16 model inside DDP (NCCL, one process) takes the chunked head
    and the recompute through DDP's forward, and two SGD steps give the plain model's log-probs and gradients (to
    CUDA's atomic adds: a few bf16 units)."""
    from test_chunked_head import ddp_and_plain_agree, one_process_group

    with one_process_group("nccl"):
        ddp_and_plain_agree(monkeypatch, llama(tie_word_embeddings=True).to("cuda", torch.bfloat16), units=4)


def test_on_cuda_recomputed_norms_and_mlp_products_lower_the_peak_and_change_no_number(monkeypatch):
    """An update-like pass of a bf16 model on CUDA (models.recompute on, then off): the same log-probs,
    the same gradients (up to the order of CUDA's atomic adds), at a lower peak of GPU memory (the norms' float32
    copies and silu(gate) not kept)."""
    from tidyrl.models import forward

    model = llama(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=512).to("cuda", torch.bfloat16).train()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 40, (8, 32), generator=g)
    completions = torch.randint(3, 40, (8, 224), generator=g)
    batch = (prompts, torch.ones_like(prompts), completions, torch.ones_like(completions).float())
    runs = []
    for on in (True, False):
        attach(model, Kernels(recompute=on))
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        lp, _ = forward.completion_logprobs(model, *batch, 1.0)
        lp.sum().backward()
        torch.cuda.synchronize()
        runs.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                     torch.cuda.max_memory_allocated() - held))
    (lp, grads, peak), (want, want_grads, want_peak) = runs
    assert torch.equal(lp, want)
    # (the same ops; CUDA's attention and embedding backward add with atomics, in no fixed order: bf16 units)
    for name, grad in grads.items():
        assert within_bf16_units(grad, want_grads[name], 2), name
    assert peak < 0.9 * want_peak, (peak, want_peak)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_recompute_functions_give_autograds_gradients_bit_for_bit(dtype):
    """NormRecomputed and SiluTimesRecomputed on CUDA, as on CPU (tests/test_recompute.py): the same outputs and
    gradients as autograd on the model's own ops, bit for bit (elementwise kernels and reductions, no atomics)."""
    from test_recompute import functions_match_autograd

    functions_match_autograd(dtype, "cuda")


def test_compiled_layers_keep_the_model_s_log_probs_and_accumulated_gradients_to_bf16_rounding(monkeypatch):
    """The trained model's decoder layers compiled (models.layer_kernels): the model's own log-probs and gradients
    to bf16 rounding, over two optimizer steps of three micro-batches of two widths each (gradients accumulated
    across them), compiled once per model."""
    import copy

    from tidyrl.models import forward, layer_kernels

    plain = llama(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, intermediate_size=256).to(
        "cuda", torch.bfloat16).train()
    compiled = copy.deepcopy(plain)
    assert layer_kernels.prepare(attach(plain, Kernels(layer_kernels="none"))) == "none"
    assert layer_kernels.prepare(attach(compiled, Kernels(layer_kernels="compile"))) == "compile"
    worst_lp, worst_grad = 0.0, (0.0, "")
    for step in range(2):
        results = []
        for model in (compiled, plain):
            model.zero_grad(set_to_none=True)
            logprobs = []
            for width in (4, 9, 4):
                gen = torch.Generator().manual_seed(step * 10 + width)
                prompts = torch.randint(3, 40, (4, width), generator=gen)
                pmask = torch.ones_like(prompts)
                pmask[0, :2] = 0
                completions = torch.randint(3, 40, (4, 6), generator=gen)
                cmask = torch.ones(4, 6)
                cmask[1, 4:] = 0
                weights = torch.randn(4, 6, generator=gen).cuda() * cmask.cuda()
                lp, _ = forward.completion_logprobs(model, prompts, pmask, completions, cmask, 1.0)
                (lp * weights).sum().backward()
                logprobs.append(lp.detach() * cmask.cuda())
            results.append((logprobs, {n: p.grad.clone() for n, p in model.named_parameters()}))
        (lps, grads), (want_lps, want_grads) = results
        worst_lp = max(worst_lp, *(bf16_units(a, b) for a, b in zip(lps, want_lps)))
        worst_grad = max(worst_grad, *((bf16_units(grads[n], want_grads[n]), n) for n in want_grads))
    assert worst_lp <= 4 and worst_grad[0] <= 8, (worst_lp, worst_grad)
    assert layer_kernels.prepare(compiled) == "compile"  # (once: the second call finds it applied)
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)


def test_a_mixture_of_experts_routes_recorded_on_cuda_replay_to_the_samplers_log_probs_in_bfloat16():
    """The built-in engine on a GPU in bfloat16 records a tiny Qwen3-MoE's routes (growing shapes, no graph); the
    trainer's lean pass replaying them takes the recorded experts at every routed position and scores the
    sampler's log-probs closer than its own routing does."""
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.generation import generate
    from tidyrl.models.routing import replaying
    from tidyrl.models.sequences import left_pad
    from tidyrl.models.tiny import build_tiny_moe

    model = build_tiny_moe("qwen3_moe", 256, hidden_size=128, num_layers=4, num_heads=4, num_experts=8,
                           experts_per_token=2, seed=0).to("cuda", torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (12,), generator=g).tolist() for _ in range(4) for _ in range(4)]
    ids, mask, _, sampled, p_routes, c_routes = generate(
        model, prompts, sample_keys=list(range(16)), max_new_tokens=24, eos_ids=[2], pad_id=0, batch_size=16,
        return_logprobs=True, return_routes=True)
    p_ids, p_mask = left_pad(prompts, 0)
    routes = torch.cat([p_routes, c_routes], 1)
    gaps = {}
    for replay in (True, False):
        with torch.no_grad(), replaying(model, routes, replay) as state:
            trainer, _ = completion_logprobs(model, p_ids, p_mask, ids, mask, 1.0, routing=state)
        real = mask > 0
        gaps[replay] = float((trainer.cpu()[real] - sampled[real]).abs().mean())
        if replay:
            assert state.changed_fraction() is not None
    assert gaps[True] <= gaps[False] + 1e-6, gaps
    print("bf16 |dlogp| mean with replay", gaps[True], "without", gaps[False])
