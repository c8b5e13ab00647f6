"""Preference optimisation (`algorithm: dpo`: DPO sigmoid, IPO, robust DPO, SimPO, ORPO), explicit from top to bottom.

    tokenise the pairs: prompt + chosen, prompt + rejected, as a rollout would (prompt and completion apart,
    EOS appended); the completion tokens are the targets
    load the policy and, frozen, the reference: the same starting model (none for simpo and orpo)
    for each optimizer step (tidyrl.loops.offline.loop.OfflineRun.train, the loop every offline stage shares):
        the next train.batch_size pairs of the stream
        micro-batches of m pairs (2m sequences in one forward):
            reference sequence log-probs: read from the cache scored once before training (the reference is
            frozen, so a pair's reference log-prob never changes: 2N sequences scored once, not once per epoch)
            policy sequence log-probs -> the loss per pair, summed and divided by the pairs of the whole
            global batch (orpo's SFT term: by the chosen completions' tokens of the whole global batch) -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row          (PreferenceStage below)
    eval: the held-out pairs' loss, accuracy and margin (their reference log-probs cached too)
    final/: the policy, for the next stage
"""

from __future__ import annotations

from typing import Optional

from tidyrl.algorithms.choices import REFERENCE_FREE_LOSS_TYPES
from tidyrl.config import Config
from tidyrl.loops.run.setup import TrainResult, prepare_for_training, weights_device
from tidyrl.models.loading import load_causal_lm, load_model_config, load_policy, load_tokenizer
from tidyrl.models.lora import adapter_note, reference_of
from tidyrl.models.sharding import forward_calls, frozen_device, place_frozen


def sequence_logps_cache(accelerator, model, sequences, pad_id: int, chunk: int):
    """[N] sequence log-probs of `sequences` (their targets' summed log-probs) under a frozen `model`, float32
    on the CPU. Scored once, under no_grad, `chunk` sequences per forward; process r scores chunks r, r + W, ...
    and the rows are summed over processes (each row is non-zero on one process only, so the sum is exact).
    Deterministic, so a resumed run recomputes the same values."""
    import torch

    from tidyrl.algorithms.preference import sequence_logps
    from tidyrl.loops.offline.loop import pad_batch, target_logprobs
    from tidyrl.models.collectives import reduce_sum

    W, rank = accelerator.num_processes, accelerator.process_index
    cache = torch.zeros(len(sequences), dtype=torch.float64)
    mine = [start for c, start in enumerate(range(0, len(sequences), chunk)) if c % W == rank]
    # A sharded model's forward is a collective: a process with fewer chunks scores the first one again and drops it.
    calls = forward_calls(model, len(mine))
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for k in range(calls):
            start = mine[k] if k < len(mine) else 0
            part = sequences[start:start + chunk]
            logps = sequence_logps(*target_logprobs(model, pad_batch(part, pad_id, accelerator.device)))
            if k < len(mine):
                cache[start:start + len(part)] = logps.double().cpu()
    model.train(was_training)
    return reduce_sum(accelerator, cache).float()


def reference_logps_cache(accelerator, reference, pairs, pad_id: int, chunk: int):
    """[N, 2] sequence log-probs (chosen, rejected) of every pair under the frozen reference: `chunk` pairs
    (2 * chunk sequences, chosen first) per forward (sequence_logps_cache)."""
    order = []  # per chunk of pairs: its chosen sides, then its rejected sides
    for start in range(0, len(pairs), chunk):
        part = pairs[start:start + chunk]
        order += [p.chosen for p in part] + [p.rejected for p in part]
    flat = sequence_logps_cache(accelerator, reference, order, pad_id, 2 * chunk)
    cache = flat.new_zeros((len(pairs), 2))
    for start in range(0, len(pairs), chunk):
        b = min(chunk, len(pairs) - start)
        cache[start:start + b, 0], cache[start:start + b, 1] = flat[2 * start:2 * start + b], flat[2 * start + b:2 * start + 2 * b]
    return cache


