"""KTO (`algorithm: kto`): preference tuning from unpaired examples, explicit from top to bottom.

    tokenise the examples (prompt + completion, a desirable / undesirable label), as DPO tokenises each side
    load the policy and, frozen, the reference: the same starting model
    the reference log-prob of every example, scored once before training (it never changes): a cache
    for each optimizer step (tidyrl.loops.offline.loop.OfflineRun.train, the loop every offline stage shares):
        the next train.batch_size examples of the stream
        the reference point z0 of the WHOLE global batch, under no_grad (KTOStage.begin_step):
            mismatched pairs (prompt of batch[i], completion of batch[i+1 mod B]) for every position i,
            each process scoring its share under the policy and the reference; the log-ratios summed over
            processes: z0 = max(0, their mean)
        micro-batches of m: the KTO loss per example against z0, summed and divided by B -> backward
        clip -> optimizer step -> one LR-scheduler step -> one metrics row
    eval: the held-out examples' loss (against the last step's z0) and implicit rewards
    final/: the policy

Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic Optimization", eq. 8 and §4.1 (z0 from
mismatched pairs of the batch). The pairing is over the global batch in stream order, so z0, and with it the
loss, is the same on any number of processes and for any micro-batch size (TRL pairs within each process's
micro-batch, so its z0 changes with both).
"""

from __future__ import annotations

from typing import Optional

from tidyrl.config import Config
from tidyrl.loops.run.setup import TrainResult, prepare_for_training, weights_device
from tidyrl.models.loading import load_causal_lm, load_model_config, load_policy, load_tokenizer
from tidyrl.models.lora import adapter_note, reference_of
from tidyrl.models.sharding import frozen_device, place_frozen


