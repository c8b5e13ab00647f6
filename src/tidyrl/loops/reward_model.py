"""Reward-model training (`algorithm: reward`), explicit from top to bottom.

    tokenise the pairs: prompt + chosen, prompt + rejected (whole text, as a reward model reads it)
    load `model` as AutoModelForSequenceClassification with one output (a new score head on the backbone)
    for each optimizer step:
        the next train.batch_size pairs of the stream
        micro-batches of m pairs: score the 2m sequences in one forward ->
        Bradley–Terry loss per pair, summed and divided by the pairs of the whole global batch -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
    final/: a sequence-classification folder (num_labels=1, pad_token_id set) that RL stages load as a
    reward model or as a critic's initialisation

The score of a sequence is the head's output at its last non-padding token, as
`*ForSequenceClassification` computes it; tidyrl pads on the right with the
config's pad_token_id, so training reads the score where inference will.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.common import (TrainResult, in_own_memory, prepare_for_training,
                                 load_tokenizer, make_accelerator, prepare_output_dir, save_pretrained_atomic,
                                 torch_dtype, without_dropout, write_run_header)


def load_reward_model(path: str, pad_id: int, dtype: str = "float32"):
    """`AutoModelForSequenceClassification` with one output, dropout off and pad_token_id set (the model finds
    each sequence's last token by it). From a causal LM folder the score head is new, initialised from the
    current torch seed."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_config = without_dropout(AutoConfig.from_pretrained(path, num_labels=1))
    model_config.pad_token_id = pad_id
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized": expected here, and said by the caller
    try:
        return in_own_memory(
            AutoModelForSequenceClassification.from_pretrained(path, config=model_config, dtype=torch_dtype(dtype)))
    finally:
        hf_logging.set_verbosity(verbosity)


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train a reward model from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.algorithms.preference import bradley_terry_loss
    from tidyrl.data import PromptStream
    from tidyrl.loops.offline import (StepLog, micro_batches, model_pad_id, optimizer_step, pad_batch, reduce_sum,
                                      say, sync_context)
    from tidyrl.offline_data import completion_eos_ids, load_preference_pairs
    from tidyrl.plan import offline_plan_from_config

    accelerator = make_accelerator(cfg)
    W, rank = accelerator.num_processes, accelerator.process_index

    # 1. Everything checkable before the model: tokenizer, data, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    pairs, notes = load_preference_pairs(cfg, tokenizer, eos_ids, whole_text=True)
    plan = offline_plan_from_config(cfg, len(pairs), W)
    out = Path(cfg.output_dir)
    prepare_output_dir(out, cfg.overwrite, accelerator)
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)  # the new score head's initialisation

    # 2. The model, the optimizer and the LR schedule (over the plan's total optimizer steps).
    model = load_reward_model(cfg.model, pad_id, cfg.model_dtype)
    if cfg.lora.enabled:  # the new score head is trained in full (peft's modules_to_save), the rest by LoRA
        from tidyrl.lora import adapter_note, apply_lora

        model = apply_lora(model, cfg.lora, cfg.model, task="sequence_classification")
        notes = notes + [adapter_note(model)]
    say(accelerator, notes + [f"reward model: {type(model).__name__} with one output on {cfg.model}"])
    model, optimizer, scheduler = prepare_for_training(accelerator, model, cfg.train, plan)
    write_run_header(cfg, plan, out, accelerator)

    # 3. One optimizer step per train.batch_size pairs.
    stream = PromptStream(len(pairs), cfg.seed)
    with StepLog(out, plan, cfg.log, accelerator) as log:
        for step in range(plan.total_optimizer_steps):
            t0 = time.perf_counter()
            batch = stream.rollout_indices(step, plan.batch_size)  # global pair indices, the same on every process
            model.train()
            parts = micro_batches(batch, plan, rank)
            sums = torch.zeros(5, dtype=torch.float64)  # loss, correct, sum r_chosen, sum r_rejected, sum margin
            for k, idx in enumerate(parts):
                with sync_context(accelerator, model, k == len(parts) - 1, cfg.train.sync_each_microbatch):
                    # Chosen and rejected in one forward: 2b sequences, chosen first.
                    sequences = [pairs[i].chosen for i in idx] + [pairs[i].rejected for i in idx]
                    inputs = pad_batch(sequences, pad_id, accelerator.device)
                    rewards_2B = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                       use_cache=False).logits.squeeze(-1).float()  # (2b,)
                    chosen_B, rejected_B = rewards_2B[: len(idx)], rewards_2B[len(idx):]
                    margin_B = torch.tensor([pairs[i].margin for i in idx], device=rewards_2B.device)
                    # Normalised by the pairs of the whole global batch (not this micro-batch): the gradient does
                    # not depend on m or W. Scaled by W since DDP averages gradients over processes.
                    loss = bradley_terry_loss(chosen_B, rejected_B, margin_B).sum() / plan.batch_size
                    accelerator.backward(loss * W)
                with torch.no_grad():
                    sums += torch.tensor([float(loss), float((chosen_B > rejected_B).sum()), float(chosen_B.sum()),
                                          float(rejected_B.sum()), float(margin_B.sum())], dtype=torch.float64)
            sums = reduce_sum(accelerator, sums)
            lr, grad_norm = optimizer_step(accelerator, model, optimizer, scheduler, cfg.train.max_grad_norm,
                                           step + 1, float(sums[0]))
            n = plan.batch_size
            log.row(step + 1, lr, float(sums[0]), grad_norm, {
                "rewards/accuracy": float(sums[1]) / n,  # fraction of pairs with r_chosen > r_rejected
                "rewards/margin": float(sums[2] - sums[3]) / n,  # mean r_chosen - r_rejected
                "rewards/chosen": float(sums[2]) / n,
                "rewards/rejected": float(sums[3]) / n,
                **({"margin_mean": float(sums[4]) / n} if cfg.reward.margin_column else {}),
                "time/update_s": time.perf_counter() - t0,
            })

    final_dir = save_pretrained_atomic(accelerator, model, tokenizer, out / "final", merged=cfg.lora.save_merged)
    return TrainResult(output_dir=out, final_dir=final_dir, plan=plan, metrics=log.last_row,
                       is_main_process=accelerator.is_main_process)
