"""Held-out evaluation through the rollout path: the learner's evaluation during training and `tidyrl eval` both
run `evaluate_held_out`, so the two give the same numbers for the same weights."""

from __future__ import annotations

import math
import time
from typing import Optional

from tidyrl.models.collectives import Sums
from tidyrl.rewards.functions import weighted_sum
from tidyrl.rollouts.making import on_engine


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
        env = made.rewards.get("env")
        env_sum = float(env.double().sum()) if env is not None else 0.0
        functions = [0.0] * len(episodes)
        if producer.reward_fns:
            functions = weighted_sum(producer.reward_fns, made.rewards).tolist()
        sums.add(reward=sum(functions) + env_sum, length=sum(made.completion_lengths),
                 truncated=made.truncated.sum())
        raw = {name: [None if math.isnan(v) else v for v in values.tolist()] for name, values in made.rewards.items()}
        for name, values in raw.items():
            scored = [v for v in values if v is not None]
            sums.add(**{f"{name}:sum": sum(scored), f"{name}:count": len(scored)})
        if with_episodes:
            lengths = made.completion_lengths
            turns = made.turns  # model turns, with an environment
            rows = [{"prompt_index": e // k, "sample": e % k, "completion": made.completions[i],
                     "reward": functions[i] + (float(env[i]) if env is not None else 0.0),
                     "rewards": {name: values[i] for name, values in raw.items()},
                     "truncated": bool(made.truncated[i]), "length": lengths[i],
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
