"""Preference optimisation (`algorithm: dpo`: DPO sigmoid, IPO, robust DPO, SimPO, ORPO), explicit from top to bottom.

    tokenise the pairs: prompt + chosen, prompt + rejected, as a rollout would (prompt and completion apart,
    EOS appended); the completion tokens are the targets
    load the policy and, frozen, the reference: the same starting model (none for simpo and orpo)
    for each optimizer step:
        the next train.batch_size pairs of the stream
        micro-batches of m pairs (2m sequences in one forward):
            reference sequence log-probs: read from the cache scored once before training (the reference is
            frozen, so a pair's reference log-prob never changes: 2N sequences scored once, not once per epoch)
            policy sequence log-probs -> the loss per pair, summed and divided by the pairs of the whole
            global batch (orpo's SFT term: by the chosen completions' tokens of the whole global batch) -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
    final/: the policy, for the next stage
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.common import (TrainResult, prepare_for_training,
                                 load_causal_lm, load_policy, load_tokenizer, make_accelerator, prepare_output_dir,
                                 save_pretrained_atomic, write_run_header)
from tidyrl.lora import adapter_note, reference_of


def reference_logps_cache(accelerator, reference, pairs, pad_id: int, chunk: int):
    """[N, 2] sequence log-probs (chosen, rejected) of every pair under the frozen reference, float32 on the CPU.

    Scored once, under no_grad, `chunk` pairs (2 * chunk sequences) per forward; process r scores chunks
    r, r + W, ... and the rows are summed over processes (each row is non-zero on one process only, so the
    sum is exact). Deterministic, so a resumed run recomputes the same values.
    """
    import torch

    from tidyrl.algorithms.preference import sequence_logps
    from tidyrl.loops.offline import pad_batch, reduce_sum, target_logprobs

    W, rank = accelerator.num_processes, accelerator.process_index
    cache = torch.zeros((len(pairs), 2), dtype=torch.float64)
    was_training = reference.training
    reference.eval()
    with torch.no_grad():
        for c, start in enumerate(range(0, len(pairs), chunk)):
            if c % W != rank:
                continue
            idx = range(start, min(start + chunk, len(pairs)))
            b = len(idx)
            inputs = pad_batch([pairs[i].chosen for i in idx] + [pairs[i].rejected for i in idx], pad_id,
                               accelerator.device)
            logps_2B = sequence_logps(*target_logprobs(reference, inputs)).double().cpu()
            cache[start:start + b, 0], cache[start:start + b, 1] = logps_2B[:b], logps_2B[b:]
    reference.train(was_training)
    return reduce_sum(accelerator, cache).float()


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with DPO or IPO from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.algorithms.preference import dpo_loss, orpo_odds_ratio_loss, sequence_logps, simpo_loss
    from tidyrl.data import PromptStream
    from tidyrl.loops.offline import (StepLog, micro_batches, model_pad_id, optimizer_step, pad_batch, reduce_sum,
                                      say, sync_context, target_logprobs)
    from tidyrl.offline_data import check_distinct_pairs, completion_eos_ids, load_preference_pairs
    from tidyrl.plan import offline_plan_from_config

    accelerator = make_accelerator(cfg)
    W, rank = accelerator.num_processes, accelerator.process_index
    opts = cfg.dpo

    # 1. Everything checkable before the models: tokenizer, data, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    pairs, notes = load_preference_pairs(cfg, tokenizer, eos_ids, whole_text=False)
    check_distinct_pairs(pairs, cfg.data.path, cfg.data.max_length)
    plan = offline_plan_from_config(cfg, len(pairs), W)
    out = Path(cfg.output_dir)
    prepare_output_dir(out, cfg.overwrite, accelerator)
    say(accelerator, notes)
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)

    # 2. The policy (trained) and the reference (the same starting weights, frozen, no grad ever). With LoRA no
    # second copy: the reference is the policy with its adapter disabled.
    model = load_policy(cfg)
    ref_model = None
    reference_free = opts.loss_type in ("simpo", "orpo")
    if reference_free:
        say(accelerator, [f"dpo.loss_type={opts.loss_type} is reference-free: no reference model loaded"])
    elif not cfg.lora.enabled:
        ref_model = load_causal_lm(cfg.model, cfg.model_dtype).to(accelerator.device)
        ref_model.eval().requires_grad_(False)
    say(accelerator, [adapter_note(model)] if cfg.lora.enabled else [])
    model, optimizer, scheduler = prepare_for_training(accelerator, model, cfg.train, plan)
    ref_cache_N2 = None
    if not reference_free:
        with reference_of(accelerator.unwrap_model(model), ref_model) as reference:
            ref_cache_N2 = reference_logps_cache(accelerator, reference, pairs, pad_id, cfg.train.micro_batch_size)
        ref_model = None  # no longer needed: its memory is free for training
        n_chunks = -(-len(pairs) // cfg.train.micro_batch_size)
        say(accelerator, [f"reference: {2 * len(pairs)} sequences scored once before training ({n_chunks} forward "
                          f"passes of up to {2 * cfg.train.micro_batch_size} sequences, split over {W} process(es)); "
                          f"kept as {len(pairs)} x 2 floats"])
    write_run_header(cfg, plan, out, accelerator)

    # 3. One optimizer step per train.batch_size pairs.
    stream = PromptStream(len(pairs), cfg.seed)
    with StepLog(out, plan, cfg.log, accelerator) as log:
        for step in range(plan.total_optimizer_steps):
            t0 = time.perf_counter()
            batch = stream.rollout_indices(step, plan.batch_size)  # global pair indices, the same on every process
            model.train()
            parts = micro_batches(batch, plan, rank)
            # loss, correct, sum reward chosen, sum reward rejected, sum logp chosen, sum logp rejected
            sums = torch.zeros(6, dtype=torch.float64)
            orpo_sums = torch.zeros(2, dtype=torch.float64)  # orpo: SFT loss, sum log odds ratio
            # orpo's SFT term is a token mean over the chosen completions of the GLOBAL batch (the same count on
            # every process: the batch indices are global), so micro-batching and processes leave it unchanged.
            chosen_tokens = max(1, sum(sum(pairs[i].chosen.target_mask) for i in batch))
            for k, idx in enumerate(parts):
                b = len(idx)
                sequences = [pairs[i].chosen for i in idx] + [pairs[i].rejected for i in idx]  # chosen first
                inputs = pad_batch(sequences, pad_id, accelerator.device)
                if not reference_free:
                    ref_B2 = ref_cache_N2[torch.tensor(idx)].to(accelerator.device)
                    ref_logps_2B = torch.cat([ref_B2[:, 0], ref_B2[:, 1]])  # (2b,) chosen first
                with sync_context(accelerator, model, k == len(parts) - 1, cfg.train.sync_each_microbatch):
                    logprobs_BT, mask_BT = target_logprobs(model, inputs)
                    logps_2B = sequence_logps(logprobs_BT, mask_BT)  # (2b,)
                    lengths_2B = mask_BT.sum(dim=-1)
                    if opts.loss_type == "simpo":
                        loss_B, reward_chosen_B, reward_rejected_B = simpo_loss(
                            logps_2B[:b], logps_2B[b:], lengths_2B[:b], lengths_2B[b:], opts.beta, opts.simpo_gamma)
                        loss = loss_B.sum() / plan.batch_size
                    elif opts.loss_type == "orpo":
                        mean_2B = logps_2B / lengths_2B.clamp(min=1)
                        or_loss_B, log_odds_ratio_B = orpo_odds_ratio_loss(mean_2B[:b], mean_2B[b:])
                        # Rewards for the metrics: the mean per-token log-probs (no reference to compare with).
                        reward_chosen_B, reward_rejected_B = mean_2B[:b].detach(), mean_2B[b:].detach()
                        sft = -logps_2B[:b].sum() / chosen_tokens
                        loss = sft + opts.orpo_lambda * or_loss_B.sum() / plan.batch_size
                        orpo_sums += torch.tensor([float(sft.detach()), float(log_odds_ratio_B.sum())], dtype=torch.float64)
                    else:
                        loss_B, reward_chosen_B, reward_rejected_B = dpo_loss(
                            logps_2B[:b], logps_2B[b:], ref_logps_2B[:b], ref_logps_2B[b:],
                            beta=opts.beta, loss_type=opts.loss_type, label_smoothing=opts.label_smoothing)
                        # Normalised by the pairs of the whole global batch, never this micro-batch; scaled by W
                        # since DDP averages gradients over processes.
                        loss = loss_B.sum() / plan.batch_size
                    accelerator.backward(loss * W)
                with torch.no_grad():
                    sums += torch.tensor([
                        float(loss), float((reward_chosen_B > reward_rejected_B).sum()), float(reward_chosen_B.sum()),
                        float(reward_rejected_B.sum()), float(logps_2B[:b].sum()), float(logps_2B[b:].sum()),
                    ], dtype=torch.float64)
            sums = reduce_sum(accelerator, sums)
            extra = {}
            if opts.loss_type == "orpo":
                orpo_sums = reduce_sum(accelerator, orpo_sums)
                extra = {"orpo/sft_loss": float(orpo_sums[0]), "orpo/log_odds_ratio": float(orpo_sums[1]) / plan.batch_size}
            lr, grad_norm = optimizer_step(accelerator, model, optimizer, scheduler, cfg.train.max_grad_norm,
                                           step + 1, float(sums[0]))
            n = plan.batch_size
            log.row(step + 1, lr, float(sums[0]), grad_norm, {
                # Implicit rewards beta * log(pi / pi_ref) (Rafailov et al. 2023, §5), before this step's update.
                "rewards/accuracy": float(sums[1]) / n,
                "rewards/margin": float(sums[2] - sums[3]) / n,
                "rewards/chosen": float(sums[2]) / n,
                "rewards/rejected": float(sums[3]) / n,
                "logps/chosen": float(sums[4]) / n,  # mean sequence log-prob under the policy
                "logps/rejected": float(sums[5]) / n,
                **extra,
                "time/update_s": time.perf_counter() - t0,
            })

    final_dir = save_pretrained_atomic(accelerator, model, tokenizer, out / "final", merged=cfg.lora.save_merged)
    return TrainResult(output_dir=out, final_dir=final_dir, plan=plan, metrics=log.last_row,
                       is_main_process=accelerator.is_main_process)
