"""Parts the offline loops (sft, reward, dpo) share: the example stream split into micro-batches, padding,
token log-probs, the optimizer step and the metrics log. Each loop stays explicit in its own module; these are
its parts, as tidyrl.loops.common is for every loop.

The accounting is the RL loop's (DESIGN §2), with a fixed dataset in place of rollouts:

    for step in range(plan.total_optimizer_steps):
        the next B examples of the stream (each dataset epoch a fresh shuffle by seed)
        this process takes its B/W, in micro-batches of m, with gradient accumulation
        the loss is normalised over the whole global batch, never per micro-batch
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Sequence

import torch

from tidyrl.offline_data import TokenizedSequence
from tidyrl.plan import OfflinePlan, offline_epochs_done

OFFLINE_STEP_METRICS = (
    "step",  # 1-based optimizer step
    "epoch",  # fractional passes over the dataset: step * batch_size / N
    "examples",  # cumulative examples (reward, dpo: pairs) drawn: step * batch_size
    "lr",  # learning rate the optimizer used for this step
    "loss",  # the step's loss: the batch's, whatever the micro-batch size and process count
    "grad_norm",  # global norm before clipping
    "time_s",  # wall-clock seconds since training started
)
"""The fields every metrics.jsonl row of sft, reward and dpo starts with, in this order (names are API);
each stage's own metrics follow (docs/stages.md)."""


def say(accelerator, lines: Sequence[str]) -> None:
    """Print notes once (main process), as `tidyrl: ...`."""
    if accelerator.is_main_process:
        for line in lines:
            print(f"tidyrl: {line}", flush=True)


def micro_batches(batch: Sequence[int], plan: OfflinePlan, rank: int) -> list[list[int]]:
    """This process's share of a global batch of example indices, B/W of them, in micro-batches of m."""
    per_process = plan.examples_per_process
    mine = list(batch[rank * per_process: (rank + 1) * per_process])
    parts = [mine[i: i + plan.micro_batch_size] for i in range(0, per_process, plan.micro_batch_size)]
    assert len(parts) == plan.gradient_accumulation_steps
    return parts


def sync_context(accelerator, model, last: bool, sync_each_microbatch: bool):
    """Gradients are synchronised on the last micro-batch only (or on each, for FSDP memory)."""
    return contextlib.nullcontext() if (last or sync_each_microbatch) else accelerator.no_sync(model)


def pad_batch(sequences: Sequence[TokenizedSequence], pad_id: int, device) -> dict:
    """Right-padded (B, T) tensors: input_ids, target_mask (float), and either attention_mask (plain rows) or
    position_ids (packed rows: positions restart at each example; with no attention_mask, transformers builds a
    block-diagonal causal mask from them, so packed examples never see each other)."""
    width = max(len(s.input_ids) for s in sequences)
    B = len(sequences)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    targets = torch.zeros((B, width), dtype=torch.float32)
    attention = torch.zeros((B, width), dtype=torch.long)
    packed = sequences[0].position_ids is not None
    positions = torch.zeros((B, width), dtype=torch.long)
    for b, s in enumerate(sequences):
        n = len(s.input_ids)
        ids[b, :n] = torch.as_tensor(s.input_ids)
        targets[b, :n] = torch.as_tensor(s.target_mask, dtype=torch.float32)
        attention[b, :n] = 1
        if packed:
            positions[b, :n] = torch.as_tensor(s.position_ids)
            positions[b, n:] = torch.arange(width - n)  # the padding is one more (ignored) sequence
    batch = {"input_ids": ids.to(device), "target_mask": targets.to(device)}
    if packed:
        batch["position_ids"] = positions.to(device)
    else:
        batch["attention_mask"] = attention.to(device)
    return batch


def target_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T-1) of tokens 1..T-1 under `model` (position t-1 predicts token t) and their target mask
    (B, T-1). `gather_logprobs` never builds a (B, T, V) log-softmax."""
    from tidyrl.ops import gather_logprobs

    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits_BTV = model(**inputs, use_cache=False).logits
    logprobs_BT = gather_logprobs(logits_BTV[:, :-1], batch["input_ids"][:, 1:])
    return logprobs_BT, batch["target_mask"][:, 1:]


def optimizer_step(accelerator, model, optimizer, scheduler, max_grad_norm: float, step: int = 0,
                   loss: float = 0.0) -> tuple[float, float]:
    """Clip, step, step the LR schedule exactly once (in every process), zero the gradients.
    Returns (the learning rate this step used, the gradient norm before clipping). A NaN or infinite `loss` or
    gradient norm stops the run before the update (NonFiniteLossError naming `step`, 1-based)."""
    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    if not (math.isfinite(loss) and math.isfinite(float(grad_norm))):
        from tidyrl.loops.rl import NonFiniteLossError

        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"optimizer step {step}: the loss is {loss} and the gradient norm {float(grad_norm)}; the update was not "
            "applied and training stopped (metrics.jsonl keeps the steps before it; this stage writes no "
            "checkpoints, so the run must start again). Lower train.learning_rate, check the data, or set "
            "train.max_grad_norm."
        )
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, float(grad_norm)


def reduce_sum(accelerator, tensor: torch.Tensor) -> torch.Tensor:
    """Sum a small per-process tensor over processes (metrics only; the losses are already global)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").cpu()


class StepLog:
    """metrics.jsonl and the progress bar of an offline stage. `row(step, values)` builds the row (fixed fields
    first) and writes it every log.log_every steps and at the last; closing checks that the run took exactly the
    plan's steps. Use as a context manager: the bar and the file are closed whatever happens."""

    def __init__(self, out: Path, plan: OfflinePlan, log_cfg, accelerator):
        from tidyrl.metrics import JsonlWriter, ProgressBar

        self.plan, self.log_every = plan, log_cfg.log_every
        enabled = accelerator.is_main_process
        self.metrics = JsonlWriter(Path(out) / "metrics.jsonl", enabled=enabled)
        self.bar = ProgressBar(plan.total_optimizer_steps, enabled=enabled and log_cfg.progress_bar)
        self.start = time.perf_counter()
        self.steps = 0
        self.last_row: dict = {}

    def __enter__(self) -> "StepLog":
        return self

    def row(self, step: int, lr: float, loss: float, grad_norm: float, extra: dict) -> dict:
        """Record optimizer step `step` (1-based)."""
        plan = self.plan
        self.steps = step
        row = {
            "step": step,
            "epoch": offline_epochs_done(plan, step),
            "examples": step * plan.batch_size,
            "lr": lr,
            "loss": loss,
            "grad_norm": grad_norm,
            "time_s": time.perf_counter() - self.start,
            **extra,
        }
        if step % self.log_every == 0 or step == plan.total_optimizer_steps:
            self.metrics.write(row)
        self.bar.step(None, row["examples"])
        self.last_row = row
        return row

    def __exit__(self, exc_type, exc, tb) -> None:
        self.bar.close()
        self.metrics.close()
        if exc_type is None and self.steps != self.plan.total_optimizer_steps:
            raise AssertionError(f"ran {self.steps} optimizer steps, plan says {self.plan.total_optimizer_steps}")


def model_pad_id(tokenizer, eos_ids: Sequence[int]) -> int:
    """Padding filler (masked out everywhere): the tokenizer's pad token, else the first EOS id."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if eos_ids:
        return int(eos_ids[0])
    raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with; set its pad_token")
