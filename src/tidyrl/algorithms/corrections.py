"""Corrections for the sampler/trainer mismatch: the weight each token's policy-gradient loss is multiplied by.

The sampler (vLLM, SGLang) and the trainer give the same sampled token different probabilities, so a rollout is
slightly off-policy. Every correction here starts from the per-token log-ratio

    delta_t = log pi_trainer(y_t) - log pi_sampler(y_t),      r_t = exp(delta_t)

and either truncates a ratio into [low, cap] or gives weight 0 to what falls outside [low, cap]. They differ in
which ratio is tested (the token's own, its sequence's product, or its sequence's geometric mean) and in the
weight a token keeps inside the bounds. `mismatch_weights` computes any of them; `MODES` lists them and
`DEFAULTS` gives each its default (low, cap), with the peer it comes from. The run's is `rollout.correction`
(`rollouts.scoring.Correction`), its upper bound `rollout.tis_cap`.

Pure tensor maths, no gradient: both log-probs are of the behaviour, not of the policy being trained.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # (the modes and defaults are read by the config's checks, which import no torch)
    from torch import Tensor

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "sequence_reject",
         "sequence_reject_token_is")
"""The modes of `mismatch_weights`. The first four are TRL's `vllm_importance_sampling_mode` values."""

DEFAULTS: dict[str, tuple[float | None, float]] = {
    # Yao et al. 2025 (C = 2); TRL 0.23-0.25 (`vllm_importance_sampling_cap=2.0`); verl `rollout_is_threshold`
    "token_truncate": (None, 2.0),
    # TRL >= 0.26: one `vllm_importance_sampling_clip_max` (formerly `_cap`) = 3.0 for all four modes, no lower bound
    "token_mask": (None, 3.0),
    "sequence_truncate": (None, 3.0),
    "sequence_mask": (None, 3.0),  # TRL's default mode
    # IcePop's [alpha, beta], as OpenRLHF's `--algo.advantage.is_correction_threshold` default [0.5, 5.0]
    "icepop": (0.5, 5.0),
    # verl's geometric rejection presets (`decoupled_geo_rs`, `bypass_ppo_clip_geo_rs`): "0.999_1.001"
    "sequence_reject": (0.999, 1.001),
    # OpenRLHF's `seq-mask-tis`, with the same default [0.5, 5.0]
    "sequence_reject_token_is": (0.5, 5.0),
}
"""Each mode's default (low, cap); low None = no lower bound."""

TWO_SIDED = ("icepop", "sequence_reject", "sequence_reject_token_is")
"""The modes that need a lower bound `low`."""


class MismatchWeights(NamedTuple):
    """What `mismatch_weights` returns; B sequences of T positions, `mask_BT` the tokens the loss covers."""

    weights: Tensor
    """(B, T): the factor on each token's policy-gradient loss; 1 off the mask."""
    delta: Tensor
    """(B, T): log pi_trainer - log pi_sampler on the mask, 0 off it."""
    ratio: Tensor
    """(B, T): the ratio each token's weight was decided on (its own, or its sequence's product or geometric
    mean), before truncation or masking; 1 off the mask."""
    clipped: Tensor
    """(B, T) bool: tokens of the mask whose ratio was truncated to a bound (the `*_truncate` modes)."""
    masked: Tensor
    """(B, T) bool: tokens of the mask given weight 0 (every other mode)."""
    masked_sequences: Tensor
    """(B,) bool: sequences with at least one masked token (for a sequence-level mode: the whole sequence)."""


def _check(mode: str, cap: float, low: float | None) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown mismatch correction {mode!r}; valid values: {', '.join(MODES)}")
    if not cap > 0:  # (also refuses NaN)
        raise ValueError(f"the cap of the mismatch correction {mode} must be a positive number, got {cap}")
    if low is None and mode in TWO_SIDED:
        raise ValueError(f"the mismatch correction {mode} needs a lower bound `low` (default {DEFAULTS[mode][0]})")
    if low is not None and not 0 <= low < cap:
        raise ValueError(f"the lower bound of the mismatch correction {mode} must be in [0, cap={cap}), got {low}")


