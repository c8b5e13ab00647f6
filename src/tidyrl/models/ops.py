"""Tensor ops on logits used by generation and scoring.

The functions avoid materialising a full [B, T, V] log-softmax: with a
vocabulary of 150k tokens that tensor is the largest object of the forward
pass. They compute in float32 whatever the logits' dtype, because
log-probabilities are differenced (ratios, KL) and bf16 keeps only ~3
significant digits. Low-precision logits are upcast one sequence at a time,
so the float32 copy never exceeds [T, V], and none is kept for the backward
pass (`_LowPrecisionLogprobs`). On CUDA, Triton kernels do the same float32 maths
in one pass over the vocabulary (`tidyrl.models.fused_logprobs`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from tidyrl.models import fused_logprobs


def _per_row_float32(fn: Callable[..., Tensor], logits_BTV: Tensor, *rest_B: Tensor) -> Tensor:
    """Apply `fn` in float32; one row at a time when the logits need an upcast."""
    if logits_BTV.dtype in (torch.float32, torch.float64):
        return fn(logits_BTV, *rest_B)
    if logits_BTV.dim() < 2:  # nothing to split
        return fn(logits_BTV.float(), *rest_B)
    rows = [fn(logits_BTV[i].float(), *(r[i] for r in rest_B)) for i in range(logits_BTV.shape[0])]
    return torch.stack(rows)


def _gather_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    # log_softmax(l)[id] = l[id] - logsumexp(l): one [..] tensor instead of [.., V].
    chosen = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor, lse: Optional[Tensor] = None) -> Tensor:
    # H = -sum p log p = logsumexp(l) - sum p * l, since log p = l - logsumexp(l).
    probs = torch.softmax(logits, dim=-1)
    # p * l is 0 * -inf = NaN where a logit is -inf (masked vocabulary); those terms are 0.
    p_times_l = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return (torch.logsumexp(logits, dim=-1) if lse is None else lse) - p_times_l.sum(dim=-1)


class _LowPrecisionLogprobs(torch.autograd.Function):
    """Token log-probs (and, optionally, entropies) of bf16/fp16 logits, computed in float32 row by row.

    Written out because autograd's version of the same loop costs on both sides of the pass:
    - `logsumexp` keeps its float32 input for the backward pass: a float32 [B, T, V] copy, twice the bf16
      logits (2.5 GB per micro-batch of 16 x 256 tokens over a 151 936-token vocabulary). Here only the logits
      themselves and the [B, T] logsumexp are kept; the backward pass upcasts a row again.
    - indexing row i (`logits[i]`) has for backward a zero tensor of the whole [B, T, V] shape with row i
      filled in, and B of them are summed: B^2 T V of memory traffic. Here the gradient rows are written into
      one tensor.
    The arithmetic is autograd's own (logsumexp's and gather's backward formulas, in the same order), so the
    log-probs and the gradient are bit-identical to it (tests/test_ops.py). On CUDA (`fused_logprobs.wanted`) both
    sides run as Triton kernels instead, the same float32 maths in one pass over the vocabulary each.
    """

    @staticmethod
    def forward(ctx, logits_BTV: Tensor, ids_BT: Tensor, with_entropy: bool, fused: bool):
        logits_BTV, ids_BT, lse, logprobs, entropy = low_precision_stats(logits_BTV, ids_BT, with_entropy, fused)
        ctx.fused = fused
        ctx.save_for_backward(logits_BTV, ids_BT, lse)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
            return logprobs, entropy
        return logprobs

    @staticmethod
    def backward(ctx, grad_BT: Tensor, *_):
        return low_precision_grad(*ctx.saved_tensors, grad_BT, fused=ctx.fused), None, None, None


def low_precision_stats(logits_BTV: Tensor, ids_BT: Tensor, with_entropy: bool, fused: Optional[bool] = None):
    """(logits, ids, logsumexp, log-probs, entropy or None) of bf16/fp16 logits, the last three float32 [B, T]: on
    CUDA (`fused_logprobs.wanted`) the Triton kernel's, one pass over the vocabulary, the logits and ids returned in
    its layout (`fused_logprobs.prepared`); elsewhere row by row, each row upcast once (`_row_stats`). `fused`: the
    choice `kernels.fused_logprobs` (None: the defaults, `models.kernels.defaults`)."""
    if fused_logprobs.wanted(logits_BTV, fused):
        logits_BTV, ids_BT = fused_logprobs.prepared(logits_BTV, ids_BT)
        return (logits_BTV, ids_BT, *fused_logprobs.logprob_stats(logits_BTV, ids_BT, with_entropy))
    return (logits_BTV, ids_BT, *_row_stats(logits_BTV, ids_BT, with_entropy))


def low_precision_grad(logits_BTV: Tensor, ids_BT: Tensor, lse: Tensor, grad_BT: Tensor,
                       out: Optional[Tensor] = None, fused: Optional[bool] = None) -> Tensor:
    """d/dl of sum g [l_id - logsumexp(l)], g (onehot(id) - exp(l - logsumexp)), in the logits' dtype: the
    backward of `low_precision_stats`' log-probs, from what it returned. An id outside [0, V) matches no column (the
    ids of a slice of the vocabulary, shifted to it). `out`: a tensor of the logits' shape to write it into, which
    may be the logits themselves (each row is read before it is written). `fused`: as `low_precision_stats`'."""
    if fused_logprobs.wanted(logits_BTV, fused):
        return fused_logprobs.logits_grad(logits_BTV, ids_BT, lse, grad_BT, out=out)
    grad_logits = torch.empty_like(logits_BTV) if out is None else out
    V = logits_BTV.shape[-1]
    inside = (ids_BT >= 0) & (ids_BT < V)
    for i in range(grad_BT.shape[0]):
        # d/dl [l_id - logsumexp(l)] = onehot(id) - softmax(l): logsumexp's backward, then gather's
        row = (-grad_BT[i]).unsqueeze(-1) * (logits_BTV[i].float() - lse[i].unsqueeze(-1)).exp()
        row.scatter_add_(-1, ids_BT[i].clamp(0, V - 1).unsqueeze(-1),
                         torch.where(inside[i], grad_BT[i], 0.0).unsqueeze(-1))
        grad_logits[i] = row  # (cast back to the logits' dtype)
    return grad_logits


