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
The results equal the unfused step's up to rounding (summation order, rsqrt): tests/test_cuda.py compiled on a
GPU, tests/test_llama_decode.py in Triton's interpreter on CPU where Triton is installed.

Used by `LlamaDecodeStep` for fixed-shape steps on CUDA where Triton imports, with every norm weight in the
activations' dtype. `TIDYRL_FUSED_DECODE=0` in the environment turns it off (the unfused step then runs).
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor


def wanted(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a step on `device` in `dtype` uses these kernels: bf16/fp16 on CUDA, a power-of-two head
    dimension (a Triton block), Triton importable, not turned off by TIDYRL_FUSED_DECODE=0."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim & (head_dim - 1):
        return False
    if os.environ.get("TIDYRL_FUSED_DECODE", "1") == "0":
        return False
    return _kernels() is not None


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

    return add_rms_norm_kernel, rope_and_cache_kernel, triton.next_power_of_2


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)) for rows x (n, N) in one kernel; with `delta` None, (x, rms_norm(x)).
    rms_norm as `llama_decode.rms_norm`: w * (v / sqrt(mean(v^2) + eps)).to(dtype), v = the rows in float32."""
    kernel, _, next_power_of_2 = _kernels()
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
    _, kernel, _ = _kernels()
    B, Hkv, C, D = keys.shape
    H = q.shape[1] // D
    assert all(t.stride(-1) == 1 for t in (q, k, v)) and keys.is_contiguous() and values.is_contiguous()
    q_out = q.new_empty((B, H, D))
    kernel[(B, H + Hkv)](q, k, v, cos, sin_signed, keys, values, at, q_out, C, q.stride(0), k.stride(0), v.stride(0),
                         H=H, HKV=Hkv, D=D, num_warps=1)
    return q_out


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
