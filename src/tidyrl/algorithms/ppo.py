"""Per-token rewards, returns and advantages for PPO (with a value model) and REINFORCE++.

Pure tensor functions (no model, no config). All [B, T] tensors cover the
completion tokens only, aligned with the per-token log-probs: column t is the
t-th generated token, and `mask_BT` is 1 on completion tokens, contiguous from
t = 0, then 0 after EOS (padding). `values_BT[i, t]` is the critic's estimate
V(s_t) of the state *before* token t is generated, i.e. read at the same
position as the log-prob of token t.

The training loop calls, once per rollout (no grad):

    rewards_BT = token_level_rewards(scores_B, kl_BT, mask_BT, kl_ctl.value)
    PPO:           advantages_BT, returns_BT = gae(rewards_BT, values_BT, mask_BT, gamma, lam)
                   advantages_BT = masked_whiten(advantages_BT, mask_BT)
    REINFORCE++:   advantages_BT = masked_whiten(discounted_returns(rewards_BT, mask_BT, gamma), mask_BT)
    (-baseline:    scores_B = group_baseline_scores(scores_B, k) before token_level_rewards)
    kl_ctl.update(mean KL per sequence, n_steps=B)

and per micro-batch the policy loss `losses.clipped_policy_loss(logp, old, advantages_BT, eps)`
plus, for PPO, `clipped_value_loss(values_BT, old_values_BT, returns_BT, clip)`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidyrl.algorithms.advantages import _groups


def _float_dtype(*tensors: Tensor) -> torch.dtype:
    # Returns and whitened advantages are sums and differences of small
    # rewards: compute in float32 at least (bf16 would round them away);
    # float64 inputs stay float64 for exact tests.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_BT(name: str, x_BT: Tensor, mask_BT: Tensor) -> None:
    if x_BT.dim() != 2 or x_BT.shape != mask_BT.shape:
        raise ValueError(
            f"{name} must be [B, T] with the shape of the mask {tuple(mask_BT.shape)}, got {tuple(x_BT.shape)}"
        )


def token_level_rewards(scores_B: Tensor, kl_BT: Tensor, mask_BT: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards: a KL penalty on every token, the score on the last one.

    Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    eq. 2; Ouyang et al. 2022 (InstructGPT), eq. 2; with the penalty applied
    per token as in OpenRLHF's `compute_reward` and TRL's PPO trainer:

        r_{i,t} = -kl_coef * kl_{i,t}  +  [t == last_i] * score_i      where mask_{i,t} = 1
        r_{i,t} = 0                                                     where mask_{i,t} = 0

    with last_i the last t where mask_{i,t} = 1. Summed over t this is
    `advantages.kl_shaped_rewards`; spreading it over tokens lets GAE and
    discounted returns credit each token with the penalty of what follows it.
    A sequence with an all-zero mask gets zeros (and its score is dropped).

    Args:
        scores_B: [B] reward-function / reward-model score per episode.
        kl_BT: [B, T] per-token KL estimate (see `kl.kl_per_token`; k1 in the papers).
        mask_BT: [B, T] 1 for completion tokens, 0 for padding.
        kl_coef: beta, e.g. `AdaptiveKLController.value`.

    Returns:
        [B, T] rewards without grad, float32 (float64 if `scores_B` or `kl_BT` is float64).
    """
    _check_BT("kl_BT", kl_BT, mask_BT)
    if scores_B.shape != mask_BT.shape[:1]:
        raise ValueError(f"scores_B must be [B] = [{mask_BT.shape[0]}], got {tuple(scores_B.shape)}")
    dtype = _float_dtype(scores_B, kl_BT)
    mask_BT = mask_BT.bool()
    # where() rather than a product: padding may hold inf/NaN KL values.
    rewards_BT = torch.where(mask_BT, -kl_coef * kl_BT.detach().to(dtype), 0.0)
    # Index of the last completion token, -1 for an empty sequence.
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    last_B = torch.where(mask_BT, positions_BT, -1).amax(dim=-1)  # (B,)
    score_B = torch.where(last_B >= 0, scores_B.detach().to(dtype), 0.0)
    return rewards_BT.scatter_add(1, last_B.clamp(min=0).unsqueeze(-1), score_B.unsqueeze(-1))


