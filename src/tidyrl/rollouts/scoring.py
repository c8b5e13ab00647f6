"""No-grad scoring of a rollout's episodes by the learner's models (DESIGN §3 step 3), one interface for all of
them (`Scorers`, `score_rollout`): the trainer's log-probs of what an engine sampled (where the run corrects the
mismatch: `Correction`), the reference's log-probs, the critic's values, a teacher's log-probs, chunk by chunk so
that at most one chunk's logits exist at a time. The forward passes are `tidyrl.models.forward`'s."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from tidyrl import liveness
from tidyrl.algorithms.corrections import DEFAULTS, MismatchWeights, mismatch_weights
from tidyrl.models.collectives import Sums, reduce_max
from tidyrl.models.devices import to_device
from tidyrl.models.forward import completion_logprobs, completion_values
from tidyrl.models.routing import replaying
from tidyrl.models.sharding import full_weights
from tidyrl.rollouts.record import Rollout, chunks


ROUTING_SUMS = ("routes_changed", "route_decisions")
"""What a forward that was given a mixture of experts' routes sums (`models.routing.Routing.changed_decisions`)."""


@torch.no_grad()
def score_logprobs(model, rollout: Rollout, temperature: float, chunk_size: int, fast_path: bool = True,
                   replay: bool = True, routing_sums: Optional[Sums] = None) -> torch.Tensor:
    """No-grad log-probs (R, Tc) of every completion token, in chunks of `chunk_size`, so that at most one
    chunk's (chunk, Tc, V) logits exist at a time. Positions past EOS are 0. The routes the rollout carries (a
    mixture of experts') are replayed, or with `replay` False only compared; `routing_sums` (ROUTING_SUMS) adds
    the decisions the model's own router would have changed."""
    out = None  # on the model's device: one copy to the host at the end, no synchronisation per chunk
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        with liveness.working("scoring", _shapes(part, idx, rollout)), \
                replaying(model, part.routes, replay) as routing:
            lp, _ = completion_logprobs(model, *part.sequences, temperature, fast_path=fast_path, routing=routing)
            if routing is not None and routing_sums is not None:
                changed, decisions = routing.changed_decisions()
                routing_sums.add(routes_changed=changed, route_decisions=decisions)
        if out is None:
            out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=lp.device)
        out[idx[0]: idx[-1] + 1, : lp.shape[1]] = lp.float() * to_device(part.completion_mask, lp.device)
        liveness.mark(f"scored episodes {idx[0] + 1}-{idx[-1] + 1} of {len(rollout)}")
    return out.cpu() if out is not None else torch.zeros(rollout.completion_ids.shape)


@torch.no_grad()
def score_values(critic, rollout: Rollout, chunk_size: int) -> torch.Tensor:
    """No-grad values (R, Tc) in chunks of `chunk_size`; positions past EOS are 0."""
    out = None  # as in score_logprobs: on the critic's device until the end
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        with liveness.working("scoring", _shapes(part, idx, rollout)):
            v = completion_values(critic, *part.sequences)
        if out is None:
            out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=v.device)
        out[idx[0]: idx[-1] + 1, : v.shape[1]] = v.float() * to_device(part.completion_mask, v.device)
        liveness.mark(f"valued episodes {idx[0] + 1}-{idx[-1] + 1} of {len(rollout)}")
    return out.cpu() if out is not None else torch.zeros(rollout.completion_ids.shape)


def _shapes(part: Rollout, idx, rollout: Rollout) -> str:
    """A scoring chunk's shapes, in words (`liveness.working`)."""
    return (f"episodes {idx[0] + 1}-{idx[-1] + 1} of {len(rollout)}: {len(part)} rows of "
            f"{part.prompt_ids.shape[1]} prompt + {part.completion_ids.shape[1]} completion tokens")


@dataclass(frozen=True)
class Correction:
    """Where the sampler/trainer mismatch is corrected (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"), decided once per run (`correction_of`) and read by the scoring, the
    update and the advantages alike.

    - "scoring": the trainer's log-probs of the sampled tokens are recomputed when the rollout is taken: they are
      the old log-probs of the PPO ratio, and with behaviour_logprobs=sampler (and a cap) each token's loss is also
      weighted by w = min(pi_trainer / pi_sampler, tis_cap);
    - "update": the sampler's log-probs are the old ones and the rollout's first optimizer step, which covers all of
      it (one mini-batch per epoch) with the weights that sampled, takes the weights from its own forward;
    - "none": the sampler's log-probs are the old ones, uncorrected (tis_cap 0)."""

    tis_cap: float
    behaviour: str
    """rollout.behaviour_logprobs: "sampler" or "trainer"."""
    where: str
    mode: str = "token_truncate"
    """rollout.correction: which ratio is tested and how (`algorithms.corrections.mismatch_weights`)."""
    low: Optional[float] = None
    """Its lower bound (rollout.correction_low, else the mode's default)."""

    def weights(self, trainer_BT, sampler_BT, mask_BT) -> MismatchWeights:
        """The per-token loss weights of this correction (`mismatch_weights`), tis_cap its upper bound."""
        return mismatch_weights(trainer_BT, sampler_BT, mask_BT, self.mode, self.tis_cap, self.low)

    @property
    def old_from_sampler(self) -> bool:
        """The rollout's old log-probs (those a KL in the reward reads) are the sampler's own."""
        return self.where != "scoring"


