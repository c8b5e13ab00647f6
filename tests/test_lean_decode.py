"""The lean Llama decode step computes what the Hugging Face forward computes, and generation with it draws
the same completions."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA_LAYOUTS as MODELS
from conftest import VOCAB as V
from conftest import interpreted_triton, rerun_interpreted, with_random_norms_and_biases
from conftest import llama as _llama

from tidyrl.models import generation, lean_decode
from tidyrl.models.kernels import Kernels, attach
from tidyrl.models.lean_decode import DecodeStep, attention_bias, supports
from tidyrl.models.generation import _BufferedLayer, _buffered_cache, generate
from tidyrl.models.sequences import cache_argument, left_pad, returned_cache, sample_seed

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels


@pytest.mark.parametrize("copy_weights", [True, False], ids=["copied-weights", "own-weights"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_step_logits_equal_the_model_forward(name, copy_weights, monkeypatch):
    """Left-padded prompts of different lengths, then 12 decoding steps: at every step the lean step's logits
    equal the model's own forward on the same cache contents, to float rounding."""
    monkeypatch.setattr(lean_decode, "COPY_MAX_BYTES", 2**40 if copy_weights else 0)
    model = MODELS[name]()
    assert supports(model)
    ids, mask, pos = _left_padded_prompts()
    steps = 12
    with torch.no_grad():
        prefill = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        step = DecodeStep(model, ids.shape[1] + steps)
        assert (step.copies is not None) == copy_weights
        for got, want, ours, theirs in _decode_side_by_side(model, step, prefill, mask, pos, steps):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
            for a, b in zip(ours.layers, theirs.layers):  # the same keys and values were written
                torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-5)
                torch.testing.assert_close(a.values, b.values, atol=2e-5, rtol=1e-5)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def _left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PROMPTS left-padded: ids, 0/1 mask and position ids (B, Lp)."""
    ids, mask = left_pad(PROMPTS, 0)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _decode_side_by_side(model, step, prefill, mask, pos, steps: int):
    """Yields (our logits, the model's logits, our cache, its cache) at each of `steps` decoding steps: the lean
    step and the model's own forward, each on a copy of `prefill`'s cache, both fed the model's greedy token."""
    B, Lp = mask.shape
    rows = torch.arange(B)
    theirs, ours = (_buffered_cache(returned_cache(prefill), rows, Lp + steps) for _ in range(2))
    full_mask = torch.cat([mask, torch.ones(B, steps, dtype=mask.dtype)], dim=1)
    bias = attention_bias(full_mask, prefill.logits.dtype)
    token, next_pos = prefill.logits[:, -1].argmax(-1), pos[:, -1:] + 1
    for t in range(steps):
        want = model(input_ids=token[:, None], attention_mask=full_mask[:, : Lp + t + 1], position_ids=next_pos,
                     **{cache_argument(model): theirs}, use_cache=True).logits[:, -1]
        yield step(token, bias[..., : Lp + t + 1], next_pos, ours.layers), want, ours, theirs
        token, next_pos = want.argmax(-1), next_pos + 1


@pytest.mark.parametrize("copy_weights", [True, False], ids=["copied-weights", "own-weights"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_equals_the_model_forward(name, copy_weights, monkeypatch):
    """The lean prefill of left-padded prompts gives the model's own last-position logits, and writes the keys
    and values its cache holds, at every real position."""
    monkeypatch.setattr(lean_decode, "COPY_MAX_BYTES", 2**40 if copy_weights else 0)
    model = MODELS[name]()
    ids, mask, pos = _left_padded_prompts()
    Lp = ids.shape[1]
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        step = DecodeStep(model, Lp + 4)
        empty = torch.empty((len(PROMPTS), step.n_kv, 0, step.head_dim))
        layers = [_BufferedLayer(empty, empty, Lp + 4) for _ in step.layers]
        got = step.prefill(ids, mask, pos, layers)
    torch.testing.assert_close(got, want.logits[:, -1], atol=2e-5, rtol=1e-5)
    real = mask.bool()
    for ours, theirs in zip(layers, returned_cache(want).layers):
        assert ours.get_seq_length() == Lp
        for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):  # (B, Hkv, Lp, D)
            torch.testing.assert_close(a.transpose(1, 2)[real], b.transpose(1, 2)[real], atol=2e-5, rtol=1e-5)
            assert torch.isfinite(a).all()


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "llama-dynamic-rope"])
def test_generate_draws_the_same_completions_with_the_lean_step(name):
    model = MODELS[name]()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]] * 4
    common = dict(sample_keys=[sample_seed(3, 1, i) for i in range(12)], max_new_tokens=20, eos_ids=[2, 3],
                  pad_id=0, return_logprobs=True)
    for extra in ({}, {"min_new_tokens": 4, "temperature": 0.7}, {"top_k": 6, "top_p": 0.9, "min_new_tokens": 2}):
        lean = generate(model, prompts, batch_size=12, **common, **extra)
        plain = generate(model, prompts, batch_size=12, fast_path=False, **common, **extra)
        chunked = generate(model, prompts, batch_size=5, **common, **extra)
        for a, b, c in zip(lean[:3], plain[:3], chunked[:3]):
            assert torch.equal(a, b) and torch.equal(a, c)
        torch.testing.assert_close(lean[3], plain[3], atol=1e-5, rtol=0)
    assert not lean[2].all()  # some rows ended at an EOS id


