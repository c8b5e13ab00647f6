"""Fewer kernels per decoder layer in a bf16/fp16 decoding step on CUDA: Triton kernels and one attention call.

Why: a CUDA graph of the lean step (`lean_decode.StaticDecode`) launches no kernel from Python, but the GPU still
runs each one, and at decoding's sizes the unfused step's many small kernels take far longer than its matmuls
(docs/benchmarking.md, "Fused decoding kernels and the whole token in one CUDA graph"; `python
benchmarks/bench_decode.py --device cuda --profile 16` profiles it, `benchmarks/count_decode_ops.py` counts the ops
without a GPU). Per layer, unfused, RMSNorm is 8 kernels (upcast, square, mean, add, rsqrt, multiply, downcast,
weight) twice, rope 3 per projection, the cache writes 2, the attention 5, the residual adds 2. Here, per layer:
- `add_rms_norm`: the residual add and the RMSNorm after it in one kernel (HF's LlamaRMSNorm maths: the sum rounded
  to the model's dtype as `x + delta` rounds it, normalised in float32, cast back, times the weight);
- `rope_and_cache`: rope of the query and key heads (RoFormer eq. 34, half-split layout, as `lean_layer.rope`: x *
  cos rounded, plus roll(x) * signed sin in one rounding as `addcmul`) and the key and value written into the
  fixed-shape cache at the step's device-side position, one kernel;
- `rope_cache_attend`: `rope_and_cache` and the attention in one kernel, which reads only the cache positions
  written so far where an SDPA call over the fixed-shape cache reads its whole capacity (a rollout's average step
  has about half of it written). `kernels.decode_attention: sdpa` keeps `rope_and_cache` and one call of torch's
  memory-efficient SDPA kernel (cuDNN's, which builds a plan for each new width, is not asked for), the query heads
  of a group as its queries, as `DecodeStep` does;
- `silu_and_mul`: the MLP's silu(gate) * up in one kernel from the gate/up product (2 kernels become 1), where the
  step has q/k/v and gate/up side by side (`DecodeStep.side_by_side`: 7 matmuls per layer become 4). And per token,
  `draw`: the next token drawn and its log-prob in three kernels, where the unfused draw is ~35 kernels, each a pass
  over a (rows, vocabulary) float32 tensor (`generation.sample_from_logits`'s two-level inverse transform, the same
  sums in the same precisions). The results equal the unfused step's up to rounding (summation order, rsqrt):
  tests/test_cuda.py compiled on a GPU, tests/test_lean_decode.py in Triton's interpreter on CPU where Triton is
  installed.

The kernels themselves are in `tidyrl.models.decode_kernels`; this module decides when they serve and launches them.
Used by `DecodeStep` for fixed-shape steps on CUDA where Triton imports, with every norm weight in the
activations' dtype. `kernels.fused_decode: false` turns it off (the unfused step then runs); the choice is the
model's (`models.kernels.kernels_of`), read by `DecodeStep` and by `generation`'s draw.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import Tensor


def wanted(device: torch.device, dtype: torch.dtype, head_dim: int, on: bool) -> bool:
    """Whether a step on `device` in `dtype` uses these kernels: bf16/fp16 on CUDA, a power-of-two head
    dimension (a Triton block), Triton importable, `on` (the model's `kernels.fused_decode`), not turned off by a
    failure."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim & (head_dim - 1):
        return False
    return _enabled(on)


def _enabled(on: bool) -> bool:
    return on and _failure is None and _kernels() is not None


_failure: Optional[str] = None  # why the kernels were given up in this process (`give_up`), or None


def failure() -> Optional[str]:
    """Why the kernels were given up in this process ("TypeName: message"), or None while they serve (or were never
    tried). A benchmark prints it: a run whose kernels failed decoded without them, and its timings say so."""
    return _failure


def give_up(err: BaseException) -> None:
    """Turn the kernels off for the rest of this process after `err` (a kernel that does not compile or run on
    this GPU), with a warning: generation goes on with the unfused ops (`generation._generate_chunk`)."""
    global _failure
    _failure = f"{type(err).__name__}: {err}"
    warnings.warn(f"tidyrl: the fused decoding kernels failed on this device ({_failure}); generation continues "
                  "without them (slower). Please report it with the GPU and torch/triton versions; "
                  "kernels.fused_decode=false silences this.", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton kernels (tidyrl.models.decode_kernels), decorated on first use; None where Triton cannot be
    imported. Imported again after `cache_clear` (the tests switch Triton's interpreter on and off)."""
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton (CPU builds of torch): the unfused step serves
        return None
    import importlib
    import sys

    name = "tidyrl.models.decode_kernels"
    return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, rms_norm(x + delta)) for rows x (n, N) in one kernel; with `delta` None, (x, rms_norm(x)).
    rms_norm as `lean_layer.rms_norm`: w * (v / sqrt(mean(v^2) + eps)).to(dtype), v = the rows in float32."""
    kernels = _kernels()
    n, N = x.shape
    total = x if delta is None else torch.empty_like(x)
    out = torch.empty_like(x)
    kernels.add_rms_norm_kernel[(n,)](x, x if delta is None else delta, weight, total, out, eps, N=N,
                                      HAS_DELTA=delta is not None, BLOCK=kernels.triton.next_power_of_2(N),
                                      num_warps=4)
    return total, out


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up for rows (n, 2I) of [gate, up] side by side (a gate/up product), in one kernel, rounded as
    torch's two ops round: the SiLU in float32 cast to the dtype, the product in float32 cast again."""
    n, width = gate_up.shape
    I = width // 2
    assert gate_up.stride(-1) == 1
    out = gate_up.new_empty((n, I))
    block = 1024
    _kernels().silu_and_mul_kernel[(n, -(-I // block))](gate_up, out, gate_up.stride(0), I=I, BLOCK=block,
                                                         num_warps=4)
    return out


def rope_and_cache(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin_signed: Tensor, keys: Tensor, values: Tensor,
                   at: Tensor) -> Tensor:
    """Queries (B, H, D) after rope, returned; keys after rope and values written into the cache buffers
    `keys`/`values` (B, Hkv, C, D, contiguous) at position `at` (a one-element device tensor). q (B, H*D), k and v
    (B, Hkv*D): rows of any stride, each row's heads contiguous (slices of one qkv product serve); cos and signed
    sin (B, 1, D) contiguous (`DecodeStep._rope_factors`)."""
    B, Hkv, C, D = keys.shape
    H = q.shape[1] // D
    assert all(t.stride(-1) == 1 for t in (q, k, v)) and keys.is_contiguous() and values.is_contiguous()
    q_out = q.new_empty((B, H, D))
    _kernels().rope_and_cache_kernel[(B, H + Hkv)](q, k, v, cos, sin_signed, keys, values, at, q_out, C,
                                                   q.stride(0), k.stride(0), v.stride(0), H=H, HKV=Hkv, D=D,
                                                   num_warps=1)
    return q_out


def rope_cache_attend(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin_signed: Tensor, keys: Tensor,
                      values: Tensor, at: Tensor, bias: Tensor, scale: float) -> Tensor:
    """`rope_and_cache` and `attention` in one kernel that reads only the cache positions written so far (0..at),
    where the SDPA call reads all C: per row and key/value head, rope of the group's query heads and its key, the
    key and value written at `at`, softmax(q k^T * scale + bias) v over positions 0..at. q (B, H*D), k and v
    (B, Hkv*D) as `rope_and_cache` takes them; bias (B, C) rows (the step's additive mask: 0 where a row may
    attend, -inf at its padding), unit stride. Returns the attention's output, (B, H*D) rows."""
    B, Hkv, C, D = keys.shape
    H = q.shape[1] // D
    R = H // Hkv
    assert all(t.stride(-1) == 1 for t in (q, k, v, bias)) and keys.is_contiguous() and values.is_contiguous()
    out = q.new_empty((B, H * D))
    kernels = _kernels()
    kernels.rope_cache_attend_kernel[(B, Hkv)](q, k, v, cos, sin_signed, keys, values, at, bias, out, C,
                                               q.stride(0), k.stride(0), v.stride(0), bias.stride(0), scale, R=R,
                                               R_P2=max(16, kernels.triton.next_power_of_2(R)), HKV=Hkv, D=D,
                                               BLOCK_N=ATTEND_BLOCK, num_warps=4)
    return out


# Cache positions per step of `rope_cache_attend`'s loop: the positions read past `at` are at most this many - 1.
ATTEND_BLOCK = 64


def draw_wanted(logits: Tensor, on: bool) -> bool:
    """Whether `draw` serves these logits: on CUDA, Triton importable, `on` (the model's `kernels.fused_decode`),
    not turned off by a failure (any float dtype: the kernel reads them in float32)."""
    return logits.is_cuda and _enabled(on)


def draw(logits: Tensor, uniforms: Tensor, t: Tensor, *, temperature: float, eos: Tensor, ban_until: int,
         block: int) -> tuple[Tensor, Tensor]:
    """`generation.draw_tokens` without top-k/top-p, in one kernel per row: the token drawn by inverse transform
    from softmax(logits / temperature), EOS (`eos`, int64) at -inf while step `t` < `ban_until`, with the row's
    uniform uniforms[:, t] (float64), the softmax's block sums and running sums as `generation.sample_from_logits`
    takes them (blocks of `block` tokens in float32, accumulated in float64; the block's tokens summed in float64),
    and its log-prob under the unbanned softmax. The same draws as the unfused ops up to float rounding at a
    boundary (summation order). Three kernels (`decode_kernels.draw_*`: per block of the row, its softmax partials,
    then its sum; per row, the pick), two passes over the vocabulary (~35 kernels unfused: softmax, block sums,
    cumsums, searches, log-softmax), no host value: a captured graph replays it. (tokens int64, log-probs
    float32), each (B,)."""
    B, V = logits.shape
    blocks = -(-V // block)
    kernels = _kernels()
    partials = torch.empty((B, blocks, 4), dtype=torch.float32, device=logits.device)
    sums = torch.empty((B, blocks), dtype=torch.float32, device=logits.device)
    token = torch.empty(B, dtype=torch.int64, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    assert logits.stride(-1) == 1 and uniforms.stride(-1) == 1 and uniforms.dtype == torch.float64
    common = dict(V=V, NBLOCKS=blocks, N_EOS=eos.numel(), SCALED=temperature != 1.0, BLOCK=block)
    # (no EOS ids: any int64 tensor stands in, never read; an empty CUDA tensor's null pointer Triton refuses)
    eos = eos if eos.numel() else token
    head = (logits, logits.stride(0))
    draw = (t, eos, ban_until, float(temperature))
    kernels.draw_partials_kernel[(B, blocks)](*head, *draw, partials, **common, num_warps=4)
    p2 = kernels.triton.next_power_of_2(blocks)
    kernels.draw_block_sums_kernel[(B, blocks)](*head, *draw, partials, sums, NB_P2=p2, **common, num_warps=4)
    kernels.draw_pick_kernel[(B,)](*head, uniforms, uniforms.stride(0), *draw, partials, sums, token, logp, NB_P2=p2,
                                   **common, num_warps=4)
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
