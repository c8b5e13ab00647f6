"""Preference losses: the reward model's Bradley–Terry loss, DPO, IPO, robust DPO, SimPO, ORPO and KTO.

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

from tidyrl.algorithms.choices import DPO_LOSS_TYPES, LABEL_SMOOTHING_LOSS_TYPES


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

    robust: Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language
    Models with Noisy Feedback", eq. 8, with label_smoothing = eps the
    label-flip rate: an unbiased estimate of the clean-label loss,

        loss_b = [-(1 - eps) log sigmoid(beta * h_b) + eps log sigmoid(-beta * h_b)] / (1 - 2 eps)

    cDPO minimises the loss under the noisy labels' distribution (biased
    towards h = 0); robust DPO de-biases it. eps = 0 gives plain DPO.

    The implicit rewards (DPO §5) are beta * log(pi / pi_ref) of each
    completion; they are detached (for metrics).

    Args:
        policy_chosen_logps_B, policy_rejected_logps_B: [B] sequence log-probs under the policy (with grad).
        ref_chosen_logps_B, ref_rejected_logps_B: [B] sequence log-probs under the reference (no grad).
        beta: > 0; DPO's beta, IPO's tau.
        loss_type: "sigmoid", "ipo" or "robust".
        label_smoothing: in [0, 0.5); cDPO's eps (sigmoid) or the flip rate (robust); not with ipo.

    Returns:
        (loss_B, chosen_rewards_B, rejected_rewards_B), each [B].
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; valid values: {', '.join(DPO_LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5 or (label_smoothing and loss_type not in LABEL_SMOOTHING_LOSS_TYPES):
        raise ValueError(f"label_smoothing must be in [0, 0.5) and only with loss_type "
                         f"{' or '.join(map(repr, LABEL_SMOOTHING_LOSS_TYPES))}, got {label_smoothing} with {loss_type!r}")
    chosen_logratio_B = policy_chosen_logps_B - ref_chosen_logps_B.detach()
    rejected_logratio_B = policy_rejected_logps_B - ref_rejected_logps_B.detach()
    h_B = chosen_logratio_B - rejected_logratio_B
    if loss_type == "sigmoid":
        loss_B = -(1 - label_smoothing) * F.logsigmoid(beta * h_B) - label_smoothing * F.logsigmoid(-beta * h_B)
    elif loss_type == "robust":
        eps = label_smoothing
        loss_B = (-(1 - eps) * F.logsigmoid(beta * h_B) + eps * F.logsigmoid(-beta * h_B)) / (1 - 2 * eps)
    else:
        loss_B = (h_B - 1 / (2 * beta)) ** 2
    return loss_B, beta * chosen_logratio_B.detach(), beta * rejected_logratio_B.detach()


def simpo_loss(chosen_logps_B: Tensor, rejected_logps_B: Tensor, chosen_lengths_B: Tensor,
               rejected_lengths_B: Tensor, beta: float, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """SimPO loss per pair: reference-free, length-normalised.

    Meng et al. 2024, "SimPO: Simple Preference Optimization with a
    Reference-Free Reward", eq. 6:

        r_w = beta / |y_w| * log pi(y_w|x),   r_l = beta / |y_l| * log pi(y_l|x)
        loss_b = -log sigmoid(r_w - r_l - gamma)

    gamma is the paper's absolute target margin (eq. 6); the paper's tables
    quote gamma / beta, so gamma = ratio * beta (e.g. beta = 2, ratio 0.5 ->
    gamma = 1).

    Args:
        chosen_logps_B, rejected_logps_B: [B] summed sequence log-probs under the policy.
        chosen_lengths_B, rejected_lengths_B: [B] completion token counts (>= 1).
        beta: > 0, the reward scale.
        gamma: >= 0, the target reward margin.

    Returns:
        (loss_B, chosen_rewards_B, rejected_rewards_B); the rewards detached.
    """
    if beta <= 0 or gamma < 0:
        raise ValueError(f"SimPO needs beta > 0 and gamma >= 0, got beta={beta}, gamma={gamma}")
    chosen_B = beta * chosen_logps_B / chosen_lengths_B.clamp(min=1).to(chosen_logps_B.dtype)
    rejected_B = beta * rejected_logps_B / rejected_lengths_B.clamp(min=1).to(rejected_logps_B.dtype)
    loss_B = -F.logsigmoid(chosen_B - rejected_B - gamma)
    return loss_B, chosen_B.detach(), rejected_B.detach()


def log_odds(mean_logps_B: Tensor) -> Tensor:
    """log odds(y|x) = log P - log(1 - P), with log P the mean per-token log-prob (ORPO eq. 4-5).

    log(1 - P) = log(-expm1(log P)): exact for P near 0 and near 1.
    """
    return mean_logps_B - torch.log(-torch.expm1(mean_logps_B))


def orpo_odds_ratio_loss(chosen_mean_logps_B: Tensor, rejected_mean_logps_B: Tensor) -> tuple[Tensor, Tensor]:
    """ORPO's odds-ratio term per pair, L_OR, and the log odds ratio (detached).

    Hong et al. 2024, "ORPO: Monolithic Preference Optimization without
    Reference Model", eq. 6-7, with P(y|x) = exp(mean_t log pi(y_t|x, y_<t))
    (the length-normalised likelihood of eq. 4):

        odds(y|x) = P(y|x) / (1 - P(y|x))
        L_OR = -log sigmoid(log odds(y_w|x) - log odds(y_l|x))
        L_ORPO = L_SFT(y_w) + lambda * L_OR

    L_SFT (the chosen completion's token-mean NLL) is `tidyrl.algorithms.sft.sft_loss`;
    the loop adds the two with lambda = `orpo_lambda`.

    Args:
        chosen_mean_logps_B, rejected_mean_logps_B: [B] mean per-token log-probs (< 0) under the policy.

    Returns:
        (loss_B, log_odds_ratio_B).
    """
    ratio_B = log_odds(chosen_mean_logps_B) - log_odds(rejected_mean_logps_B)
    return -F.logsigmoid(ratio_B), ratio_B.detach()


def kto_loss(policy_logps_B: Tensor, ref_logps_B: Tensor, desirable_B: Tensor, z0: Tensor | float, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """KTO loss per example (unpaired), and the implicit rewards.

    Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
    Optimization", eq. 8:

        r_b = log pi(y|x) - log pi_ref(y|x)
        v_b = lambda_D * sigmoid(beta * (r_b - z0))   if y is desirable
              lambda_U * sigmoid(beta * (z0 - r_b))   if y is undesirable
        loss_b = lambda_y - v_b

    z0 is the reference point, a constant (no gradient): see `kto_reference_point`.

    Args:
        policy_logps_B: [B] sequence log-probs under the policy (with grad).
        ref_logps_B: [B] sequence log-probs under the frozen reference.
        desirable_B: [B] bool, True for desirable examples.
        z0: the reference point (scalar).
        beta: > 0.
        desirable_weight, undesirable_weight: lambda_D, lambda_U > 0.

    Returns:
        (loss_B, rewards_B): rewards beta * r_b, detached.
    """
    if beta <= 0 or desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"KTO needs beta, desirable_weight, undesirable_weight > 0, got "
                         f"{beta}, {desirable_weight}, {undesirable_weight}")
    z0 = torch.as_tensor(z0, dtype=policy_logps_B.dtype, device=policy_logps_B.device).detach()
    r_B = policy_logps_B - ref_logps_B.detach()
    desirable_B = desirable_B.bool()
    lam_B = torch.where(desirable_B, torch.full_like(r_B, desirable_weight), torch.full_like(r_B, undesirable_weight))
    v_B = lam_B * torch.sigmoid(torch.where(desirable_B, beta * (r_B - z0), beta * (z0 - r_B)))
    return lam_B - v_B, beta * r_B.detach()


def kto_reference_point(kl_logratio_sum: Tensor | float, count: int) -> Tensor:
    """KTO's reference point z0 = max(0, mean KL log-ratio), detached.

    Ethayarajh et al. 2024, §4.1: z0 estimates KL(pi || pi_ref) from
    mismatched pairs (x_i, y_j), j != i, in the same batch:

        z0 = max(0, 1/m * sum_i [log pi(y_j|x_i) - log pi_ref(y_j|x_i)])

    The caller sums the log-ratios over the GLOBAL optimizer batch (all
    micro-batches and processes) so z0 does not depend on how the batch is split.
    """
    total = torch.as_tensor(kl_logratio_sum, dtype=torch.float32).detach()
    return (total / max(count, 1)).clamp(min=0)
