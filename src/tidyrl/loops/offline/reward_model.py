"""Reward-model training (`algorithm: reward`), explicit from top to bottom.

    tokenise the pairs: prompt + chosen, prompt + rejected (whole text, as a reward model reads it)
    load `model` as AutoModelForSequenceClassification with one output (a new score head on the backbone)
    for each optimizer step (tidyrl.loops.offline.loop.OfflineRun.train, the loop every offline stage shares):
        the next train.batch_size pairs of the stream
        micro-batches of m pairs: score the 2m sequences in one forward ->
        Bradley–Terry loss per pair, summed and divided by the pairs of the whole global batch -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row            (RewardStage below)
    eval: the held-out pairs' loss, accuracy and margin (eval/loss, eval/accuracy, eval/margin)
    final/: a sequence-classification folder (num_labels=1, pad_token_id set) that RL stages load as a
    reward model or as a critic's initialisation

The score of a sequence is the head's output at its last token, as
`*ForSequenceClassification` pools it (the last token that is not padding); tidyrl pads on the right with an
id absent from the batch, so training reads the score where inference will, also where pad == eos and a
sequence ends with its EOS.
"""

from __future__ import annotations

from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.run.setup import TrainResult, prepare_for_training, weights_device
from tidyrl.models.loading import OWN_LAYERS, load_model_config, load_tokenizer, placed, torch_dtype, without_dropout


def load_reward_model(path: str, pad_id: int, dtype: str = "float32", device=None, kernels=None):
    """`AutoModelForSequenceClassification` with one output, dropout off and pad_token_id set (the model finds
    each sequence's last token by it). From a causal LM folder the score head is new, initialised from the
    current torch seed (on the host, wherever the model is then placed: `models.loading.placed`). It carries the
    choice `kernels` as every model a run loads (`models.kernels.attach`)."""
    from tidyrl.models.kernels import attach

    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_config = without_dropout(AutoConfig.from_pretrained(path, num_labels=1))
    model_config.pad_token_id = pad_id
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "score.weight newly initialized": expected here, and said by the caller
    try:
        return attach(placed(AutoModelForSequenceClassification.from_pretrained(path, config=model_config,
                                                                                dtype=torch_dtype(dtype),
                                                                                **OWN_LAYERS), device),
                      kernels)
    finally:
        hf_logging.set_verbosity(verbosity)


