"""The learner's side of a rollout (DESIGN §3 step 4), as functions: the rewards of the global rollout (normalised
by the run's running moments), the algorithm's advantages, and the rollout's metrics and samples.jsonl rows. The
rollout arrives made and scored (`rollouts.taking.Rollouts.take`); every statistic is over the global rollout, so
the number of processes does not change it."""

from __future__ import annotations

import math
from typing import Any

import torch

from tidyrl.algorithms.estimators import ESTIMATORS, Estimate
from tidyrl.algorithms.kl import kl_per_token
from tidyrl.algorithms.losses import masked_mean
from tidyrl.rewards.functions import weighted_sum
from tidyrl.rollouts.record import Rollout

GROUP_COUNTS = ("groups/generated", "groups/kept", "groups/filled", "groups/dropped")
"""rollout.dynamic_sampling's per-rollout counts, summed over the run for the summary."""


def rollout_rewards(rollout: Rollout, reward_fns: list, moments: dict, rollout_cfg, options):
    """Each episode's reward (R,) of the global rollout, summed in one place (`rewards.functions.weighted_sum`):
    the raw per-function scores (`Rollout.rewards`, gathered in float32), `normalize: true` rewards normalised
    by their running moments (`moments`, updated), the environment's reward added (weight 1), and DAPO's soft
    overlong punishment where the algorithm's options ask for it (`overlong_buffer`). Returns (the raw scores by
    name: reward/<name> metrics and samples, the rewards, the overlong penalties or None)."""
    raw = {name: v.float() for name, v in rollout.rewards.items()}  # name -> (R,), NaN = no score
    per = normalised(raw, moments)  # on the global batch: W-invariant
    scores = weighted_sum(reward_fns, per, per.get("env"))  # (R,)
    if not isinstance(scores, torch.Tensor):  # no task reward at all (pure distillation): 0 for every episode
        scores = torch.zeros(len(rollout))
    overlong = None
    if options.overlong_buffer:  # DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), part of the reward
        from tidyrl.algorithms.losses import overlong_penalty

        overlong = overlong_penalty(rollout.completion_mask.sum(1), rollout_cfg.max_new_tokens,
                                    options.overlong_buffer, options.overlong_penalty)
        scores = scores + overlong
    return raw, scores, overlong


def multi_turn_stats(r: int, rollout: Rollout) -> tuple[dict, list, list]:
    """Multi-turn episodes of rollout r (0-based), the global rollout: (turns_mean and env/error_fraction, with
    an agent agent/segments_mean and agent/edited_fraction; the environment errors; the lines that say them and
    any failed close() calls)."""
    errors = [text for text in rollout.error_texts or () if text]
    closing = [text for text in rollout.close_errors or () if text]
    notes = []
    if errors:
        notes.append(f"rollout {r + 1}: {len(errors)} episode(s) ended on an environment error, e.g. "
                     f"{errors[0].splitlines()[0]}")  # (an agent's traceback: in samples.jsonl)
    if closing:
        notes.append(f"rollout {r + 1}: {len(closing)} environment close() call(s) failed (recorded, the run goes "
                     f"on), e.g. {closing[0]}")
    stats = {"turns_mean": float(rollout.turns.mean()), "env/error_fraction": float(rollout.env_errors.mean())}
    if rollout.segments is not None:  # an agent's episodes (rollouts.agents): the calls that did not continue one
        stats |= {"agent/segments_mean": float(rollout.segments.mean()),
                  "agent/edited_fraction": float((rollout.segments > 1).float().mean())}
    return stats, errors, notes


def environment_failure(cfg, plan, r: int, step: int, failed: float, errors: list):
    """The error that stops a run whose rollout r had more than environment.max_error_fraction of its episodes end
    on an environment error (`failed`): what to check, and what the checkpoint of the `step` steps done holds."""
    from tidyrl.environments import EnvironmentFailure

    env = cfg.environment
    saved = "nothing was trained yet: start the run again once the environment works"
    if step > 0:
        saved = (f"checkpoint-{step} holds the {step} optimizer steps done; once the environment works, resume "
                 "with: tidyrl train CONFIG.yaml resume_from=latest (the rollout is made again, the same)")
    examples = "; ".join(errors[:3]) or "(on another process)"
    return EnvironmentFailure(
        f"rollout {r + 1}: {failed:.0%} of the episodes ended on an environment error, more than "
        f"environment.max_error_fraction = {env.max_error_fraction}; the run would learn from nothing, so it "
        f"stopped. {'Agent' if env.agent is not None else 'Environment'} {env.agent or env.factory}, first errors: "
        f"{examples}. Check that it can serve "
        f"{plan.episodes_per_rollout_per_process} episodes at once per process (a server's session "
        f"capacity), that environment.timeout_s = {env.timeout_s} s fits its calls, and that the server is up. "
        f"{saved}.")


def normalised(per_fn: dict, moments: dict) -> dict:
    """`rewards[i].normalize`: those rewards' scores shifted and scaled by their running moments over the run,
    updated with this (global) rollout's scores first; the others as they are."""
    out = dict(per_fn)
    for name, m in moments.items():
        scored = per_fn[name][~torch.isnan(per_fn[name])]
        m.update(scored.tolist())
        out[name] = (per_fn[name] - m.mean) / max(m.std, 1e-8)
    return out