def reference_cost(cfg, plan, num_eval: int) -> dict:
    """What the reference costs, for plan.json and `tidyrl plan`: DPO-style losses score every train and held-out
    pair's two sequences once before training (reference_logps_cache), in forward passes of up to
    2 * micro_batch_size sequences split over the processes; simpo and orpo load no reference. `plan`: the run's
    OfflinePlan (its num_examples are the training pairs); `num_eval`: the held-out pairs."""
    if cfg.dpo.loss_type in REFERENCE_FREE_LOSS_TYPES:
        return {"reference": "none (reference-free loss)"}
    m, num_pairs = cfg.train.micro_batch_size, plan.num_examples
    return {"reference": "scored once before training, cached",
            "reference_sequences": 2 * (num_pairs + num_eval),
            "reference_forward_passes": -(-num_pairs // m) + -(-num_eval // m)}


class PreferenceStage:
    """dpo.loss_type's loss on a micro-batch of pairs (tidyrl.algorithms.preference cites each paper), divided
    by the pairs of the whole global batch (ORPO's SFT term: by the chosen completions' tokens of the whole
    global batch), so micro-batch size and process count change nothing."""

    sums = ("loss", "correct", "reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected", "orpo_sft",
            "orpo_log_odds_ratio", "real_tokens", "token_cells")
    bar = ("rewards/accuracy",)
    eval_sums = ("loss", "correct", "reward_chosen", "reward_rejected", "orpo_nll", "orpo_tokens", "orpo_or")

    def __init__(self, model, pairs, held_out, ref_cache_N2, eval_ref_cache_N2, opts, pad_id: int, device,
                 batch_size: int, flat: bool):
        self.model, self.pairs, self.held_out = model, pairs, held_out
        self.ref_cache_N2, self.eval_ref_cache_N2 = ref_cache_N2, eval_ref_cache_N2
        self.opts, self.pad_id, self.device, self.batch_size, self.flat = opts, pad_id, device, batch_size, flat

    def length(self, i):  # chosen and rejected share the padded width
        return max(len(self.pairs[i].chosen.input_ids), len(self.pairs[i].rejected.input_ids))

    def begin_step(self, batch):
        # orpo's SFT term is a token mean over the chosen completions of the GLOBAL batch (the same count on
        # every process: the batch indices are global).
        self.chosen_tokens = max(1, sum(sum(self.pairs[i].chosen.target_mask) for i in batch))

    def _losses(self, pairs, ref_B2, chosen_tokens: int, num_pairs: int):
        """(the loss: the pairs' summed loss / `num_pairs` (ORPO's SFT term: / `chosen_tokens`), per-pair rewards
        chosen and rejected, policy log-probs (2b,), orpo's (SFT term, summed log odds ratio, summed odds-ratio
        loss), the sequences) of `pairs`; `ref_B2` their reference log-probs (None when reference-free)."""
        import torch

        from tidyrl.algorithms.preference import dpo_loss, orpo_odds_ratio_loss, sequence_logps, simpo_loss
        from tidyrl.models.devices import to_device
        from tidyrl.loops.offline.loop import batch_cells, pad_batch, target_logprobs

        opts, b = self.opts, len(pairs)
        sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]  # chosen first
        inputs = pad_batch(sequences, self.pad_id, self.device, flat=self.flat)
        logprobs_BT, mask_BT = target_logprobs(self.model, inputs)
        logps_2B = sequence_logps(logprobs_BT, mask_BT)  # (2b,)
        lengths_2B = mask_BT.sum(dim=-1)
        orpo = (torch.zeros(()), torch.zeros(()), torch.zeros(()))
        if opts.loss_type == "simpo":
            loss_B, reward_chosen_B, reward_rejected_B = simpo_loss(
                logps_2B[:b], logps_2B[b:], lengths_2B[:b], lengths_2B[b:], opts.beta, opts.simpo_gamma)
            loss = loss_B.sum() / num_pairs
        elif opts.loss_type == "orpo":
            mean_2B = logps_2B / lengths_2B.clamp(min=1)
            or_loss_B, log_odds_ratio_B = orpo_odds_ratio_loss(mean_2B[:b], mean_2B[b:])
            # Rewards for the metrics: the mean per-token log-probs (no reference to compare with).
            reward_chosen_B, reward_rejected_B = mean_2B[:b].detach(), mean_2B[b:].detach()
            sft = -logps_2B[:b].sum() / chosen_tokens
            loss = sft + opts.orpo_lambda * or_loss_B.sum() / num_pairs
            orpo = (sft.detach(), log_odds_ratio_B.detach().sum(), or_loss_B.detach().sum())
        else:
            ref = to_device(ref_B2, logps_2B.device)
            loss_B, reward_chosen_B, reward_rejected_B = dpo_loss(
                logps_2B[:b], logps_2B[b:], ref[:, 0], ref[:, 1],
                beta=opts.beta, loss_type=opts.loss_type, label_smoothing=opts.label_smoothing)
            loss = loss_B.sum() / num_pairs
        return (loss, reward_chosen_B.detach(), reward_rejected_B.detach(), logps_2B.detach(), orpo,
                (sum(len(s.input_ids) for s in sequences), batch_cells(inputs)))

    def micro_batch(self, idx):
        import torch

        ref = None if self.ref_cache_N2 is None else self.ref_cache_N2[torch.tensor(idx)]
        loss, chosen_B, rejected_B, logps_2B, orpo, (real, cells) = self._losses(
            [self.pairs[i] for i in idx], ref, self.chosen_tokens, self.batch_size)
        b = len(idx)
        return loss, {"loss": loss.detach(), "correct": (chosen_B > rejected_B).sum(),
                      "reward_chosen": chosen_B.sum(), "reward_rejected": rejected_B.sum(),
                      "logp_chosen": logps_2B[:b].sum(), "logp_rejected": logps_2B[b:].sum(),
                      "orpo_sft": orpo[0], "orpo_log_odds_ratio": orpo[1], "real_tokens": real, "token_cells": cells}

    def metrics(self, sums, batch):
        n = len(batch)
        extra = {}
        if self.opts.loss_type == "orpo":
            extra = {"orpo/sft_loss": sums["orpo_sft"], "orpo/log_odds_ratio": sums["orpo_log_odds_ratio"] / n}
        return {
            # Implicit rewards beta * log(pi / pi_ref) (Rafailov et al. 2023, §5), before this step's update.
            "rewards/accuracy": sums["correct"] / n,
            "rewards/margin": (sums["reward_chosen"] - sums["reward_rejected"]) / n,
            "rewards/chosen": sums["reward_chosen"] / n,
            "rewards/rejected": sums["reward_rejected"] / n,
            "logps/chosen": sums["logp_chosen"] / n,  # mean sequence log-prob under the policy
            "logps/rejected": sums["logp_rejected"] / n,
            **extra,
        }

    def evaluate(self, idx):
        import torch

        pairs = [self.held_out[i] for i in idx]
        ref = None if self.eval_ref_cache_N2 is None else self.eval_ref_cache_N2[torch.tensor(idx)]
        tokens = sum(sum(p.chosen.target_mask) for p in pairs)
        # Sums over the held-out pairs (num_pairs=1, ORPO's SFT term per token: x tokens), divided in eval_metrics.
        loss, chosen_B, rejected_B, _, orpo, _ = self._losses(pairs, ref, 1, 1)
        return {"loss": loss, "correct": (chosen_B > rejected_B).sum(), "reward_chosen": chosen_B.sum(),
                "reward_rejected": rejected_B.sum(), "orpo_nll": orpo[0], "orpo_tokens": tokens, "orpo_or": orpo[2]}

    def eval_metrics(self, sums, n):
        loss = sums["loss"] / n
        if self.opts.loss_type == "orpo":  # the training loss's form over the whole held-out set
            loss = sums["orpo_nll"] / max(sums["orpo_tokens"], 1) + self.opts.orpo_lambda * sums["orpo_or"] / n
        return {"eval/loss": loss, "eval/accuracy": sums["correct"] / n,
                "eval/margin": (sums["reward_chosen"] - sums["reward_rejected"]) / n}


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with a preference loss (dpo.loss_type) from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.loops.offline.loop import OfflineRun, choose_padding_free, model_pad_id
    from tidyrl.data.offline import (check_distinct_pairs, completion_eos_ids, load_preference_pairs, pair_key,
                                     split_train_eval)
    from tidyrl.memory.offline import check_offline_memory, memory_header
    from tidyrl.plan import offline_plan_from_config

    run = OfflineRun(cfg)  # a bad resume_from fails here, before anything loads
    W, opts = run.world_size, cfg.dpo

    # 1. Everything checkable before the models: tokenizer, data, eval split, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    pairs, notes = load_preference_pairs(cfg, tokenizer, eos_ids, whole_text=False)
    check_distinct_pairs(pairs, cfg.data.path, cfg.data.max_length)
    pairs, held_out, eval_notes = split_train_eval(
        cfg, pairs, lambda c: load_preference_pairs(c, tokenizer, eos_ids, whole_text=False)[0], pair_key)
    check_distinct_pairs(held_out, cfg.data.eval_path or cfg.data.path, cfg.data.max_length)
    plan = offline_plan_from_config(cfg, len(pairs), W)
    memory, line = check_offline_memory(cfg, load_model_config(cfg.model), pairs, held_out, plan)
    run.open_output(notes + eval_notes + [line])
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)

    # 2. The policy (trained; the checkpoint's when resuming) and the reference: the starting weights, frozen,
    # no grad ever. With LoRA no second copy: the reference is the policy with its adapter disabled.
    model = load_policy(cfg.model, cfg.model_dtype, cfg.lora if cfg.lora.enabled else None, run.resume_path,
                        device=weights_device(run.accelerator), kernels=cfg.kernels)
    ref_model = None
    reference_free = opts.loss_type in REFERENCE_FREE_LOSS_TYPES
    if reference_free:
        run.say([f"dpo.loss_type={opts.loss_type} is reference-free: no reference model loaded"])
    elif not cfg.lora.enabled:
        # (under FSDP2 sharded like the policy: `place_frozen`)
        ref_model = place_frozen(load_causal_lm(cfg.model, cfg.model_dtype, device=frozen_device(run.accelerator),
                                                kernels=cfg.kernels), run.accelerator)
    flat, notes = choose_padding_free(cfg, model)
    run.say(notes + ([adapter_note(model)] if cfg.lora.enabled else []))
    model, optimizer, scheduler = prepare_for_training(run.accelerator, model, cfg.train, plan)
    ref_cache_N2 = eval_ref_cache_N2 = None
    if not reference_free:
        m = cfg.train.micro_batch_size
        with reference_of(run.accelerator.unwrap_model(model), ref_model) as reference:
            ref_cache_N2 = reference_logps_cache(run.accelerator, reference, pairs, pad_id, m)
            if held_out:
                eval_ref_cache_N2 = reference_logps_cache(run.accelerator, reference, held_out, pad_id, m)
        ref_model = reference = None  # no longer needed (both names held it): its memory is free for training
        cost = reference_cost(cfg, plan, len(held_out))
        run.say([f"reference: {cost['reference_sequences']} sequences scored once before training "
                 f"({cost['reference_forward_passes']} forward passes of up to {2 * m} sequences, split over {W} "
                 f"process(es)); kept as {len(pairs) + len(held_out)} x 2 floats"])

    # 3. The loop: one optimizer step per train.batch_size pairs.
    stage = PreferenceStage(model, pairs, held_out, ref_cache_N2, eval_ref_cache_N2, opts, pad_id,
                            run.accelerator.device, plan.batch_size, flat)
    return run.train(stage, model, optimizer, scheduler, tokenizer, plan, len(pairs), len(held_out),
                     header={**reference_cost(cfg, plan, len(held_out)), **memory_header(memory)})