def _row_stats(logits_BTV: Tensor, ids_BT: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(logsumexp, log-probs, entropy or None), float32 [B, T], each row of low-precision logits upcast once."""
    shape = logits_BTV.shape[:-1]
    logprobs = torch.empty(shape, dtype=torch.float32, device=logits_BTV.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if with_entropy else None
    for i in range(shape[0]):
        row = logits_BTV[i].float()
        lse[i] = torch.logsumexp(row, dim=-1)
        logprobs[i] = row.gather(-1, ids_BT[i].unsqueeze(-1)).squeeze(-1) - lse[i]
        if with_entropy:
            entropy[i] = _entropy(row, lse[i])
    return lse, logprobs, entropy


def gather_logprobs(logits_BTV: Tensor, ids_BT: Tensor, fused: Optional[bool] = None) -> Tensor:
    """Log-probability of each chosen token: log softmax(logits)[id].

        logprob_{b,t} = logits_{b,t,id_{b,t}} - logsumexp_v(logits_{b,t,v})

    Args:
        logits_BTV: [B, T, V] logits (any float dtype; bf16/fp16 are upcast to float32 one row at a time).
        ids_BT: [B, T] token ids (int64).
        fused: bf16/fp16 logits on CUDA: whether `fused_logprobs`' kernels may serve (`kernels.fused_logprobs`;
            None: the defaults, `models.kernels.defaults`).

    Returns:
        [B, T] float32 log-probabilities (float64 for float64 logits); differentiable.
    """
    return gather_logprobs_and_entropy(logits_BTV, ids_BT, with_entropy=False, fused=fused)[0]


def gather_logprobs_and_entropy(logits_BTV: Tensor, ids_BT: Tensor, with_entropy: bool = True,
                                fused: Optional[bool] = None) -> tuple[Tensor, Optional[Tensor]]:
    """`gather_logprobs` and, with `with_entropy`, `entropy_from_logits` (without grad) of the same logits in one
    pass over them: a low-precision row is upcast once for both. Returns (logprobs [B, T], entropy [B, T] or
    None). `fused`: as `gather_logprobs`'."""
    ids_BT = ids_BT.long()
    if logits_BTV.dtype in (torch.float32, torch.float64) or logits_BTV.dim() < 2:
        logprobs = _per_row_float32(_gather_logprobs, logits_BTV, ids_BT)
        if not with_entropy:
            return logprobs, None
        with torch.no_grad():
            return logprobs, _per_row_float32(_entropy, logits_BTV)
    if with_entropy:
        return _LowPrecisionLogprobs.apply(logits_BTV, ids_BT, True, fused)
    return _LowPrecisionLogprobs.apply(logits_BTV, ids_BT, False, fused), None


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the next-token distribution softmax(logits), in nats.

        H_{b,t} = -sum_v p_v log p_v = logsumexp(l) - sum_v softmax(l)_v * l_v

    Args:
        logits_BTV: [B, T, V] logits (any float dtype; bf16/fp16 are upcast to float32 one row at a time).

    Returns:
        [B, T] float32 entropies (float64 for float64 logits).
    """
    return _per_row_float32(_entropy, logits_BTV)
