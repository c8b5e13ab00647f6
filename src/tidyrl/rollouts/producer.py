"""Rollout production: prompts in, rewarded episodes out, through any engine (DESIGN §3 steps 1-2 and the rewards
of step 4, §6 "one rollout path").

    producer = Producer(engine, tokenizer, prompts, rewards, settings, seed, environment)
    episodes = producer.round(slot, keys, rows)  # episode keys[i] of prompt row rows[i], this process's share

Training (`loops.rl.learner`), evaluation during training and `tidyrl eval` all make their episodes here, so every
engine serves single-turn prompts, multi-turn environments and evaluation alike. Sampling is keyed: episode key
e of slot s (a rollout, or `EVAL_SLOT`) samples turn t with `sample_seed(seed, s, e)` (single turn) or
`sample_seed(seed, s, "e.t")` (multi-turn; its environment gets "e.env"), so the episodes do not depend on the
number of processes, the batch split or the engine's batching, and a resumed run makes them again.

The producer knows no learner: it returns the episodes as a `Rollout` record (its episode fields, rewarded) and
is handed the accelerator for the one collective it needs (dynamic sampling's gathers). A training rollout is
made of these by `rollouts.making.make_rollout`.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from tidyrl.models.sequences import left_pad, sample_seed
from tidyrl.rewards.functions import compute_rewards, weighted_sum
from tidyrl.rewards.reward_models import RewardModel
from tidyrl.rollouts.agents import Agent, run_agent_episodes
from tidyrl.rollouts.episodes import EpisodeSettings, as_episodes, build_environments, run_episodes
from tidyrl.rollouts.record import Rollout

EVAL_SLOT = -1
"""The rollout slot of evaluation's sampling keys: training uses 0, 1, ...; every evaluation this one, so two
evaluations differ by the policy only."""


class Columns:
    """A prompt table held as lists (column -> values), read like a `datasets.Dataset`: `table[rows]` gives each
    column's values of those rows."""

    def __init__(self, columns: dict):
        self.columns = columns

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def __getitem__(self, rows):
        if isinstance(rows, int):
            return {c: values[rows] for c, values in self.columns.items()}
        return {c: [values[i] for i in rows] for c, values in self.columns.items()}