def estimate_advantages(spec, options, rollout: Rollout, scores, *, k: int, beta: float, use_reference: bool,
                        policy_is_reference: bool) -> Estimate:
    """The advantages of the algorithm's estimator (`spec.advantages`) for the global rollout. Multi-turn: only the
    model's tokens carry a KL or an advantage."""
    mask = rollout.completion_mask
    if rollout.action_mask is not None:
        mask = mask * rollout.action_mask.to(mask.dtype)
    # Before the first update the policy is the reference (the same starting weights; with LoRA, B = 0), so the
    # KL is exactly 0. Its estimate is not: the sampler's and the scorer's log-probs of the same weights differ by
    # float rounding (~1e-7, and differently with another batch split). Where a group's scores tie, the baseline
    # leaves only that rounding, the whitening scales it up, and AdamW turns a gradient of rounding into steps of
    # the full learning rate: the run trained on noise and drifted ~lr per step between 1 and 2 processes
    # (REINFORCE++-baseline, RLOO). So the first rollout's KL is taken as the 0 it is.
    in_reward = spec.kl_in == "reward" and use_reference and not policy_is_reference
    kl = kl_per_token(rollout.old_logprobs, rollout.ref_logprobs, options.kl_estimator) if in_reward \
        else torch.zeros_like(mask)
    return ESTIMATORS[spec.advantages](scores, k=k, mask=mask, multi_turn=rollout.action_mask is not None,
                                       truncated=rollout.truncated, kl=kl, beta=beta, values=rollout.old_values,
                                       teacher=rollout.teacher_logprobs, student=rollout.old_logprobs,
                                       **vars(options))


def no_signal_note(r: int, episodes: int, scores) -> str:
    """The warning for a rollout whose advantages are all 0 (rollout `r`, 0-based): it teaches nothing, yet its
    update runs and moves the weights by what needs no signal (AdamW's moments from earlier steps, weight decay, a
    KL term in the loss)."""
    low, high = float(scores.min()), float(scores.max())
    scored = f"all scored {low:g}" if low == high else f"scored {low:g} to {high:g}, equal within each prompt's samples"
    return (f"warning: rollout {r + 1}: every advantage is 0 (its {episodes} episodes {scored}), so its "
            "policy-gradient term is 0 and it teaches nothing; its update still runs and still moves the weights by "
            "what needs no signal (AdamW's momentum from earlier steps, weight decay, a KL term in the loss). A task "
            "the model never (or always) solves gives no signal: start from a model that sometimes solves it (SFT "
            "first), add partial credit (e.g. a format reward), give easier prompts, or drop such groups "
            "(rollout.dynamic_sampling). Said once; advantage_abs_mean in metrics.jsonl shows every rollout.")


def rollout_stats(rollout: Rollout, scores, raw_per_fn: dict, overlong, algo_stats: dict) -> dict:
    """The rollout's metrics, the same in every metrics row of its optimizer steps."""
    lengths = rollout.completion_mask.sum(1)
    adv = rollout.advantages
    stats: dict[str, Any] = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
        "completion_length_mean": float(lengths.mean()),
        "truncated_fraction": float(rollout.truncated.float().mean()),
        "advantage_abs_mean": float(adv.abs().mean() if adv.dim() == 1 else
                                    masked_mean(adv.abs(), rollout.completion_mask)),
        **algo_stats,
    }
    for name, v in raw_per_fn.items():
        scored = v[~torch.isnan(v)]
        stats[f"reward/{name}"] = float(scored.mean()) if len(scored) else None
    if overlong is not None:
        stats["overlong_penalty_mean"] = float(overlong.mean())  # included in reward_mean
    if rollout.action_mask is not None:  # multi-turn: how the trajectories split between model and environment
        model_tokens = (rollout.action_mask * rollout.completion_mask).sum(1)
        stats["tokens/model_mean"] = float(model_tokens.mean())
        stats["tokens/env_mean"] = float((rollout.completion_mask.sum(1) - model_tokens).mean())
    return stats


def sample_row(tokenizer, rollout: Rollout, e: int, k: int, prompt, scores, raw_per_fn) -> dict:
    """One samples.jsonl row for global episode e (with its environment's or agent's error, if it ended on one)."""
    n = int(rollout.completion_mask[e].sum())
    adv = rollout.advantages
    return {
        "prompt": prompt if isinstance(prompt, str) else list(prompt),
        "sample": e % k,  # which of the prompt's k completions
        "completion": tokenizer.decode(rollout.completion_ids[e, :n].tolist(), skip_special_tokens=True),
        "reward": float(scores[e]),
        "rewards": {name: None if math.isnan(float(v[e])) else float(v[e]) for name, v in raw_per_fn.items()},
        # token-level advantages (PPO, REINFORCE++): the mean over the completion's tokens
        "advantage": float(adv[e] if adv.dim() == 1 else masked_mean(adv[e], rollout.completion_mask[e])),
        "truncated": bool(rollout.truncated[e]),
        **({"error": rollout.error_texts[e]} if rollout.error_texts and rollout.error_texts[e] else {}),
    }