@pytest.mark.parametrize("name", ["llama-gqa", "llama-mha-bias", "qwen2", "llama-dynamic-rope"])
def test_fixed_shape_decoding_draws_the_same_completions(name, monkeypatch):
    """The fixed-shape step (what a CUDA graph replays on a GPU; eager here) attends over the whole cache with
    the unwritten positions masked and keeps finished rows in the batch: the same tokens as the growing cache,
    log-probs equal to rounding. Its write index and mask live on the device, so one captured step serves
    every token. Its cache is padded to a multiple of 16 positions as on CUDA (never written, masked)."""
    from tidyrl.models import devices

    monkeypatch.setitem(devices.WIDTH_MULTIPLE, "cpu", 16)
    model = MODELS[name]()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]] * 4
    common = dict(sample_keys=[sample_seed(5, 2, i) for i in range(12)], max_new_tokens=16, eos_ids=[2, 3],
                  pad_id=0, return_logprobs=True, batch_size=12)
    built, steps = [], []  # the fixed-shape units of each call, and how many ran
    real = generation.Replayed

    class Counted(real):
        def __call__(self):
            steps[-1] += 1
            return super().__call__()

    monkeypatch.setattr(generation, "Replayed", lambda *a, **k: built.append(Counted(*a, **k)) or built[-1])
    ended = []
    # The last setting makes half the vocabulary EOS: every row ends within a few tokens, the fixed-shape loop
    # decodes padding until it asks whether all have (every _END_CHECK_EVERY tokens: one host read per 8), then stops.
    for extra in ({}, {"min_new_tokens": 3, "temperature": 0.7}, {"top_k": 6, "min_new_tokens": 2},
                  {"eos_ids": list(range(2, V, 2))}):
        settings = {**common, **extra}
        steps.append(0)
        fixed = generate(model, prompts, static_cache=True, **settings)
        ended.append(bool((~fixed[2]).any()))
        growing = generate(model, prompts, static_cache=False, **settings)
        for a, b in zip(fixed[:3], growing[:3]):
            assert torch.equal(a, b)
        torch.testing.assert_close(fixed[3], growing[3], atol=1e-5, rtol=0)
    assert len(built) == 4 and not any(r.use_graph for r in built)  # built once per call; no graph off CUDA
    assert any(ended)  # some rows ended early and stayed in the batch (decoding padding) until the others did
    assert int(fixed[1].sum(1).max()) < generation._END_CHECK_EVERY  # every row ended before the first check,
    assert steps[-1] == generation._END_CHECK_EVERY - 1  # where the loop stopped (units after the first token)


# Ops that read a device value on the host or size their output by the data: a CUDA graph cannot capture them.
_HOST_READS = {"_local_scalar_dense", "nonzero", "_unique", "_unique2", "unique_dim", "unique_consecutive",
               "masked_select", "isin", "item"}


