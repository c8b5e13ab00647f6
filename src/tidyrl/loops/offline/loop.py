"""Parts the offline loops (sft, reward, dpo, kto) share: the example stream split into micro-batches, padding,
token log-probs, the optimizer step and the metrics log. Each loop stays explicit in its own module; these are
its parts, as tidyrl.loops.run is for every loop.

The accounting is the RL loop's (DESIGN §2), with a fixed dataset in place of rollouts:

    for step in range(plan.total_optimizer_steps):
        the next B examples of the stream (each dataset epoch a fresh shuffle by seed)
        this process takes its B/W, in micro-batches of m, with gradient accumulation
        the loss is normalised over the whole global batch, never per micro-batch
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional, Protocol, Sequence

import torch

from tidyrl import liveness
from tidyrl.console import say
from tidyrl.data.offline import TokenizedSequence
from tidyrl.models.devices import to_device
from tidyrl.models.sequences import forward_parameters
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
"""The fields every metrics.jsonl row of an offline stage starts with, in this order (names are API);
each stage's own metrics follow (docs/stages.md)."""


def micro_batches(batch: Sequence[int], plan: OfflinePlan, rank: int, length=None,
                  whole_batch_first: bool = False) -> list[list[int]]:
    """This process's share of a global batch of example indices, B/W of them, in micro-batches of m. With
    `length` (train.group_by_length: example index -> tokens), the share is ordered by length first, so each
    micro-batch holds examples of similar length and pads little. The step's examples, its normaliser and so
    its gradient are the same either way (only the summation order differs, as with another m).

    `whole_batch_first` (train.exact_gradients): the whole batch ordered and cut into micro-batches first, then
    shared out (`exact_sums.global_micro_batches`), so each micro-batch holds the same examples whatever W is."""
    if whole_batch_first:
        from tidyrl.loops.run.exact_sums import global_micro_batches

        everything = sorted(batch, key=length) if length is not None else list(batch)  # stable, as below
        parts = global_micro_batches(everything, plan.micro_batch_size, rank, plan.world_size)
        assert len(parts) == plan.gradient_accumulation_steps
        return parts
    per_process = plan.examples_per_process
    mine = list(batch[rank * per_process: (rank + 1) * per_process])
    if length is not None:
        mine.sort(key=length)  # stable: equal lengths keep the stream's order
    parts = [mine[i: i + plan.micro_batch_size] for i in range(0, per_process, plan.micro_batch_size)]
    assert len(parts) == plan.gradient_accumulation_steps
    return parts


def pad_batch(sequences: Sequence[TokenizedSequence], pad_id: int, device, flat: bool = False) -> dict:
    """Right-padded (B, T) tensors (T: the longest sequence, on CUDA rounded up to a multiple of
    models.devices.WIDTH_MULTIPLE): input_ids, target_mask (float), and either attention_mask (plain rows) or
    position_ids (packed rows: positions restart at each example; with no attention_mask, transformers builds a
    block-diagonal causal mask from them, so packed examples never see each other).

    `flat` (train.padding_free): the B sequences side by side in ONE row of their total length, no padding at
    all, positions restarting at each; `lengths` records where each ends, so `target_logprobs` hands back the
    (B, T-1) layout the losses expect."""
    if flat:
        ids = [t for s in sequences for t in s.input_ids]
        positions = [p for s in sequences for p in (s.position_ids or range(len(s.input_ids)))]
        targets = [t for s in sequences for t in s.target_mask]
        return {"input_ids": torch.tensor([ids], device=device),
                "position_ids": torch.tensor([positions], device=device),
                "target_mask": torch.tensor([targets], dtype=torch.float32, device=device),
                "lengths": [len(s.input_ids) for s in sequences]}
    from tidyrl.models.devices import width_padding

    # On CUDA the width is rounded up to a multiple (models.devices.WIDTH_MULTIPLE), so that shapes recur: a width
    # the attention kernel has not seen costs it a new plan (measured in docs/benchmarking.md), and every batch has
    # its own.
    longest = max(len(s.input_ids) for s in sequences)
    width = longest + width_padding(longest, device)
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
    # (to_device: from pinned memory without waiting for the GPU, one wait fewer per micro-batch and tensor)
    batch = {"input_ids": to_device(ids, device), "target_mask": to_device(targets, device)}
    if packed:
        batch["position_ids"] = to_device(positions, device)
    else:
        batch["attention_mask"] = to_device(attention, device)
    return batch


