"""One optimizer step of the on-policy RL learner (DESIGN §3 step 5): a global mini-batch of a rollout's
episodes, this process's share in micro-batches of m with gradient accumulation, the loss normalised over the
whole mini-batch (so m and the number of processes never change the gradient), then one optimizer and one
LR-scheduler step for the policy (and PPO's critic).

What differs between algorithms comes from the algorithm table (`algorithms.table`): the policy loss, where the
KL goes, whether a critic learns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from tidyrl import liveness
from tidyrl.algorithms.kl import kl_per_token
from tidyrl.algorithms.losses import aggregate_loss, loss_normaliser, policy_loss
from tidyrl.algorithms.ppo import clipped_value_loss
from tidyrl.loops.run.exact_sums import exact_accumulator, global_micro_batches
from tidyrl.models.collectives import Sums, reduce_max, reduce_sum
from tidyrl.loops.run.steps import apply_update, no_sync
from tidyrl.models.devices import phase_done, to_device
from tidyrl.models.forward import completion_logprobs, completion_values
from tidyrl.models.routing import add_aux_loss, replaying
from tidyrl.rollouts.record import Rollout, chunks
from tidyrl.rollouts.scoring import ROUTING_SUMS, correction_metrics, model_tokens

SUMS = ("loss", "kl_x_tokens", "entropy_x_tokens", "clipped_tokens", "tokens", "value_loss", "value_clipped_tokens",
        "mismatch_abs", "mismatch_capped", "mismatch_masked", "mismatch_sequences", "mismatch_masked_sequences",
        "aux_loss", *ROUTING_SUMS)
"""What a step sums over its micro-batches and processes, for its metrics."""


@dataclass
class Trainee:
    """What the updates change: the policy (and PPO's critic), each with its optimizer and LR schedule."""

    model: Any
    optimizer: Any
    scheduler: Any
    critic: Any = None
    critic_optimizer: Any = None
    critic_scheduler: Any = None


@dataclass(frozen=True)
class UpdateSettings:
    """How a step computes its loss: the algorithm's options and table entry, resolved once per run."""

    options: Any
    """The algorithm's config section (clip_eps, kl_coef, loss_aggregation, ...)."""
    policy_loss: str
    kl_in_loss: bool
    correction: Any
    """`rollouts.scoring.Correction`: where the sampler/trainer mismatch is corrected, and its cap."""
    temperature: float
    max_new_tokens: int
    fast_path: bool
    sync_each_microbatch: bool
    max_grad_norm: float
    exact_gradients: bool = False
    routing_replay: bool = True
    """rollout.routing_replay: a mixture of experts' recorded routes replayed in the forward (else compared)."""
    router_aux_loss_coef: float = 0.0
    """train.router_aux_loss_coef as the policy resolves it (`models.routing.aux_loss_coef`)."""

    @classmethod
    def of_run(cls, cfg, options, spec, correction, router_aux_loss_coef: float = 0.0) -> "UpdateSettings":
        """A run's settings: its config, the algorithm's config section (`options`) and table entry (`spec`),
        where the mismatch is corrected (`correction`), and the policy's load-balancing weight."""
        ro, train = cfg.rollout, cfg.train
        return cls(options=options, policy_loss=options.policy_loss or spec.policy_loss,
                   kl_in_loss=spec.kl_in == "loss", correction=correction, temperature=ro.temperature, max_new_tokens=ro.max_new_tokens,
                   # (exact sums: the policy is marked by models.forward.exact_forward, which turns its fast paths off)
                   fast_path=cfg.model_fast_paths, sync_each_microbatch=train.sync_each_microbatch,
                   max_grad_norm=train.max_grad_norm, exact_gradients=train.exact_gradients,
                   routing_replay=ro.routing_replay, router_aux_loss_coef=router_aux_loss_coef)


def loss_mask(completion_mask, truncated, action_mask, mask_truncated: bool):
    """The tokens the loss (and its normaliser, KL and entropy metrics) covers: every completion token the model
    sampled (multi-turn: not the environment's, `action_mask`), and with mask_truncated (DAPO's overlong
    filtering) only those of completions that ended with EOS."""
    mask = completion_mask if action_mask is None else completion_mask * action_mask.to(completion_mask.dtype)
    if not mask_truncated:
        return mask
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]


