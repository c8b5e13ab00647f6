"""Supervised fine-tuning (`algorithm: sft`), explicit from top to bottom.

    tokenise the examples (prompt + completion, or messages), pack them if asked
    for each optimizer step:
        the next train.batch_size examples of the stream
        micro-batches of m: masked NLL of the target tokens, normalised by the
        target-token count of the whole global batch -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
    final/: the model, for the next stage (reward model, DPO, RL)

All counts come from the plan (tidyrl.plan.make_offline_plan); docs/stages.md has the data format.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.common import (TrainResult, prepare_for_training,
                                 load_policy, load_tokenizer, make_accelerator, prepare_output_dir,
                                 save_pretrained_atomic, write_run_header)
from tidyrl.lora import adapter_note


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with SFT from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.algorithms.sft import sft_loss, sft_normaliser
    from tidyrl.data import PromptStream
    from tidyrl.loops.offline import (StepLog, micro_batches, model_pad_id, optimizer_step, pad_batch, reduce_sum,
                                      say, sync_context, target_logprobs)
    from tidyrl.offline_data import completion_eos_ids, load_sft_examples
    from tidyrl.plan import offline_plan_from_config

    accelerator = make_accelerator(cfg)
    W, rank = accelerator.num_processes, accelerator.process_index

    # 1. Everything checkable before the model: tokenizer, data, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    examples, notes = load_sft_examples(cfg, tokenizer, eos_ids)
    plan = offline_plan_from_config(cfg, len(examples), W)
    out = Path(cfg.output_dir)
    prepare_output_dir(out, cfg.overwrite, accelerator)
    say(accelerator, notes)
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)

    # 2. The model, the optimizer and the LR schedule (over the plan's total optimizer steps).
    model = load_policy(cfg)
    say(accelerator, [adapter_note(model)] if cfg.lora.enabled else [])
    model, optimizer, scheduler = prepare_for_training(accelerator, model, cfg.train, plan)
    write_run_header(cfg, plan, out, accelerator)

    # 3. One optimizer step per train.batch_size examples; the stream crosses epoch boundaries (fresh shuffle each).
    mode = cfg.sft.loss_aggregation
    stream = PromptStream(len(examples), cfg.seed)
    with StepLog(out, plan, cfg.log, accelerator) as log:
        for step in range(plan.total_optimizer_steps):
            t0 = time.perf_counter()
            batch = stream.rollout_indices(step, plan.batch_size)  # global: the same list on every process
            # Every process holds every example, so the whole batch's target count needs no all-reduce.
            num_targets = sum(sum(examples[i].target_mask) for i in batch)
            normaliser = sft_normaliser(mode, num_tokens=num_targets, num_sequences=len(batch))
            model.train()
            parts = micro_batches(batch, plan, rank)
            sums = torch.zeros(2, dtype=torch.float64)  # loss, negative log-likelihood summed over targets
            for k, idx in enumerate(parts):
                with sync_context(accelerator, model, k == len(parts) - 1, cfg.train.sync_each_microbatch):
                    inputs = pad_batch([examples[i] for i in idx], pad_id, accelerator.device)
                    logprobs_BT, mask_BT = target_logprobs(model, inputs)  # (b, T-1) each
                    loss = sft_loss(logprobs_BT, mask_BT, mode, normaliser)
                    # DDP averages gradients over W processes; the loss is this process's share of the global
                    # batch loss, so scale by W to make the synchronised gradient the global one.
                    accelerator.backward(loss * W)
                with torch.no_grad():
                    sums += torch.tensor([float(loss), float(-(logprobs_BT * mask_BT).sum())], dtype=torch.float64)
            sums = reduce_sum(accelerator, sums)
            lr, grad_norm = optimizer_step(accelerator, model, optimizer, scheduler, cfg.train.max_grad_norm,
                                           step + 1, float(sums[0]))
            log.row(step + 1, lr, float(sums[0]), grad_norm, {
                "tokens": num_targets,  # trained (target) tokens of the global batch
                "nll_token_mean": float(sums[1]) / max(num_targets, 1),  # = loss with token_mean
                "time/update_s": time.perf_counter() - t0,
            })

    final_dir = save_pretrained_atomic(accelerator, model, tokenizer, out / "final", merged=cfg.lora.save_merged)
    return TrainResult(output_dir=out, final_dir=final_dir, plan=plan, metrics=log.last_row,
                       is_main_process=accelerator.is_main_process)