class Producer:
    """Makes rewarded episodes of a prompt set through an engine; see the module docstring."""

    def __init__(self, engine, tokenizer, dataset, prompt_ids: Sequence[Sequence[int]], *, prompt_column: str,
                 columns: Sequence[str], reward_fns: list, settings: EpisodeSettings, seed: int,
                 environment: Any = None, pool=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.dataset, self.prompt_ids = dataset, prompt_ids
        self.prompt_column, self.columns = prompt_column, list(columns)
        self.reward_fns, self.settings, self.seed = reward_fns, settings, seed
        self.environment, self.pool = environment, pool
        self.env_name = getattr(environment, "__name__", type(environment).__name__)

    def round(self, slot: int, keys: Sequence, rows: Sequence[int], settings: Optional[EpisodeSettings] = None
              ) -> Rollout:
        """Episodes with keys `keys` (global, e.g. round * R + episode) of the prompt rows `rows` (one per
        episode), sampled in `slot` with `settings` (default: the producer's), then rewarded."""
        settings = settings or self.settings
        table = self.dataset[list(rows)] if len(rows) else {}  # column -> one value per episode
        prompts = table[self.prompt_column] if len(rows) else []
        columns = {c: table[c] for c in self.columns} if len(rows) else {c: [] for c in self.columns}
        prompt_ids = [self.prompt_ids[row] for row in rows]
        multi_turn = self.environment is not None
        agent = isinstance(self.environment, Agent)
        if multi_turn:  # turn t (an agent's call t) of episode e: its own key; its environment (agent) a seed
            env_rows = [{c: columns[c][i] for c in columns} | {self.prompt_column: prompts[i]}
                        for i in range(len(keys))]
            env_seeds = [sample_seed(self.seed, slot, f"{key}.env") for key in keys]
            key_of = lambda i, t: sample_seed(self.seed, slot, f"{keys[i]}.{t}")  # noqa: E731
        else:
            key_of = lambda i, t: sample_seed(self.seed, slot, keys[i])  # noqa: E731
        if agent:
            conversations = run_agent_episodes(self.environment, self.engine, self.tokenizer, settings, env_rows,
                                               prompts, env_seeds, key_of, self.pool)
            prompt_ids = [c.prompt_ids or p for c, p in zip(conversations, prompt_ids)]
        else:
            extra = {} if not multi_turn else dict(
                environments=build_environments(self.environment, env_rows, env_seeds, self.pool),
                messages=[list(p) if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts],
                pool=self.pool, env_names=[self.env_name] * len(keys))
            conversations = run_episodes(self.engine, self.tokenizer, prompt_ids, settings, sample_key=key_of,
                                         **extra)
        episodes = as_episodes(conversations, settings.sampling.max_new_tokens, settings.sampling.pad_id, multi_turn,
                               agent)
        if multi_turn:
            episodes.error_texts = [None if c.error is None else _with_prompt(c.error, p)
                                    for c, p in zip(conversations, prompts)]
        lengths = episodes.completion_lengths
        completion_ids = [episodes.completion_ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        rewards = {}
        if self.reward_fns and len(rows):  # with an environment, the reward functions are optional
            scored = compute_rewards(self.reward_fns, prompts=prompts, completions=completions,
                                     completion_ids=completion_ids, columns=columns)
            rewards = {name: torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
                       for name, values in scored.per_function.items()}
        elif self.reward_fns:  # no episodes on this process: a sharded reward model joins the others' forwards
            for func in self.reward_fns:
                if isinstance(func.fn, RewardModel) and func.fn.model is not None:
                    func.fn(prompts=[], completions=[])
        p_ids, p_mask = left_pad(prompt_ids, settings.sampling.pad_id)
        if episodes.prompt_routes is not None and episodes.prompt_routes.shape[1] < p_ids.shape[1]:
            # (the longest prompt's episode recorded none: its environment failed before any turn)
            extra = p_ids.shape[1] - episodes.prompt_routes.shape[1]
            episodes.prompt_routes = torch.nn.functional.pad(episodes.prompt_routes, (0, 0, 0, 0, extra, 0), value=-1)
        return replace(episodes, prompt_ids=p_ids, prompt_mask=p_mask, completions=completions,
                       rewards={**rewards, **episodes.rewards},  # the environment's reward last, beside the functions'
                       info={"time/reward_s": time.perf_counter() - t0})


def make_producers(cfg, inputs, engine, eos_ids, pad_id: int, pool, record_routes: bool = False):
    """The producers of an RL run's episodes through `engine`, from its checked inputs (`inputs`: the tokenizer,
    the training and held-out prompt sets, rewards, environment and tools): the training prompts' (with
    `record_routes`, their mixture of experts' routes too) and the held-out prompts' (log.eval_decoding's
    settings), or None without those."""
    from tidyrl.data import other_columns

    common = dict(environment=inputs.environment, tools=inputs.tools, reward_fns=inputs.reward_fns, pool=pool)
    producer = make_producer(cfg, engine, inputs.tokenizer, inputs.dataset, inputs.prompt_ids, eos_ids, pad_id,
                             columns=inputs.columns, record_routes=record_routes, **common)
    if not inputs.eval_prompt_ids:
        return producer, None
    return producer, make_producer(cfg, engine, inputs.tokenizer, inputs.eval_dataset, inputs.eval_prompt_ids,
                                   eos_ids, pad_id, greedy=cfg.log.eval_decoding == "greedy",
                                   columns=other_columns(inputs.eval_dataset, cfg.data.prompt_column), **common)


def make_producer(cfg, engine, tokenizer, dataset, prompt_ids: list, eos_ids, pad_id: int, *,
                  columns: list, reward_fns: list, environment=None, tools=None, pool=None, greedy: bool = False,
                  seed: Optional[int] = None, record_routes: bool = False):
    """The producer of `dataset`'s episodes through `engine` with the run config's (`cfg`) rollout settings, its
    seed and prompt column (and the environment's settings, if any); `greedy`: the most likely token at every step
    (top_k = 1); `seed`: the sampling keys' (default: the config's); `record_routes`: the engine returns a mixture
    of experts' routes (`SamplingSettings.record_routes`). Training, its held-out evaluation and `tidyrl eval` make
    theirs here."""
    from tidyrl.engines import SamplingSettings

    ro, env = cfg.rollout, cfg.environment
    sampling = replace(SamplingSettings.of_rollout(ro, eos_ids, pad_id), record_routes=record_routes)
    if greedy:
        sampling = replace(sampling, top_k=1)
    settings = EpisodeSettings(sampling)
    if environment is not None:
        settings = EpisodeSettings(sampling, max_turns=env.max_turns, max_turn_tokens=env.max_turn_tokens or
                                   ro.max_new_tokens, error_reward=env.error_reward, tools=tools)
    return Producer(engine, tokenizer, dataset, prompt_ids, prompt_column=cfg.data.prompt_column, columns=columns,
                    reward_fns=reward_fns, settings=settings, seed=cfg.seed if seed is None else seed,
                    environment=environment, pool=pool)


class DynamicSamplingError(RuntimeError):
    """rollout.dynamic_sampling ran out of rounds with too few informative groups, and on_sampling_cap=error."""


def dynamic_sampling(producer: Producer, r: int, indices: Sequence[int], episodes: range, first: Rollout, *,
                     prompts_per_rollout: int, k: int, max_rounds: int, on_cap: str, accelerator) -> Rollout:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2, eq. 11's constraint 0 < |{correct}| < G): keep the groups
    whose k raw weighted rewards are not all equal, drawing rounds of P more prompts (a keyed draw per
    (rollout, round), apart from the prompt stream) until P such groups exist or `max_rounds` is reached; then
    `on_cap` fills the rest with equal-reward groups (first generated first) or stops. Every round is gathered
    from every process, so every process makes the same choice; the rollout holds the chosen groups in (round,
    group) order and this process gets its usual share, with its `prompts` (the chosen groups') and its `info`
    (sampling/rounds, groups/generated, groups/kept, groups/filled, groups/dropped, time/reward_s). `first` is
    round 0 (the rollout's own prompts `indices`); `episodes` are this process's global episode ids."""
    P, R = prompts_per_rollout, prompts_per_rollout * k
    pad_id = producer.settings.sampling.pad_id
    rounds, kept, spare = [], [], []
    reward_s = 0.0
    made, round_indices = first, list(indices)
    for q in range(max_rounds):
        if q > 0:  # a keyed draw of P prompts: the same on every process and on resume
            generator = torch.Generator().manual_seed(sample_seed(producer.seed, r, -q))
            round_indices = torch.randperm(len(producer.dataset), generator=generator)[:P].tolist()
            made = producer.round(r, [q * R + e for e in episodes], [round_indices[e // k] for e in episodes])
        reward_s += made.info["time/reward_s"]
        # raw: before `normalize`; in float32, as the learner sums them
        every = replace(made, rewards={n: v.float() for n, v in made.rewards.items()}, completions=None
                        ).gathered(accelerator, pad_id)
        rounds.append((every, round_indices))
        groups = weighted_sum(producer.reward_fns, every.rewards, every.rewards.get("env")).view(P, k)
        informative = (groups.max(dim=1).values - groups.min(dim=1).values) > 0
        for p in range(P):
            (kept if informative[p] else spare).append((q, p))
        if len(kept) >= P:
            break
    chosen = kept[:P]
    filled = P - len(chosen)
    if filled and on_cap == "error":
        raise DynamicSamplingError(
            f"rollout {r + 1}: {len(rounds)} rounds (rollout.max_sampling_rounds) of {P} prompts gave {len(kept)} "
            f"groups whose {k} rewards differ, fewer than prompts_per_rollout = {P}; the rest all scored alike. "
            "Raise rollout.max_sampling_rounds, use easier (or harder) prompts, or set "
            "rollout.on_sampling_cap=fill to complete rollouts with such groups.")
    chosen = sorted(chosen + spare[:filled])
    whole = Rollout.joined([rounds[q][0].rows(p * k, (p + 1) * k) for q, p in chosen], pad_id)
    generated = P * len(rounds)
    info = {"sampling/rounds": len(rounds), "groups/generated": generated, "groups/kept": P - filled,
            "groups/filled": filled, "groups/dropped": generated - P, "time/reward_s": reward_s}
    return replace(whole.rows(episodes.start, episodes.stop), info=info,
                   prompts=[producer.dataset[rounds[q][1][p]][producer.prompt_column] for q, p in chosen])


def _with_prompt(error: str, prompt) -> str:
    """An episode's error with its prompt after the first line (an agent's traceback follows it)."""
    first, newline, rest = error.partition("\n")
    return f"{first} (episode of prompt {_short_prompt(prompt)}){newline}{rest}"


def _short_prompt(prompt, limit: int = 60) -> str:
    """A prompt in an error line: its text (a chat prompt: its last message), cut."""
    text = prompt if isinstance(prompt, str) else str((prompt or [{}])[-1].get("content", ""))
    return repr(text if len(text) <= limit else text[:limit] + "...")
