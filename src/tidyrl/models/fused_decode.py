"""Fewer kernels per decoder layer in a bf16/fp16 decoding step on CUDA: Triton kernels and one attention call.

Why: a CUDA graph of the lean step (`llama_decode.StaticDecode`) launches no kernel from Python, but the GPU
still runs each one: on an H200 a Qwen2.5-0.5B step was ~1 100 kernels per token, ~3 us each, for 3.2 ms of
device time, where its matmuls need ~0.35 ms (docs/benchmarks.md, issue 26). Per layer, RMSNorm was 8 kernels
(upcast, square, mean, add, rsqrt, multiply, downcast, weight) twice, rope 3 per projection, the cache writes 2,
the attention 5, the residual adds 2. Here, per layer:
- `add_rms_norm`: the residual add and the RMSNorm after it in one kernel (HF's LlamaRMSNorm maths: the sum
  rounded to the model's dtype as `x + delta` rounds it, normalised in float32, cast back, times the weight);
- `rope_and_cache`: rope of the query and key heads (RoFormer eq. 34, half-split layout, as `llama_decode.rope`:
  x * cos rounded, plus roll(x) * signed sin in one rounding as `addcmul`) and the key and value written into the
  fixed-shape cache at the step's device-side position, one kernel;
- the attention: torch's memory-efficient SDPA kernel (one launch; cuDNN's, which builds a plan for each new
  width, is not asked for), the query heads of a group as its queries, as `LlamaDecodeStep` does.
And per token, `draw`: the next token drawn and its log-prob in one kernel per row, where the unfused draw is ~35
kernels, each a pass over a (rows, vocabulary) float32 tensor (`generation.sample_from_logits`'s two-level
inverse transform, the same sums in the same precisions).
The results equal the unfused step's up to rounding (summation order, rsqrt): tests/test_cuda.py compiled on a
GPU, tests/test_llama_decode.py in Triton's interpreter on CPU where Triton is installed.

Used by `LlamaDecodeStep` for fixed-shape steps on CUDA where Triton imports, with every norm weight in the
activations' dtype. `TIDYRL_FUSED_DECODE=0` in the environment turns it off (the unfused step then runs).
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
from torch import Tensor


def wanted(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step on `device` in `dtype` uses these kernels: bf16/fp16 on CUDA, a power-of-two head
    dimension (a Triton block), Triton importable, not turned off by TIDYRL_FUSED_DECODE=0 or by a failure."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim & (head_dim - 1):
        return False
    return _enabled()


def _enabled() -> bool:
    return os.environ.get("TIDYRL_FUSED_DECODE", "1") != "0" and _failure is None and _kernels() is not None


_failure: Optional[str] = None  # why the kernels were given up in this process (`give_up`), or None


def give_up(err: BaseException) -> None:
    """Turn the kernels off for the rest of this process after `err` (a kernel that does not compile or run on
    this GPU), with a warning: generation goes on with the unfused ops (`generation._generate_chunk`)."""
    global _failure
    _failure = f"{type(err).__name__}: {err}"
    warnings.warn(f"tidyrl: the fused decoding kernels failed on this device ({_failure}); generation continues "
                  "without them (slower). Please report it with the GPU and torch/triton versions; "
                  "TIDYRL_FUSED_DECODE=0 silences this.", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels, compiled on first use; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU builds of torch): the unfused step serves
        return None

    @triton.jit
    def add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        inside = offs < N
        x = tl.load(x_ptr + row * N + offs, mask=inside, other=0.0)
        if HAS_DELTA:  # x + delta as torch adds two bf16 tensors: in float32, one rounding
            x = (x.to(tl.float32) + tl.load(delta_ptr + row * N + offs, mask=inside, other=0.0).to(tl.float32)
                 ).to(sum_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * N + offs, x, mask=inside)
        v = x.to(tl.float32)
        normed = (v / tl.sqrt(tl.sum(v * v, axis=0) / N + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(weight_ptr + offs, mask=inside, other=0.0)
        tl.store(out_ptr + row * N + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=inside)

    @triton.jit
    def rope_and_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, at_ptr, q_out_ptr,
                              C, q_row, k_row, v_row, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs = tl.arange(0, D)
        partner = (offs + D // 2) % D  # roll(x, D/2)[i] = x[(i + D/2) mod D]
        cos = tl.load(cos_ptr + b * D + offs).to(tl.float32)
        sin = tl.load(sin_ptr + b * D + offs).to(tl.float32)  # signed: (-sin1, sin2)
        if head < H:
            src = q_ptr + b * q_row + head * D
        else:
            src = k_ptr + b * k_row + (head - H) * D
        x = tl.load(src + offs)
        kind = x.dtype
        first = (x.to(tl.float32) * cos).to(kind)  # x * cos, rounded as torch's product
        out = (first.to(tl.float32) + tl.load(src + partner).to(tl.float32) * sin).to(kind)  # addcmul: one rounding
        if head < H:
            tl.store(q_out_ptr + (b * H + head) * D + offs, out)
        else:
            g = head - H
            slot = ((b * HKV + g) * C + tl.load(at_ptr)) * D
            tl.store(keys_ptr + slot + offs, out)
            tl.store(values_ptr + slot + offs, tl.load(v_ptr + b * v_row + g * D + offs))

    @triton.jit
    def draw_kernel(logits_ptr, row_stride, u_ptr, u_row_stride, t_ptr, eos_ptr, ban_until, temperature, sums_ptr,
                    token_ptr, logp_ptr, V: tl.constexpr, NBLOCKS: tl.constexpr, N_EOS: tl.constexpr,
                    SCALED: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        lanes = tl.arange(0, BLOCK)
        t = tl.load(t_ptr)
        banned = t < ban_until
        # 1. Online max and sum of exp (Milakov & Gimelshein 2018) of the scaled logits x (the log-prob's
        #    normaliser) and of z, x with EOS at -inf while banned (what the token is drawn from).
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        sx = tl.zeros([BLOCK], tl.float32)
        mz = tl.full([BLOCK], float("-inf"), tl.float32)
        sz = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            if SCALED:
                x = x / temperature
            hit = offs < 0
            for i in range(N_EOS):
                hit = hit | (offs == tl.load(eos_ptr + i))
            z = tl.where(hit & banned, float("-inf"), x)
            new = tl.maximum(mx, x)
            sx = sx * tl.where(new == float("-inf"), 1.0, tl.exp(mx - new)) + tl.where(x == float("-inf"), 0.0,
                                                                                       tl.exp(x - new))
            mx = new
            new = tl.maximum(mz, z)
            sz = sz * tl.where(new == float("-inf"), 1.0, tl.exp(mz - new)) + tl.where(z == float("-inf"), 0.0,
                                                                                       tl.exp(z - new))
            mz = new
        top_x = tl.max(mx, axis=0)
        sum_x = tl.sum(sx * tl.where(mx == float("-inf"), 0.0, tl.exp(mx - top_x)), axis=0)
        top_z = tl.max(mz, axis=0)
        sum_z = tl.sum(sz * tl.where(mz == float("-inf"), 0.0, tl.exp(mz - top_z)), axis=0)
        # 2. softmax(z) summed per block of BLOCK tokens in float32, the blocks accumulated in float64.
        total = tl.zeros([], tl.float64)
        for b in range(0, NBLOCKS):
            offs = b * BLOCK + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            if SCALED:
                x = x / temperature
            hit = offs < 0
            for i in range(N_EOS):
                hit = hit | (offs == tl.load(eos_ptr + i))
            z = tl.where(hit & banned, float("-inf"), x)
            block_sum = tl.sum(tl.where(z == float("-inf"), 0.0, tl.exp(z - top_z) / sum_z), axis=0)
            tl.store(sums_ptr + row * NBLOCKS + b, block_sum)
            total += block_sum.to(tl.float64)
        # 3. The first block whose cumulative sum exceeds u * total (the last where none does).
        target = tl.load(u_ptr + row * u_row_stride + t) * total
        cdf = tl.zeros([], tl.float64)
        chosen_block = tl.zeros([], tl.int32) + NBLOCKS - 1
        before = tl.zeros([], tl.float64)
        last_before = tl.zeros([], tl.float64)
        found = tl.zeros([], tl.int32)
        for b in range(0, NBLOCKS):
            nxt = cdf + tl.load(sums_ptr + row * NBLOCKS + b).to(tl.float64)
            first = (found == 0) & (nxt > target)
            chosen_block = tl.where(first, b, chosen_block)
            before = tl.where(first, cdf, before)
            found = tl.where(first, 1, found)
            last_before = cdf
            cdf = nxt
        before = tl.where(found == 1, before, last_before)
        # 4. Within it, the first token whose float64 running sum exceeds the rest of the target, kept under the
        #    block's own total (its sum in another order): the number of running sums <= the rest.
        offs = chosen_block * BLOCK + lanes
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if SCALED:
            x = x / temperature
        hit = offs < 0
        for i in range(N_EOS):
            hit = hit | (offs == tl.load(eos_ptr + i))
        z = tl.where(hit & banned, float("-inf"), x)
        inner = tl.cumsum(tl.where(z == float("-inf"), 0.0, tl.exp(z - top_z) / sum_z).to(tl.float64), axis=0)
        last = tl.max(inner, axis=0)
        below_last = tl.where(last > 0, (last.to(tl.int64, bitcast=True) - 1).to(tl.float64, bitcast=True), 0.0)
        rest = tl.minimum(target - before, below_last)
        token = tl.minimum(chosen_block * BLOCK + tl.sum((inner <= rest).to(tl.int32), axis=0), V - 1)
        # log softmax(x)[token], x unbanned: (x - max) - log(sum exp(x - max)), as torch's log_softmax.
        x_token = tl.load(base + token).to(tl.float32)
        if SCALED:
            x_token = x_token / temperature
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, (x_token - top_x) - tl.log(sum_x))

    return add_rms_norm_kernel, rope_and_cache_kernel, triton.next_power_of_2, draw_kernel


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)) for rows x (n, N) in one kernel; with `delta` None, (x, rms_norm(x)).
    rms_norm as `llama_decode.rms_norm`: w * (v / sqrt(mean(v^2) + eps)).to(dtype), v = the rows in float32."""
    kernel, _, next_power_of_2, _ = _kernels()
    n, N = x.shape
    total = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    kernel[(n,)](x, x if delta is None else delta, weight, total, out, eps, N=N, HAS_DELTA=delta is not None,
                 BLOCK=next_power_of_2(N), num_warps=4)
    return total, out


