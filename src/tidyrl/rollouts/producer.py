"""Rollout production: prompts in, rewarded episodes out, through any engine (DESIGN §3 steps 1-2 and the rewards
of step 4, §6 "one rollout path").

    producer = Producer(engine, tokenizer, prompts, rewards, settings, seed, environment)
    made = producer.round(slot, keys, rows)      # episode keys[i] of prompt row rows[i], this process's share

Training (`loops.rl`), evaluation during training and `tidyrl eval` all make their episodes here, so every
engine serves single-turn prompts, multi-turn environments and evaluation alike. Sampling is keyed: episode key
e of slot s (a rollout, or `EVAL_SLOT`) samples turn t with `sample_seed(seed, s, e)` (single turn) or
`sample_seed(seed, s, "e.t")` (multi-turn; its environment gets "e.env"), so the episodes do not depend on the
number of processes, the batch split or the engine's batching, and a resumed run makes them again.

The producer knows no learner: it returns records (`Made`) and is handed the one collective it needs (a gather,
for dynamic sampling) as a function. A training rollout is made of these by `rollouts.making.make_rollout`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence

import torch

from tidyrl.models.generation import sample_seed
from tidyrl.rewards.functions import compute_rewards, weighted_sum
from tidyrl.rewards.reward_models import RewardModel
from tidyrl.rollouts.episodes import EpisodeSettings, Episodes, as_episodes, build_environments, run_episodes

EVAL_SLOT = -1
"""The rollout slot of evaluation's sampling keys: training uses 0, 1, ...; every evaluation this one, so two
evaluations differ by the policy only."""


@dataclass
class Made:
    """One call's episodes (this process's), rewarded."""

    prompt_ids: list
    """Each episode's prompt tokens."""
    episodes: Episodes
    completions: Optional[list]
    """Each episode's completion as text (decoded once, without special tokens): what the rewards read; None
    for dynamic sampling's chosen groups (gathered from every process's rounds as tensors)."""
    per_fn: dict
    """Reward name -> (B,) raw scores, NaN where a function gave none (float64 from `Producer.round`: the
    functions' values exactly; float32 in dynamic sampling's chosen groups, as the learner sums them); the
    environment's reward as "env". The one record of the rewards: the weighted total is
    `rewards.functions.weighted_sum` of these, wherever it is needed."""
    reward_s: float
    """Seconds spent in the reward functions."""

    @property
    def completion_lengths(self) -> list[int]:
        return self.episodes.completion_mask.sum(1).long().tolist()

    def to_dict(self) -> dict:
        """Tensors and plain values only (what a checkpoint's `weights_only` load reads back): `from_dict`."""
        return {"prompt_ids": [list(p) for p in self.prompt_ids],
                "episodes": {f.name: getattr(self.episodes, f.name) for f in fields(Episodes)},
                "completions": self.completions, "per_fn": dict(self.per_fn), "reward_s": self.reward_s}

    @classmethod
    def from_dict(cls, d: dict) -> "Made":
        return cls(d["prompt_ids"], Episodes(**d["episodes"]), d["completions"], d["per_fn"], d["reward_s"])

    @classmethod
    def joined(cls, parts: Sequence["Made"]) -> "Made":
        """The episodes of `parts` one after the other (the processes' shares in rank order: the global ones)."""
        def cat(values):
            if values[0] is None:
                return None
            return torch.cat(values) if isinstance(values[0], torch.Tensor) else [v for part in values for v in part]

        return cls(cat([p.prompt_ids for p in parts]),
                   Episodes(**{f.name: cat([getattr(p.episodes, f.name) for p in parts]) for f in fields(Episodes)}),
                   None if any(p.completions is None for p in parts) else cat([p.completions for p in parts]),
                   {n: cat([p.per_fn[n] for p in parts]) for n in parts[0].per_fn}, max(p.reward_s for p in parts))

    def rows(self, start: int, stop: int) -> "Made":
        """Episodes start .. stop - 1 (one process's share of the global episodes)."""
        def cut(value):
            return None if value is None else value[start:stop]

        return Made(cut(self.prompt_ids), Episodes(**{f.name: cut(getattr(self.episodes, f.name))
                                                      for f in fields(Episodes)}),
                    cut(self.completions), {n: cut(v) for n, v in self.per_fn.items()}, self.reward_s)


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
              ) -> Made:
        """Episodes with keys `keys` (global, e.g. round * R + episode) of the prompt rows `rows` (one per
        episode), sampled in `slot` with `settings` (default: the producer's), then rewarded."""
        settings = settings or self.settings
        table = self.dataset[list(rows)] if len(rows) else {}  # column -> one value per episode
        prompts = table[self.prompt_column] if len(rows) else []
        columns = {c: table[c] for c in self.columns} if len(rows) else {c: [] for c in self.columns}
        prompt_ids = [self.prompt_ids[row] for row in rows]
        multi_turn = self.environment is not None
        extra = {}
        if multi_turn:
            env_rows = [{c: columns[c][i] for c in columns} | {self.prompt_column: prompts[i]}
                        for i in range(len(keys))]
            extra = dict(
                environments=build_environments(self.environment, env_rows,
                                                [sample_seed(self.seed, slot, f"{key}.env") for key in keys],
                                                self.pool),
                messages=[list(p) if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts],
                pool=self.pool, env_names=[self.env_name] * len(keys))
            key_of = lambda i, t: sample_seed(self.seed, slot, f"{keys[i]}.{t}")  # noqa: E731
        else:
            key_of = lambda i, t: sample_seed(self.seed, slot, keys[i])  # noqa: E731
        conversations = run_episodes(self.engine, self.tokenizer, prompt_ids, settings, sample_key=key_of, **extra)
        episodes = as_episodes(conversations, settings.sampling.max_new_tokens, settings.sampling.pad_id, multi_turn)
        if multi_turn:
            episodes.error_texts = [None if c.error is None else f"{c.error} (episode of prompt {_short_prompt(p)})"
                                    for c, p in zip(conversations, prompts)]
        lengths = episodes.completion_mask.sum(1).long().tolist()
        completion_ids = [episodes.completion_ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        per_fn = {}
        if self.reward_fns and len(rows):  # with an environment, the reward functions are optional
            scored = compute_rewards(self.reward_fns, prompts=prompts, completions=completions,
                                     completion_ids=completion_ids, columns=columns)
            per_fn = {name: torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
                      for name, values in scored.per_function.items()}
        elif self.reward_fns:  # no episodes on this process: a sharded reward model joins the others' forwards
            for func in self.reward_fns:
                if isinstance(func.fn, RewardModel) and func.fn.model is not None:
                    func.fn(prompts=[], completions=[])
        if multi_turn:  # the environment's reward, beside the reward functions' (weight 1)
            per_fn["env"] = episodes.env_reward
        return Made(prompt_ids, episodes, completions, per_fn, time.perf_counter() - t0)


class DynamicSamplingError(RuntimeError):
    """rollout.dynamic_sampling ran out of rounds with too few informative groups, and on_sampling_cap=error."""


@dataclass
class Chosen:
    """A rollout's episodes after dynamic sampling: this process's share of the chosen groups."""

    made: Made
    group_prompts: list
    """The chosen groups' prompts (for samples.jsonl)."""
    stats: dict
    """sampling/rounds, groups/generated, groups/kept, groups/filled, groups/dropped."""


def dynamic_sampling(producer: Producer, r: int, indices: Sequence[int], episodes: range, first: Made, *,
                     prompts_per_rollout: int, k: int, max_rounds: int, on_cap: str,
                     gather: Callable) -> Chosen:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2, eq. 11's constraint 0 < |{correct}| < G): keep the groups
    whose k raw weighted rewards are not all equal, drawing rounds of P more prompts (a keyed draw per
    (rollout, round), apart from the prompt stream) until P such groups exist or `max_rounds` is reached; then
    `on_cap` fills the rest with equal-reward groups (first generated first) or stops. Every round is gathered
    (`gather`: a per-process tensor -> the concatenation over processes), so every process makes the same
    choice; the rollout holds the chosen groups in (round, group) order and this process gets its usual share.
    `first` is round 0 (the rollout's own prompts `indices`); `episodes` are this process's global episode ids."""
    P, R = prompts_per_rollout, prompts_per_rollout * k
    names = list(first.per_fn)
    rounds, kept, spare = [], [], []
    reward_s = 0.0
    made, round_indices = first, list(indices)
    for q in range(max_rounds):
        if q > 0:  # a keyed draw of P prompts: the same on every process and on resume
            generator = torch.Generator().manual_seed(sample_seed(producer.seed, r, -q))
            round_indices = torch.randperm(len(producer.dataset), generator=generator)[:P].tolist()
            made = producer.round(r, [q * R + e for e in episodes], [round_indices[e // k] for e in episodes])
        reward_s += made.reward_s
        ep = made.episodes
        every = {"ids": gather(ep.completion_ids), "mask": gather(ep.completion_mask),
                 "truncated": gather(ep.truncated), "logprobs": gather(ep.logprobs),
                 "per_fn": {n: gather(made.per_fn[n].float()) for n in names}, "indices": round_indices}
        rounds.append(every)
        # raw: before `normalize`; in float32, as the learner sums them
        groups = weighted_sum(producer.reward_fns, every["per_fn"], every["per_fn"].get("env")).view(P, k)
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
    rows = [rounds[q] for q, _ in chosen]
    mine = slice(episodes.start, episodes.stop)

    def take(of):
        return torch.cat([of(rd)[p * k:(p + 1) * k] for rd, (_, p) in zip(rows, chosen)])[mine]

    selected = Episodes(take(lambda rd: rd["ids"]), take(lambda rd: rd["mask"]), take(lambda rd: rd["truncated"]),
                        take(lambda rd: rd["logprobs"]))
    per_fn = {n: take(lambda rd, n=n: rd["per_fn"][n]) for n in names}
    prompt_ids = [producer.prompt_ids[rounds[chosen[e // k][0]]["indices"][chosen[e // k][1]]] for e in episodes]
    prompts = [producer.dataset[rounds[q]["indices"][p]][producer.prompt_column] for q, p in chosen]
    generated = P * len(rounds)
    stats = {"sampling/rounds": len(rounds), "groups/generated": generated, "groups/kept": P - filled,
             "groups/filled": filled, "groups/dropped": generated - P}
    return Chosen(Made(prompt_ids, selected, None, per_fn, reward_s), prompts, stats)


def _short_prompt(prompt, limit: int = 60) -> str:
    """A prompt in an error line: its text (a chat prompt: its last message), cut."""
    text = prompt if isinstance(prompt, str) else str((prompt or [{}])[-1].get("content", ""))
    return repr(text if len(text) <= limit else text[:limit] + "...")