def test_a_fixed_shape_token_reads_no_host_value(monkeypatch):
    """What a CUDA graph captures per token (the decoding step and the draw of the next token, with EOS banned
    and top-k/top-p filtering) calls no op that reads a device value on the host or sizes its output by the data
    (every aten op it dispatches is recorded): `torch.isin`, for one, sorts through torch.unique once the tokens
    outnumber the ids, and an `.item()` or a boolean index would stop the capture on a GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    called: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                 for i in (args[1] if len(args) > 1 else ()) if i is not None)
            called.append("boolean index" if bool_index else name)
            return func(*args, **(kwargs or {}))

    real = generation.Replayed

    class Recorded(real):
        def __call__(self):
            with Record():
                return super().__call__()

    monkeypatch.setattr(generation, "Replayed", Recorded)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [14]] * 4
    generate(MODELS["qwen2"](), prompts, sample_keys=list(range(12)), max_new_tokens=6, eos_ids=[2, 3], pad_id=0,
             batch_size=12, static_cache=True, min_new_tokens=2, top_k=6, top_p=0.9)
    assert {"baddbmm", "searchsorted", "index_copy_", "topk", "sort"} <= set(called)  # the whole unit was seen
    assert not _HOST_READS & set(called) and "boolean index" not in called


def fused_and_plain_steps_agree(model, device, copied: bool = False) -> None:
    """Four fixed-shape bf16 steps of `model` from the same prefilled cache, with the fused kernels and without:
    logits within a few bf16 units of each other, the same argmax nearly everywhere, the cache written alike
    (values exactly, keys after rope to rounding), nothing written past the steps' positions."""
    step = DecodeStep(model, 64)
    assert step.fused and step.copied == copied and (step.side_by_side() is None) == copied
    ids, mask = (t.to(device) for t in left_pad([[5, 6, 7], [8, 9, 10, 11, 12], [14]], 0))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    Lp, C = ids.shape[1], 16
    empty = torch.empty((3, step.n_kv, 0, step.head_dim), dtype=torch.bfloat16, device=device)
    prefilled = [_BufferedLayer(empty, empty, C) for _ in step.layers]
    step.prefill(ids, mask, positions, prefilled)
    attn = torch.ones((3, C), dtype=torch.long, device=device)
    attn[:, :Lp] = mask
    runs = []
    for on in (True, False):
        step.fused = on
        layers = [_BufferedLayer(l._k[:, :, :Lp].clone(), l._v[:, :, :Lp].clone(), C) for l in prefilled]
        static = lean_decode.StaticDecode(step, layers, attention_bias(attn, torch.bfloat16), Lp)
        assert all((l.qkv is not None) == (on and not copied) for l in static.layers)
        static.positions.copy_(positions[:, -1:] + 1)
        logits = []
        for tokens in ([3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 15]):
            static.tokens.copy_(torch.tensor(tokens))
            logits.append(static().float())
        runs.append((torch.stack(logits), [(l.keys.float(), l.values.float()) for l in static.layers]))
    (fused_logits, fused_cache), (plain_logits, plain_cache) = runs
    assert (fused_logits - plain_logits).abs().max() <= 0.03 * plain_logits.abs().max()  # a few bf16 units
    assert (fused_logits.argmax(-1) == plain_logits.argmax(-1)).float().mean() >= 0.9
    for (k1, v1), (k2, v2) in zip(fused_cache, plain_cache):
        assert torch.equal(v1[:, :, :Lp], v2[:, :, :Lp]) and torch.equal(k1[:, :, Lp + 4:], k2[:, :, Lp + 4:])
        assert (k1 - k2).abs().max() <= 0.05 * k2.abs().max() and (v1 - v2).abs().max() <= 0.05 * v2.abs().max()