def correction_of(rollout_cfg, minibatches_per_epoch: int, default_tis_cap: float) -> Correction:
    """The run's `Correction`: rollout.tis_cap, or where unset the engine's default (`default_tis_cap`), at least 2.0
    with a lag (the weights that sampled are then older than the learner's)."""
    ro = rollout_cfg
    mode = getattr(ro, "correction", "token_truncate")
    cap = ro.tis_cap
    if cap is None:  # on where the sampler is not the trainer: token_truncate's 2.0 or the engine's, else the mode's
        on = default_tis_cap > 0 or ro.lag
        cap = (max(default_tis_cap, 2.0 if ro.lag else 0.0) if mode == "token_truncate" else DEFAULTS[mode][1]) \
            if on else 0.0
    low = getattr(ro, "correction_low", None)
    low = DEFAULTS[mode][0] if low is None else low
    if ro.behaviour_logprobs == "sampler" and (cap == 0 or minibatches_per_epoch == 1):
        return Correction(cap, ro.behaviour_logprobs, "update" if cap > 0 else "none", mode, low)
    return Correction(cap, ro.behaviour_logprobs, "scoring", mode, low)


@dataclass
class Scorers:
    """The learner's models that score a rollout when it takes it (DESIGN §6 "frozen models follow the policy"),
    each without gradients, in chunks: the trainer (`policy`: its log-probs where `Correction.where` is
    "scoring"), the KL reference (`reference`: a frozen model, or None with LoRA: the policy with its adapter off;
    read only with `use_reference`), PPO's critic, a teacher (on-policy distillation: a frozen model, one of another
    tokenizer, or a vLLM server). `keep_old`: whether the record keeps its old log-probs (read after the first
    optimizer step, by a KL in the reward, or by a teacher's advantages)."""

    policy: Any
    correction: Correction
    temperature: float
    chunk_size: int
    fast_path: bool
    keep_old: bool
    replay: bool = True
    """rollout.routing_replay: the routes a rollout carries are replayed (else only compared)."""
    use_reference: bool = False
    reference: Any = None
    critic: Any = None
    teacher: Any = None


def score_rollout(rollout: Rollout, scorers: Scorers, accelerator, prompts=None) -> Rollout:
    """This process's share of a rollout, scored by the learner's models (`Scorers`): the old log-probs and, where
    the sampler was not the trainer, the importance weights; the reference's log-probs, the critic's values, a
    teacher's log-probs (`prompts`: each episode's prompt, which a teacher of another tokenizer renders itself).
    Its `info` gains the mismatch's metrics (this process's tokens, summed over processes),
    time/teacher_s and time/score_s."""
    from tidyrl.models.lora import reference_of

    s, c = scorers, scorers.correction
    t0 = time.perf_counter()
    sampled = rollout.sampled_logprobs
    # The sampling pass computed the old log-probs with the same weights (no second forward pass; equal up to
    # rounding); they differ from the current ones only after the rollout's first optimizer step.
    old = sampled if s.keep_old else None
    is_weights, info = None, {}
    if c.where == "scoring":
        old, is_weights, info = behaviour_correction(s.policy, rollout, sampled, c, s.temperature, s.chunk_size,
                                                     s.fast_path, accelerator, s.replay)
    ref = values = None
    if s.use_reference:
        # The policy is gathered whole where it is the reference (LoRA, its adapter off); a frozen reference sharded
        # under FSDP2 gathers a layer at a time in each forward, as many on every process (equal shares, equal chunks).
        whole = full_weights(s.policy) if s.reference is None else contextlib.nullcontext()
        with whole, reference_of(s.policy, s.reference) as model:
            ref = score_logprobs(model, rollout, s.temperature, s.chunk_size, fast_path=s.fast_path, replay=s.replay)
    if s.critic is not None:
        s.critic.eval()
        with full_weights(s.critic):
            values = score_values(s.critic, rollout, s.chunk_size)
    teacher = None
    if s.teacher is not None:
        t1 = time.perf_counter()
        teacher = teacher_logprobs(s.teacher, rollout, s.temperature, s.chunk_size, s.fast_path, prompts, old)
        info["time/teacher_s"] = time.perf_counter() - t1
    info["time/score_s"] = time.perf_counter() - t0
    return replace(rollout, old_logprobs=old, ref_logprobs=ref, old_values=values, is_weights=is_weights,
                   teacher_logprobs=teacher, info={**rollout.info, **info})