def batch_cells(batch: dict) -> int:
    """Token cells a forward of `batch` computes (rows x width): with padding_fraction, what padding costs."""
    return batch["input_ids"].numel()


def target_logprobs(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T-1) of tokens 1..T-1 under `model` (position t-1 predicts token t) and their target mask
    (B, T-1). `gather_logprobs` never builds a (B, T, V) log-softmax. A flat batch (pad_batch(flat=True)) is
    scored as its one row, then laid out as B right-padded rows: the first token of each example, which the
    previous example's last token "predicts" in the flat row, is never a target, so nothing crosses examples."""
    import torch.nn.functional as F

    from tidyrl.models.kernels import kernels_of
    from tidyrl.models.ops import gather_logprobs

    from tidyrl.models.routing import active, add_aux_loss

    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
    logits_BTV = model(**inputs, use_cache=False).logits
    routing = active(model)
    if routing is not None and routing.keep_logits:  # a mixture of experts' load-balancing loss: real tokens only
        add_aux_loss(routing, [(inputs["attention_mask"].reshape(-1) > 0).float()] if "attention_mask" in inputs
                     else None)
    # The last position predicts nothing: read with token 0 and dropped, rather than slicing the logits (whose
    # backward would be a zero-filled copy of them all).
    logprobs_BT = gather_logprobs(logits_BTV, F.pad(batch["input_ids"][:, 1:], (0, 1)),
                                  fused=kernels_of(model).fused_logprobs)[:, :-1]
    mask_BT = batch["target_mask"][:, 1:]
    if "lengths" not in batch:
        return logprobs_BT, mask_BT
    lengths = batch["lengths"]
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    width = max(lengths) - 1
    # Row b, column j: the log-prob of example b's token j + 1, at flat index start_b + j of the shifted row.
    index_BT = starts[:, None] + torch.arange(width)[None, :]
    valid_BT = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None] - 1
    index_BT = to_device(torch.where(valid_BT, index_BT, 0), logprobs_BT.device)
    valid_BT = to_device(valid_BT, logprobs_BT.device)
    logprobs = torch.where(valid_BT, logprobs_BT[0][index_BT], 0.0)
    mask = torch.where(valid_BT, mask_BT[0][index_BT], 0.0)
    return logprobs, mask


def packed_attention_error(model) -> Optional[str]:
    """Why examples side by side in one row (sft.packing, train.padding_free) would not be scored as they are
    alone, or None when they are. Measured on the loaded model itself, whatever its attention implementation:
    two short random sequences scored apart and packed (positions restarting, no attention mask); examples
    that see each other, or positions that do not restart, change the logits by O(1), rounding by ~1e-6."""
    unwrapped = getattr(model, "module", model)
    config = unwrapped.config
    device = next(unwrapped.parameters()).device
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, config.vocab_size, (n,), generator=generator).to(device) for n in (5, 3))
    was_training = unwrapped.training
    unwrapped.eval()
    with torch.no_grad():
        apart = torch.cat([unwrapped(input_ids=x[None], use_cache=False).logits[0] for x in (a, b)]).float()
        positions = torch.cat([torch.arange(5), torch.arange(3)])[None].to(device)
        # Not to a forward that does not name them: Bloom's in transformers 4 warns that they have no effect
        # (ALiBi) and are deprecated.
        positions = {"position_ids": positions} if "position_ids" in forward_parameters(unwrapped) else {}
        packed = unwrapped(input_ids=torch.cat([a, b])[None], **positions, use_cache=False).logits[0].float()
    unwrapped.train(was_training)
    # Rounding of another shape stays near 1e-6 in float32 (1e-3 in bfloat16); mixing examples, even in a random
    # tiny model, shows at ~5e-3 and up (bloom's ALiBi, OPT's learned positions), in a trained one at O(1).
    full_precision = next(unwrapped.parameters()).dtype in (torch.float32, torch.float64)
    tolerance = 1e-4 if full_precision else 1e-2
    error = float((packed - apart).abs().max()) / max(1.0, float(apart.abs().max()))
    if error <= tolerance:
        return None
    return (f"the model ({config.model_type}, attention {getattr(config, '_attn_implementation', None)!r}) does not "
            f"keep examples apart in one row: packed logits differ from separate ones by {error:.2g} (relative); "
            "its attention or position handling ignores restarting position_ids")


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
"""Attention implementations that run a flat row's examples as separate sequences (varlen kernels): there
padding-free micro-batches cost only their real tokens, so `train.padding_free: null` turns them on."""