def test_the_fused_decoding_kernels_are_the_unfused_step_up_to_rounding(monkeypatch):
    """bf16 fixed-shape steps with tidyrl.models.fused_decode (each residual add fused with its RMSNorm, rope with
    the cache writes, the attention one SDPA call; Triton's interpreter here, compiled in tests/test_cuda.py) give
    the unfused step's logits and cache up to bf16 rounding, over several tokens, with q/k/v biases (qwen2) and
    grouped heads, on the model's own weights (q/k/v and gate/up side by side for the generation, silu(gate) * up
    one kernel) and on the small-model copies; the attention both as one kernel with rope and the cache writes over
    the positions written so far (the default) and as SDPA over the whole capacity (kernels.decode_attention: sdpa)."""
    fused = interpreted_triton(monkeypatch, "fused_decode")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(f"{__file__}::test_the_fused_decoding_kernels_are_the_unfused_step_up_to_rounding")
    calls = []
    for name in ("add_rms_norm", "rope_and_cache", "attention", "rope_cache_attend", "silu_and_mul"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    monkeypatch.setattr(fused, "wanted", lambda device, dtype, head_dim, on: on and dtype == torch.bfloat16)
    try:
        for attention in ("kernel", "sdpa"):
            calls.clear()
            for name, copy_max in (("llama-gqa", 0), ("qwen2", 0), ("qwen2", lean_decode.COPY_MAX_BYTES)):
                monkeypatch.setattr(lean_decode, "COPY_MAX_BYTES", copy_max)
                model = attach(MODELS[name]().to(torch.bfloat16), Kernels(decode_attention=attention))
                fused_and_plain_steps_agree(model, "cpu", copied=bool(copy_max))
            per_step = 2 * 2 + 1  # two layers: two norms each, and the final norm
            layer_steps = 3 * 4 * 2  # three models, four steps, two layers
            assert calls.count("add_rms_norm") == 3 * 4 * per_step and calls.count("silu_and_mul") == layer_steps
            if attention == "kernel":
                assert calls.count("rope_cache_attend") == layer_steps and "attention" not in calls
                assert "rope_and_cache" not in calls
            else:
                assert calls.count("rope_and_cache") == layer_steps and calls.count("attention") == layer_steps
                assert "rope_cache_attend" not in calls
    finally:
        fused._kernels.cache_clear()


def test_the_attention_kernel_reads_only_the_written_positions_and_equals_rope_cache_and_sdpa(monkeypatch):
    """fused_decode.rope_cache_attend (Triton's interpreter here; compiled in tests/test_cuda.py) writes the cache
    exactly as rope_and_cache does and gives SDPA's output over the whole capacity to bf16 rounding: grouped heads
    (3 per group, padded to 16 in the kernel), rows with left padding, one whose first blocks are all padding,
    several blocks of positions with a partial last one; and it never reads a position past `at` (NaNs there change
    nothing, where SDPA's output turns NaN)."""
    fused = interpreted_triton(monkeypatch, "fused_decode")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(
            f"{__file__}::test_the_attention_kernel_reads_only_the_written_positions_and_equals_rope_cache_and_sdpa")
    try:
        for block, at in ((64, 70), (16, 70), (16, 31), (64, 0)):
            monkeypatch.setattr(fused, "ATTEND_BLOCK", block)
            attention_kernel_agrees(fused, "cpu", B=3, Hkv=2, R=3, D=16, C=80, at=at)
    finally:
        fused._kernels.cache_clear()


def attention_kernel_agrees(fused, device, *, B: int, Hkv: int, R: int, D: int, C: int, at: int) -> None:
    """`fused.rope_cache_attend` against `rope_and_cache` and SDPA for one step writing position `at` of a (B, Hkv,
    C, D) bf16 cache, rows 0 and 1 left-padded (row 1 by 40 positions): the cache written alike up to `at`, the
    outputs to bf16 rounding, none NaN with NaNs past `at`."""
    g = torch.Generator().manual_seed(3)
    H, dt = Hkv * R, torch.bfloat16
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(device, dt)
    q, k, v = qkv[:, : H * D], qkv[:, H * D: (H + Hkv) * D], qkv[:, (H + Hkv) * D:]  # strided rows, as in a step
    angles = (5.0 + torch.arange(B)[:, None]) / 10000 ** (torch.arange(0, D, 2) / D)
    angles = torch.cat([angles, angles], -1)
    cos = angles.cos().to(device, dt)[:, None].contiguous()
    sin = lean_decode.signed_sin(angles.sin().to(device, dt))[:, None].contiguous()
    keys, values = (torch.randn(B, Hkv, C, D, generator=g).to(device, dt) for _ in range(2))
    mask = torch.ones(B, C, dtype=torch.long)
    mask[0, : min(4, at)] = 0
    mask[1, : min(40, at)] = 0
    mask[:, at + 1:] = 0
    bias = lean_decode.attention_bias(mask.to(device), dt).view(B, C)
    where = torch.tensor([at], device=device)
    k1, v1 = keys.clone(), values.clone()
    k1[:, :, at + 1:] = float("nan")  # never read
    v1[:, :, at + 1:] = float("nan")
    out = fused.rope_cache_attend(q, k, v, cos, sin, k1, v1, where, bias, D ** -0.5)
    k2, v2 = keys.clone(), values.clone()
    q2 = fused.rope_and_cache(q, k, v, cos, sin, k2, v2, where)
    assert torch.equal(k1[:, :, : at + 1], k2[:, :, : at + 1]) and torch.equal(v1[:, :, : at + 1], v2[:, :, : at + 1])
    want = fused.attention(q2.view(B * Hkv, 1, R, D), k2.view(B * Hkv, 1, C, D), v2.view(B * Hkv, 1, C, D),
                           bias[:, None, None].expand(B, Hkv, R, C).reshape(B * Hkv, 1, R, C), D ** -0.5)
    want = want.reshape(B, H * D).float()
    assert out.shape == (B, H * D) and out.dtype == dt and not out.isnan().any()
    assert (out.float() - want).abs().max() <= 2 ** -7 * want.abs().max(), at


def test_the_fused_draw_is_the_unfused_draw(monkeypatch):
    """tidyrl.models.fused_decode.draw (one Triton kernel per row; its interpreter here) draws the tokens
    generation.draw_tokens draws from the same logits and uniforms, and gives their log-probs to float32 rounding:
    at temperatures 1 and 0.7, with EOS banned and not (the step against min_new_tokens, on the device), logits in
    bf16 and float32 with some at -inf, uniforms at 0 and just under 1, over blocks of 16 tokens with a partial last
    one (the sampler's two levels)."""
    fused = interpreted_triton(monkeypatch, "fused_decode")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(f"{__file__}::test_the_fused_draw_is_the_unfused_draw")
    monkeypatch.setattr(generation, "_SAMPLING_BLOCK", 16)
    g = torch.Generator().manual_seed(7)
    B, V, T = 12, 53, 4
    eos = torch.tensor([2, 3])
    eos_column = torch.zeros((1, V), dtype=torch.bool).index_fill_(1, eos, True)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            logits = (2.5 * torch.randn(B, V, generator=g)).to(dtype)
            logits[0, 20:40] = float("-inf")
            logits[1, :16] = float("-inf")  # a whole first block without mass
            uniforms = torch.rand(B, T, generator=g, dtype=torch.float64)
            uniforms[2, :] = 0.0
            uniforms[3, :] = 1.0 - 2.0 ** -52
            for temperature in (1.0, 0.7):
                for step, ban_until in ((0, 2), (3, 2)):  # banned, then past min_new_tokens
                    t = torch.tensor([step])
                    token, logp = fused.draw(logits, uniforms, t, temperature=temperature, eos=eos,
                                             ban_until=ban_until, block=16)
                    want, want_logp = generation.draw_tokens(
                        logits, uniforms[:, step], temperature=temperature, top_k=0, top_p=1.0,
                        banned=eos_column if step < ban_until else None)
                    assert token.dtype == torch.int64 and torch.equal(token, want), (dtype, temperature, step)
                    torch.testing.assert_close(logp, want_logp, atol=2e-6, rtol=0)
                    if step < ban_until:
                        assert not torch.isin(token, eos).any()
            none = torch.empty(0, dtype=torch.long)  # no EOS ids at all: nothing banned
            token, logp = fused.draw(logits, uniforms, torch.tensor([0]), temperature=1.0, eos=none, ban_until=2,
                                     block=16)
            want, want_logp = generation.draw_tokens(logits, uniforms[:, 0], temperature=1.0, top_k=0, top_p=1.0)
            assert torch.equal(token, want)
            torch.testing.assert_close(logp, want_logp, atol=2e-6, rtol=0)
    finally:
        fused._kernels.cache_clear()


def test_a_fixed_shape_generation_with_the_fused_draw_draws_what_the_unfused_one_draws(monkeypatch):
    """The fused draw inside the fixed-shape loop (the device-side step t, the uniforms' columns, EOS banned until
    min_new_tokens, temperature), in Triton's interpreter: the same completions as the unfused draw on a float32
    model, log-probs to float32 rounding; and a bf16 model with every fused kernel generates whole completions."""
    fused = interpreted_triton(monkeypatch, "fused_decode")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(
            f"{__file__}::test_a_fixed_shape_generation_with_the_fused_draw_draws_what_the_unfused_one_draws")
    prompts = [[5, 6, 7], [8, 9, 10, 11], [14]] * 4
    kwargs = dict(sample_keys=list(range(12)), max_new_tokens=12, eos_ids=[2, 3], pad_id=0, batch_size=12,
                  return_logprobs=True, static_cache=True, min_new_tokens=3, temperature=0.8)
    try:
        model = MODELS["llama-gqa"]()
        plain = generate(model, prompts, **kwargs)
        monkeypatch.setattr(fused, "draw_wanted", lambda logits, on: on)
        drawn = generate(model, prompts, **kwargs)
        for a, b in zip(drawn[:3], plain[:3]):
            assert torch.equal(a, b)
        torch.testing.assert_close(drawn[3], plain[3], atol=2e-6, rtol=0)
        assert (drawn[1].sum(1) >= 3).all()  # no EOS before min_new_tokens

        monkeypatch.setattr(fused, "wanted", lambda device, dtype, head_dim, on: on and dtype == torch.bfloat16)
        low = MODELS["qwen2"]().to(torch.bfloat16)
        ids, mask, _, logprobs = generate(low, prompts, **kwargs)
        assert lean_decode._STEPS[low].fused and ids.shape == (12, 12)
        assert (mask.sum(1) >= 3).all() and torch.isfinite(logprobs).all() and (logprobs[mask > 0] < 0).all()
    finally:
        fused._kernels.cache_clear()


def test_fused_kernels_that_fail_on_a_device_give_way_to_the_unfused_ops(monkeypatch):
    """A fused kernel that cannot compile or run on some GPU does not fail the generation: the chunk is decoded
    again with the unfused ops from the prompts' cache (the same completions as without the kernels), a warning
    says why, and the kernels stay off for the process. An error with the kernels off is raised as it is, and so is
    running out of memory (the unfused ops need more)."""
    from tidyrl.models import fused_decode

    model = MODELS["qwen2"]().to(torch.bfloat16)
    prompts = [[5, 6, 7], [8, 9, 10, 11], [14]] * 4
    kwargs = dict(sample_keys=list(range(12)), max_new_tokens=10, eos_ids=[2, 3], pad_id=0, batch_size=12,
                  return_logprobs=True, static_cache=True, min_new_tokens=2)
    plain = generate(model, prompts, **kwargs)
    monkeypatch.setattr(fused_decode, "_failure", None)
    monkeypatch.setattr(fused_decode, "_kernels", lambda: object())  # "importable"; the step asks on the CPU:
    monkeypatch.setattr(fused_decode, "wanted", lambda device, dtype, head_dim, on: fused_decode._enabled(on))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("PTX compile failed for sm_75")

    monkeypatch.setattr(fused_decode, "add_rms_norm", broken)
    real_call = lean_decode.StaticDecode.__call__
    lean_decode._STEPS.pop(model, None)
    with pytest.warns(RuntimeWarning, match="fused decoding kernels failed.*PTX compile failed for sm_75"):
        again = generate(model, prompts, **kwargs)
    assert calls == [1] and not fused_decode._enabled(True)
    assert fused_decode.failure() == "RuntimeError: PTX compile failed for sm_75"  # what the benchmarks print
    for a, b in zip(again, plain):
        assert torch.equal(a, b)
    lean_decode._STEPS.pop(model, None)
    assert not lean_decode.decode_step_for(model, 32).fused  # off for the process

    monkeypatch.setattr(lean_decode.StaticDecode, "__call__", lambda self: broken())
    with pytest.raises(RuntimeError, match="sm_75"):  # the unfused ops' own error
        generate(model, prompts, **kwargs)

    monkeypatch.setattr(fused_decode, "_failure", None)  # with the kernels on, running out of memory is raised
    def out_of_memory(*args, **kwargs):
        calls.append(2)
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(fused_decode, "add_rms_norm", out_of_memory)
    monkeypatch.setattr(lean_decode.StaticDecode, "__call__", real_call)
    lean_decode._STEPS.pop(model, None)
    with pytest.raises(torch.OutOfMemoryError):
        generate(model, prompts, **kwargs)
    assert calls[-1] == 2 and fused_decode._failure is None  # not retried, the kernels not given up


def test_a_capture_that_fails_leaves_the_unit_running_eagerly_with_a_warning(monkeypatch):
    """Where the CUDA graph's capture refuses an op, the generation goes on launching the same unit kernel by kernel
    (with a warning naming the failure) instead of failing the run: the warm-up's effects are the first call's, a
    capture records without running, so no token is lost or repeated. (torch.cuda's graph pieces faked: no GPU.)"""
    import contextlib

    class Graph:
        def replay(self):
            raise AssertionError("a failed capture is never replayed")

    @contextlib.contextmanager
    def refusing_capture(graph, capture_error_mode):
        assert capture_error_mode == "thread_local"
        yield
        raise RuntimeError("operation not permitted when stream is capturing")

    class Stream:
        def wait_stream(self, other):
            pass

    for name, fake in {"Stream": Stream, "stream": lambda s: contextlib.nullcontext(), "current_stream": Stream,
                       "CUDAGraph": Graph, "graph": refusing_capture}.items():
        monkeypatch.setattr(torch.cuda, name, fake)
    calls = []
    replay = lean_decode.Replayed(lambda: calls.append(len(calls)) or len(calls), use_graph=True)
    with pytest.warns(RuntimeWarning, match="without a CUDA graph.*operation not permitted"):
        assert replay() == 1  # the warm-up's result; the capture ran fn again (recording) and failed
    assert not replay.use_graph and replay.graph is None
    assert replay() == 3 and replay() == 4  # eager from here on, one call of fn per call


def test_generation_uses_the_weights_as_they_are_now():
    """The copies of small models are made per generation: after the parameters change (an optimizer step),
    the next generation decodes with the new weights."""
    model = _llama()
    prompts = [[5, 6, 7]] * 4
    common = dict(sample_keys=[1, 2, 3, 4], max_new_tokens=10, eos_ids=[2], pad_id=0, batch_size=4,
                  return_logprobs=True)
    before = generate(model, prompts, **common)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    after = generate(model, prompts, **common)
    plain = generate(model, prompts, fast_path=False, **common)
    torch.testing.assert_close(after[3], plain[3], atol=1e-5, rtol=0)
    assert not torch.allclose(after[3], before[3])


def test_gradient_checkpointing_keeps_the_lean_step_for_generation():
    """Checkpointing is for training: a model with it enabled (which hooks its input embeddings to require grad)
    still generates with the cache and the lean step, drawing the same completions as without it."""
    from tidyrl.models.loading import enable_gradient_checkpointing

    plain, checkpointed = _llama(), _llama()
    enable_gradient_checkpointing(checkpointed)
    checkpointed.enable_input_require_grads()  # what transformers 5 and peft add to checkpointing (not 4.56)
    checkpointed.eval()
    assert checkpointed.model.embed_tokens._forward_hooks  # the hook is there, and harmless without grad
    assert supports(checkpointed)
    common = dict(sample_keys=[1, 2, 3, 4], max_new_tokens=10, eos_ids=[2], pad_id=0, batch_size=4)
    for a, b in zip(generate(plain, [[5, 6, 7]] * 4, **common), generate(checkpointed, [[5, 6, 7]] * 4, **common)):
        assert torch.equal(a, b)
    checkpointed.model.embed_tokens.register_forward_hook(lambda *a: None)  # any other hook still refuses it
    assert not supports(checkpointed)


@pytest.mark.parametrize("copy_weights", [True, False], ids=["merged-copies", "own-weights"])
def test_lora_models_generate_with_the_lean_step_and_draw_what_peft_draws(copy_weights, monkeypatch):
    """A peft LoRA model generates with the lean step (and so, on CUDA, its graph): every projection W x + s B A x,
    the same tokens and log-probs (to rounding) as peft's own forward. With the adapter disabled, or its dropout
    in effect (training mode), the step steps aside; the training pass never takes a LoRA model."""
    peft = pytest.importorskip("peft")
    from tidyrl.models.lean_forward import can_run

    monkeypatch.setattr(lean_decode, "COPY_MAX_BYTES", 2**40 if copy_weights else 0)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                          target_modules=modules))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B starts at zero (the adapter a no-op): draw it, so that the adapter changes every output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.eval()
    assert supports(model, lora=True) and not supports(model) and not can_run(model)
    step = lean_decode.decode_step_for(model, 20)
    assert step is not None and (step.copies is not None) == copy_weights
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [10, 11, 12, 13]]
    common = dict(sample_keys=[1, 2, 3, 4], max_new_tokens=10, eos_ids=[2], pad_id=0, batch_size=4,
                  return_logprobs=True)
    lean, own = generate(model, prompts, **common), generate(model, prompts, fast_path=False, **common)
    assert torch.equal(lean[0], own[0]) and torch.equal(lean[1], own[1])
    torch.testing.assert_close(lean[3], own[3], atol=1e-5, rtol=0)
    with model.disable_adapter():
        assert not supports(model, lora=True)
        base = generate(model, prompts, **common)
    assert (lean[3] - base[3]).abs().max() > 0.1  # the adapter was computed, not skipped
    model.train()
    assert not supports(model, lora=True)  # its dropout would act in the model's forward