def gae(rewards_BT: Tensor, values_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the completion tokens.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", eq. 16 (computed by the recursion
    below, as in PPO's implementation):

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (the value target, "returns")

    The episode ends at the last completion token: V_{t+1} = 0 and A_{t+1} = 0
    there (nothing follows EOS, and a truncated completion is treated the same,
    as OpenRLHF and TRL do). gamma = lam = 1 gives A_t = sum_{s>=t} r_s - V_t.

    Values and rewards at padding are ignored, even inf/NaN. The mask must be
    contiguous from t = 0: a hole would act as the end of the episode.

    Args:
        rewards_BT: [B, T] per-token rewards (`token_level_rewards`).
        values_BT: [B, T] critic values V(s_t) at rollout time.
        mask_BT: [B, T] 1 for completion tokens, 0 for padding.
        gamma: discount, 1.0 in LLM RLHF (OpenRLHF, TRL).
        lam: GAE lambda, trades bias (small) for variance (large); TRL and OpenRLHF use 0.95.

    Returns:
        (advantages_BT, returns_BT): [B, T] each, without grad, 0 where mask is 0,
        float32 (float64 if rewards or values are float64).
    """
    _check_BT("rewards_BT", rewards_BT, mask_BT)
    _check_BT("values_BT", values_BT, mask_BT)
    dtype = _float_dtype(rewards_BT, values_BT)
    with torch.no_grad():
        mask_BT = mask_BT.bool()
        rewards_BT = torch.where(mask_BT, rewards_BT.to(dtype), 0.0)
        values_BT = torch.where(mask_BT, values_BT.to(dtype), 0.0)  # V = 0 after the last token
        advantages_BT = torch.zeros_like(rewards_BT)
        next_value_B = torch.zeros_like(rewards_BT[:, 0])
        next_advantage_B = torch.zeros_like(rewards_BT[:, 0])
        for t in reversed(range(rewards_BT.shape[1])):
            delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
            # Zero at padding, so the last real token sees A_{t+1} = 0.
            next_advantage_B = torch.where(mask_BT[:, t], delta_B + gamma * lam * next_advantage_B, 0.0)
            advantages_BT[:, t] = next_advantage_B
            next_value_B = values_BT[:, t]
        returns_BT = torch.where(mask_BT, advantages_BT + values_BT, 0.0)
    return advantages_BT, returns_BT


def over_actions(fn, mask_BT: Tensor, *tensors_BT: Tensor):
    """Apply a per-token recursion (`gae`, `discounted_returns`) over the model's own tokens only.

    In a multi-turn trajectory the environment's tokens sit between the model's turns; they are not actions,
    so the recursion must run over the model's tokens as one contiguous sequence (the next action after the
    end of a turn is the first token of the model's next turn, not an environment token), whereas `gae` and
    `discounted_returns` take a contiguous mask. So: gather each row's masked positions to the left, call
    `fn(*compacted, compact_mask)`, and scatter every [B, T'] result back to its positions (0 elsewhere).
    With a contiguous mask this is `fn(*tensors_BT, mask_BT)` exactly.

    Returns whatever `fn` returns, each [B, T'] tensor scattered back to [B, T].
    """
    mask = mask_BT.bool()
    counts_B = mask.sum(dim=1)
    width = max(int(counts_B.max()) if counts_B.numel() else 0, 1)
    # Stable sort of (not mask): masked positions first, in order.
    order_BT = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :width]
    valid_BT = torch.arange(width, device=mask.device)[None, :] < counts_B[:, None]
    compact = [torch.where(valid_BT, t.gather(1, order_BT), torch.zeros((), dtype=t.dtype, device=t.device))
               for t in tensors_BT]
    result = fn(*compact, valid_BT.to(mask_BT.dtype))

    def back(y):
        out = torch.zeros(mask_BT.shape, dtype=y.dtype, device=y.device)
        return out.scatter(1, order_BT, torch.where(valid_BT, y, torch.zeros((), dtype=y.dtype, device=y.device)))

    if isinstance(result, tuple):
        return tuple(back(y) for y in result)
    return back(result)


def discounted_returns(rewards_BT: Tensor, mask_BT: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go of every completion token (REINFORCE++'s advantage before whitening).

    Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models" (arXiv:2501.03262), the token advantage:

        G_t = sum_{s >= t, within the completion} gamma^{s-t} r_s

    With `token_level_rewards` and gamma = 1 this is the paper's
    A_t = score - beta * sum_{s>=t} KL_s: each token is credited with the
    score and the KL penalty of itself and what follows it.

    Args:
        rewards_BT: [B, T] per-token rewards.
        mask_BT: [B, T] 1 for completion tokens (contiguous from t = 0), 0 for padding.
        gamma: discount; 1.0 in the paper and OpenRLHF (which forces 1.0 for the baseline variant).

    Returns:
        [B, T] returns without grad, 0 where mask is 0, float32 (float64 if `rewards_BT` is float64).
    """
    _check_BT("rewards_BT", rewards_BT, mask_BT)
    with torch.no_grad():
        mask_BT = mask_BT.bool()
        rewards_BT = torch.where(mask_BT, rewards_BT.to(_float_dtype(rewards_BT)), 0.0)
        returns_BT = torch.zeros_like(rewards_BT)
        running_B = torch.zeros_like(rewards_BT[:, 0])
        for t in reversed(range(rewards_BT.shape[1])):
            running_B = torch.where(mask_BT[:, t], rewards_BT[:, t] + gamma * running_B, 0.0)
            returns_BT[:, t] = running_B
    return returns_BT


def masked_whiten(values_BT: Tensor, mask_BT: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise to mean 0, variance 1 over the masked entries of the whole tensor.

        x' = (x - mean) / sqrt(var + eps)            shift_mean=True
        x' = (x - mean) / sqrt(var + eps) + mean     shift_mean=False (rescale only, as TRL for rewards)

    mean and var over the entries where mask is 1, over all sequences together
    (REINFORCE++'s *global* normalisation, Hu 2025; PPO advantage
    normalisation, Huang et al. 2022, "The 37 Implementation Details of PPO",
    detail 7). var is the population variance (divide by n), as OpenRLHF's
    advantage normalisation; TRL's `masked_whiten` divides by n - 1 instead,
    which differs by a factor sqrt(n / (n - 1)), negligible over the thousands
    of tokens of a rollout. With fewer than 2 masked entries there is no
    spread to divide by: the values are centred (or returned, with
    shift_mean=False) without scaling, never NaN.

    Under data parallelism the statistics should cover the whole rollout:
    call this on the gathered rollout, not on one process's share.

    Args:
        values_BT: [B, T] values to whiten (advantages, or rewards).
        mask_BT: [B, T] 1 for entries to include.
        shift_mean: False adds the mean back after scaling.
        eps: added to the variance.

    Returns:
        [B, T], 0 where mask is 0, float32 (float64 if `values_BT` is float64).
    """
    _check_BT("values_BT", values_BT, mask_BT)
    mask_BT = mask_BT.bool()
    values_BT = values_BT.to(_float_dtype(values_BT))
    n = mask_BT.sum().to(values_BT.dtype)
    mean = torch.where(mask_BT, values_BT, 0.0).sum() / n.clamp(min=1.0)
    centred_BT = torch.where(mask_BT, values_BT - mean, 0.0)
    var = centred_BT.square().sum() / n.clamp(min=1.0)
    # Tensor ops rather than `if n < 2` keep this free of a GPU -> CPU sync.
    scale = torch.where(n >= 2, torch.rsqrt(var + eps), torch.ones_like(var))
    whitened_BT = centred_BT * scale
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(mask_BT, whitened_BT, 0.0)


def clipped_value_loss(
    values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, clip: float | None
) -> tuple[Tensor, Tensor]:
    """PPO's value loss, per token, with the value update clipped around the rollout's values.

    Schulman et al. 2017 as implemented in OpenAI baselines (ppo2); Huang et
    al. 2022, "The 37 Implementation Details of PPO", detail 9:

        v_clipped_t = old_t + clamp(v_t - old_t, -clip, clip)
        loss_t      = 1/2 * max((v_t - R_t)^2, (v_clipped_t - R_t)^2)
        loss_t      = 1/2 * (v_t - R_t)^2                                  clip = None

    The max is pessimistic like the policy clip: when the clipped prediction
    is the worse one, v has moved more than `clip` from `old` in the direction
    of R, the loss is flat in v and the gradient is zero. Note `clip` is in
    the units of the rewards (OpenRLHF's `value_clip`, TRL's `cliprange_value`),
    unlike the policy's ratio clip.

    Args:
        values_BT: [B, T] current critic values (with grad).
        old_values_BT: [B, T] critic values at rollout time (detached here).
        returns_BT: [B, T] value targets, `gae(...)[1]` (detached here).
        clip: maximum change of a value from `old`; None disables clipping.

    Returns:
        (loss_BT, clipped_BT): [B, T] per-token loss (unmasked: aggregate with
        `losses.aggregate_loss`), float32 (float64 for float64 values); and a
        [B, T] bool tensor, True where the clipped term is strictly larger
        (for a `value_clip_fraction` metric).
    """
    if clip is not None and clip < 0:
        raise ValueError(f"the value clip must be >= 0 or None, got {clip}")
    dtype = _float_dtype(values_BT)
    values_BT = values_BT.to(dtype)  # a cast keeps the graph
    returns_BT = returns_BT.detach().to(dtype)
    unclipped_BT = (values_BT - returns_BT).square()
    if clip is None:
        return 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT, dtype=torch.bool)
    old_values_BT = old_values_BT.detach().to(dtype)
    values_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    clipped_term_BT = (values_clipped_BT - returns_BT).square()
    loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_term_BT)
    with torch.no_grad():
        clipped_BT = clipped_term_BT > unclipped_BT
    return loss_BT, clipped_BT


class AdaptiveKLController:
    """Ziegler et al. 2019 §2.2: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2); beta_{t+1} = beta_t (1 + K_beta e_t), with K_beta = n_steps / horizon.

    A proportional controller that moves the KL coefficient beta towards the
    value that keeps the measured KL(pi || pi_ref) near `target`. The paper
    writes K_beta = 0.1; its code (lm-human-preferences, followed by TRL and
    OpenRLHF) sets K_beta = n_steps / horizon, with n_steps the number of
    episodes since the last update, so that beta changes by at most a factor
    e^{±0.2} every `horizon` episodes whatever the batch size.

    `current_kl` is the mean over episodes of the per-sequence KL sum
    (sum_t kl_{i,t}), the KL of whole completions the target refers to.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"the KL target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"the KL horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update beta from the KL of the last rollout of `n_steps` episodes; return the new beta."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        # Only beta evolves; target and horizon come from the config.
        return {"value": self.value}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])


class FixedKLController:
    """A constant KL coefficient with `AdaptiveKLController`'s interface: `update` returns it unchanged."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, d: dict) -> None:
        self.value = float(d["value"])


def group_baseline_scores(scores_B: Tensor, group_size: int) -> Tensor:
    """Subtract each prompt's mean score: the baseline of REINFORCE++-baseline.

    Hu 2025 (arXiv:2501.03262, v3 onwards, "REINFORCE++ w/ baseline");
    OpenRLHF's `advantage_estimator=reinforce_baseline`:

        score'_i = score_i - mean(score_group)

    There is no division by the group std (unlike GRPO): the scale is set
    afterwards by the global `masked_whiten` of the token advantages. Groups
    are contiguous: episodes p*k .. p*k + k - 1 share prompt p.

    Args:
        scores_B: [B] score per episode, B = P * group_size.
        group_size: k, completions per prompt.

    Returns:
        [B] centred scores, float32 (float64 if `scores_B` is float64).
    """
    scores_Pk = _groups(scores_B, group_size)  # raises ValueError if B % k != 0
    return (scores_Pk - scores_Pk.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)


def explained_variance(values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor) -> float:
    """How much of the returns' variance the critic explains: 1 - Var[R - V] / Var[R].

    Over the masked entries, population variances, as cleanrl's PPO metric
    (`losses/explained_variance`). 1 is a perfect critic, 0 is no better than
    predicting a constant, negative is worse. When Var[R] = 0 (or the mask is
    empty) the ratio is undefined; this returns 0.0 there (cleanrl returns
    NaN) so that a metric log never holds NaN.

    Args:
        values_BT: [B, T] critic values at rollout time.
        returns_BT: [B, T] value targets.
        mask_BT: [B, T] 1 for completion tokens.

    Returns:
        A Python float.
    """
    _check_BT("values_BT", values_BT, mask_BT)
    _check_BT("returns_BT", returns_BT, mask_BT)
    mask_BT = mask_BT.bool()
    # float64: a metric, computed once per rollout; avoids cancellation in 1 - a/b.
    returns_N = returns_BT.detach()[mask_BT].double()
    values_N = values_BT.detach()[mask_BT].double()
    if returns_N.numel() == 0:
        return 0.0
    var_returns = returns_N.var(unbiased=False).item()
    if var_returns == 0.0:
        return 0.0
    return 1.0 - (returns_N - values_N).var(unbiased=False).item() / var_returns