def rope_and_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin_signed: Tensor, keys: Tensor, values: Tensor,
                   at: Tensor) -> Tensor:
    """Queries (B, H, D) after rope, returned; keys after rope and values written into the cache buffers
    `keys`/`values` (B, Hkv, C, D, contiguous) at position `at` (a one-element device tensor). q (B, H*D), k and v
    (B, Hkv*D): rows of any stride, each row's heads contiguous (slices of one qkv product serve); cos and signed
    sin (B, 1, D) contiguous (`LlamaDecodeStep._rope_factors`)."""
    _, kernel, _, _ = _kernels()
    B, Hkv, C, D = keys.shape
    H = q.shape[1] // D
    assert all(t.stride(-1) == 1 for t in (q, k, v)) and keys.is_contiguous() and values.is_contiguous()
    q_out = q.new_empty((B, H, D))
    kernel[(B, H + Hkv)](q, k, v, cos, sin_signed, keys, values, at, q_out, C, q.stride(0), k.stride(0), v.stride(0),
                         H=H, HKV=Hkv, D=D, num_warps=1)
    return q_out


def draw_wanted(logits: Tensor) -> bool:
    """Whether `draw` serves these logits: on CUDA, Triton importable, not turned off by TIDYRL_FUSED_DECODE=0 or
    by a failure (any float dtype: the kernel reads them in float32)."""
    return logits.is_cuda and _enabled()


