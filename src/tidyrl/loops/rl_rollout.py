"""The learner's side of a rollout (DESIGN §3 steps 3-4), as functions: score the produced episodes (the trainer's
log-probs where the sampler was another program, the reference's, the critic's values), turn rewards into the
algorithm's advantages, and the rollout's metrics and samples.jsonl rows. Every statistic is over the global
rollout, so the number of processes does not change it."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import fields, replace
from typing import Any, Optional

import torch

from tidyrl.algorithms.estimators import ESTIMATORS, Estimate
from tidyrl.algorithms.kl import kl_per_token
from tidyrl.algorithms.losses import masked_mean, truncated_importance_weights
from tidyrl.loops.collectives import reduce_max
from tidyrl.loops.training import Sums
from tidyrl.models.sharding import full_weights
from tidyrl.rewards.functions import weighted_sum
from tidyrl.rollouts.making import episode_tokens, on_engine
from tidyrl.rollouts.record import Rollout
from tidyrl.rollouts.scoring import score_logprobs

GROUP_COUNTS = ("groups/generated", "groups/kept", "groups/filled", "groups/dropped")
"""rollout.dynamic_sampling's per-rollout counts, summed over the run for the summary."""


def behaviour_correction(policy, local: Rollout, sampled_logprobs, *, tis_cap: float, behaviour: str,
                         temperature: float, chunk_size: int, fast_path: bool, accelerator) -> tuple[Any, Any, dict]:
    """The sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"): the trainer's log-probs of the sampled tokens, recomputed by the policy's forward. They are the
    old log-probs of the PPO ratio; with rollout.behaviour_logprobs=sampler (and a cap) each token's loss is also
    weighted by the truncated importance ratio w = min(pi_trainer / pi_sampler, tis_cap). Returns (the old
    log-probs, the weights or None, the mismatch metrics: this process's tokens, summed over processes)."""
    with full_weights(policy):
        trainer = score_logprobs(policy, local, temperature, chunk_size, fast_path=fast_path)
    mask = local.completion_mask.bool()
    weights, delta, capped = truncated_importance_weights(trainer, sampled_logprobs, mask, tis_cap)
    is_weights = weights if behaviour == "sampler" and tis_cap > 0 else None
    totals = Sums("abs", "tokens", "capped")
    totals.add(abs=delta.abs().sum(), tokens=mask.sum(), capped=capped.sum() if is_weights is not None else 0.0)
    summed = totals.reduced(accelerator)
    peak = reduce_max(accelerator, float(delta.abs().max()) if delta.numel() else 0.0)
    tokens = max(summed["tokens"], 1.0)
    stats = {"mismatch/logprob_abs_mean": summed["abs"] / tokens, "mismatch/logprob_abs_max": peak}
    if is_weights is not None:
        stats["mismatch/capped_fraction"] = summed["capped"] / tokens
    return trainer, is_weights, stats


def old_from_sampler(cfg, plan, tis_cap: float) -> bool:
    """Whether the rollout's old log-probs (those the KL in the reward reads) are the sampler's own: with
    rollout.behaviour_logprobs=sampler, uncorrected or corrected inside the update (one mini-batch per epoch); else
    `score_episodes` recomputes them with the trainer (behaviour_correction)."""
    return cfg.rollout.behaviour_logprobs == "sampler" and (tis_cap == 0 or plan.minibatches_per_epoch == 1)


def rollout_rewards(per_fn: dict, reward_fns: list, gather, moments: dict, rollout: Rollout, rollout_cfg, options):
    """Each episode's reward (R,) of the global rollout, summed in one place (`rewards.functions.weighted_sum`):
    this process's per-function scores (`Made.per_fn`) gathered in float32, `normalize: true` rewards normalised
    by their running moments (`moments`, updated), the environment's reward added (weight 1), and DAPO's soft
    overlong punishment where the algorithm's options ask for it (`overlong_buffer`). Returns (the raw scores by
    name: reward/<name> metrics and samples, the rewards, the overlong penalties or None)."""
    raw = {name: gather(v.float()) for name, v in per_fn.items()}  # name -> (R,), NaN = no score
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


def multi_turn_stats(r: int, episodes, gather) -> tuple[dict, list, list]:
    """Multi-turn episodes of rollout r (0-based): (turns_mean and env/error_fraction over the global rollout,
    this process's environment errors, the lines that say them and any failed close() calls)."""
    errors = [text for text in episodes.error_texts if text]
    closing = [text for text in episodes.close_errors if text]
    notes = []
    if errors:
        notes.append(f"rollout {r + 1}: {len(errors)} episode(s) of this process ended on an environment error, "
                     f"e.g. {errors[0]}")
    if closing:
        notes.append(f"rollout {r + 1}: {len(closing)} environment close() call(s) failed (recorded, the run goes "
                     f"on), e.g. {closing[0]}")
    stats = {"turns_mean": float(gather(episodes.turns).mean()),
             "env/error_fraction": float(gather(episodes.errors).mean())}
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
        f"stopped. Environment {env.factory}, first errors: {examples}. Check that it can serve "
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
    """One samples.jsonl row for global episode e."""
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
    }


