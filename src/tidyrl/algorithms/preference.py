"""Preference losses: the reward model's Bradley–Terry loss, DPO and IPO.

Pure tensor functions (no model, no config). Each returns one loss per pair,
shape (B,); the loop sums them over a micro-batch and divides by the number
of pairs in the whole optimizer batch (all micro-batches, all processes), so
the gradient does not depend on `micro_batch_size` or the number of processes
(the same argument as `tidyrl.algorithms.losses.aggregate_loss`).

    reward model:  r_c, r_r = rm(prompt + chosen), rm(prompt + rejected)       (B,) each
                   loss_B = bradley_terry_loss(r_c, r_r, margin_B)
    DPO / IPO:     logp_B = sequence_logps(token_logprobs_BT, completion_mask_BT)   for chosen and rejected,
                   under the policy (with grad) and the frozen reference (no grad)
                   loss_B, reward_c_B, reward_r_B = dpo_loss(...)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DPO_LOSS_TYPES = ("sigmoid", "ipo")
"""Valid `loss_type` values of `dpo_loss` (config key `dpo.loss_type`)."""


def sequence_logps(logprobs_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """log pi(y | x) of each sequence: the sum of its completion tokens' log-probs.

        logp_b = sum_t logprobs_{b,t} * mask_{b,t}

    Args:
        logprobs_BT: [B, T] per-token log-probs.
        mask_BT: [B, T] 1 for completion tokens, 0 for prompt and padding.

    Returns:
        [B] sequence log-probs (0 for an empty mask).
    """
    # where() rather than a product: padding positions may hold -inf, and -inf * 0 is NaN.
    zero = torch.zeros((), dtype=logprobs_BT.dtype, device=logprobs_BT.device)
    return torch.where(mask_BT.bool(), logprobs_BT, zero).sum(dim=-1)


def bradley_terry_loss(chosen_rewards_B: Tensor, rejected_rewards_B: Tensor, margin_B: Tensor | None = None) -> Tensor:
    """Negative log-likelihood of the preference under the Bradley–Terry model, per pair.

    Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs: I. The
    Method of Paired Comparisons": P(chosen > rejected) = sigmoid(r_c - r_r).
    As the reward-model loss of Ouyang et al. 2022 (InstructGPT), eq. 1:

        loss_b = -log sigmoid(r_c,b - r_r,b - m_b)

    The margin m_b >= 0 (Touvron et al. 2023, Llama 2, eq. 2) asks the chosen
    reward to exceed the rejected one by at least m_b before the loss flattens:
    pairs rated "significantly better" get a larger margin. m = 0 is plain
    Bradley–Terry. `logsigmoid` is used for -log sigmoid: it does not overflow
    for large negative differences.

    Args:
        chosen_rewards_B: [B] scalar rewards of the chosen sequences.
        rejected_rewards_B: [B] scalar rewards of the rejected sequences.
        margin_B: [B] margins, or None for no margin.

    Returns:
        [B] per-pair losses.
    """
    diff_B = chosen_rewards_B - rejected_rewards_B
    if margin_B is not None:
        diff_B = diff_B - margin_B.to(diff_B.dtype)
    return -F.logsigmoid(diff_B)


def dpo_loss(
    policy_chosen_logps_B: Tensor,
    policy_rejected_logps_B: Tensor,
    ref_chosen_logps_B: Tensor,
    ref_rejected_logps_B: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO (sigmoid) or IPO loss per pair, and the implicit rewards.

    With sequence log-probs (`sequence_logps`) of the chosen (w) and rejected
    (l) completions under the policy pi and the frozen reference pi_ref:

        h_b = [log pi(y_w|x) - log pi_ref(y_w|x)] - [log pi(y_l|x) - log pi_ref(y_l|x)]

    sigmoid: Rafailov et al. 2023, "Direct Preference Optimization: Your
    Language Model is Secretly a Reward Model", eq. 7:

        loss_b = -log sigmoid(beta * h_b)

    With label_smoothing = eps > 0, the labels are assumed flipped with
    probability eps (conservative DPO; Mitchell 2023, "A note on DPO with
    noisy preferences & relationship to IPO"):

        loss_b = -(1 - eps) log sigmoid(beta * h_b) - eps log sigmoid(-beta * h_b)

    ipo: Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", eq. 17, with tau = beta:

        loss_b = (h_b - 1 / (2 * tau))^2

    IPO regresses h to a finite target instead of pushing it to infinity, so
    it does not overfit deterministic preferences. As in the paper, h uses
    summed (not length-averaged) log-probs.

    The implicit rewards (DPO §5) are beta * log(pi / pi_ref) of each
    completion; they are detached (for metrics).

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] sequence log-probs under the policy (with grad).
        ref_chosen_logps_B, ref_rejected_logps_B: [B] sequence log-probs under the reference (no grad).
        beta: > 0; DPO's beta, IPO's tau.
        loss_type: "sigmoid" or "ipo".
        label_smoothing: in [0, 0.5); sigmoid only.

    Returns:
        (loss_B, chosen_rewards_B, rejected_rewards_B), each [B].
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; valid values: {', '.join(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5 or (label_smoothing and loss_type != "sigmoid"):
        raise ValueError(f"label_smoothing must be in [0, 0.5) and only with loss_type='sigmoid', "
                         f"got {label_smoothing} with {loss_type!r}")
    chosen_logratio_B = policy_chosen_logps_B - ref_chosen_logps_B.detach()
    rejected_logratio_B = policy_rejected_logps_B - ref_rejected_logps_B.detach()
    h_B = chosen_logratio_B - rejected_logratio_B
    if loss_type == "sigmoid":
        loss_B = -(1 - label_smoothing) * F.logsigmoid(beta * h_B) - label_smoothing * F.logsigmoid(-beta * h_B)
    else:
        loss_B = (h_B - 1 / (2 * beta)) ** 2
    return loss_B, beta * chosen_logratio_B.detach(), beta * rejected_logratio_B.detach()