def behaviour_correction(policy, rollout: Rollout, sampled_logprobs, correction: Correction, temperature: float,
                         chunk_size: int, fast_path: bool, accelerator, replay: bool = True) -> tuple[Any, Any, dict]:
    """The trainer's log-probs of the sampled tokens, recomputed by the policy's forward: the old log-probs of the
    PPO ratio, and with behaviour_logprobs=sampler (and a cap) the truncated importance weights
    w = min(pi_trainer / pi_sampler, tis_cap) (`Correction`). Returns (the old log-probs, the weights or None, the
    mismatch metrics: this process's tokens, summed over processes; with a mixture of experts' routes, the fraction
    of their decisions the trainer's own router would have changed)."""
    totals = Sums("abs", "tokens", "capped", "masked", "sequences", "masked_sequences", *ROUTING_SUMS)
    with full_weights(policy):
        trainer = score_logprobs(policy, rollout, temperature, chunk_size, fast_path=fast_path, replay=replay,
                                 routing_sums=totals)
    mask = model_tokens(rollout).bool()
    corrected = correction.tis_cap > 0
    w = correction.weights(trainer, sampled_logprobs, mask) if corrected else None
    delta = w.delta if corrected else torch.where(mask, trainer - sampled_logprobs, torch.zeros(()))
    is_weights = w.weights if correction.behaviour == "sampler" and corrected else None
    totals.add(abs=delta.abs().sum(), tokens=mask.sum())
    if is_weights is not None:
        totals.add(capped=w.clipped.sum(), masked=w.masked.sum(), sequences=len(mask),
                   masked_sequences=w.masked_sequences.sum())
    summed = totals.reduced(accelerator)
    peak = reduce_max(accelerator, float(delta.abs().max()) if delta.numel() else 0.0)
    tokens = max(summed["tokens"], 1.0)
    stats = {"mismatch/logprob_abs_mean": summed["abs"] / tokens, "mismatch/logprob_abs_max": peak}
    if is_weights is not None:
        stats.update(correction_metrics(summed, correction.mode))
    if summed["route_decisions"]:
        stats["routing/changed_fraction"] = summed["routes_changed"] / summed["route_decisions"]
    return trainer, is_weights, stats


def model_tokens(rollout: Rollout):
    """The model's own sampled tokens of a rollout's completions (R, Tc): not an environment's, which have no
    sampler log-prob (the tokens a mismatch correction tests, and an expert load counts)."""
    if rollout.action_mask is None:
        return rollout.completion_mask
    return rollout.completion_mask * rollout.action_mask.to(rollout.completion_mask.dtype)


def correction_metrics(summed: dict, mode: str) -> dict:
    """What a correction truncated or masked, from its sums (tokens, capped, masked, sequences, masked_sequences):
    mismatch/capped_fraction (of the tokens, the truncating modes), mismatch/masked_fraction (of the tokens) and
    mismatch/masked_sequence_fraction (of the sequences) for the masking ones."""
    tokens = max(summed["tokens"], 1.0)
    if mode.endswith("truncate"):
        return {"mismatch/capped_fraction": summed["capped"] / tokens}
    return {"mismatch/masked_fraction": summed["masked"] / tokens,
            "mismatch/masked_sequence_fraction": summed["masked_sequences"] / max(summed["sequences"], 1.0)}


def teacher_logprobs(teacher, rollout: Rollout, temperature: float, chunk_size: int, fast_path: bool, prompts=None,
                     student=None):
    """A teacher's log-probs (R, Tc) of the episodes' completion tokens, 0 past each completion: a local model
    scored as the KL reference is (no grad, in chunks, at the rollout's temperature); a teacher of another
    tokenizer (`rollouts.teacher.CrossTokenizerTeacher`: the episodes' `prompts` re-rendered for it, its values
    mapped onto the student's tokens by characters; `student`: the student's log-probs, for the tokens it has no
    value for); or a teacher served by vLLM (`engines.server.ServerScorer`:
    each episode's prompt and completion sent as one prompt, its log-probs read back at temperature 1)."""
    if isinstance(teacher, torch.nn.Module):  # (sharded under FSDP2: a layer gathered at a time, as the reference)
        return score_logprobs(teacher, rollout, temperature, chunk_size, fast_path=fast_path)
    lengths = rollout.completion_lengths
    completions = [rollout.completion_ids[i, :n].tolist() for i, n in enumerate(lengths)]
    if getattr(teacher, "renders_prompts", False):
        rows = teacher.logprobs(prompts, completions,
                                [student[i, :n].tolist() for i, n in enumerate(lengths)])
    else:
        prompts_ids = [rollout.prompt_ids[i][rollout.prompt_mask[i].bool()].tolist() for i in range(len(rollout))]
        rows = teacher.logprobs([p + c for p, c in zip(prompts_ids, completions)], [len(p) for p in prompts_ids])
    out = torch.zeros(rollout.completion_ids.shape)
    for i, row in enumerate(rows):
        out[i, : lengths[i]] = torch.tensor(row, dtype=torch.float32)
    return out
