"""Token log-probs and entropies of bf16/fp16 logits in one pass over the vocabulary: Triton kernels, CUDA only.

The row-by-row float32 path of `tidyrl.models.ops` is exact but, on a GPU, writes the vocabulary over and over:
each row's float32 copy, logsumexp's shifted and exponentiated copies, softmax, p * l, and in the backward pass
the upcast, shift, exp and product again, ~12 kernels per row (docs/benchmarking.md, "Log-probs of bf16 logits in two
Triton kernels", has the bytes written on a real model's shape). Here:
- the forward pass reads each position's logits once, keeping per lane a running maximum m, sum s = sum exp(l - m)
  and sum t = sum exp(l - m) * l (the "online softmax" of Milakov & Gimelshein 2018, rescaling both sums when m
  grows), then logsumexp = M + log S, log p(id) = l_id - logsumexp, entropy H = logsumexp - T / S (since
  log p = l - logsumexp, H = -sum p log p = logsumexp - sum p l);
- the backward pass reads them once more and writes d/dl = g (onehot(id) - exp(l - logsumexp)) in the logits'
  dtype, the formula of logsumexp's and gather's backward (as `ops._LowPrecisionLogprobs`).
All arithmetic is float32, as in `ops`; the results differ from the row-by-row path by float32 rounding only
(summation order; tests/test_cuda.py and, in Triton's interpreter, tests/test_ops.py).

Used by `ops.low_precision_stats` and `ops.low_precision_grad` (the two sides of `ops._LowPrecisionLogprobs` and of
`models.chunked_head`'s output layer) for bf16/fp16 logits on CUDA where Triton is
importable (it comes with CUDA builds of torch). `kernels.fused_logprobs: false` turns it off (the row-by-row path
then runs; `models.kernels`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from tidyrl.models import kernels

BLOCK = 4096  # logits per lane block: 37 blocks for a 151 936-token vocabulary


def wanted(logits: Tensor, on: Optional[bool] = None) -> bool:
    """Whether the fused kernels serve these logits: bf16/fp16 on CUDA, Triton importable, `on` (the choice
    `kernels.fused_logprobs`; None: the defaults, `models.kernels.defaults`)."""
    if not logits.is_cuda or logits.dtype not in (torch.bfloat16, torch.float16) or logits.dim() != 3:
        return False
    if not (kernels.defaults().fused_logprobs if on is None else on):
        return False
    return _kernels() is not None


@functools.lru_cache(maxsize=None)
def _kernels():
    """The two Triton kernels, compiled on first use; None where Triton cannot be imported."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU builds of torch): the row-by-row path serves
        return None

    # (T and the strides change with every chunk's width: not specialised on, so one compile serves them all)
    @triton.jit(do_not_specialize=["T", "stride_b", "stride_t"])
    def forward_kernel(logits_ptr, ids_ptr, lse_ptr, logp_ptr, ent_ptr, T, V: tl.constexpr, stride_b, stride_t,
                       WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        b, t = row // T, row % T
        base = logits_ptr + b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + lanes
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            # a lane that has seen only -inf keeps s = acc = 0 (exp(-inf - -inf) would be NaN)
            scale = tl.where(new_m == float("-inf"), 1.0, tl.exp(m - new_m))
            e = tl.where(x == float("-inf"), 0.0, tl.exp(x - new_m))
            s = s * scale + e
            if WITH_ENTROPY:  # p * l is 0 * -inf = NaN where a logit is -inf: those terms are 0
                acc = acc * scale + tl.where(x == float("-inf"), 0.0, e * x)
            m = new_m
        big = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
        total = tl.sum(s * w, axis=0)
        lse = big + tl.log(total)
        chosen = tl.load(base + tl.load(ids_ptr + row)).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, chosen - lse)
        if WITH_ENTROPY:
            tl.store(ent_ptr + row, lse - tl.sum(acc * w, axis=0) / total)

    @triton.jit(do_not_specialize=["T", "stride_b", "stride_t"])
    def backward_kernel(logits_ptr, ids_ptr, lse_ptr, grad_ptr, out_ptr, T, V: tl.constexpr, stride_b, stride_t,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        b, t = row // T, row % T
        inside = offs < V
        x = tl.load(logits_ptr + b.to(tl.int64) * stride_b + t.to(tl.int64) * stride_t + offs, mask=inside,
                    other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + row)
        d = -g * tl.exp(x - tl.load(lse_ptr + row))
        d = tl.where(offs == tl.load(ids_ptr + row), d + g, d)
        tl.store(out_ptr + row.to(tl.int64) * V + offs, d.to(out_ptr.dtype.element_ty), mask=inside)

    return forward_kernel, backward_kernel, triton.cdiv


def _on(device: torch.device):
    """Triton launches on the current CUDA device: the logits' own (a model on another GPU than the current one)."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def prepared(logits_BTV: Tensor, ids_BT: Tensor) -> tuple[Tensor, Tensor]:
    """The logits with the vocabulary contiguous (the kernels' layout; any B and T strides) and the ids as
    contiguous int64 on their device."""
    if logits_BTV.stride(-1) != 1:
        logits_BTV = logits_BTV.contiguous()
    return logits_BTV, ids_BT.to(device=logits_BTV.device, dtype=torch.int64).contiguous()


def logprob_stats(logits_BTV: Tensor, ids_BT: Tensor, with_entropy: bool
                  ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(logsumexp, log-probs, entropy or None), float32 [B, T], of `prepared` logits and ids: the forward kernel."""
    forward_kernel, _, _ = _kernels()
    B, T, V = logits_BTV.shape
    lse = torch.empty((B, T), dtype=torch.float32, device=logits_BTV.device)
    logp, ent = torch.empty_like(lse), torch.empty_like(lse) if with_entropy else None
    if B * T:
        with _on(logits_BTV.device):
            forward_kernel[(B * T,)](logits_BTV, ids_BT, lse, logp, lse if ent is None else ent, T, V,
                                     logits_BTV.stride(0), logits_BTV.stride(1), WITH_ENTROPY=with_entropy,
                                     BLOCK=BLOCK, num_warps=8)
    return lse, logp, ent


def logits_grad(logits_BTV: Tensor, ids_BT: Tensor, lse: Tensor, grad_BT: Tensor,
                out: Optional[Tensor] = None) -> Tensor:
    """The gradient of the log-probs' loss with respect to the (`prepared`) logits, in their dtype: the backward
    kernel. `out`: a contiguous (B, T, V) tensor to write it into, which may be the logits themselves (each element
    is read before it is written, by the same program)."""
    _, backward_kernel, cdiv = _kernels()
    B, T, V = logits_BTV.shape
    grad_logits = torch.empty((B, T, V), dtype=logits_BTV.dtype, device=logits_BTV.device) if out is None else out
    if B * T:
        with _on(logits_BTV.device):
            backward_kernel[(B * T, cdiv(V, BLOCK))](logits_BTV, ids_BT, lse, grad_BT.float().contiguous(),
                                                     grad_logits, T, V, logits_BTV.stride(0), logits_BTV.stride(1),
                                                     BLOCK=BLOCK, num_warps=8)
    return grad_logits