def choose_padding_free(cfg, model) -> tuple[bool, list[str]]:
    """train.padding_free resolved for the loaded `model` (null: on with a varlen attention kernel), and notes.
    It and sft.packing need the model to keep examples apart in one row (packed_attention_error, measured):
    if asked for and the model does not, a ConfigError naming the model type, before training starts."""
    from tidyrl.config import ConfigError, packs_rows

    packing = packs_rows(cfg)
    wanted = cfg.train.padding_free
    if wanted is None:
        wanted = getattr(model.config, "_attn_implementation", None) in VARLEN_ATTENTION
    if not (wanted or packing):
        return False, []
    problem = packed_attention_error(model)
    if problem is not None:
        if cfg.train.padding_free is None and not packing:
            return False, [f"padding-free micro-batches off: {problem}"]
        key = "sft.packing" if packing else "train.padding_free"
        raise ConfigError([f"{key}: {problem}. Set {key}=false (train.group_by_length still cuts padding)."])
    return wanted, (["padding-free micro-batches: each micro-batch is one row of its examples, no padding"]
                    if wanted else [])


class OfflineStage(Protocol):
    """What a stage (sft, reward, dpo, ...) supplies to `OfflineRun.train`: its loss and metrics, nothing else.

    sums:        names of the per-micro-batch sums (`loss` first), reduced over processes once per step
    length(i)    tokens of example i (train.group_by_length sorts by it)
    bar:         row metrics shown beside the loss in the progress bar (e.g. rewards/accuracy)
    begin_step(batch)   the global batch's example indices, before its micro-batches (global normalisers)
    micro_batch(idx)    -> (loss, sums): this micro-batch's loss, already divided by the GLOBAL batch's
                        normaliser (so m and W change nothing), and its sums by name
    metrics(sums, batch) -> the row's stage metrics from the reduced sums
    evaluate(idx)       -> sums of a held-out micro-batch under no_grad (eval_sums names them), or None
    eval_metrics(sums, n) -> eval/ metrics from the reduced eval sums over n held-out examples
    """

    sums: tuple[str, ...]
    bar: tuple[str, ...]
    eval_sums: tuple[str, ...]

    def length(self, i: int) -> int: ...

    def begin_step(self, batch: list[int]) -> None: ...

    def micro_batch(self, idx: list[int]) -> tuple[torch.Tensor, dict]: ...

    def metrics(self, sums: dict, batch: list[int]) -> dict: ...

    def evaluate(self, idx: list[int]) -> dict: ...

    def eval_metrics(self, sums: dict, n: int) -> dict: ...