class RewardStage:
    """The Bradley–Terry loss on a micro-batch of pairs (Ouyang et al. 2022, eq. 1; with margins, Touvron et al.
    2023 §3.2.2), divided by the pairs of the whole global batch."""

    sums = ("loss", "correct", "reward_chosen", "reward_rejected", "margin", "real_tokens", "token_cells")
    bar = ("rewards/accuracy",)
    eval_sums = ("loss", "correct", "reward_chosen", "reward_rejected")

    def __init__(self, model, pairs, held_out, pad_id: int, device, batch_size: int, with_margin: bool):
        self.model, self.pairs, self.held_out = model, pairs, held_out
        self.pad_id, self.device, self.batch_size, self.with_margin = pad_id, device, batch_size, with_margin

    def length(self, i):  # chosen and rejected share the padded width
        return max(len(self.pairs[i].chosen.input_ids), len(self.pairs[i].rejected.input_ids))

    def begin_step(self, batch):
        pass

    def _score(self, pairs):
        """Chosen and rejected in one forward: 2b sequences, chosen first. Returns (loss per pair, r_chosen,
        r_rejected, margins, the padded batch)."""
        import torch

        from tidyrl.algorithms.preference import bradley_terry_loss
        from tidyrl.loops.offline.loop import pad_batch
        from tidyrl.models.sequences import absent_id
        from tidyrl.models.sharding import ddp_inner

        sequences = [p.chosen for p in pairs] + [p.rejected for p in pairs]
        # The score is read at each row's last token that is not padding (the classifier's pooling). Padded with
        # the pad id, a sequence that ends with it (pad == eos, a completion ending in its EOS) would be read one
        # token early; padded with an id absent from the batch, it is read at its last token, as the RL scorer
        # reads it (rewards.reward_models). The config's own pad id is put back for saving.
        filler = absent_id([seq.input_ids for seq in sequences])
        inputs = pad_batch(sequences, filler, self.device)
        config = ddp_inner(self.model).config
        config.pad_token_id, pad_id = filler, config.pad_token_id
        try:
            rewards_2B = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    use_cache=False).logits.squeeze(-1).float()  # (2b,)
        finally:
            config.pad_token_id = pad_id
        chosen_B, rejected_B = rewards_2B[: len(pairs)], rewards_2B[len(pairs):]
        margin_B = torch.tensor([p.margin for p in pairs], device=rewards_2B.device)
        return bradley_terry_loss(chosen_B, rejected_B, margin_B), chosen_B, rejected_B, margin_B, inputs

    def micro_batch(self, idx):
        from tidyrl.loops.offline.loop import batch_cells

        pairs = [self.pairs[i] for i in idx]
        loss_B, chosen_B, rejected_B, margin_B, inputs = self._score(pairs)
        # Normalised by the pairs of the whole global batch (not this micro-batch): the gradient does not
        # depend on m or W.
        loss = loss_B.sum() / self.batch_size
        real = sum(len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs)
        chosen_B, rejected_B = chosen_B.detach(), rejected_B.detach()
        return loss, {"loss": loss.detach(), "correct": (chosen_B > rejected_B).sum(), "reward_chosen": chosen_B.sum(),
                      "reward_rejected": rejected_B.sum(), "margin": margin_B.sum(), "real_tokens": real,
                      "token_cells": batch_cells(inputs)}

    def metrics(self, sums, batch):
        n = len(batch)
        return {
            "rewards/accuracy": sums["correct"] / n,  # fraction of pairs with r_chosen > r_rejected
            "rewards/margin": (sums["reward_chosen"] - sums["reward_rejected"]) / n,  # mean r_chosen - r_rejected
            "rewards/chosen": sums["reward_chosen"] / n,
            "rewards/rejected": sums["reward_rejected"] / n,
            **({"margin_mean": sums["margin"] / n} if self.with_margin else {}),
        }

    def evaluate(self, idx):
        loss_B, chosen_B, rejected_B, _, _ = self._score([self.held_out[i] for i in idx])
        return {"loss": loss_B.sum(), "correct": (chosen_B > rejected_B).sum(), "reward_chosen": chosen_B.sum(),
                "reward_rejected": rejected_B.sum()}

    def eval_metrics(self, sums, n):
        return {"eval/loss": sums["loss"] / n, "eval/accuracy": sums["correct"] / n,
                "eval/margin": (sums["reward_chosen"] - sums["reward_rejected"]) / n}


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train a reward model from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.loops.offline.loop import OfflineRun, model_pad_id
    from tidyrl.data.offline import completion_eos_ids, load_preference_pairs, pair_key, split_train_eval
    from tidyrl.memory.offline import check_offline_memory, memory_header
    from tidyrl.plan import offline_plan_from_config

    run = OfflineRun(cfg)  # a bad resume_from fails here, before anything loads

    # 1. Everything checkable before the model: tokenizer, data, eval split, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    margin_column = cfg.reward.margin_column
    pairs, notes = load_preference_pairs(cfg, tokenizer, eos_ids, whole_text=True, margin_column=margin_column)
    pairs, held_out, eval_notes = split_train_eval(
        cfg, pairs, lambda c: load_preference_pairs(c, tokenizer, eos_ids, whole_text=True,
                                                    margin_column=margin_column)[0], pair_key)
    plan = offline_plan_from_config(cfg, len(pairs), run.world_size)
    memory, line = check_offline_memory(cfg, load_model_config(cfg.model), pairs, held_out, plan)
    run.open_output(eval_notes + [line])
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)  # the new score head's initialisation

    # 2. The model (the checkpoint's when resuming), the optimizer and the LR schedule (over the plan's steps).
    if cfg.lora.enabled:  # the new score head is trained in full (peft's modules_to_save), the rest by LoRA
        from tidyrl.models.lora import adapter_note, apply_lora, load_adapter

        model = load_reward_model(cfg.model, pad_id, cfg.model_dtype, kernels=cfg.kernels)
        model = (load_adapter(model, run.resume_path, trainable=True) if run.resume_path else
                 apply_lora(model, cfg.lora, cfg.model, task="sequence_classification"))
        notes = notes + [adapter_note(model)]
    else:
        model = load_reward_model(str(run.resume_path or cfg.model), pad_id, cfg.model_dtype,
                                  device=weights_device(run.accelerator), kernels=cfg.kernels)
    run.say(notes + [f"reward model: {type(model).__name__} with one output on {cfg.model}"])
    model, optimizer, scheduler = prepare_for_training(run.accelerator, model, cfg.train, plan)

    # 3. The loop: one optimizer step per train.batch_size pairs.
    stage = RewardStage(model, pairs, held_out, pad_id, run.accelerator.device, plan.batch_size,
                        cfg.reward.margin_column is not None)
    return run.train(stage, model, optimizer, scheduler, tokenizer, plan, len(pairs), len(held_out),
                     header=memory_header(memory))