def optimizer_step(rollout: Rollout, minibatch, step: int, *, trainee: Trainee, settings: UpdateSettings, plan,
                   accelerator, out) -> tuple[dict, Optional[torch.Tensor]]:
    """One optimizer step over a global mini-batch of episode indices. Returns the step's metrics and, in the
    rollout's first step when it takes its importance weights from its own forward (and more steps follow), the
    trainer's log-probs (R, Tc) that its forwards computed, which the later epochs read (`weights_for_later_epochs`,
    the learner's next step); else None."""
    models = [trainee.model] if trainee.critic is None else [trainee.model, trainee.critic]
    for m in models:
        m.train()
    t0 = time.perf_counter()
    o = settings.options
    # Normaliser of the whole global mini-batch (every process holds the global rollout, so no all-reduce).
    mb_mask = loss_mask(rollout.completion_mask[minibatch], rollout.truncated[minibatch],
                        None if rollout.action_mask is None else rollout.action_mask[minibatch], o.mask_truncated)
    normaliser = loss_normaliser(o.loss_aggregation, num_tokens=float(mb_mask.sum()), num_sequences=len(minibatch),
                                 max_new_tokens=settings.max_new_tokens)
    per_proc = plan.episodes_per_minibatch_per_process
    rank = accelerator.process_index
    mine = minibatch[rank * per_proc: (rank + 1) * per_proc].tolist()
    # Samples of one prompt side by side, so a micro-batch runs each shared prompt once (models/forward.py). The
    # split into micro-batches changes only the summation order: the normaliser is the mini-batch's.
    mine.sort(key=lambda e: e // plan.samples_per_prompt)
    micro_batches = list(chunks(mine, plan.micro_batch_size))
    exact = None
    if settings.exact_gradients:  # the micro-batches of the whole mini-batch first, then shared out (exact_sums)
        everything = sorted(minibatch.tolist(), key=lambda e: e // plan.samples_per_prompt)
        micro_batches = global_micro_batches(everything, plan.micro_batch_size, rank, accelerator.num_processes)
        exact = exact_accumulator(models)
    assert len(micro_batches) == plan.gradient_accumulation_steps
    sums = Sums(*SUMS)
    # The rollout's first step takes the importance weights from its own forward (rollouts.scoring.Correction).
    in_update_weights = settings.correction.where == "update" and rollout.is_weights is None
    # Later epochs need the trainer's log-probs at sampling time (their old log-probs and weights): this step's
    # forwards compute them, for this process's episodes (kept on the device until the step's end).
    device = accelerator.device
    trainer_logprobs = torch.zeros(rollout.completion_ids.shape, device=device) \
        if in_update_weights and plan.optimizer_steps_per_rollout > 1 else None
    peak = torch.zeros(())
    for i, idx in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = exact.micro_batch_sync(last) if exact is not None else settings.sync_each_microbatch or last
        shapes = (f"micro-batch {i + 1} of {len(micro_batches)} of optimizer step {step}: {len(idx)} episodes of up "
                  f"to {rollout.prompt_ids.shape[1]} prompt + {rollout.completion_ids.shape[1]} completion tokens")
        # (the last micro-batch synchronises, DESIGN §2)
        with liveness.working("update", shapes), no_sync(accelerator, models, sync):
            peak = _micro_batch(rollout, idx, step, normaliser, trainee, settings, accelerator, sums, peak,
                                trainer_logprobs, in_update_weights, share=len(idx) / len(minibatch))
        if exact is not None:  # this micro-batch's gradient onto the grid (no floating-point sum across them)
            exact.add()
        liveness.mark(f"micro-batch {i + 1} of {len(micro_batches)} of optimizer step {step}")
    if exact is not None:  # the integer sums over every process, as the gradients
        exact.reduce(accelerator)
    sums = sums.reduced(accelerator)
    if trainer_logprobs is not None:  # every episode was in this step, on one process each: a sum gathers them
        trainer_logprobs = reduce_sum(accelerator, trainer_logprobs).cpu()
    return _step_and_metrics(sums, step, trainee, settings, accelerator, out, t0, in_update_weights, peak,
                             rollout.ref_logprobs is not None), trainer_logprobs


def _micro_batch(rollout, idx, step, normaliser, trainee, settings, accelerator, sums, peak, trainer_logprobs,
                 in_update_weights, share: float = 1.0):
    """Forward and backward of one micro-batch (episodes `idx`, `share` of the global mini-batch); adds its metric
    sums. Returns the running peak of the sampler/trainer log-prob gap."""
    o, device, model, critic = settings.options, accelerator.device, trainee.model, trainee.critic
    # The micro-batch stays on the host (where its padding is trimmed and its shared prompts found); each tensor
    # the step reads goes to the device without a synchronisation (tidyrl.models.devices).
    part = rollout.select(idx)
    mask = to_device(loss_mask(part.completion_mask, part.truncated, part.action_mask, o.mask_truncated), device)
    aux = settings.router_aux_loss_coef > 0
    with replaying(model, part.routes, settings.routing_replay, keep_logits=aux) as routing:
        logprobs, entropy = completion_logprobs(model, *part.sequences, settings.temperature, with_entropy=True,
                                                fast_path=settings.fast_path, routing=routing)
        if routing is not None and aux:  # over the inputs of the scored predictions, whatever the layout
            add_aux_loss(routing, routing.weights(aux_tokens(part)))
    if routing is not None and part.routes is not None:
        changed, decisions = routing.changed_decisions()
        sums.add(routes_changed=changed, route_decisions=decisions)
    # The ratio's old log-probs are the trainer's at sampling time. With one step per rollout that is this very
    # forward (the weights have not moved), also where old_logprobs holds the sampler's for a KL in the reward:
    # against those the ratio would count the sampler/trainer mismatch that the importance weights below already
    # correct, a second time, and clip on it.
    old = logprobs.detach() if part.old_logprobs is None or in_update_weights else to_device(part.old_logprobs, device)
    adv = to_device(part.advantages, device)
    token_loss, clipped = policy_loss(settings.policy_loss, logprobs, old, adv, mask, o.clip_eps, o.clip_eps_high)
    if part.is_weights is not None:  # truncated importance sampling: the sampler was not the trainer
        token_loss = token_loss * to_device(part.is_weights, device).to(token_loss.dtype)
    elif in_update_weights:  # the same, its weights from this forward
        w = settings.correction.weights(logprobs.detach(), to_device(part.sampled_logprobs, device), mask)
        token_loss = token_loss * w.weights
        sums.add(mismatch_abs=w.delta.abs().sum(), mismatch_capped=w.clipped.sum(), mismatch_masked=w.masked.sum(),
                 mismatch_sequences=len(idx), mismatch_masked_sequences=w.masked_sequences.sum())
        peak = torch.maximum(w.delta.abs().max(), torch.as_tensor(peak))
        if trainer_logprobs is not None:  # (index_copy_ with a device index: a list index would sync)
            trainer_logprobs[:, : logprobs.shape[1]].index_copy_(
                0, to_device(torch.as_tensor(idx), device), logprobs.detach().float() * to_device(part.completion_mask,
                                                                                                   device))
    kl = None
    if part.ref_logprobs is not None:
        # At step 1 the policy is the reference: its own log-probs are the reference's exactly, while the scored
        # ones differ by rounding, whose KL gradient AdamW would turn into full steps where a group's advantages
        # tie at 0. k2/k3 and their gradients are then exactly 0; k1 keeps its gradient (that of log pi).
        ref = logprobs.detach() if step == 1 else to_device(part.ref_logprobs, device)
        kl = kl_per_token(logprobs, ref, o.kl_estimator)
        if settings.kl_in_loss:  # e.g. GRPO: the KL a term of the loss (Shao et al. 2024, eq. 3)
            token_loss = token_loss + o.kl_coef * kl
    loss = aggregate_loss(token_loss, mask, o.loss_aggregation, normaliser)
    if routing is not None and routing.aux:  # the load-balancing loss, this micro-batch's share of the mini-batch's
        aux_loss = sum(routing.aux) * share
        loss = loss + settings.router_aux_loss_coef * aux_loss
        sums.add(aux_loss=aux_loss.detach())
    value_loss, value_clipped = torch.zeros(()), torch.zeros_like(mask)
    if critic is not None:  # PPO: the clipped value loss on the GAE returns, same normaliser
        values = completion_values(critic, *part.sequences)
        value_BT, value_clipped = clipped_value_loss(values, to_device(part.old_values, device),
                                                     to_device(part.returns, device), o.value_clip)
        value_loss = aggregate_loss(value_BT, mask, o.loss_aggregation, normaliser)
        loss = loss + o.vf_coef * value_loss
    # DDP averages gradients over W processes; our loss is already this process's share of the global mean, so
    # scale by W to make the synchronised gradient the global one. Exact sums add the processes' gradients
    # themselves: no scale.
    accelerator.backward(loss if settings.exact_gradients else loss * accelerator.num_processes)
    with torch.no_grad():
        sums.add(loss=loss, kl_x_tokens=(kl * mask).sum() if kl is not None else 0.0,
                 entropy_x_tokens=(entropy * mask).sum(), clipped_tokens=(clipped.float() * mask).sum(),
                 tokens=mask.sum(), value_loss=value_loss, value_clipped_tokens=(value_clipped.float() * mask).sum())
    return peak


def aux_tokens(part: Rollout) -> torch.Tensor:
    """The positions of [prompt, completion] (R, Lp + Tc) a load-balancing loss covers: the inputs of the scored
    predictions, every real prompt token and every completion token but each row's last (which predicts nothing,
    and which the lean pass never runs)."""
    completion = part.completion_mask > 0
    last = completion & ~F.pad(completion[:, 1:], (0, 1), value=False)
    return torch.cat([part.prompt_mask > 0, completion & ~last], dim=1)


def _step_and_metrics(sums: dict, step, trainee, settings, accelerator, out, t0, in_update_weights, peak,
                      with_kl: bool) -> dict:
    """The optimizer and scheduler steps (the critic's too), and the step's metrics."""
    parts = [(trainee.model, trainee.optimizer, trainee.scheduler)]
    if trainee.critic is not None:  # the critic's own optimizer and schedule, also stepped once per optimizer step
        parts.append((trainee.critic, trainee.critic_optimizer, trainee.critic_scheduler))
    updates = apply_update(accelerator, parts, settings.max_grad_norm, step, sums["loss"], out,
                           "Lower train.learning_rate, check the rewards' scale, or set train.max_grad_norm.",
                           exact=settings.exact_gradients)
    (lr, grad_norm) = updates[0]
    phase_done(accelerator.device)  # the optimizer step's kernels are the update's time (docs/benchmarks.md)
    tokens = max(sums["tokens"], 1.0)
    metrics = {
        "lr": lr,
        "loss": sums["loss"],
        "kl": sums["kl_x_tokens"] / tokens if with_kl else None,
        "entropy": sums["entropy_x_tokens"] / tokens,
        "clip_fraction": sums["clipped_tokens"] / tokens,
        "grad_norm": grad_norm,
        "time/update_s": time.perf_counter() - t0,
    }
    if in_update_weights:  # truncated importance sampling inside the update (the rollout's first step)
        metrics.update({"mismatch/logprob_abs_mean": sums["mismatch_abs"] / tokens,
                        "mismatch/logprob_abs_max": reduce_max(accelerator, float(peak)),
                        **correction_metrics({"tokens": tokens, "capped": sums["mismatch_capped"],
                                              "masked": sums["mismatch_masked"],
                                              "sequences": sums["mismatch_sequences"],
                                              "masked_sequences": sums["mismatch_masked_sequences"]},
                                             settings.correction.mode)})
    if settings.router_aux_loss_coef > 0:
        metrics["moe/aux_loss"] = sums["aux_loss"]
    if sums["route_decisions"]:  # a mixture of experts' recorded routes: the trainer's own router's other choices
        metrics["routing/update_changed_fraction"] = sums["routes_changed"] / sums["route_decisions"]
    if trainee.critic is not None:
        metrics["critic_lr"] = updates[1][0]
        metrics.update({"value_loss": sums["value_loss"], "value_clip_fraction": sums["value_clipped_tokens"] / tokens,
                        "critic_grad_norm": updates[1][1], "time/update_s": time.perf_counter() - t0})
    return metrics


def weights_for_later_epochs(rollout: Rollout, trainer_logprobs, correction) -> Rollout:
    """After the rollout's first step took its importance weights from its own forward: the trainer's log-probs
    of that forward (`optimizer_step`'s second value) become the old log-probs of the later epochs, and their
    weights (`correction`'s: `rollouts.scoring.Correction.weights`) are kept (as a separate scoring pass would have
    computed them, with one more forward). Saved with the rollout in a checkpoint, so a resume continues with
    them."""
    weights = correction.weights(trainer_logprobs, rollout.sampled_logprobs, model_tokens(rollout)).weights
    return replace(rollout, is_weights=weights, old_logprobs=trainer_logprobs)


def minibatch(plan, seed: int, r: int, j: int):
    """The global episodes of step j (0-based) of rollout r: mini-batch j % M of a fresh shuffle of the R episodes
    for each pass, keyed by (seed, rollout, pass); the same on every process, whatever W is."""
    from tidyrl.models.sequences import sample_seed

    epoch, mb = divmod(j, plan.minibatches_per_epoch)
    gen = torch.Generator().manual_seed(sample_seed(seed, r, -1 - epoch))
    size = plan.episodes_per_minibatch
    return torch.randperm(plan.episodes_per_rollout, generator=gen)[mb * size: (mb + 1) * size]


def prepare_critic(trainee: Trainee, path: str, cfg, plan, accelerator) -> None:
    """PPO's critic loaded from `path` and prepared for training beside the policy: its own learning rate
    (critic.learning_rate, default the policy's) and schedule (critic.lr_scheduler), on the policy's step count and
    warm-up."""
    from tidyrl.loops.run.setup import prepare_for_training, weights_device
    from tidyrl.models.loading import load_critic

    train = replace(cfg.train, learning_rate=cfg.critic.learning_rate if cfg.critic.learning_rate is not None
                    else cfg.train.learning_rate)
    trainee.critic, trainee.critic_optimizer, trainee.critic_scheduler = prepare_for_training(
        accelerator, load_critic(path, cfg.model_dtype, weights_device(accelerator), kernels=cfg.kernels), train, plan,
        cfg.critic.lr_scheduler)