class OfflineRun:
    """One offline run: its accelerator, output folder and resume state, and `train`, the loop every offline
    stage shares (the RL loop's contract: checkpoints every log.save_every steps that resume bit for bit, the
    trackers of log.report_to, a stop on Ctrl-C/SIGTERM with a checkpoint, a clean stop on a NaN loss, the
    end-of-run summary). Built first, so a bad resume_from fails before any data or weights load."""

    def __init__(self, cfg):
        from tidyrl.loops.run.setup import make_accelerator
        from tidyrl.loops.run.steps import check_resume

        self.cfg = cfg
        self.accelerator = make_accelerator(cfg, watch=True)
        self.world_size, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        self.out = Path(cfg.output_dir)
        self.resume_path, self.resumed = check_resume(cfg, self.out, self.accelerator)

    def say(self, lines: Sequence[Optional[str]]) -> None:
        """The run's notes, printed once (main process)."""
        say(lines, main=self.is_main)

    def open_output(self, notes: Sequence[str] = ()) -> None:
        """A new run takes its output folder (refused if it holds another run, unless overwrite); a resumed one
        keeps it (already held). Then the notes are printed."""
        from tidyrl.loops.run.setup import prepare_output_dir

        if self.resumed is None:
            prepare_output_dir(self.out, self.cfg.overwrite, self.accelerator)
        self.say(notes)

    def train(self, stage: OfflineStage, model, optimizer, scheduler, tokenizer, plan: OfflinePlan,
              num_examples: int, eval_examples: int = 0, header: Optional[dict] = None):
        """`_train`; an out-of-memory error ends it with where it struck, the planned and the measured peak, and
        what to change (`loops.run.out_of_memory`)."""
        from tidyrl.loops.run.out_of_memory import out_of_memory
        from tidyrl.models.peak_memory import is_out_of_memory
        from tidyrl.models.routing import aux_loss_coef

        self.probing = False
        # a mixture of experts' load-balancing weight (train.router_aux_loss_coef as the model resolves it), once
        self.aux_coef = aux_loss_coef(self.cfg.train.router_aux_loss_coef, model)
        try:
            return self._train(stage, model, optimizer, scheduler, tokenizer, plan, num_examples, eval_examples,
                               header)
        except BaseException as err:
            if not is_out_of_memory(err):
                raise
            phases = (header or {}).get("memory", {}).get("per_process_bytes")
            raise out_of_memory(err, self.cfg, phases and {k: v["total"] for k, v in phases.items()},
                                self.accelerator.device, self.out, self.rank, probing=self.probing) from err

    def _train(self, stage: OfflineStage, model, optimizer, scheduler, tokenizer, plan: OfflinePlan,
               num_examples: int, eval_examples: int = 0, header: Optional[dict] = None):
        """The loop (DESIGN §2), from step 0 or the resumed checkpoint's step to the plan's last:

            for step: the next B examples of the stream (each dataset epoch a fresh shuffle by seed)
                this process's B/W in micro-batches of m: stage.micro_batch -> backward (synchronised on the last)
                the sums reduced by name -> clip -> optimizer step -> one LR-scheduler step -> one metrics row
                every log.eval_every steps and at the last: the held-out examples scored (eval/ metrics)
                every log.save_every steps: a checkpoint; on Ctrl-C/SIGTERM: a checkpoint, then stop
            final/: the model; the summary

        The skeleton (metrics log, progress bar, stop signals, checkpoint cadence) is the RL loop's,
        `loops.run.steps.Steps`.
        """
        import functools

        from tidyrl.data import PromptStream
        from tidyrl.loops.run.setup import (TrainResult, distribution_of, kernel_override_lines, save_pretrained_atomic,
                                         write_run_header)
        from tidyrl.loops.run.steps import Steps, keep_if_best
        from tidyrl.metrics import format_offline_summary

        cfg, acc = self.cfg, self.accelerator
        probe = self._probe(stage, model, optimizer, plan, num_examples, header)
        step, first, self.best = (self._resume(model, optimizer, scheduler, plan) if self.resumed is not None
                                  else (0, {}, None))
        if self.resumed is None:
            self.start = time.perf_counter()
        write_run_header(cfg, plan, self.out, acc,
                         {**({"eval_examples": eval_examples} if eval_examples else {}), **(header or {}),
                          **({"memory_probe": probe} if probe else {})},
                         resumed=self.resumed is not None)
        stream = PromptStream(num_examples, cfg.seed)
        eval_every = cfg.log.eval_every
        row: dict = {}
        with Steps(cfg, plan, self.out, acc, first_step=step) as steps:
            while step < plan.total_optimizer_steps:
                batch = stream.rollout_indices(step, plan.batch_size)  # global: the same list on every process
                step += 1
                row = self._step(stage, model, optimizer, scheduler, plan, batch, step)
                if eval_examples and (step == plan.total_optimizer_steps or (eval_every and step % eval_every == 0)):
                    row.update(self._evaluate(stage, model, eval_examples))
                    self.best = keep_if_best(acc, cfg, self.out, self.best, row, model, tokenizer)
                if not first:  # the summary's "from" values
                    first = {k: row[k] for k in ("loss", *stage.bar) if row.get(k) is not None}
                steps.record(row)
                steps.bar.advance({"loss": f"{row['loss']:.4f}",
                                   **{k.split("/")[-1]: f"{row[k]:.3f}" for k in stage.bar if row.get(k) is not None}})
                steps.checkpoint_when_due(step, functools.partial(self._save_checkpoint, model, tokenizer, optimizer,
                                                                  scheduler, plan, step, first))
        steps.finished(step)
        final_dir = save_pretrained_atomic(acc, model, tokenizer, self.out / "final", merged=cfg.lora.save_merged)
        if self.is_main:
            print(format_offline_summary(cfg.algorithm, plan, steps.log.timings, time.perf_counter() - self.start,
                                         first, row, self.out, final_dir, steps.log.tracker_locations, self.best,
                                         distribution=distribution_of(acc), overrides=kernel_override_lines(cfg)),
                  flush=True)
        return TrainResult(output_dir=self.out, final_dir=final_dir, plan=plan, metrics=row,
                           is_main_process=self.is_main)

    def _resume(self, model, optimizer, scheduler, plan) -> tuple[int, dict, Optional[dict]]:
        """The checkpoint's optimizer, schedule, random state and counters restored, the metrics rows past its step
        dropped (the remaining steps write them again). Returns (its step, the first row's values, the best)."""
        from tidyrl.checkpoint import restore_optimizer, set_rng_state, truncate_jsonl
        from tidyrl.loops.run.steps import continue_longer

        acc = self.accelerator
        restore_optimizer(self.resumed, "optimizer", model, optimizer)
        scheduler.load_state_dict(self.resumed["scheduler"])
        set_rng_state(self.resumed["rng"])
        state = self.resumed["state"]
        step, first = state["step"], state.get("first_row") or {}
        self.start = time.perf_counter() - state["elapsed_s"]
        note = continue_longer(self.cfg, self.resumed, plan, self.out, acc, [scheduler])
        say(note, main=self.is_main)
        acc.wait_for_everyone()
        if self.is_main:  # the rows the remaining steps write again
            truncate_jsonl(self.out / "metrics.jsonl", lambda row: row["step"] <= step)
        acc.wait_for_everyone()
        return step, first, state.get("best")

    def _probe(self, stage: OfflineStage, model, optimizer, plan: OfflinePlan, num_examples: int,
               header: Optional[dict]) -> Optional[dict]:
        """train.memory_probe: before the first step, the update's worst case once: the global batch of the
        longest examples begun (`stage.begin_step`: its normalisers, KTO's reference point) and a micro-batch of
        the m longest, forward and backward, with a later micro-batch's company (`worst_case.later_micro_batch`;
        under FSDP2 with accumulation a first micro-batch runs before it), no collective of the gradients under DDP,
        no optimizer step, no trace (`worst_case.no_trace`). Returns plan.json's `memory_probe`, or None."""
        from types import SimpleNamespace

        from tidyrl.loops.run.exact_sums import exact_accumulator
        from tidyrl.loops.run.steps import no_sync
        from tidyrl.loops.run.worst_case import figures, later_micro_batch, no_trace, probe_line
        from tidyrl.models import peak_memory
        from tidyrl.models.sharding import is_root_sharded

        if not self.cfg.train.memory_probe:
            return None
        self.probing = True
        order = sorted(range(num_examples), key=lambda i: (-stage.length(i), i))  # the same on every process
        batch, idx = order[: plan.batch_size], order[: plan.micro_batch_size]
        phase = ((header or {}).get("memory") or {}).get("per_process_bytes", {}).get("update")
        planned = phase and SimpleNamespace(total=phase["total"], parts={k: v for k, v in phase.items()
                                                                         if k != "total"})
        sharded, steps = is_root_sharded(model), plan.gradient_accumulation_steps
        shapes = f"{len(idx)} examples of up to {stage.length(idx[0])} tokens"
        t0 = time.perf_counter()
        fresh = not optimizer.state
        with no_trace([model]), peak_memory.measured(self.accelerator.device) as got:
            model.train()
            stage.begin_step(batch)
            exact = exact_accumulator([model]) if self.cfg.train.exact_gradients else None  # (resident in a step)
            with later_micro_batch([(model, optimizer)], steps > 1, sharded):
                for i in range(2 if sharded and steps > 1 else 1):
                    last = i == steps - 1
                    sync = sharded and (exact.micro_batch_sync(last) if exact is not None
                                        else self.cfg.train.sync_each_microbatch or last)
                    with liveness.working("update", f"the worst-case probe: {shapes}"), \
                            no_sync(self.accelerator, [model], sync):
                        loss, _ = stage.micro_batch(idx)
                        self.accelerator.backward(loss)
            del exact
        probe = {"phases": {"update": figures(shapes, got[0], planned, fresh)},
                 "seconds": round(time.perf_counter() - t0, 3)}
        self.probing = False
        self.say([probe_line(probe, "the first step")])
        return probe

    def _step(self, stage: OfflineStage, model, optimizer, scheduler, plan: OfflinePlan, batch: list, step: int
              ) -> dict:
        """One optimizer step on the global `batch`: this process's share in micro-batches of m, accumulated
        (DDP averages over W processes; each loss is this process's share of the global batch loss, scaled by W
        so that the synchronised gradient is the global one), the sums reduced, clipped, stepped. Its metrics
        row. With train.exact_gradients the micro-batches are cut from the whole batch, each one's gradient goes
        onto the integer grid and the processes' integer sums are all-reduced (loops/run/exact_sums.py): no DDP
        synchronisation, no scale by W."""
        from tidyrl.loops.run.exact_sums import exact_accumulator
        from tidyrl.loops.run.steps import apply_update, no_sync
        from tidyrl.models.collectives import Sums, reduce_sum
        from tidyrl.models.routing import replaying

        cfg, acc = self.cfg, self.accelerator
        t0 = time.perf_counter()
        model.train()
        stage.begin_step(batch)
        exact = exact_accumulator([model]) if cfg.train.exact_gradients else None
        parts = micro_batches(batch, plan, self.rank, stage.length if cfg.train.group_by_length else None,
                              whole_batch_first=exact is not None)
        sums = Sums(*stage.sums)
        aux_coef, aux_total = self.aux_coef, 0.0
        for k, idx in enumerate(parts):
            last = k == len(parts) - 1
            sync = exact.micro_batch_sync(last) if exact is not None else cfg.train.sync_each_microbatch or last
            shapes = (f"micro-batch {k + 1} of {len(parts)} of optimizer step {step}: {len(idx)} examples of up to "
                      f"{max(stage.length(i) for i in idx)} tokens")
            with liveness.working("update", shapes), no_sync(acc, [model], sync), \
                    replaying(model, None, keep_logits=aux_coef > 0) as routing:
                loss, values = stage.micro_batch(idx)
                if routing is not None and routing.aux:  # this micro-batch's share of the batch's load-balancing loss
                    aux = sum(routing.aux) * len(idx) / plan.batch_size
                    loss = loss + aux_coef * aux
                    aux_total += float(aux.detach())
                acc.backward(loss if exact is not None else loss * self.world_size)
            if exact is not None:  # this micro-batch's gradient onto the grid (no floating-point sum across them)
                exact.add()
            sums.add(**values)
            liveness.mark(f"micro-batch {k + 1} of {len(parts)} of an optimizer step")
        if exact is not None:  # the integer sums over every process, as the gradients
            exact.reduce(acc)
        totals = sums.reduced(acc)
        [(lr, grad_norm)] = apply_update(
            acc, [(model, optimizer, scheduler)], cfg.train.max_grad_norm, step, totals["loss"], self.out,
            "Lower train.learning_rate, check the data, or set train.max_grad_norm.", exact=exact is not None)
        row = {
            "step": step,
            "epoch": offline_epochs_done(plan, step),
            "examples": step * plan.batch_size,
            "lr": lr,
            "loss": totals["loss"],
            "grad_norm": grad_norm,
            "time_s": time.perf_counter() - self.start,
            **stage.metrics(totals, batch),
            "time/update_s": time.perf_counter() - t0,
        }
        if aux_coef > 0:
            row["moe/aux_loss"] = float(reduce_sum(acc, torch.tensor(aux_total, dtype=torch.float64)))
        if "real_tokens" in totals:  # what padding costs (packing lowers it), and the throughput
            row["padding_fraction"] = 1.0 - totals["real_tokens"] / max(totals["token_cells"], 1.0)
            row["tokens_per_s"] = totals["real_tokens"] / max(row["time/update_s"], 1e-9)
        return row

    def _evaluate(self, stage: OfflineStage, model, n: int) -> dict:
        """The held-out examples 0..n-1, in micro-batches of m split over processes (chunk c on process
        c mod W), under no_grad; the sums reduced by name, then the stage's eval/ metrics."""
        from tidyrl.models.collectives import Sums

        m = self.cfg.train.micro_batch_size
        t0 = time.perf_counter()
        sums = Sums(*stage.eval_sums)
        model.eval()
        with torch.no_grad():
            for c, start in enumerate(range(0, n, m)):
                if c % self.world_size == self.rank:
                    sums.add(**stage.evaluate(list(range(start, min(start + m, n)))))
        model.train()
        return {**stage.eval_metrics(sums.reduced(self.accelerator), n), "time/eval_s": time.perf_counter() - t0}

    def _save_checkpoint(self, model, tokenizer, optimizer, scheduler, plan, step: int, first: dict) -> None:
        """checkpoint-<step> (atomic, tidyrl.checkpoint): written by the main process; under FSDP2 each process
        also writes its shards."""
        from tidyrl.checkpoint import save_checkpoint
        from tidyrl.config import config_to_dict
        from tidyrl.loops.run.setup import distribution_of
        from tidyrl.models.sharding import is_root_sharded

        acc = self.accelerator
        sharded = is_root_sharded(model)
        acc.wait_for_everyone()
        if sharded or self.is_main:
            state = {"step": step, "elapsed_s": time.perf_counter() - self.start, "first_row": first, "best": self.best,
                     "world_size": self.world_size, "distribution": distribution_of(acc), "plan": plan.to_dict(),
                     "config": config_to_dict(self.cfg)}
            save_checkpoint(self.out, step, model=acc.unwrap_model(model), tokenizer=tokenizer, optimizer=optimizer,
                            scheduler=scheduler, state=state, rollout=None, keep_last=self.cfg.log.keep_last)
        acc.wait_for_everyone()

def model_pad_id(tokenizer, eos_ids: Sequence[int]) -> int:
    """Padding filler (masked out everywhere): the tokenizer's pad token, else the first EOS id."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    if eos_ids:
        return int(eos_ids[0])
    raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with; set its pad_token")