def mismatch_weights(trainer_BT: Tensor, sampler_BT: Tensor, mask_BT: Tensor, mode: str, cap: float,
                     low: float | None = None) -> MismatchWeights:
    """Per-token loss weights against the sampler/trainer mismatch. With r_t = pi_trainer(y_t) / pi_sampler(y_t)
    on the n tokens of a sequence's mask, R = prod_t r_t = exp(sum_t delta_t) its ratio and
    G = exp(sum_t delta_t / n) its geometric mean, and in(x) = [low <= x <= cap] (low None: x <= cap):

        token_truncate            w_t = clip(r_t, low, cap)       TIS, Yao et al. 2025; TRL
        token_mask                w_t = r_t * in(r_t)             MIS per token; TRL
        sequence_truncate         w_t = clip(R, low, cap)         TRL
        sequence_mask             w_t = R * in(R)                 MIS, Liu, Li et al. 2025; TRL (its default)
        icepop                    w_t = r_t * in(r_t)             IcePop, Ling Team 2025, M(k; alpha, beta)
        sequence_reject           w_t = in(G)                     verl's geometric rejection (`seq_mean_k1`)
        sequence_reject_token_is  w_t = r_t * in(G)               OpenRLHF's `seq-mask-tis`

    The masking modes keep the ratio inside the bounds (TRL's mask modes, IcePop's M(k) = k on [alpha, beta],
    OpenRLHF, slime); only `sequence_reject` keeps weight 1, as verl's rejection only edits the loss mask.
    `icepop` is `token_mask` with a lower bound that must be given. A zero weight leaves a token in the loss's
    normaliser here, as in TRL and OpenRLHF; verl removes rejected tokens from it (drop `masked` from the mask
    for that). TRL: trl/trainer/grpo_trainer.py (`vllm_importance_sampling_ratio`); OpenRLHF:
    openrlhf/models/loss.py (`PolicyLoss.forward`); verl: verl/trainer/ppo/rollout_corr_helper.py.

    Args:
        trainer_BT, sampler_BT: (B, T) log-probs of the sampled tokens under the trainer and the sampler.
        mask_BT: (B, T) 1 on the tokens the loss covers.
        mode: one of `MODES`.
        cap: the upper bound (C, C_max, beta); `DEFAULTS` has each mode's.
        low: the lower bound (C_min, alpha), in [0, cap); None = none, only for the modes not in `TWO_SIDED`.

    Returns:
        A `MismatchWeights`: weights (1 off the mask), delta (0 off the mask), the ratio tested, and which tokens
        were clipped or masked and which sequences masked.
    """
    import torch

    _check(mode, cap, low)
    mask = mask_BT.bool()
    with torch.no_grad():
        delta = torch.where(mask, trainer_BT - sampler_BT.to(trainer_BT.device), torch.zeros((), device=mask.device))
        token_ratio = torch.exp(delta)  # (B, T)
        log_sum = delta.sum(dim=-1, keepdim=True)  # (B, 1); delta is 0 off the mask
        if mode in ("token_truncate", "token_mask", "icepop"):
            ratio = token_ratio
        elif mode in ("sequence_truncate", "sequence_mask"):
            ratio = torch.exp(log_sum).expand_as(delta)  # TRL: exp of the summed log-ratios, the product
        else:
            ratio = torch.exp(log_sum / mask.sum(dim=-1, keepdim=True).clamp(min=1)).expand_as(delta)
        ones, zeros = torch.ones_like(delta), torch.zeros_like(delta)
        ratio = torch.where(mask, ratio, ones)
        outside = ((ratio > cap) | (ratio < (-math.inf if low is None else low))) & mask
        nothing = torch.zeros_like(mask)
        if mode in ("token_truncate", "sequence_truncate"):
            kept, clipped, masked = ratio.clamp(min=low, max=cap), outside, nothing
        else:
            inside = {"sequence_reject": ones, "sequence_reject_token_is": token_ratio}.get(mode, ratio)
            kept, clipped, masked = torch.where(outside, zeros, inside), nothing, outside
        weights = torch.where(mask, kept, ones)
    return MismatchWeights(weights, delta, ratio, clipped, masked, masked.any(dim=-1))
