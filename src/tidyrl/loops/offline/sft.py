"""Supervised fine-tuning (`algorithm: sft`), explicit from top to bottom.

    tokenise the examples (prompt + completion, or messages); hold out the eval split; pack the rest if asked
    for each optimizer step (tidyrl.loops.offline.loop.OfflineRun.train, the loop every offline stage shares):
        the next train.batch_size examples of the stream
        micro-batches of m: masked NLL of the target tokens, normalised by the
        target-token count of the whole global batch -> backward          (SFTStage below)
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
    eval: the held-out examples' NLL per target token (eval/loss)
    final/: the model, for the next stage (reward model, DPO, RL)

All counts come from the plan (tidyrl.plan.make_offline_plan); docs/stages.md has the data format.
"""

from __future__ import annotations

from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.run.setup import TrainResult, prepare_for_training, weights_device
from tidyrl.models.loading import load_model_config, load_policy, load_tokenizer
from tidyrl.models.lora import adapter_note


class SFTStage:
    """The SFT loss on a micro-batch (Ouyang et al. 2022 §3.5: NLL of the demonstration's tokens), with the
    normaliser of the whole global batch, so micro-batch size and process count change nothing."""

    sums = ("loss", "nll", "real_tokens", "token_cells")
    bar = ()
    eval_sums = ("nll", "targets")

    def __init__(self, model, examples, held_out, pad_id: int, device, mode: str, flat: bool):
        self.model, self.examples, self.held_out = model, examples, held_out
        self.pad_id, self.device, self.mode, self.flat = pad_id, device, mode, flat

    def length(self, i):
        return len(self.examples[i].input_ids)

    def begin_step(self, batch):
        from tidyrl.algorithms.sft import sft_normaliser

        # Every process holds every example, so the whole batch's target count needs no all-reduce.
        self.num_targets = sum(sum(self.examples[i].target_mask) for i in batch)
        self.normaliser = sft_normaliser(self.mode, num_tokens=self.num_targets, num_sequences=len(batch))

    def _nll(self, sequences):
        """(log-probs, target mask), (b, T-1) each, and the token cells the forward computed."""
        from tidyrl.loops.offline.loop import batch_cells, pad_batch, target_logprobs

        inputs = pad_batch(sequences, self.pad_id, self.device, flat=self.flat)
        logprobs_BT, mask_BT = target_logprobs(self.model, inputs)
        return logprobs_BT, mask_BT, batch_cells(inputs)

    def micro_batch(self, idx):
        from tidyrl.algorithms.sft import sft_loss

        sequences = [self.examples[i] for i in idx]
        logprobs_BT, mask_BT, cells = self._nll(sequences)
        loss = sft_loss(logprobs_BT, mask_BT, self.mode, self.normaliser)
        return loss, {"loss": loss.detach(), "nll": -(logprobs_BT.detach() * mask_BT).sum(),
                      "real_tokens": sum(len(s.input_ids) for s in sequences), "token_cells": cells}

    def metrics(self, sums, batch):
        return {"tokens": self.num_targets,  # trained (target) tokens of the global batch
                "nll_token_mean": sums["nll"] / max(self.num_targets, 1)}  # = loss with token_mean

    def evaluate(self, idx):
        logprobs_BT, mask_BT, _ = self._nll([self.held_out[i] for i in idx])
        return {"nll": -(logprobs_BT * mask_BT).sum(), "targets": mask_BT.sum()}

    def eval_metrics(self, sums, n):
        return {"eval/loss": sums["nll"] / max(sums["targets"], 1)}  # NLL per held-out target token


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with SFT from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.loops.offline.loop import OfflineRun, choose_padding_free, model_pad_id
    from tidyrl.data.offline import (completion_eos_ids, load_sft_examples, pack_examples, sequence_key,
                                     split_train_eval)
    from tidyrl.memory.offline import check_offline_memory, memory_header
    from tidyrl.plan import offline_plan_from_config

    run = OfflineRun(cfg)  # a bad resume_from fails here, before anything loads

    # 1. Everything checkable before the model: tokenizer, data, eval split, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    examples, notes = load_sft_examples(cfg, tokenizer, eos_ids)
    examples, held_out, eval_notes = split_train_eval(
        cfg, examples, lambda c: load_sft_examples(c, tokenizer, eos_ids)[0], sequence_key)
    if cfg.sft.packing:  # after the split: a packed row never mixes train and eval examples
        examples, note = pack_examples(examples, cfg.data.max_length)
        notes.append(note)
    plan = offline_plan_from_config(cfg, len(examples), run.world_size)
    memory, line = check_offline_memory(cfg, load_model_config(cfg.model), examples, held_out, plan)
    run.open_output(notes + eval_notes + [line])
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)

    # 2. The model (the checkpoint's when resuming), the optimizer and the LR schedule (over the plan's steps).
    model = load_policy(cfg.model, cfg.model_dtype, cfg.lora if cfg.lora.enabled else None, run.resume_path,
                        device=weights_device(run.accelerator), kernels=cfg.kernels)
    flat, notes = choose_padding_free(cfg, model)  # and checks that packed rows keep examples apart
    run.say(notes + ([adapter_note(model)] if cfg.lora.enabled else []))
    model, optimizer, scheduler = prepare_for_training(run.accelerator, model, cfg.train, plan)

    # 3. The loop: one optimizer step per train.batch_size examples; the stream crosses epoch boundaries.
    stage = SFTStage(model, examples, held_out, pad_id, run.accelerator.device, cfg.sft.loss_aggregation, flat)
    return run.train(stage, model, optimizer, scheduler, tokenizer, plan, len(examples), len(held_out),
                     header=memory_header(memory))
