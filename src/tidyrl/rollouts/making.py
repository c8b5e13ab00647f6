"""One rollout, made (DESIGN §3 steps 1-2 and the rewards of step 4; §6 "one rollout path"): the engine holds the
weights of a version, this process's rewarded episodes are produced through it, the engine lets its memory go.

    source = RolloutSource(engine, producer, stream, ...)     # fixed for the run
    produced = make_rollout(source, r, version, weights)      # -> Produced: the one record the learner takes

The learner calls `make_rollout` itself at lag 0; with rollout.lag the lag (`rollouts.ahead.RolloutsAhead`) calls
it, on its thread, with the weights it copied at the launch: it knows no learner. The record is what a checkpoint
holds for a rollout made ahead, and what the learner scores with its own current weights (old and reference
log-probs, values: `loops.rl_rollout.score_episodes`), gathers and trains on. Those scores cannot be part of a
rollout made ahead: the old log-probs and the values are those of the learner's weights when it takes the rollout.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

from tidyrl.rollouts.producer import Made, Producer, dynamic_sampling
from tidyrl.rollouts.record import Rollout


@dataclass
class Produced:
    """A rollout as the learner takes it: this process's rewarded episodes, the rollout's P group prompts,
    dynamic sampling's metrics, the seconds of the weight sync and of the generation (rewards aside), and the
    version of the weights that made it (version v: the learner's weights after v rollouts' updates)."""

    made: Made
    group_prompts: list
    sampling_stats: dict
    sync_s: float
    generate_s: float
    version: int

    def to_dict(self) -> dict:
        """Plain values and tensors (a checkpoint's `weights_only` load reads them back: `from_dict`); the version
        is kept beside them by the checkpoint."""
        return {"made": self.made.to_dict(), "group_prompts": list(self.group_prompts),
                "sampling_stats": dict(self.sampling_stats), "sync_s": self.sync_s, "generate_s": self.generate_s}

    @classmethod
    def from_dict(cls, d: dict, version: int) -> "Produced":
        return cls(Made.from_dict(d["made"]), d["group_prompts"], d["sampling_stats"], d["sync_s"], d["generate_s"],
                   version)

    @classmethod
    def share(cls, shares: Sequence["Produced"], rank: int, world: int) -> "Produced":
        """Process `rank`'s share among `world` processes of a rollout made by len(shares) processes (their shares
        in rank order): a resume on another number of processes takes the rollouts made ahead this way."""
        if len(shares) == world:
            return shares[rank]
        whole = Made.joined([p.made for p in shares])
        per = len(whole.prompt_ids) // world
        first = shares[0]
        return replace(first, made=whole.rows(rank * per, (rank + 1) * per))


@dataclass
class DynamicSampling:
    """rollout.dynamic_sampling's settings (`producer.dynamic_sampling`)."""

    max_rounds: int
    on_cap: str


@dataclass
class Rescoring:
    """rollout.lag with top_k/top_p on an engine with its own weights: the behaviour log-probs recomputed by the
    weights that generated (`with_behaviour_logprobs`), with these settings."""

    pad_id: int
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
    gather: Optional[Callable] = None
    """A per-process tensor -> its concatenation over processes (dynamic sampling's one collective)."""
    rescore: Optional[Rescoring] = None


def make_rollout(source: RolloutSource, r: int, version: int, weights=None) -> Produced:
    """Rollout r (0-based), made by the weights of `version`: `weights` None (the policy as it is), a snapshot
    (`ahead.weight_snapshot`: loaded into the behaviour copy) or an FSDP2 policy's gathered `FullWeights` (which
    an engine with its own copy syncs from). On the learner's thread or the lag's; the engine serves one caller at
    a time (`RolloutsAhead.engine_lock`)."""
    from tidyrl.engines.base import FullWeights
    from tidyrl.rollouts.ahead import load_snapshot

    if weights is None:
        model = source.policy
    elif isinstance(weights, FullWeights):
        model = weights
    else:
        model = source.behaviour
        load_snapshot(model, weights)
    t0 = time.perf_counter()
    (made, group_prompts, sampling_stats), sync_s = on_engine(source.engine, model, lambda: _produce(source, r))
    if weights is not None and source.rescore is not None:  # (the frozen copy: not under FSDP, refused there)
        s = source.rescore
        made = with_behaviour_logprobs(made, model, s.pad_id, s.temperature, s.chunk_size, s.fast_path)
    generate_s = time.perf_counter() - t0 - sync_s - made.reward_s  # (the rewards' seconds are their own metric)
    return Produced(made, group_prompts, sampling_stats, sync_s, generate_s, version)


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


def _produce(source: RolloutSource, r: int):
    """This process's episodes of rollout r, rewarded (with rollout.dynamic_sampling: of the chosen groups).
    Returns (the episodes, the rollout's P group prompts, dynamic sampling's metrics)."""
    producer, k, episodes = source.producer, source.samples_per_prompt, source.episodes
    indices = source.stream.rollout_indices(r, source.prompts_per_rollout)  # P prompt rows
    made = producer.round(r, list(episodes), [indices[e // k] for e in episodes])
    group_prompts = producer.dataset[indices][producer.prompt_column]
    if source.dynamic is None:
        return made, group_prompts, {}
    chosen = dynamic_sampling(producer, r, indices, episodes, made, prompts_per_rollout=source.prompts_per_rollout,
                              k=k, max_rounds=source.dynamic.max_rounds, on_cap=source.dynamic.on_cap,
                              gather=source.gather)
    return chosen.made, chosen.group_prompts, chosen.stats


def episode_tokens(made: Made, pad_id: int) -> Rollout:
    """A process's episodes (`made`) as the tensors a forward takes: prompts left-padded, completions and masks."""
    from tidyrl.models.generation import left_pad

    ep = made.episodes
    p_ids, p_mask = left_pad(made.prompt_ids, pad_id)
    return Rollout(p_ids, p_mask, ep.completion_ids, ep.completion_mask, ep.truncated, action_mask=ep.action_mask)


def with_behaviour_logprobs(made: Made, behaviour, pad_id: int, temperature: float, chunk_size: int,
                            fast_path: bool) -> Made:
    """`made` with its episodes' behaviour log-probs recomputed by `behaviour` (the frozen copy at the version that
    generated them): rollout.lag with top_k/top_p on an engine whose own log-probs are renormalised over the kept
    tokens (`RolloutConfig.filtered_sampling`). They are then the policy's at that version and temperature,
    unfiltered, as the builtin engine returns them, which the truncated importance weights of the lag divide by. 0
    where the engine wrote none (padding, an environment's tokens)."""
    from tidyrl.rollouts.scoring import score_logprobs

    ep = made.episodes
    logprobs = score_logprobs(behaviour, episode_tokens(made, pad_id), temperature, chunk_size, fast_path=fast_path)
    if ep.action_mask is not None:
        logprobs = logprobs * ep.action_mask.to(logprobs.dtype)
    return replace(made, episodes=replace(ep, logprobs=logprobs.to(ep.logprobs.dtype)))
