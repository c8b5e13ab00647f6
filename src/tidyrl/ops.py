"""Tensor ops on logits used by generation and scoring.

Both functions avoid materialising a full [B, T, V] log-softmax: with a
vocabulary of 150k tokens that tensor is the largest object of the forward
pass. They compute in float32 whatever the logits' dtype, because
log-probabilities are differenced (ratios, KL) and bf16 keeps only ~3
significant digits. Low-precision logits are upcast one sequence at a time,
so the float32 copy never exceeds [T, V].
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


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


def _entropy(logits: Tensor) -> Tensor:
    # H = -sum p log p = logsumexp(l) - sum p * l, since log p = l - logsumexp(l).
    probs = torch.softmax(logits, dim=-1)
    # p * l is 0 * -inf = NaN where a logit is -inf (masked vocabulary); those terms are 0.
    p_times_l = torch.where(probs > 0, probs * logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    return torch.logsumexp(logits, dim=-1) - p_times_l.sum(dim=-1)


def gather_logprobs(logits_BTV: Tensor, ids_BT: Tensor) -> Tensor:
    """Log-probability of each chosen token: log softmax(logits)[id].

        logprob_{b,t} = logits_{b,t,id_{b,t}} - logsumexp_v(logits_{b,t,v})

    Args:
        logits_BTV: [B, T, V] logits (any float dtype; bf16/fp16 are upcast to float32).
        ids_BT: [B, T] token ids (int64).

    Returns:
        [B, T] float32 log-probabilities (float64 for float64 logits); differentiable.
    """
    return _per_row_float32(_gather_logprobs, logits_BTV, ids_BT.long())


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the next-token distribution softmax(logits), in nats.

        H_{b,t} = -sum_v p_v log p_v = logsumexp(l) - sum_v softmax(l)_v * l_v

    Args:
        logits_BTV: [B, T, V] logits (any float dtype; bf16/fp16 are upcast to float32).

    Returns:
        [B, T] float32 entropies (float64 for float64 logits).
    """
    return _per_row_float32(_entropy, logits_BTV)