def gather_rollout(accelerator, local: Rollout, pad_id: int) -> Rollout:
    """Every process gets all R episodes (ids and masks are small), padded to common widths: prompts on the left
    (with the pad id), every per-token field on the right (completions with the pad id)."""
    if accelerator.num_processes == 1:
        return local

    def cat(name, t):
        if t is None:
            return None
        t = t.to(accelerator.device)
        if t.dim() == 2:
            pad_index = pad_id if name in ("prompt_ids", "completion_ids") else 0
            t = accelerator.pad_across_processes(t, dim=1, pad_index=pad_index, pad_first=name.startswith("prompt"))
        return accelerator.gather(t).cpu()

    return Rollout(**{f.name: cat(f.name, getattr(local, f.name)) for f in fields(Rollout)})


def score_episodes(made, policy, pad_id: int, cfg, plan, *, tis_cap: float, accelerator, use_reference: bool,
                   reference, kl_in_reward: bool, critic, teacher=None, prompts=None) -> tuple[Rollout, dict]:
    """This process's share of the rollout record, scored: the behaviour (old) log-probs and, where the sampler
    was not the trainer, the importance weights; with a KL term (`use_reference`) the reference's log-probs
    (`reference`: the frozen model, or None with LoRA: the policy with its adapter off); the critic's values
    (`critic`, or None); a teacher's log-probs (`teacher`: on-policy distillation, or None; `prompts`: the
    episodes' prompts, which a teacher of another tokenizer renders itself). Returns (the local Rollout, its
    metrics: the mismatch's, time/teacher_s)."""
    from tidyrl.models.lora import reference_of
    from tidyrl.rollouts.scoring import score_values

    ro = cfg.rollout
    ep = made.episodes
    tokens = episode_tokens(made, pad_id)
    # Old log-probs differ from the current ones only after the rollout's first optimizer step, so they are kept
    # only when E*M > 1, or when the KL penalty sits in the reward. The sampling pass computed them with the same
    # weights (no second forward pass; equal up to rounding).
    # A teacher's advantages read them too: log pi_T - log pi_S on each sampled token.
    old = ep.logprobs if (plan.optimizer_steps_per_rollout > 1 or (use_reference and kl_in_reward)
                          or teacher is not None) else None
    is_weights, sampler, mismatch = None, None, {}
    if old_from_sampler(cfg, plan, tis_cap):
        if tis_cap > 0:
            # The rollout's first optimizer step covers all of it (one mini-batch per epoch), and the policy that
            # takes it IS the trainer at sampling time: the importance weights come from that step's own forward
            # (loops.rl_update), which also records the trainer's log-probs for the later epochs. No extra pass.
            sampler = ep.logprobs
    else:
        old, is_weights, mismatch = behaviour_correction(
            policy, tokens, ep.logprobs, tis_cap=tis_cap, behaviour=ro.behaviour_logprobs, temperature=ro.temperature,
            chunk_size=ro.forward_batch_size, fast_path=cfg.model_fast_paths, accelerator=accelerator)
    ref = values = None
    if use_reference:
        # The policy is gathered whole where it is the reference (LoRA, its adapter off); a frozen reference sharded
        # under FSDP2 gathers a layer at a time in each forward, as many on every process (equal shares, equal chunks).
        whole = full_weights(policy) if reference is None else contextlib.nullcontext()
        with whole, reference_of(policy, reference) as model:
            ref = score_logprobs(model, tokens, ro.temperature, ro.forward_batch_size, fast_path=cfg.model_fast_paths)
    if critic is not None:
        critic.eval()
        with full_weights(critic):
            values = score_values(critic, tokens, ro.forward_batch_size)
    teacher_lp = None
    if teacher is not None:
        t0 = time.perf_counter()
        teacher_lp = teacher_logprobs(teacher, tokens, ro.temperature, ro.forward_batch_size, cfg.model_fast_paths,
                                      prompts, old)
        mismatch["time/teacher_s"] = time.perf_counter() - t0
    return replace(tokens, old_logprobs=old, ref_logprobs=ref, old_values=values, is_weights=is_weights,
                   sampler_logprobs=sampler, teacher_logprobs=teacher_lp), mismatch


