"""Policy losses and their aggregation into one scalar per micro-batch.

Pure tensor functions (no model, no config). The training loop calls, per
micro-batch,

    loss_BT, clipped_BT = clipped_policy_loss(logprobs_BT, old_logprobs_BT, adv_B, clip_eps)
    loss_BT = loss_BT + kl_coef * kl_per_token(...)      # GRPO: KL in the loss
    loss = aggregate_loss(loss_BT, mask_BT, mode, normaliser)
    loss.backward()

with `normaliser = loss_normaliser(mode, ...)` computed once for the whole
optimizer mini-batch (all micro-batches, all processes). See
`aggregate_loss` for why that makes gradient accumulation and the number of
processes invisible to the gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidyrl.algorithms.choices import LOSS_AGGREGATIONS


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid values: {', '.join(LOSS_AGGREGATIONS)}")


def _masked_sum(values_BT: Tensor, mask_BT: Tensor, dim: int | None = None) -> Tensor:
    # where() rather than values * mask: padding positions may hold inf/NaN
    # (e.g. an exp() ratio on pad logits), and NaN * 0 is NaN.
    masked_BT = torch.where(mask_BT.bool(), values_BT, torch.zeros((), dtype=values_BT.dtype, device=values_BT.device))
    return masked_BT.sum() if dim is None else masked_BT.sum(dim=dim)


def clipped_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate, per token, as a loss to minimise.

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 7,
    used per token by GRPO (Shao et al. 2024, DeepSeekMath, eq. 3):

        ratio_t = exp(logp_t - old_logp_t)
        loss_t  = -min(ratio_t * A,  clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high) * A)

    `clip_eps_high` > `clip_eps` is DAPO's clip-higher (Yu et al. 2025,
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", §3.1):
    a looser upper bound lets low-probability tokens with positive advantage
    grow, which counters entropy collapse. It defaults to `clip_eps`.

    The clipped branch is the active minimum exactly when
    (ratio < 1 - clip_eps and A < 0) or (ratio > 1 + clip_eps_high and A > 0);
    there the loss is constant in logp and its gradient is zero. When
    old_logprobs are the detached current log-probs (one optimizer step per
    rollout, E * M == 1) the ratio is 1, nothing is clipped and the gradient
    is the plain policy gradient -A * grad(logp).

    Args:
        logprobs_BT: [B, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs_BT: [B, T] log-probs under the policy that generated the rollout
            (detached here: a constant of the objective).
        advantages: [B] (one per sequence, broadcast over T) or [B, T]; detached here.
        clip_eps: lower clipping range, ratio >= 1 - clip_eps.
        clip_eps_high: upper clipping range, ratio <= 1 + clip_eps_high; None = clip_eps.

    Returns:
        (loss_BT, clipped_BT): [B, T] per-token loss (unmasked: aggregate with
        `aggregate_loss`) and a [B, T] bool tensor marking tokens where the
        clipped branch is active (for the `clip_fraction` metric).
    """
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if clip_eps < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")
    adv_BT = advantages.detach()
    if adv_BT.dim() == 1:
        adv_BT = adv_BT.unsqueeze(-1)  # (B, 1): same advantage for every token of a sequence
    adv_BT = adv_BT.to(logprobs_BT.dtype)

    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT.detach())
    unclipped_loss_BT = -ratio_BT * adv_BT
    clipped_loss_BT = -ratio_BT.clamp(1.0 - clip_eps, 1.0 + clip_eps_high) * adv_BT
    # -min(a, b) == max(-a, -b): the pessimistic (larger) loss wins.
    loss_BT = torch.maximum(unclipped_loss_BT, clipped_loss_BT)

    with torch.no_grad():
        clipped_BT = ((ratio_BT < 1.0 - clip_eps) & (adv_BT < 0)) | ((ratio_BT > 1.0 + clip_eps_high) & (adv_BT > 0))
    return loss_BT, clipped_BT


