"""Advantage estimators: rewards of one rollout in, one advantage per episode out.

Pure tensor functions (no model, no config). The rollout is laid out in
contiguous groups: with P prompts and k samples each, B = P * k and episodes
p*k .. p*k + k - 1 share prompt p. Reshaping to [P, k] therefore puts one
group on each row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidyrl.algorithms.choices import GRPO_SCALES


def _as_float(x: Tensor) -> Tensor:
    # Advantages are small differences of rewards: keep them in float32 at
    # least (bf16 rewards or integer scores would round them away); float64
    # stays float64 for exact tests.
    return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _groups(rewards_B: Tensor, group_size: int) -> Tensor:
    """View `rewards_B` as [P, k], checking the layout."""
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards_B.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    B = rewards_B.shape[0]
    if B % group_size != 0:
        raise ValueError(
            f"the number of rewards ({B}) is not a multiple of group_size ({group_size}); "
            "expected B = prompts * samples_per_prompt with each prompt's samples contiguous"
        )
    return _as_float(rewards_B).view(B // group_size, group_size)  # (P, k)


def _unbiased_std(x: Tensor, dim: int | None = None) -> Tensor:
    # torch.std with one element is NaN (division by n - 1 = 0). A lone
    # sample has no spread, so call its std 0: the centred advantage is 0 and
    # stays 0 after division by (0 + eps) instead of turning into NaN.
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.sum() if dim is None else x.sum(dim))
    return x.std() if dim is None else x.std(dim=dim)


def grpo_advantages(
    rewards_B: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages of GRPO (outcome supervision).

    Shao et al. 2024, "DeepSeekMath", §4.1.2 (the advantage used in eq. 3):
    every token of completion i of a group gets

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)            scale="group"

    Variants of the denominator:

        A_i = (r_i - mean(r_group)) / (std(r_all) + eps)              scale="batch"
        A_i =  r_i - mean(r_group)                                    scale="none"

    "batch" centres per group but scales by the std of the whole rollout, as
    TRL's `scale_rewards="batch"` (it avoids inflating near-constant groups).
    "none" is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like Training:
    A Critical Perspective", Dr. GRPO): dividing by the group std weights
    questions by their difficulty, a bias the paper removes.

    The std is the unbiased one (n - 1), torch's and TRL's default; a group of
    one sample has std 0 (advantage 0), not NaN.

    Args:
        rewards_B: [B] scalar reward per episode, B = P * group_size, groups contiguous.
        group_size: k, completions per prompt.
        scale: "group", "batch" or "none".
        eps: added to the std to avoid division by zero in constant groups.

    Returns:
        [B] advantages, float32 (float64 if `rewards_B` is float64).
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"unknown GRPO reward scaling {scale!r}; valid values: {', '.join(GRPO_SCALES)}")
    rewards_Pk = _groups(rewards_B, group_size)
    centred_Pk = rewards_Pk - rewards_Pk.mean(dim=1, keepdim=True)
    if scale == "group":
        centred_Pk = centred_Pk / (_unbiased_std(rewards_Pk, dim=1).unsqueeze(1) + eps)
    elif scale == "batch":
        centred_Pk = centred_Pk / (_unbiased_std(rewards_Pk) + eps)
    return centred_Pk.reshape(-1)  # (B,)


def rloo_advantages(rewards_B: Tensor, group_size: int) -> Tensor:
    """REINFORCE leave-one-out advantages (RLOO).

    Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs" (arXiv:2402.14740). Each
    sample's baseline is the mean reward of the other k - 1 samples of its
    prompt, so the baseline is independent of the sample and the gradient
    estimate stays unbiased:

        A_i = r_i - 1/(k-1) * sum_{j != i} r_j  =  k/(k-1) * (r_i - mean(r_group))

    Args:
        rewards_B: [B] reward per episode (already KL-shaped if a KL penalty is on),
            B = P * group_size, groups contiguous.
        group_size: k >= 2.

    Returns:
        [B] advantages, float32 (float64 if `rewards_B` is float64).
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size (samples_per_prompt) >= 2 for a leave-one-out baseline, got {group_size}")
    rewards_Pk = _groups(rewards_B, group_size)
    baseline_Pk = (rewards_Pk.sum(dim=1, keepdim=True) - rewards_Pk) / (group_size - 1)
    return (rewards_Pk - baseline_Pk).reshape(-1)  # (B,)


def kl_shaped_rewards(scores_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, kl_coef: float) -> Tensor:
    """Put the KL penalty into the sequence reward (RLOO, RLHF-style).

    Ahmadian et al. 2024 (the whole completion as one action) following Ziegler et al. 2019 / Stiennon et al. 2020: the
    reward is the score minus the KL to the reference policy, summed over the
    completion's tokens:

        r_i = score_i - kl_coef * sum_t kl_{i,t} * mask_{i,t}

    Args:
        scores_B: [B] reward-function / reward-model score per episode.
        kl_BT: [B, T] per-token KL estimate (see `kl.kl_per_token`), computed without grad.
        mask_BT: [B, T] 1 for completion tokens, 0 for padding.
        kl_coef: penalty weight (beta).

    Returns:
        [B] shaped rewards, float32 (float64 if `scores_B` is float64).
    """
    # where() rather than a product: padding may hold inf/NaN KL values.
    scores_B = _as_float(scores_B)
    kl_sum_B = torch.where(mask_BT.bool(), kl_BT.to(scores_B.dtype), 0.0).sum(dim=-1)
    return scores_B - kl_coef * kl_sum_B


def reverse_kl_advantages(teacher_BT: Tensor, student_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Per-token advantages of on-policy distillation: the negative reverse KL to the teacher on each sampled
    token, undiscounted and without a baseline.

    Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
    (GKD with the reverse KL on student samples); Thinking Machines 2025, "On-Policy Distillation": the student
    samples x ~ pi_S, the teacher scores every sampled token, and token t's reward is the single-sample (k1)
    estimate of the negative reverse KL,

        A_t = log pi_T(x_t | x_<t) - log pi_S(x_t | x_<t)

    with a discount of 0 (each token's advantage is its own term: the teacher already judges every token, so no
    credit flows back from later ones) and no baseline (the term is a per-token judgement, not a sequence outcome
    compared within a group). Its expectation under the student is -KL(pi_S || pi_T); a policy-gradient step on
    it lowers the reverse KL. Positions outside `mask_BT` (padding, an environment's tokens) are 0.

    Args:
        teacher_BT: [B, T] the teacher's log-probs of the sampled tokens.
        student_BT: [B, T] the student's (the behaviour policy's) log-probs of the same tokens.
        mask_BT: [B, T] 1 for the student's own tokens.
    """
    return (teacher_BT - student_BT) * mask_BT
