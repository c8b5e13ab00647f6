"""The `Rollout` record (DESIGN §3): one rollout's episodes and everything computed about them, from the producer
to the learner, one type all the way:

    rollouts.producer    the episodes: prompts, completions, the engine's log-probs, rewards (+ the environment's)
    rollouts.making      the rollout: the version of the weights that made it, its prompts, its making's metrics
    rollouts.scoring     the scores of the learner's models when it takes it: old, reference, teacher log-probs,
                         values, importance weights
    the learner          advantages and returns (loops.rl.advantages)

Each field says what it is per: an episode (one row per episode; a token field also one column per completion
token, a prompt field one per prompt token, left-padded), or the whole rollout. `select`, `rows`, `joined` and
`gathered` follow those kinds, so a new field is one line here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Optional, Sequence

import torch

PROMPT, TOKEN, EPISODE, ROLLOUT = "prompt", "token", "episode", "rollout"


def _per(kind: str, default=None, factory=None):
    if factory is not None:
        return field(default_factory=factory, metadata={"per": kind})
    return field(default=default, metadata={"per": kind})


@dataclass
class Rollout:
    """One rollout's episodes, R of them (per process: its share), prompt-major: episode p*k + j is sample j of
    prompt p. Shapes: R episodes, Lp = longest prompt, Tc = longest completion (the token budget until
    `select` trims it)."""

    # ---- the episodes (rollouts.producer)
    prompt_ids: torch.Tensor = _per(PROMPT)  # (R, Lp) long, left-padded
    prompt_mask: torch.Tensor = _per(PROMPT)  # (R, Lp) long, 1 = real token
    completion_ids: torch.Tensor = _per(TOKEN)  # (R, Tc) long, right-padded; model and environment tokens
    completion_mask: torch.Tensor = _per(TOKEN)  # (R, Tc) float, 1 up to and including EOS
    truncated: torch.Tensor = _per(EPISODE)  # (R,) bool, reached the token budget before its end
    sampled_logprobs: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) the engine's log-prob of each token it
    # sampled (the behaviour log-probs; 0 elsewhere)
    action_mask: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) multi-turn: 1 = the model's token, 0 = the env's
    rewards: dict = _per(EPISODE, factory=dict)  # name -> (R,) raw scores of each reward function, NaN = none;
    # "env": the environment's. The one record of the rewards (their weighted sum: rewards.functions.weighted_sum)
    completions: Optional[list] = _per(EPISODE)  # R texts, decoded without special tokens (what rewards read);
    # None once groups were chosen from several rounds (rollout.dynamic_sampling)
    turns: Optional[torch.Tensor] = _per(EPISODE)  # (R,) float multi-turn: the model's turns
    env_errors: Optional[torch.Tensor] = _per(EPISODE)  # (R,) float multi-turn: 1 = ended on an environment error
    error_texts: Optional[list] = _per(EPISODE)  # R texts or None: each episode's environment error
    close_errors: Optional[list] = _per(EPISODE)  # R texts or None: what its environment's close() raised
    segments: Optional[torch.Tensor] = _per(EPISODE)  # (R,) float an agent's episodes: segments (rollouts.agents)
    prompt_routes: Optional[torch.Tensor] = _per(PROMPT)  # (R, Lp, MoE layers, k) int16 a mixture of experts'
    # routes in the sampler's prefill (models.routing), -1 = none; None unless routing replay records them
    completion_routes: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc, MoE layers, k) int16 the routes of each
    # token when the sampler fed it back (the last one never was: -1)

    # ---- the rollout (rollouts.making)
    version: int = _per(ROLLOUT, 0)  # the weights that made it: the learner's after `version` rollouts' updates
    prompts: list = _per(ROLLOUT, factory=list)  # the P group prompts (as the data set holds them)
    info: dict = _per(ROLLOUT, factory=dict)  # its making's metrics: time/generate_s, time/reward_s, sampling/...

    # ---- the learner's models' scores (rollouts.scoring)
    old_logprobs: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) the policy before the updates; None when unread
    ref_logprobs: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) frozen reference; None when no KL term
    teacher_logprobs: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) on-policy distillation: the teacher's
    old_values: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) PPO: the critic's values before the updates
    is_weights: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) truncated importance weights min(pi_trainer /
    # pi_sampler, cap); None where none are taken, or until the update takes them (rollouts.scoring.Correction)

    # ---- the learner's (loops.rl.advantages)
    advantages: Optional[torch.Tensor] = _per(TOKEN)  # (R,) or (R, Tc)
    returns: Optional[torch.Tensor] = _per(TOKEN)  # (R, Tc) PPO: GAE returns, the critic's targets

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask): what the model's forward takes
        (`models.forward.completion_logprobs(model, *batch.sequences, ...)`)."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    @property
    def routes(self) -> Optional[torch.Tensor]:
        """A mixture of experts' routes over the rows [prompt, completion] (R, Lp + Tc, MoE layers, k), what the
        training forwards replay (`models.routing.replaying`); None where none were recorded."""
        if self.prompt_routes is None or self.completion_routes is None:
            return None
        return torch.cat([self.prompt_routes, self.completion_routes], dim=1)

    @property
    def completion_lengths(self) -> list[int]:
        return self.completion_mask.sum(1).long().tolist()

    def select(self, idx: Sequence[int] | torch.Tensor) -> "Rollout":
        """The episodes `idx`, with padding columns that none of them use trimmed away."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        pm = self.prompt_mask[idx]
        cm = self.completion_mask[idx]
        first = int((pm.sum(0) > 0).nonzero()[0]) if pm.numel() else 0  # left padding shared by all
        width = max(int(cm.sum(1).max().item()) if cm.numel() else 0, 1)
        return self._each(lambda t: t[idx][:, first:], lambda t: t[idx][:, :width] if t.dim() >= 2 else t[idx],
                          lambda values: [values[i] for i in idx.tolist()])

    def rows(self, start: int, stop: int) -> "Rollout":
        """Episodes start .. stop - 1, every column kept (one process's share of the global episodes)."""
        return self._each(lambda t: t[start:stop], lambda t: t[start:stop], lambda values: values[start:stop])

    def _each(self, prompt, other, listed) -> "Rollout":
        """A copy with `prompt` applied to each prompt field, `other` to every other per-episode tensor (token
        fields and (R,) ones alike, also inside `rewards`) and `listed` to the per-episode lists."""
        def one(kind, value):
            if value is None or kind == ROLLOUT:
                return value
            if isinstance(value, dict):
                return {name: one(kind, v) for name, v in value.items()}
            if isinstance(value, list):
                return listed(value)
            return prompt(value) if kind == PROMPT else other(value)

        return replace(self, **{f.name: one(f.metadata["per"], getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def joined(cls, parts: Sequence["Rollout"], pad_id: int) -> "Rollout":
        """The episodes of `parts` one after the other (e.g. the processes' shares in rank order: the global
        rollout), padded to common widths (prompts on the left with `pad_id`, completions on the right); the
        rollout's own fields from the first part."""
        first = parts[0]

        def cat(name, kind, values):
            if kind == ROLLOUT:
                return values[0]
            if any(v is None for v in values):
                return None
            if isinstance(values[0], dict):
                return {n: cat(name, kind, [v[n] for v in values]) for n in values[0]}
            if isinstance(values[0], list):
                return [x for v in values for x in v]
            if values[0].dim() >= 2:
                width = max(v.shape[1] for v in values)
                values = [_padded(v, width, _filler(name, pad_id), left=kind == PROMPT) for v in values]
            return torch.cat(values)

        return replace(first, **{f.name: cat(f.name, f.metadata["per"], [getattr(p, f.name) for p in parts])
                                 for f in fields(cls)})

    def gathered(self, accelerator, pad_id: int) -> "Rollout":
        """Every process's share of the rollout, joined in rank order on every process (ids and masks are small;
        a collective: every process calls it): the global rollout, the same on any number of processes."""
        if accelerator.num_processes == 1:
            return self
        from accelerate.utils import gather_object

        def cat(name, kind, value):
            if kind == ROLLOUT or value is None:
                return value
            if isinstance(value, dict):
                return {n: cat(name, kind, v) for n, v in value.items()}
            if isinstance(value, list):
                return gather_object(list(value))
            t = value.to(accelerator.device)
            if t.dtype == torch.int16:  # (routes: gloo gathers no int16)
                t = t.int()
            if t.dim() >= 2:
                t = accelerator.pad_across_processes(t, dim=1, pad_index=_filler(name, pad_id),
                                                     pad_first=kind == PROMPT)
            return accelerator.gather(t).cpu().to(value.dtype)

        return replace(self, **{f.name: cat(f.name, f.metadata["per"], getattr(self, f.name)) for f in fields(self)})

    def to_dict(self) -> dict:
        """Tensors and plain values only (what a checkpoint's `weights_only` load reads back: `Rollout(**d)`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _filler(name: str, pad_id: int) -> int:
    """What pads a field to a common width: the pad id for token ids, -1 (none) for routes, 0 for masks and
    per-token values."""
    if name.endswith("_routes"):
        return -1
    return pad_id if name in ("prompt_ids", "completion_ids") else 0


def _padded(t: torch.Tensor, width: int, fill, left: bool) -> torch.Tensor:
    extra = width - t.shape[1]
    if extra == 0:
        return t
    pad = torch.full((t.shape[0], extra, *t.shape[2:]), fill, dtype=t.dtype)
    return torch.cat([pad, t] if left else [t, pad], dim=1)


def chunks(seq: Sequence[int], size: int) -> Iterator[list[int]]:
    seq = list(seq)
    for start in range(0, len(seq), size):
        yield seq[start: start + size]


def share(shares: Sequence[Rollout], rank: int, world: int, pad_id: int) -> Rollout:
    """Process `rank`'s share among `world` processes of a rollout made by len(shares) processes (their shares in
    rank order): a resume on another number of processes takes the rollouts made ahead this way."""
    if len(shares) == world:
        return shares[rank]
    whole = Rollout.joined(shares, pad_id)
    per = len(whole) // world
    return whole.rows(rank * per, (rank + 1) * per)
