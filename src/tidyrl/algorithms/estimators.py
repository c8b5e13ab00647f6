"""The advantage estimators of the algorithm table (`table.Algorithm.advantages`), one pure function each:
the rollout's scores and tensors in, its advantages (and PPO's returns) and the rollout metrics they give out.

Every function takes the same keyword arguments (the learner passes the rollout's tensors and the algorithm's
options as plain values; each reads what it needs) and runs over the global rollout, so the number of processes
does not change the result (DESIGN §2):

    scores      (R,) each episode's reward (the weighted sum, normalised rewards included)
    k           completions per prompt; episodes p*k .. p*k + k - 1 share prompt p
    mask        (R, T) the model's own tokens (multi-turn: environment tokens are 0)
    multi_turn  the recursions run over the model's tokens only (`ppo.over_actions`)
    truncated   (R,) completions that reached max_new_tokens without EOS
    kl          (R, T) the per-token KL to the reference where the KL goes into the reward (zeros otherwise)
    beta        the KL coefficient of this rollout
    values      (R, T) the critic's values (PPO), or None
    teacher     (R, T) a teacher's log-probs of the sampled tokens (on-policy distillation), or None
    student     (R, T) the behaviour policy's log-probs of the same tokens (the old log-probs), or None
    and the options of the algorithm's config section (scale_rewards, gamma, lam, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import Tensor

from tidyrl.algorithms import ppo
from tidyrl.algorithms.advantages import (grpo_advantages, kl_shaped_rewards, reverse_kl_advantages,
                                          rloo_advantages)


@dataclass
class Estimate:
    """What an estimator gives: advantages (R,) or (R, T), PPO's returns (R, T), and rollout metrics."""

    advantages: Tensor
    returns: Optional[Tensor] = None
    stats: dict = field(default_factory=dict)


def group(scores: Tensor, *, k: int, scale_rewards: str, **_) -> Estimate:
    """GRPO: each reward less its group's mean, over the group's (or batch's) std (advantages.grpo_advantages).
    The KL, if any, is a term of the loss, not of these."""
    return Estimate(grpo_advantages(scores, k, scale=scale_rewards))


def leave_one_out(scores: Tensor, *, k: int, kl: Tensor, mask: Tensor, beta: float, **_) -> Estimate:
    """RLOO: the KL subtracted from each sequence's reward, then the mean of the other k - 1 as the baseline."""
    return Estimate(rloo_advantages(kl_shaped_rewards(scores, kl, mask, beta), k))


def _token_rewards(scores, *, k, kl, mask, beta, truncated, missing_eos_penalty, group_baseline):
    """PPO's and REINFORCE++'s per-token rewards: -beta * KL on every token, the score (less the missing-EOS
    penalty, and for REINFORCE++-baseline less the group's mean) on the last one."""
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * truncated.float()
    if group_baseline:
        scores = ppo.group_baseline_scores(scores, k)
    rewards = ppo.token_level_rewards(scores, kl, mask, beta)
    return rewards, {"kl_coef": beta, "rollout_kl": float((kl * mask).sum(1).mean())}


def _over(mask: Tensor, multi_turn: bool) -> Callable:
    """A per-token recursion over the completion (single turn) or over the model's own tokens (multi-turn)."""
    if multi_turn:
        return lambda fn, *ts: ppo.over_actions(fn, mask, *ts)
    return lambda fn, *ts: fn(*ts, mask)


def gae(scores: Tensor, *, k: int, kl: Tensor, mask: Tensor, beta: float, truncated: Tensor, values: Tensor,
        multi_turn: bool, gamma: float, lam: float, whiten_advantages: bool, missing_eos_penalty, **_) -> Estimate:
    """PPO: generalised advantage estimation on the critic's values (ppo.gae), whitened over the batch."""
    rewards, stats = _token_rewards(scores, k=k, kl=kl, mask=mask, beta=beta, truncated=truncated,
                                    missing_eos_penalty=missing_eos_penalty, group_baseline=False)
    advantages, returns = _over(mask, multi_turn)(lambda r, v, m: ppo.gae(r, v, m, gamma, lam), rewards, values)
    if whiten_advantages:
        advantages = ppo.masked_whiten(advantages, mask)
    stats["explained_variance"] = ppo.explained_variance(values, returns, mask)
    stats["returns_mean"] = float((returns * mask).sum() / mask.sum().clamp(min=1))
    return Estimate(advantages, returns, stats)


def returns(scores: Tensor, *, k: int, kl: Tensor, mask: Tensor, beta: float, truncated: Tensor, multi_turn: bool,
            gamma: float, missing_eos_penalty, **_) -> Estimate:
    """REINFORCE++: discounted returns of the per-token rewards, whitened over the global batch (Hu 2025)."""
    rewards, stats = _token_rewards(scores, k=k, kl=kl, mask=mask, beta=beta, truncated=truncated,
                                    missing_eos_penalty=missing_eos_penalty, group_baseline=False)
    to_go = _over(mask, multi_turn)(lambda r, m: ppo.discounted_returns(r, m, gamma), rewards)
    return Estimate(ppo.masked_whiten(to_go, mask), None, stats)


def group_returns(scores: Tensor, *, k: int, kl: Tensor, mask: Tensor, beta: float, truncated: Tensor,
                  multi_turn: bool, gamma: float, missing_eos_penalty, **_) -> Estimate:
    """REINFORCE++-baseline: `returns` after each score less its group's mean (ppo.group_baseline_scores)."""
    rewards, stats = _token_rewards(scores, k=k, kl=kl, mask=mask, beta=beta, truncated=truncated,
                                    missing_eos_penalty=missing_eos_penalty, group_baseline=True)
    to_go = _over(mask, multi_turn)(lambda r, m: ppo.discounted_returns(r, m, gamma), rewards)
    return Estimate(ppo.masked_whiten(to_go, mask), None, stats)


def reverse_kl(scores: Tensor, *, k: int, mask: Tensor, teacher: Tensor, student: Tensor, task_reward_weight: float,
               scale_rewards: str, **_) -> Estimate:
    """On-policy distillation: each token's negative reverse KL to the teacher (advantages.reverse_kl_advantages),
    plus, with `task_reward_weight` w > 0, w times GRPO's group advantage of the task reward on every token of the
    completion: A_t = (log pi_T - log pi_S)_t + w * A_group. Metrics: distill/reverse_kl (the mean over the
    student's tokens of log pi_S - log pi_T, the k1 estimate of KL(pi_S || pi_T) per token) and, with task
    rewards, distill/kl_share (the KL term's share of the advantages' absolute sum)."""
    kl_part = reverse_kl_advantages(teacher, student, mask)
    tokens = mask.sum().clamp(min=1)
    stats = {"distill/reverse_kl": float(-kl_part.sum() / tokens)}
    if not task_reward_weight:
        return Estimate(kl_part, None, stats)
    task_part = task_reward_weight * grpo_advantages(scores, k, scale=scale_rewards)[:, None] * mask
    kl_abs, task_abs = float(kl_part.abs().sum()), float(task_part.abs().sum())
    stats["distill/kl_share"] = kl_abs / (kl_abs + task_abs) if kl_abs + task_abs > 0 else 0.0
    return Estimate(kl_part + task_part, None, stats)


ESTIMATORS: dict[str, Callable[..., Estimate]] = {
    "group": group, "leave_one_out": leave_one_out, "gae": gae, "returns": returns, "group_returns": group_returns,
    "reverse_kl": reverse_kl,
}
"""`table.Algorithm.advantages` -> its estimator."""
