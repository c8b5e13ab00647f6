"""Making one rollout (DESIGN §3 steps 1-2 and the rewards of step 4, §6 "one rollout path"): the engine holds the
weights of a version, this process's rewarded episodes are produced through it, the engine lets its memory go.

    source = RolloutSource(engine, producer, stream, ...)     # fixed for the run
    rollout = make_rollout(source, r, version, weights)       # -> the Rollout record, its episodes and rewards

At lag 0 the lag (`rollouts.ahead.RolloutsAhead`) calls `make_rollout` when the learner takes the rollout; with
rollout.lag, ahead, on its thread, with the weights it copied at the launch. Either way it is handed everything
it needs and knows no learner. The record is what a checkpoint holds for a rollout made ahead; the scores of the
learner's models are added when the learner takes it (`rollouts.taking.Rollouts.take`): the old log-probs and the
values are those of the learner's weights then, so they cannot be part of a rollout made ahead.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from tidyrl.rollouts.producer import Producer, dynamic_sampling
from tidyrl.rollouts.record import Rollout


@dataclass
class DynamicSampling:
    """rollout.dynamic_sampling's settings (`producer.dynamic_sampling`)."""

    max_rounds: int
    on_cap: str


@dataclass
class Rescoring:
    """rollout.lag with top_k/top_p on an engine with its own weights: the behaviour log-probs recomputed by the
    weights that generated (`with_behaviour_logprobs`), with these settings."""

    temperature: float
    chunk_size: int
    fast_path: bool


@dataclass
class RolloutSource:
    """What makes a run's rollouts, fixed for the run: the engine and the producer of the training prompts, the
    prompt stream, this process's global episode ids, and the models whose weights generate (the policy itself at
    lag 0; with a lag, `behaviour`, a frozen copy each launch's snapshot is loaded into)."""

    engine: Any
    producer: Producer
    stream: Any
    """`data.PromptStream`: rollout r's P prompt rows."""
    prompts_per_rollout: int
    samples_per_prompt: int
    episodes: range
    """This process's global episode ids of a rollout."""
    policy: Any
    behaviour: Any = None
    dynamic: Optional[DynamicSampling] = None
    accelerator: Any = None
    """The run's processes (dynamic sampling gathers every round over them)."""
    rescore: Optional[Rescoring] = None


def make_rollout(source: RolloutSource, r: int, version: int, weights=None) -> Rollout:
    """Rollout r (0-based), this process's share, made by the weights of `version`: `weights` None (the policy as
    it is), a snapshot (`weights.weight_snapshot`: loaded into the behaviour copy) or an FSDP2 policy's gathered
    `FullWeights` (which an engine with its own copy syncs from). Its `info`: time/weight_sync_s (an engine that
    syncs), time/generate_s (the rewards aside), time/reward_s, dynamic sampling's counts. On the learner's thread
    or the lag's; the engine serves one caller at a time (`RolloutsAhead.engine_lock`)."""
    from tidyrl.engines.base import FullWeights
    from tidyrl.rollouts.weights import load_snapshot

    if weights is None:
        model = source.policy
    elif isinstance(weights, FullWeights):
        model = weights
    else:
        model = source.behaviour
        load_snapshot(model, weights)
    t0 = time.perf_counter()
    made, sync_s = on_engine(source.engine, model, lambda: _produce(source, r))
    if weights is not None and source.rescore is not None:  # (the frozen copy: not under FSDP, refused there)
        s = source.rescore
        made = with_behaviour_logprobs(made, model, s.temperature, s.chunk_size, s.fast_path)
    reward_s = made.info["time/reward_s"]
    info = {"time/weight_sync_s": sync_s} if source.engine.capabilities.needs_weight_sync else {}
    info.update({"time/generate_s": time.perf_counter() - t0 - sync_s - reward_s, "time/reward_s": reward_s})
    info.update({k: v for k, v in made.info.items() if k != "time/reward_s"})  # dynamic sampling's counts
    return replace(made, version=version, info=info)


def on_engine(engine, model, produce: Callable[[], Any]) -> tuple[Any, float]:
    """sync -> produce -> release, the one way an engine is used: the engine takes `model`'s weights (an engine
    that samples the model itself takes nothing, and gets an FSDP2-sharded model's whole weights gathered once for
    the call, `full_weights`), `produce()` generates through it, then the engine lets its memory go (e.g. vLLM on
    CUDA: to scoring and the update until the next sync). Returns (what `produce` returned, the sync's
    seconds)."""
    from tidyrl.models.sharding import full_weights

    sync_s = engine.sync(model)
    whole = full_weights(model) if engine.capabilities.samples_trained_weights else contextlib.nullcontext()
    with whole:  # a collective under FSDP: every process enters, even with no episode
        produced = produce()
    engine.release()
    return produced, sync_s


def _produce(source: RolloutSource, r: int) -> Rollout:
    """This process's episodes of rollout r, rewarded (with rollout.dynamic_sampling: of the chosen groups), with
    the rollout's P group prompts."""
    producer, k, episodes = source.producer, source.samples_per_prompt, source.episodes
    indices = source.stream.rollout_indices(r, source.prompts_per_rollout)  # P prompt rows
    made = producer.round(r, list(episodes), [indices[e // k] for e in episodes])
    if source.dynamic is None:
        return replace(made, prompts=producer.dataset[indices][producer.prompt_column])
    return dynamic_sampling(producer, r, indices, episodes, made, prompts_per_rollout=source.prompts_per_rollout,
                            k=k, max_rounds=source.dynamic.max_rounds, on_cap=source.dynamic.on_cap,
                            accelerator=source.accelerator)


def with_behaviour_logprobs(made: Rollout, behaviour, temperature: float, chunk_size: int, fast_path: bool
                            ) -> Rollout:
    """`made` with its episodes' behaviour log-probs recomputed by `behaviour` (the frozen copy at the version that
    generated them): rollout.lag with top_k/top_p on an engine whose own log-probs are renormalised over the kept
    tokens (`RolloutConfig.filtered_sampling`). They are then the policy's at that version and temperature,
    unfiltered, as the builtin engine returns them, which the truncated importance weights of the lag divide by. 0
    where the engine wrote none (padding, an environment's tokens)."""
    from tidyrl.rollouts.scoring import score_logprobs

    logprobs = score_logprobs(behaviour, made, temperature, chunk_size, fast_path=fast_path)
    if made.action_mask is not None:
        logprobs = logprobs * made.action_mask.to(logprobs.dtype)
    return replace(made, sampled_logprobs=logprobs.to(made.sampled_logprobs.dtype))