def sequence_clipped_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO's clipped surrogate: one importance ratio per completion, as a loss to minimise.

    Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 5-7:

        s_i    = exp( (1/|y_i|) * sum_t (logp_it - old_logp_it) )      (the geometric mean of the token ratios)
        loss_i = -min(s_i * A_i,  clip(s_i, 1 - clip_eps, 1 + clip_eps_high) * A_i)

    The ratio is length-normalised so that one clipping range fits completions of any length; a sequence is
    clipped (zero gradient) or not as a whole. The gradient of s_i is s_i * (1/|y_i|) * sum_t grad logp_it:
    every token of a completion weighted equally (the paper's point against GRPO's token ratios).

    Returns (loss_BT, clipped_BT): [B, T] with each completion's loss_i (and whether it was clipped) on every one
    of its tokens, so that `aggregate_loss(..., "sequence_mean", ...)` gives the paper's mean over completions
    (token_mean weights each completion by its length instead). Padding positions are 0 / False.

    Args:
        logprobs_BT: [B, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs_BT: [B, T] under the policy that generated the rollout (detached here).
        advantages_B: [B], one per completion (GRPO's, RLOO's); detached here.
        mask_BT: [B, T] 1 for completion tokens.
        clip_eps, clip_eps_high: the clipping range of s_i; GSPO's are ~1e-3 (e.g. 3e-4 and 4e-4), not PPO's 0.2.
    """
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if clip_eps < 0 or clip_eps_high < 0:
        raise ValueError(f"clip_eps and clip_eps_high must be >= 0, got {clip_eps} and {clip_eps_high}")
    if advantages_B.dim() != 1:
        raise ValueError("the sequence-level (GSPO) loss takes one advantage per completion, got shape "
                         f"{tuple(advantages_B.shape)}")
    mask = mask_BT.to(logprobs_BT.dtype)
    lengths_B = mask.sum(dim=-1).clamp(min=1.0)
    log_ratio_B = _masked_sum(logprobs_BT - old_logprobs_BT.detach(), mask_BT, dim=-1) / lengths_B
    ratio_B = torch.exp(log_ratio_B)
    adv_B = advantages_B.detach().to(logprobs_BT.dtype)
    loss_B = torch.maximum(-ratio_B * adv_B, -ratio_B.clamp(1.0 - clip_eps, 1.0 + clip_eps_high) * adv_B)
    with torch.no_grad():
        clipped_B = ((ratio_B < 1.0 - clip_eps) & (adv_B < 0)) | ((ratio_B > 1.0 + clip_eps_high) & (adv_B > 0))
    return loss_B[:, None] * mask, clipped_B[:, None] & mask_BT.bool()


def cispo_policy_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages: Tensor,
    clip_eps_high: float,
) -> tuple[Tensor, Tensor]:
    """CISPO's loss: a clipped, stop-gradient importance weight on a REINFORCE token loss, as a loss to minimise.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention", §3.1, eq. 4-5:

        r_t    = exp(logp_t - old_logp_t)
        w_t    = sg( clip(r_t, 1 - eps_low, 1 + eps_high) )
        loss_t = -w_t * A * logp_t

    PPO's clip zeroes the gradient of the clipped tokens, which drops rare tokens with large ratios (often the
    "reflective" ones) from the update; CISPO clips only the weight, so every token keeps its gradient
    -w_t * A * grad(logp_t). As in the paper's experiments there is no lower bound (eps_low large: the weight is
    only capped from above at 1 + `clip_eps_high`). With one optimizer step per rollout the ratio is 1 and the
    gradient is the plain policy gradient, as PPO's.

    Args:
        logprobs_BT: [B, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs_BT: [B, T] under the policy that generated the rollout (detached here).
        advantages: [B] (broadcast over T) or [B, T]; detached here.
        clip_eps_high: the weight's cap is 1 + clip_eps_high (> 0).

    Returns:
        (loss_BT, capped_BT): [B, T] per-token loss (unmasked) and the tokens whose weight was capped (the
        `clip_fraction` metric).
    """
    if clip_eps_high <= 0:
        raise ValueError(f"CISPO's clip_eps_high must be > 0, got {clip_eps_high}")
    adv_BT = advantages.detach()
    if adv_BT.dim() == 1:
        adv_BT = adv_BT.unsqueeze(-1)
    adv_BT = adv_BT.to(logprobs_BT.dtype)
    with torch.no_grad():
        ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
        weight_BT = ratio_BT.clamp(max=1.0 + clip_eps_high)
        capped_BT = ratio_BT > 1.0 + clip_eps_high
    return -weight_BT * adv_BT * logprobs_BT, capped_BT


def policy_loss(name: str, logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages: Tensor, mask_BT: Tensor,
                clip_eps: float, clip_eps_high: float | None) -> tuple[Tensor, Tensor]:
    """The policy loss `<section>.policy_loss` names (algorithms.table.POLICY_LOSSES), per token, and the tokens
    it clipped: token (PPO's clipped ratio), sequence (GSPO's), cispo (CISPO's weight, capped at
    1 + clip_eps_high, or 1 + clip_eps when that is unset)."""
    if name == "token":
        return clipped_policy_loss(logprobs_BT, old_logprobs_BT, advantages, clip_eps, clip_eps_high)
    if name == "sequence":
        return sequence_clipped_policy_loss(logprobs_BT, old_logprobs_BT, advantages, mask_BT, clip_eps,
                                            clip_eps_high)
    if name == "cispo":
        return cispo_policy_loss(logprobs_BT, old_logprobs_BT, advantages,
                                 clip_eps if clip_eps_high is None else clip_eps_high)
    raise ValueError(f"unknown policy loss {name!r}; valid values: token, sequence, cispo")


def overlong_penalty(lengths_B: Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to each completion's reward.

    Yu et al. 2025, "DAPO", eq. 13, with L_max = max_new_tokens and L_cache = buffer:

        R_length(y) = 0                                     if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                      -1                                    if |y| > L_max   (cannot happen: generation stops)

    times `factor`: a linear ramp from 0 to -factor over the last `buffer` tokens, so a model learns to finish
    before the limit rather than being cut there. `buffer` = 0 gives no penalty.
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(f"the overlong buffer must be in [0, max_new_tokens={max_new_tokens}], got {buffer}")
    lengths_B = lengths_B.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(lengths_B)
    start = max_new_tokens - buffer
    ramp_B = (start - lengths_B) / buffer
    return factor * torch.where(lengths_B > max_new_tokens, torch.full_like(ramp_B, -1.0), ramp_B.clamp(max=0.0))


def loss_normaliser(mode: str, *, num_tokens: int | float, num_sequences: int, max_new_tokens: int) -> float:
    """The denominator of the loss for one whole optimizer mini-batch.

    All counts are for the whole mini-batch: summed over its micro-batches
    and over all processes (e.g. with an all-reduce of the token count).

        token_mean     ->  num_tokens                       (mean over all completion tokens; DAPO §3.3)
        sequence_mean  ->  num_sequences                    (mean over sequences of per-sequence token means;
                                                             GRPO as written, Shao et al. 2024 eq. 3)
        constant       ->  num_sequences * max_new_tokens   (Dr. GRPO, Liu et al. 2025: a constant that
                                                             does not depend on completion lengths)

    A count of zero (an empty mini-batch) gives 1, so the loss is 0, not NaN.

    Returns:
        The normaliser, a positive float, to pass to `aggregate_loss`.
    """
    _check_mode(mode)
    if mode == "token_mean":
        denominator = float(num_tokens)
    elif mode == "sequence_mean":
        denominator = float(num_sequences)
    else:
        denominator = float(num_sequences * max_new_tokens)
    return max(denominator, 1.0)


def aggregate_loss(loss_BT: Tensor, mask_BT: Tensor, mode: str, normaliser: float) -> Tensor:
    """Reduce per-token losses of one micro-batch to its share of the mini-batch loss.

        token_mean, constant:  sum_{i,t} loss_{i,t} mask_{i,t} / normaliser
        sequence_mean:         sum_i [ sum_t loss_{i,t} mask_{i,t} / max(1, sum_t mask_{i,t}) ] / normaliser

    with `normaliser = loss_normaliser(mode, ...)` of the whole optimizer
    mini-batch. Key property: both formulas are a sum over tokens (or
    sequences) divided by a number fixed for the mini-batch, so they are
    additive. Splitting the mini-batch into micro-batches (gradient
    accumulation) and processes (data parallel, whose gradients are summed),
    calling this on each part with the same normaliser and summing the results
    gives exactly the loss, hence the gradient, of the whole mini-batch in one
    piece. A per-micro-batch mean would instead weight tokens of short
    micro-batches more, and the gradient would change with `micro_batch_size`
    and the number of processes.

    Note for the caller: DDP averages gradients over the W processes, so the
    loop multiplies this loss by W to keep the sum; nor may anything divide it
    by the number of accumulation steps (the normaliser already accounts for it).

    Args:
        loss_BT: [B, T] per-token loss.
        mask_BT: [B, T] 1 (or True) for completion tokens, 0 for padding.
        mode: "token_mean", "sequence_mean" or "constant".
        normaliser: from `loss_normaliser` for the whole optimizer mini-batch.

    Returns:
        Scalar tensor.
    """
    _check_mode(mode)
    if mode == "sequence_mean":
        tokens_B = mask_BT.to(loss_BT.dtype).sum(dim=-1).clamp(min=1.0)
        return (_masked_sum(loss_BT, mask_BT, dim=-1) / tokens_B).sum() / normaliser
    return _masked_sum(loss_BT, mask_BT) / normaliser


def masked_mean(values_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Mean of `values_BT` over positions where `mask_BT` is 1; 0 when the mask is empty.

    A helper for metrics (KL, entropy, clip fraction over completion tokens).

    Args:
        values_BT: [B, T] values (bool values are counted as 0/1).
        mask_BT: [B, T] 1 (or True) for positions to include.

    Returns:
        Scalar tensor (float32 for bool or integer values).
    """
    if not values_BT.is_floating_point():
        values_BT = values_BT.float()
    count = mask_BT.bool().sum().clamp(min=1).to(values_BT.dtype)
    return _masked_sum(values_BT, mask_BT) / count