class KTOStage:
    """The KTO loss on a micro-batch of unpaired examples, against the global batch's reference point."""

    sums = ("loss", "reward_desirable", "desirable", "reward_undesirable", "undesirable", "real_tokens",
            "token_cells")
    bar = ("kl",)
    eval_sums = ("loss", "reward_desirable", "desirable", "reward_undesirable", "undesirable")

    def __init__(self, run, model, ref_model, examples, held_out, ref_cache_N, eval_ref_cache_N, opts, pad_id: int,
                 batch_size: int, max_length: Optional[int], flat: bool):
        self.run, self.model, self.ref_model = run, model, ref_model
        self.examples, self.held_out = examples, held_out
        self.ref_cache_N, self.eval_ref_cache_N = ref_cache_N, eval_ref_cache_N
        self.opts, self.pad_id, self.batch_size, self.max_length, self.flat = opts, pad_id, batch_size, max_length, flat
        self.device = run.accelerator.device
        self.z0 = 0.0

    def length(self, i):
        return len(self.examples[i].sequence.input_ids)

    def _logps(self, model, sequences):
        """Sequence log-probs (b,) of the completions under `model`, and the token cells computed."""
        from tidyrl.algorithms.preference import sequence_logps
        from tidyrl.loops.offline.loop import batch_cells, pad_batch, target_logprobs

        inputs = pad_batch(sequences, self.pad_id, self.device, flat=self.flat)
        return sequence_logps(*target_logprobs(model, inputs)), batch_cells(inputs)

    def begin_step(self, batch):
        """z0 of this global batch: the mean policy/reference log-ratio of its mismatched pairs (x_i, y_{i+1}),
        clamped at 0 and detached (kto_reference_point); each process scores the positions of its share."""
        import torch

        from tidyrl.algorithms.preference import kto_reference_point
        from tidyrl.data.offline import mismatched_sequence
        from tidyrl.models.collectives import reduce_sum

        B, per, rank = len(batch), self.batch_size // self.run.world_size, self.run.rank
        m = self.run.cfg.train.micro_batch_size
        mine = range(rank * per, (rank + 1) * per)
        log_ratios_B = torch.zeros(B, dtype=torch.float64, device=self.device)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(mine.start, mine.stop, m):
                positions = range(start, min(start + m, mine.stop))
                sequences = [mismatched_sequence(self.examples[batch[i]], self.examples[batch[(i + 1) % B]],
                                                 self.max_length) for i in positions]
                policy_B, _ = self._logps(self.model, sequences)
                with reference_of(self.run.accelerator.unwrap_model(self.model), self.ref_model) as reference:
                    reference_B, _ = self._logps(reference, sequences)
                log_ratios_B[positions.start:positions.stop] = (policy_B - reference_B).double()
        self.model.train(was_training)
        # Each position is scored on one process (chunks of m from position 0 whatever W is; 0 elsewhere), so the
        # sum over processes is exact, and the sum over positions, in their order, is the same on any W: z0 and
        # with it each micro-batch's gradient do not depend on the split (train.exact_gradients).
        log_ratios_B = reduce_sum(self.run.accelerator, log_ratios_B)
        self.z0 = float(kto_reference_point(log_ratios_B.sum(), B))

    def _loss(self, examples, ref_B):
        import torch

        from tidyrl.algorithms.preference import kto_loss
        from tidyrl.models.devices import to_device

        policy_B, cells = self._logps(self.model, [e.sequence for e in examples])
        desirable_B = to_device(torch.tensor([e.desirable for e in examples]), policy_B.device)
        o = self.opts
        loss_B, rewards_B = kto_loss(policy_B, to_device(ref_B, policy_B.device), desirable_B, self.z0, o.beta,
                                     o.desirable_weight, o.undesirable_weight)
        d = desirable_B.float()
        sums = {"reward_desirable": (rewards_B * d).sum(), "desirable": d.sum(),
                "reward_undesirable": (rewards_B * (1 - d)).sum(), "undesirable": (1 - d).sum()}
        return loss_B, sums, cells

    def micro_batch(self, idx):
        import torch

        examples = [self.examples[i] for i in idx]
        loss_B, sums, cells = self._loss(examples, self.ref_cache_N[torch.tensor(idx)])
        loss = loss_B.sum() / self.batch_size  # over the whole global batch: m and W change nothing
        return loss, {"loss": loss.detach(), **sums, "real_tokens": sum(len(e.sequence.input_ids) for e in examples),
                      "token_cells": cells}

    def metrics(self, sums, batch):
        chosen = sums["reward_desirable"] / sums["desirable"] if sums["desirable"] else None
        rejected = sums["reward_undesirable"] / sums["undesirable"] if sums["undesirable"] else None
        return {
            "kl": self.z0,  # the reference point z0 of this step's batch
            "rewards/chosen": chosen,  # mean implicit reward beta * log(pi / pi_ref) of the desirable examples
            "rewards/rejected": rejected,  # ... and of the undesirable ones
            "rewards/margin": None if chosen is None or rejected is None else chosen - rejected,
            "desirable_fraction": sums["desirable"] / len(batch),
        }

    def evaluate(self, idx):
        import torch

        loss_B, sums, _ = self._loss([self.held_out[i] for i in idx], self.eval_ref_cache_N[torch.tensor(idx)])
        return {"loss": loss_B.sum(), **sums}

    def eval_metrics(self, sums, n):
        chosen = sums["reward_desirable"] / sums["desirable"] if sums["desirable"] else None
        rejected = sums["reward_undesirable"] / sums["undesirable"] if sums["undesirable"] else None
        return {"eval/loss": sums["loss"] / n,
                "eval/margin": None if chosen is None or rejected is None else chosen - rejected}


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with KTO from a validated Config (see `tidyrl.train`)."""
    import torch

    from tidyrl.loops.offline.dpo import sequence_logps_cache
    from tidyrl.loops.offline.loop import OfflineRun, choose_padding_free, model_pad_id
    from tidyrl.data.offline import completion_eos_ids, kto_key, load_kto_examples, split_train_eval
    from tidyrl.memory.offline import check_offline_memory, memory_header
    from tidyrl.plan import offline_plan_from_config

    run = OfflineRun(cfg)  # a bad resume_from fails here, before anything loads

    # 1. Everything checkable before the models: tokenizer, data, eval split, plan, output folder.
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    examples, notes = load_kto_examples(cfg, tokenizer, eos_ids)
    examples, held_out, eval_notes = split_train_eval(
        cfg, examples, lambda c: load_kto_examples(c, tokenizer, eos_ids)[0], kto_key)
    plan = offline_plan_from_config(cfg, len(examples), run.world_size)
    memory, line = check_offline_memory(cfg, load_model_config(cfg.model), examples, held_out, plan)
    notes.append(line)
    n_d = sum(e.desirable for e in examples)
    ratio = cfg.kto.desirable_weight * n_d / (cfg.kto.undesirable_weight * max(len(examples) - n_d, 1))
    if not 1.0 <= ratio <= 4 / 3:  # Ethayarajh et al. 2024 §4.2: the weighted counts' ratio in [1, 4/3]
        notes.append(f"note: desirable_weight * desirable / (undesirable_weight * undesirable) = {ratio:.2f}; the KTO "
                     "paper recommends 1 to 4/3 (set kto.desirable_weight / kto.undesirable_weight to balance them)")
    run.open_output(notes + eval_notes)
    pad_id = model_pad_id(tokenizer, eos_ids)
    torch.manual_seed(cfg.seed)

    # 2. The policy (the checkpoint's when resuming) and the reference: the starting weights, frozen. With LoRA no
    # second copy: the reference is the policy with its adapter disabled. KTO keeps it for the per-step z0.
    model = load_policy(cfg.model, cfg.model_dtype, cfg.lora if cfg.lora.enabled else None, run.resume_path,
                        device=weights_device(run.accelerator), kernels=cfg.kernels)
    ref_model = None
    if not cfg.lora.enabled:
        # (under FSDP2 sharded like the policy: `place_frozen`)
        ref_model = place_frozen(load_causal_lm(cfg.model, cfg.model_dtype, device=frozen_device(run.accelerator),
                                                kernels=cfg.kernels), run.accelerator)
    flat, pad_notes = choose_padding_free(cfg, model)
    run.say(pad_notes + ([adapter_note(model)] if cfg.lora.enabled else []))
    model, optimizer, scheduler = prepare_for_training(run.accelerator, model, cfg.train, plan)
    m = cfg.train.micro_batch_size

    def cache(items):  # the reference log-prob of each example's completion, once
        if not items:
            return None
        with reference_of(run.accelerator.unwrap_model(model), ref_model) as reference:
            return sequence_logps_cache(run.accelerator, reference, [e.sequence for e in items], pad_id, m)

    ref_cache_N, eval_ref_cache_N = cache(examples), cache(held_out)
    cost = reference_cost(cfg, plan, len(held_out))
    run.say([f"reference: {len(examples) + len(held_out)} examples scored once before training; the z0 pairs: "
             f"{cost['z0_sequences_per_step']} sequences per step under the policy and the reference (no grad)"])

    # 3. The loop: one optimizer step per train.batch_size examples.
    stage = KTOStage(run, model, ref_model, examples, held_out, ref_cache_N, eval_ref_cache_N, cfg.kto, pad_id,
                     plan.batch_size, cfg.data.max_length, flat)
    return run.train(stage, model, optimizer, scheduler, tokenizer, plan, len(examples), len(held_out),
                     header={**cost, **memory_header(memory)})


def reference_cost(cfg, plan, num_eval: int) -> dict:
    """What the reference costs, for plan.json and `tidyrl plan`: every example's completion scored once (cached;
    the reference is frozen), plus each step's mismatched pairs for z0 (B sequences under the policy and the
    reference). `plan`: the run's OfflinePlan; `num_eval`: the held-out examples."""
    B = plan.batch_size
    return {"reference": "examples scored once before training, cached; z0's mismatched pairs every step",
            "reference_sequences": plan.num_examples + num_eval, "z0_sequences_per_step": B,
            "z0_sequences": B * plan.total_optimizer_steps}