def test_layouts_it_does_not_compute_are_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert not supports(gemma2)
    assert lean_decode.refusal(gemma2) == "Gemma2ForCausalLM has no family declaration"

    class Adapter(torch.nn.Linear):  # what a LoRA wrapper looks like to us: not a plain Linear
        pass

    wrapped = _llama()
    old = wrapped.model.layers[1].self_attn.q_proj
    wrapped.model.layers[1].self_attn.q_proj = Adapter(old.in_features, old.out_features, bias=False)
    assert not supports(wrapped)
    assert supports(_llama()) and not supports(_llama(attn_implementation="flex_attention"))


def test_one_step_per_model_its_copies_rewritten_before_every_generation():
    """decode_step_for keeps one step per model and rewrites its copies in place each time, also after an
    update that leaves no trace in the parameters' version counters (fused AdamW); a model moved to another
    dtype gets a new step; the step does not keep its model alive."""
    import gc
    import weakref

    model = _llama()
    step = lean_decode.decode_step_for(model, 16)
    assert step.copies is not None
    buffers = [c.weight for c in step.copies]
    model.model.layers[0].mlp.down_proj.weight.grad = torch.ones_like(model.model.layers[0].mlp.down_proj.weight)
    torch.optim.AdamW([model.model.layers[0].mlp.down_proj.weight], lr=0.5, fused=True).step()
    assert lean_decode.decode_step_for(model, 24) is step  # longer generations extend the rope table
    assert step.rope_tables["full_attention"][0].shape[0] == 24
    assert [c.weight for c in step.copies] == buffers  # the same tensors, rewritten
    assert torch.equal(step.layers[0].down.weight, model.model.layers[0].mlp.down_proj.weight.t())
    model.double()
    again = lean_decode.decode_step_for(model, 16)
    assert again is not step and again.copies[0].weight.dtype == torch.float64
    gone = weakref.ref(model)
    del model, step, again
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "mistral"])
def test_bfloat16_prefill_and_steps_stay_within_rounding_of_the_model(name):
    """A bfloat16 model takes the general step (casts as the model's own forward): its prefill and decoding
    logits stay within a few bfloat16 roundings of the model's (1-2 units in the last place measured; a wrong
    mask, position or weight is off by the logits' own size)."""
    model = MODELS[name]().to(torch.bfloat16)
    ids, mask, pos = _left_padded_prompts()
    steps, Lp = 8, ids.shape[1]
    with torch.no_grad():
        prefill = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        step = DecodeStep(model, Lp + steps)
        tol = 2**-5 * prefill.logits.float().abs().max().item()
        empty = torch.empty((len(PROMPTS), step.n_kv, 0, step.head_dim), dtype=torch.bfloat16)
        layers = [_BufferedLayer(empty, empty, Lp + steps) for _ in step.layers]
        got = step.prefill(ids, mask, pos, layers)
        torch.testing.assert_close(got.float(), prefill.logits[:, -1].float(), atol=tol, rtol=0)
        for got, want, _, _ in _decode_side_by_side(model, step, prefill, mask, pos, steps):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_side_by_side_weights_are_the_projections_concatenated_for_a_generation_only(monkeypatch):
    """The fused step's q/k/v and gate/up weights side by side: each linear's weight and bias in order (zeros for
    a missing bias), made for a StaticDecode and not kept by the step; none for the unfused step, the small-model
    copies, or above SIDE_BY_SIDE_MAX_BYTES."""
    model = with_random_norms_and_biases(_llama(attention_bias=True)).to(torch.bfloat16)
    monkeypatch.setattr(lean_decode, "COPY_MAX_BYTES", 0)
    monkeypatch.setattr(lean_decode.fused_decode, "wanted", lambda device, dtype, head_dim, on: on)
    step = DecodeStep(model, 64)
    pairs = step.side_by_side()
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    (qkv_w, qkv_b), (gate_up_w, gate_up_b) = pairs[1]
    assert torch.equal(qkv_w, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(qkv_b, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(gate_up_w, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])) and gate_up_b is None
    assert len(pairs) == 2 and not any(hasattr(step, name) for name in ("qkv", "gate_up"))
    size = sum(w.numel() * w.element_size() for layer in pairs for w, _ in layer)
    monkeypatch.setattr(lean_decode, "SIDE_BY_SIDE_MAX_BYTES", size - 1)
    assert step.side_by_side() is None
    monkeypatch.setattr(lean_decode, "SIDE_BY_SIDE_MAX_BYTES", size)
    assert step.side_by_side() is not None
    step.fused = False
    assert step.side_by_side() is None