def teacher_logprobs(teacher, tokens: Rollout, temperature: float, chunk_size: int, fast_path: bool,
                     prompts=None, student=None):
    """A teacher's log-probs (R, Tc) of the episodes' completion tokens, 0 past each completion: a local model
    scored as the KL reference is (no grad, in chunks, at the rollout's temperature); a teacher of another
    tokenizer (`rollouts.teacher.CrossTokenizerTeacher`: the episodes' `prompts` re-rendered for it, its values
    mapped onto the student's tokens by characters; `student`: the student's log-probs, for the tokens it has no
    value for); or a teacher served by vLLM (`engines.server.ServerScorer`: each episode's prompt and completion
    sent as one prompt, its log-probs read back at temperature 1)."""
    from tidyrl.rollouts.teacher import CrossTokenizerTeacher

    if isinstance(teacher, torch.nn.Module):  # (sharded under FSDP2: a layer gathered at a time, as the reference)
        return score_logprobs(teacher, tokens, temperature, chunk_size, fast_path=fast_path)
    lengths = [int(n) for n in tokens.completion_mask.sum(1).tolist()]
    completions = [tokens.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
    if isinstance(teacher, CrossTokenizerTeacher):
        rows = teacher.logprobs(prompts, completions, [student[i, :n].tolist() for i, n in enumerate(lengths)])
    else:
        prompts_ids = [tokens.prompt_ids[i][tokens.prompt_mask[i].bool()].tolist() for i in range(len(tokens))]
        rows = teacher.logprobs([p + c for p, c in zip(prompts_ids, completions)], [len(p) for p in prompts_ids])
    out = torch.zeros(tokens.completion_ids.shape)
    for i, row in enumerate(rows):
        out[i, : lengths[i]] = torch.tensor(row, dtype=torch.float32)
    return out


def evaluate_held_out(producer, engine, policy, k: int, prompts: int, accelerator,
                      with_episodes: bool = False) -> tuple[dict, Optional[list]]:
    """The held-out prompts, generated and scored with the current policy through the rollout path (with an
    environment: episodes with it, as in training): eval/reward_mean (the weighted sum of the raw scores, plus the
    environment's reward: a `normalize: true` reward is not normalised), eval/reward/<name> (eval/reward/env with
    an environment), eval/completion_length_mean, eval/truncated_fraction, time/eval_s. Training's evaluation and
    `tidyrl eval` both run this.

    k completions per prompt (log.eval_decoding greedy: 1, the most likely token each step; sampled:
    rollout.samples_per_prompt), keyed by (seed, EVAL_SLOT, episode) at every evaluation, so two evaluations differ
    by the policy only. Each process takes a contiguous share of the episodes and the sums are reduced by name: the
    same numbers on any number of processes. Returns (the metrics, and with `with_episodes` every episode's row
    in episode order, gathered from every process: prompt_index, sample, completion, reward, rewards, truncated,
    length, and with an environment turns (the model's turns); else None)."""
    from tidyrl.rollouts.producer import EVAL_SLOT

    total, rank, world = prompts * k, accelerator.process_index, accelerator.num_processes
    episodes = range(total * rank // world, total * (rank + 1) // world)
    names = [f.name for f in producer.reward_fns] + (["env"] if producer.environment is not None else [])
    sums = Sums("reward", "length", "truncated", *[f"{n}:sum" for n in names], *[f"{n}:count" for n in names])
    t0 = time.perf_counter()
    made, _ = on_engine(engine, policy, lambda: producer.round(EVAL_SLOT, list(episodes), [e // k for e in episodes]))
    rows = []
    if len(episodes):
        # Each episode's reward as in training: the functions' weighted raw scores (float64, as the functions gave
        # them), plus the environment's (weight 1).
        env = made.episodes.env_reward
        env_sum = float(env.double().sum()) if env is not None else 0.0
        functions = [0.0] * len(episodes)
        if producer.reward_fns:
            functions = weighted_sum(producer.reward_fns, made.per_fn).tolist()
        sums.add(reward=sum(functions) + env_sum, length=sum(made.completion_lengths),
                 truncated=made.episodes.truncated.sum())
        raw = {name: [None if math.isnan(v) else v for v in values.tolist()] for name, values in made.per_fn.items()}
        for name, values in raw.items():
            scored = [v for v in values if v is not None]
            sums.add(**{f"{name}:sum": sum(scored), f"{name}:count": len(scored)})
        if with_episodes:
            lengths = made.completion_lengths
            turns = made.episodes.turns  # model turns, with an environment
            rows = [{"prompt_index": e // k, "sample": e % k, "completion": made.completions[i],
                     "reward": functions[i] + (float(env[i]) if env is not None else 0.0),
                     "rewards": {name: values[i] for name, values in raw.items()},
                     "truncated": bool(made.episodes.truncated[i]), "length": lengths[i],
                     **({"turns": int(turns[i])} if turns is not None else {})}
                    for i, e in enumerate(episodes)]
    totals = sums.reduced(accelerator)
    metrics = {"eval/reward_mean": totals["reward"] / total}
    for name in names:
        count = totals[f"{name}:count"]
        metrics[f"eval/reward/{name}"] = totals[f"{name}:sum"] / count if count else None
    metrics.update({"eval/completion_length_mean": totals["length"] / total,
                    "eval/truncated_fraction": totals["truncated"] / total, "time/eval_s": time.perf_counter() - t0})
    if not with_episodes:
        return metrics, None
    if world > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    return metrics, rows
