"""The on-policy RL loop (GRPO, RLOO), explicit from top to bottom (DESIGN §3).

    for each rollout:
        draw P prompts -> generate k completions each -> rewards
        -> old / reference log-probs (only when needed) -> advantages
        for each of E passes, for each of M mini-batches:
            micro-batches of m with gradient accumulation -> one optimizer step
            -> one LR-scheduler step -> one metrics row

All counts come from the plan (tidyrl.plan); nothing here recomputes them.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Optional

from tidyrl.config import Config
from tidyrl.loops.common import (TrainResult, build_optimizer, build_scheduler, enable_gradient_checkpointing,
                                 load_causal_lm, load_tokenizer, make_accelerator, prepare_output_dir,
                                 save_pretrained_atomic, write_run_header)
from tidyrl.plan import epochs_done, plan_from_config

def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with GRPO or RLOO from a validated Config (see `tidyrl.train`)."""
    return _RLRun(cfg, base_dir).run()


class _RLRun:
    """State of one run; `run()` is the loop. Split into small methods only where it reads better."""

    def __init__(self, cfg: Config, base_dir: Optional[str]):
        import torch

        from tidyrl.data import PromptStream, load_prompt_dataset, other_columns
        from tidyrl.rewards import build_reward_functions

        self.cfg = cfg
        self.algo = cfg.grpo if cfg.algorithm == "grpo" else cfg.rloo
        self.accelerator = make_accelerator()
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process

        # Everything cheap and checkable first: data, plan, rewards, output folder. No model yet.
        self.dataset = load_prompt_dataset(cfg.data.path, cfg.data.prompt_column, cfg.data.split)
        self.plan = plan_from_config(cfg, len(self.dataset), self.world_size)
        self.columns = other_columns(self.dataset, cfg.data.prompt_column)
        self.reward_fns = build_reward_functions(cfg.rewards, base_dir=base_dir)
        self.stream = PromptStream(len(self.dataset), cfg.seed)
        self.out = Path(cfg.output_dir)
        prepare_output_dir(self.out, cfg.overwrite, self.accelerator)
        torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ setup
    def _load_models(self) -> None:
        from tidyrl.data import render_prompt
        from tidyrl.rollout import eos_token_ids, pad_token_id

        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.tokenizer or cfg.model)
        render_prompt(self.dataset[0][cfg.data.prompt_column], self.tokenizer)  # chat template errors now
        self.model = load_causal_lm(cfg.model, cfg.model_dtype)
        if cfg.train.gradient_checkpointing:
            enable_gradient_checkpointing(self.model)
        self.ref_model = None
        if self.algo.kl_coef > 0:
            self.ref_model = load_causal_lm(cfg.model, cfg.model_dtype).to(self.accelerator.device)
            self.ref_model.eval().requires_grad_(False)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.eos_ids)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.train.lr_scheduler, self.plan)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        from tidyrl.metrics import STEP_METRICS, JsonlWriter, ProgressBar

        self._load_models()
        cfg, plan = self.cfg, self.plan
        write_run_header(cfg, plan, self.out, self.accelerator)
        metrics_log = JsonlWriter(self.out / "metrics.jsonl", enabled=self.is_main)
        samples_log = JsonlWriter(self.out / "samples.jsonl", enabled=self.is_main)
        bar = ProgressBar(plan.total_optimizer_steps, enabled=self.is_main and cfg.log.progress_bar)

        self.start = time.perf_counter()
        step, row, first_reward, last_reward = 0, {}, None, None
        try:
            for r in range(plan.rollouts):
                rollout, stats = self.make_rollout(r)
                samples_log_rows = stats.pop("_samples")
                for sample in samples_log_rows:
                    samples_log.write({"rollout": r + 1, "step": step, **sample})
                first_reward = stats["reward_mean"] if first_reward is None else first_reward
                last_reward = stats["reward_mean"]
                for epoch in range(plan.epochs_per_rollout):
                    order = self._episode_order(r, epoch)
                    for mb in range(plan.minibatches_per_epoch):
                        step += 1
                        size = plan.episodes_per_minibatch
                        minibatch = order[mb * size: (mb + 1) * size]
                        step_stats = self.optimizer_step(rollout, minibatch)
                        values = {
                            "step": step,
                            "rollout": r + 1,
                            "episodes": (r + 1) * plan.episodes_per_rollout,
                            "epoch": epochs_done(plan, r + 1),
                            **step_stats,
                            **stats,
                            "time_s": time.perf_counter() - self.start,
                        }
                        # The fixed fields of DESIGN §5 first, in their documented order, then the extras.
                        row = {k: values.pop(k) for k in STEP_METRICS} | values
                        if step % cfg.log.log_every == 0 or step == plan.total_optimizer_steps:
                            metrics_log.write(row)
                        bar.step(stats["reward_mean"], row["episodes"])
        finally:  # whatever happens, the bar is closed and every row written so far is on disk
            bar.close()
            metrics_log.close()
            samples_log.close()
        if bar.n not in (0, plan.total_optimizer_steps) or step != plan.total_optimizer_steps:
            raise AssertionError(f"ran {step} optimizer steps, plan says {plan.total_optimizer_steps}")
        final_dir = save_pretrained_atomic(self.accelerator, self.model, self.tokenizer, self.out / "final")
        return TrainResult(self.out, final_dir, plan, row, first_reward, last_reward, self.is_main)

    # ------------------------------------------------------------------ one rollout
    def make_rollout(self, r: int):
        """Generate, reward and score rollout `r` (0-based). Returns the global Rollout (every process
        holds all R episodes, so mini-batches are the same whatever W is) and its metrics."""
        import torch

        from tidyrl.algorithms.advantages import grpo_advantages, kl_shaped_rewards, rloo_advantages
        from tidyrl.algorithms.kl import kl_per_token
        from tidyrl.data import encode_prompts
        from tidyrl.rewards import compute_rewards
        from tidyrl.rollout import Rollout, generate, left_pad, sample_seed, score_logprobs

        cfg, plan, ro = self.cfg, self.plan, self.cfg.rollout
        k = plan.samples_per_prompt
        policy = self.accelerator.unwrap_model(self.model)
        policy.eval()

        prompt_rows = self.dataset[self.stream.rollout_indices(r, plan.prompts_per_rollout)]  # columns -> P values
        per_proc = plan.episodes_per_rollout_per_process
        episodes = range(self.rank * per_proc, (self.rank + 1) * per_proc)  # this process's global episode ids
        prompts = [prompt_rows[cfg.data.prompt_column][e // k] for e in episodes]
        columns = {c: [prompt_rows[c][e // k] for e in episodes] for c in self.columns}

        t0 = time.perf_counter()
        prompt_ids = encode_prompts(prompts, self.tokenizer)
        ids, mask, truncated = generate(
            policy, prompt_ids, sample_keys=[sample_seed(cfg.seed, r, e) for e in episodes],
            max_new_tokens=ro.max_new_tokens, min_new_tokens=ro.min_new_tokens, eos_ids=self.eos_ids,
            pad_id=self.pad_id, batch_size=ro.generation_batch_size, temperature=ro.temperature, top_p=ro.top_p,
            top_k=ro.top_k,
        )
        t_generate = time.perf_counter() - t0

        lengths = mask.sum(1).long().tolist()
        completion_ids = [ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        result = compute_rewards(self.reward_fns, prompts=prompts, completions=completions,
                                 completion_ids=completion_ids, columns=columns)
        t_reward = time.perf_counter() - t0

        p_ids, p_mask = left_pad(prompt_ids, self.pad_id)
        local = Rollout(p_ids, p_mask, ids, mask, truncated)
        per_fn_local = {name: torch.tensor([math.nan if v is None else float(v) for v in values])
                        for name, values in result.per_function.items()}
        rollout = self._gather_rollout(local)
        scores = self._gather(torch.tensor(result.total, dtype=torch.float32))  # (R,)
        per_fn = {name: self._gather(v) for name, v in per_fn_local.items()}

        t0 = time.perf_counter()
        # Old log-probs differ from the current ones only after the first optimizer step of the rollout,
        # so they are scored only when E*M > 1 (or when RLOO needs them for its KL-shaped reward).
        need_policy_lp = plan.optimizer_steps_per_rollout > 1 or (cfg.algorithm == "rloo" and self.ref_model)
        if need_policy_lp:
            rollout.old_logprobs = score_logprobs(policy, rollout, ro.temperature, ro.forward_batch_size)
        if self.ref_model is not None:
            rollout.ref_logprobs = score_logprobs(self.ref_model, rollout, ro.temperature, ro.forward_batch_size)
        t_score = time.perf_counter() - t0

        if cfg.algorithm == "grpo":
            rollout.advantages = grpo_advantages(scores, k, scale=self.algo.scale_rewards)
        else:
            shaped = scores
            if self.ref_model is not None:
                kl_BT = kl_per_token(rollout.old_logprobs, rollout.ref_logprobs, self.algo.kl_estimator)
                shaped = kl_shaped_rewards(scores, kl_BT, rollout.completion_mask, self.algo.kl_coef)
            rollout.advantages = rloo_advantages(shaped, k)

        lengths_R = rollout.completion_mask.sum(1)
        stats: dict[str, Any] = {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "completion_length_mean": float(lengths_R.mean()),
            "truncated_fraction": float(rollout.truncated.float().mean()),
            "advantage_abs_mean": float(rollout.advantages.abs().mean()),
        }
        for name, v in per_fn.items():
            scored = v[~torch.isnan(v)]
            stats[f"reward/{name}"] = float(scored.mean()) if len(scored) else None
        stats["time/generate_s"] = t_generate
        stats["time/reward_s"] = t_reward
        stats["time/score_s"] = t_score
        stats["_samples"] = [
            {
                "prompt": prompts[i] if isinstance(prompts[i], str) else list(prompts[i]),
                "completion": completions[i],
                "reward": result.total[i],
                "rewards": {name: values[i] for name, values in result.per_function.items()},
                "advantage": float(rollout.advantages[episodes[i]]),
                "truncated": bool(truncated[i]),
            }
            for i in range(min(cfg.log.samples_per_rollout, len(prompts)))
        ] if self.is_main else []
        return rollout, stats

    def _episode_order(self, r: int, epoch: int):
        """A fresh shuffle of the R episodes for each pass, keyed by (seed, rollout, pass); the same on
        every process, so the global mini-batches do not depend on W."""
        import torch

        from tidyrl.rollout import sample_seed

        gen = torch.Generator().manual_seed(sample_seed(self.cfg.seed, r, -1 - epoch))
        return torch.randperm(self.plan.episodes_per_rollout, generator=gen)

    # ------------------------------------------------------------------ one optimizer step
    def optimizer_step(self, rollout, minibatch) -> dict:
        """One optimizer step over a global mini-batch of episode indices: this process takes its slice,
        in micro-batches of m with gradient accumulation; the loss is normalised over the whole mini-batch."""
        import torch

        from tidyrl.algorithms.kl import kl_per_token
        from tidyrl.algorithms.losses import aggregate_loss, clipped_policy_loss, loss_normaliser
        from tidyrl.rollout import chunks, completion_logprobs

        cfg, plan, algo = self.cfg, self.plan, self.algo
        model = self.model
        model.train()
        t0 = time.perf_counter()
        # Normaliser of the whole global mini-batch (every process holds the global rollout, so no all-reduce).
        mb_mask = rollout.completion_mask[minibatch]
        normaliser = loss_normaliser(algo.loss_aggregation, num_tokens=float(mb_mask.sum()),
                                     num_sequences=len(minibatch), max_new_tokens=cfg.rollout.max_new_tokens)
        per_proc = plan.episodes_per_minibatch_per_process
        mine = minibatch[self.rank * per_proc: (self.rank + 1) * per_proc].tolist()
        micro_batches = list(chunks(mine, plan.micro_batch_size))
        assert len(micro_batches) == plan.gradient_accumulation_steps
        sums = torch.zeros(5, dtype=torch.float64)  # loss, kl*tokens, entropy*tokens, clipped, tokens
        for i, idx in enumerate(micro_batches):
            part = rollout.select(idx)
            mask = part.completion_mask.to(self.accelerator.device)
            sync = cfg.train.sync_each_microbatch or i == len(micro_batches) - 1
            ctx = contextlib.nullcontext() if sync else self.accelerator.no_sync(model)
            with ctx:
                logprobs, entropy = completion_logprobs(model, part, cfg.rollout.temperature, with_entropy=True)
                old = part.old_logprobs.to(logprobs.device) if part.old_logprobs is not None else logprobs.detach()
                adv = part.advantages.to(logprobs.device)
                token_loss, clipped = clipped_policy_loss(logprobs, old, adv, algo.clip_eps, algo.clip_eps_high)
                kl = None
                if part.ref_logprobs is not None:
                    kl = kl_per_token(logprobs, part.ref_logprobs.to(logprobs.device), algo.kl_estimator)
                    if cfg.algorithm == "grpo":  # GRPO: KL in the loss (Shao et al. 2024, eq. 3)
                        token_loss = token_loss + algo.kl_coef * kl
                loss = aggregate_loss(token_loss, mask, algo.loss_aggregation, normaliser)
                # DDP averages gradients over W processes; our loss is already this process's share of the
                # global mean, so scale by W to make the synchronised gradient the global one.
                self.accelerator.backward(loss * self.world_size)
            with torch.no_grad():
                sums += torch.tensor([
                    float(loss),
                    float((kl * mask).sum()) if kl is not None else 0.0,
                    float((entropy * mask).sum()),
                    float((clipped.float() * mask).sum()),
                    float(mask.sum()),
                ], dtype=torch.float64)
        sums = self._reduce_sum(sums)
        max_norm = cfg.train.max_grad_norm if cfg.train.max_grad_norm > 0 else math.inf
        grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()  # exactly once per optimizer step, in every process
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(float(sums[4]), 1.0)
        return {
            "lr": lr,
            "loss": float(sums[0]),
            "kl": float(sums[1]) / tokens if rollout.ref_logprobs is not None else None,
            "entropy": float(sums[2]) / tokens,
            "clip_fraction": float(sums[3]) / tokens,
            "grad_norm": float(grad_norm),
            "time/update_s": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ multi-process helpers
    def _gather(self, tensor):
        """Concatenate a per-process tensor over processes (rank order = global episode order)."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def _reduce_sum(self, tensor):
        if self.world_size == 1:
            return tensor
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum").cpu()

    def _gather_rollout(self, local):
        """Every process gets all R episodes (ids and masks are small), padded to common widths."""
        if self.world_size == 1:
            return local

        from tidyrl.rollout import Rollout

        acc = self.accelerator

        def cat(t, pad_first=False, pad_index=0):
            t = acc.pad_across_processes(t.to(acc.device), dim=1, pad_index=pad_index, pad_first=pad_first)
            return acc.gather(t).cpu()

        return Rollout(
            prompt_ids=cat(local.prompt_ids, pad_first=True, pad_index=self.pad_id),
            prompt_mask=cat(local.prompt_mask, pad_first=True),
            completion_ids=cat(local.completion_ids, pad_index=self.pad_id),
            completion_mask=cat(local.completion_mask),
            truncated=acc.gather(local.truncated.to(acc.device)).cpu(),
        )