def draw(logits: Tensor, uniforms: Tensor, t: Tensor, *, temperature: float, eos: Tensor, ban_until: int,
         block: int) -> tuple[Tensor, Tensor]:
    """`generation.draw_tokens` without top-k/top-p, in one kernel per row: the token drawn by inverse transform
    from softmax(logits / temperature), EOS (`eos`, int64) at -inf while step `t` < `ban_until`, with the row's
    uniform uniforms[:, t] (float64), the softmax's block sums and running sums as `generation.sample_from_logits`
    takes them (blocks of `block` tokens in float32, accumulated in float64; the block's tokens summed in float64),
    and its log-prob under the unbanned softmax. The same draws as the unfused ops up to float rounding at a
    boundary (summation order). Two passes over the vocabulary per row (~35 kernels unfused: softmax, block sums,
    cumsums, searches, log-softmax), no host value: a captured graph replays it. (tokens int64, log-probs
    float32), each (B,)."""
    *_, kernel = _kernels()
    B, V = logits.shape
    blocks = -(-V // block)
    sums = torch.empty((B, blocks), dtype=torch.float32, device=logits.device)
    token = torch.empty(B, dtype=torch.int64, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    assert logits.stride(-1) == 1 and uniforms.stride(-1) == 1 and uniforms.dtype == torch.float64
    # (no EOS ids: any int64 tensor stands in, never read; an empty CUDA tensor's null pointer Triton refuses)
    kernel[(B,)](logits, logits.stride(0), uniforms, uniforms.stride(0), t, eos if eos.numel() else token, ban_until,
                 float(temperature), sums, token, logp, V=V, NBLOCKS=blocks, N_EOS=eos.numel(),
                 SCALED=temperature != 1.0, BLOCK=block, num_warps=4)
    return token, logp


def attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale + bias) v for one query token per row: q (B * Hkv, 1, R, D), the R query heads of a
    group as its R queries against the group's keys and values (B * Hkv, 1, C, D), bias (B * Hkv, 1, R, C). One
    call of torch's memory-efficient kernel (the math one where it does not apply). Its output (B * Hkv, 1, R, D)
    is laid out (B * Hkv, R, 1, D): with one head, (B, H * D) rows without a copy. C a multiple of 16 spares
    torch a padded copy of the bias per call (its alignment)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scale)
