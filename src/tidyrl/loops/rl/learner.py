"""The on-policy RL learner (GRPO, RLOO, PPO, REINFORCE++, CISPO, ...), explicit from top to bottom (DESIGN §3):

    for each rollout:
        the rollout, made, scored, gathered            (tidyrl.rollouts.taking.Rollouts.take: its rewarded episodes,
                                                        made ahead beside training with rollout.lag; old / reference
                                                        / teacher log-probs and values, only where read)
        -> rewards -> advantages                                                      (loops.rl.advantages)
        for each of E passes, for each of M mini-batches:
            micro-batches of m with gradient accumulation -> one optimizer step   (loops.rl.update)
            -> one LR-scheduler step -> one metrics row -> save / evaluate when due   (loops.run.steps.Steps)

All counts come from the plan (tidyrl.plan); what differs between algorithms comes from the algorithm table
(tidyrl.algorithms.table) and what differs between engines from their capabilities: nothing here tests an
algorithm's or an engine's name.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from tidyrl.algorithms.table import ALGORITHMS
from tidyrl.console import say
from tidyrl.config import Config, algorithm_section
from tidyrl.loops.run.setup import (TrainResult, distribution_of, make_accelerator, prepare_for_training,
                                 prepare_output_dir, save_pretrained_atomic, weights_device, write_run_header)
from tidyrl.loops.rl.inputs import check_rl_inputs, loaded_path_note, plan_extras
from tidyrl.loops.rl.checkpoint import RunState, restore_run, rollouts_made_ahead, save_run, saved_made_ahead
from tidyrl.loops.rl.advantages import (GROUP_COUNTS, environment_failure, estimate_advantages, multi_turn_stats,
                                     no_signal_note, rollout_rewards, rollout_stats, sample_row)
from tidyrl.loops.rl.update import (Trainee, UpdateSettings, minibatch, optimizer_step, prepare_critic,
                                    weights_for_later_epochs)
from tidyrl.loops.run.steps import Steps, check_resume, continue_longer, keep_if_best
from tidyrl.models.collectives import reduce_min
from tidyrl.models.loading import load_causal_lm, load_policy
from tidyrl.models.lora import adapter_note
from tidyrl.models.routing import aux_loss_coef, expert_load, load_metrics, moe_layers
from tidyrl.models.sharding import is_sharded
from tidyrl.plan import epochs_done
from tidyrl.rollouts.making import DynamicSampling, Rescoring, RolloutSource
from tidyrl.rollouts.producer import DynamicSamplingError, make_producers
from tidyrl.rollouts.scoring import Scorers, correction_of, model_tokens
from tidyrl.rollouts.taking import Rollouts
from tidyrl.rollouts.weights import behaviour_copy

__all__ = ["run", "DynamicSamplingError"]


def recorded_auto_sizes(out: Path) -> Optional[dict]:
    """plan.json's `auto_batch_sizes` of the run a resume continues (None where it chose none)."""
    import json

    path = out / "plan.json"
    return json.loads(path.read_text()).get("auto_batch_sizes") if path.exists() else None


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with an on-policy RL algorithm from a validated Config (see `tidyrl.train`)."""
    return RLRun(cfg, base_dir).run()


class RLRun:
    """One run's state; `run()` is the loop."""

    def __init__(self, cfg: Config, base_dir: Optional[str]):
        import torch

        from tidyrl.data import PromptStream
        from tidyrl.engines import resume_note
        from tidyrl.rewards.reward_models import RunningMoments

        self.cfg, self.spec, self.algo = cfg, ALGORITHMS[cfg.algorithm], algorithm_section(cfg)
        self.accelerator = make_accelerator(cfg, watch=True)
        self.world_size, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        self.out = Path(cfg.output_dir)
        # Everything cheap and checkable first: checkpoint, model and tokenizer paths, data, prompt lengths, plan,
        # rewards, output folder. No weights are loaded before all of it has passed.
        self.resume_path, self.resumed = check_resume(cfg, self.out, self.accelerator)
        self.inputs = inputs = check_rl_inputs(cfg, base_dir, self.world_size,
                                               recorded_auto=recorded_auto_sizes(self.out) if self.resumed else None,
                                               smallest=functools.partial(reduce_min, self.accelerator))
        self.plan, self.tokenizer = inputs.plan, inputs.tokenizer
        self.env_pool = None
        if inputs.environment is not None:
            from tidyrl.environments import EnvironmentPool

            self.env_pool = EnvironmentPool(cfg.environment.timeout_s, cfg.environment.workers)
        sampler_note = self.resumed and resume_note(cfg.rollout.engine, self.resumed["state"])
        for line in (inputs.report, inputs.eval_report, sampler_note):
            self._say(line)
        # rewards[i].normalize: running moments of that reward's scores over the whole run (global batch).
        self.state = RunState({f.name: RunningMoments() for f, c in zip(inputs.reward_fns, cfg.rewards) if c.normalize})
        self.stream = PromptStream(len(inputs.dataset), cfg.seed)
        if inputs.critic:
            critic = inputs.critic
            self._say(f"critic initialised from {critic['critic_model']} ({critic['critic_model_reason']})")
        if self.resumed is None:
            prepare_output_dir(self.out, cfg.overwrite, self.accelerator)
        torch.manual_seed(cfg.seed)

    def _say(self, text) -> None:
        say(text, main=self.is_main)

    def _load_models(self) -> None:
        import torch

        from tidyrl.algorithms.ppo import AdaptiveKLController, FixedKLController
        from tidyrl.models.sequences import eos_token_ids, pad_token_id
        from tidyrl.models.sharding import frozen_device, place_frozen
        from tidyrl.rewards.reward_models import RewardModel

        cfg, a = self.cfg, self.algo
        # A resumed run continues from the checkpoint's weights; the reference stays the starting model.
        model = load_policy(cfg.model, cfg.model_dtype, cfg.lora if cfg.lora.enabled else None, self.resume_path,
                            device=weights_device(self.accelerator), kernels=cfg.kernels)
        self._say(loaded_path_note("policy", model, self.inputs.paths))
        # The reference of the KL penalty: a second, frozen copy of the starting model; with LoRA, none is loaded:
        # the policy with its adapter disabled is the starting model (`lora.reference_of`).
        self.use_reference = a.kl_coef > 0
        self.ref_model = None
        if self.use_reference and not cfg.lora.enabled:  # (under FSDP2 sharded like the policy: `place_frozen`)
            self.ref_model = place_frozen(load_causal_lm(cfg.model, cfg.model_dtype, kernels=cfg.kernels,
                                                         device=frozen_device(self.accelerator)), self.accelerator)
            if is_sharded(self.ref_model):
                self._say(f"KL reference: sharded like the policy, {self.world_size} shards")
        self.teacher = load_teacher(cfg, self.accelerator, self.tokenizer, eos_token_ids(model, self.tokenizer),
                                    self._say) if self.spec.teacher else None
        self._say(adapter_note(model))
        for reward in self.inputs.reward_fns:  # reward models: weights now, placed like the reference
            if isinstance(reward.fn, RewardModel):
                reward.fn.model = place_frozen(reward.fn.load(frozen_device(self.accelerator)).model, self.accelerator)
        self.eos_ids = eos_token_ids(model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.eos_ids)
        self.trainee = Trainee(*prepare_for_training(self.accelerator, model, cfg.train, self.plan))
        if cfg.train.exact_gradients:  # every forward of these the model's own one pass, as FSDP2 runs it
            from tidyrl.models.forward import exact_forward

            for scorer in (self.trainee.model, self.ref_model, self.teacher):
                if isinstance(scorer, torch.nn.Module):
                    exact_forward(scorer)
        self.behaviour = None
        policy = self.accelerator.unwrap_model(self.trainee.model)
        if cfg.rollout.lag > 0 and not is_sharded(policy):
            # the weights that generate, a version behind: a frozen copy the launches load (under FSDP2 none: the
            # servers hold that version, synced from the snapshot gathered at its launch)
            self.behaviour = behaviour_copy(policy)
        if self.spec.critic:  # PPO's value model, from the checkpoint on a resume
            critic_path = str(self.resume_path / "critic") if self.resume_path else self.inputs.critic["critic_model"]
            prepare_critic(self.trainee, critic_path, cfg, self.plan, self.accelerator)
        if self.spec.kl_in == "reward":  # the KL coefficient of the rewards: fixed, or adaptive (Ziegler et al. 2019)
            self.state.kl_control = (AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon)
                               if getattr(a, "adaptive_kl", False) else FixedKLController(a.kl_coef))
        self._make_producers()

    def _make_producers(self) -> None:
        """rollout.engine for this process, the source of the training rollouts (`rollouts.making`), the producer of
        the held-out episodes, and the run's rollouts (`rollouts.taking.Rollouts`: made ahead with a lag)."""
        from tidyrl.engines import make_engine
        from tidyrl.rewards.reward_models import RewardModel

        cfg, ro, plan = self.cfg, self.cfg.rollout, self.plan
        longest = max(len(p) for p in [*self.inputs.prompt_ids, *(self.inputs.eval_prompt_ids or [])])
        policy = self.accelerator.unwrap_model(self.trainee.model)
        self.engine = make_engine(cfg, policy if self.behaviour is None else self.behaviour,
                                  self.accelerator.device.type, longest + ro.max_new_tokens)
        # Truncated importance sampling (Yao et al. 2025): where and with what cap, decided once for every reader.
        self.correction = correction_of(ro, plan.minibatches_per_epoch, self.engine.capabilities.default_tis_cap)
        # A mixture of experts' routes, where the engine returns them: replayed (rollout.routing_replay) or compared
        self.moe_layers = moe_layers(policy)
        self.records_routes = bool(self.moe_layers) and self.engine.capabilities.records_routes
        if self.moe_layers and ro.routing_replay and not self.records_routes:
            self._say(f"routing replay: off, the {self.engine.name} engine returns no routes of a mixture of "
                      "experts; the trainer routes every token itself (docs/moe.md)")
        producer, self.eval_producer = make_producers(cfg, self.inputs, self.engine, self.eos_ids, self.pad_id,
                                                      self.env_pool, record_routes=self.records_routes)
        per_proc = plan.episodes_per_rollout_per_process
        # rollout.lag with top_k/top_p on an engine with its own weights: its log-probs are renormalised over the
        # kept tokens, so the behaviour log-probs are recomputed by the frozen copy (`making.with_behaviour_logprobs`)
        rescore = ro.filtered_sampling and not self.engine.capabilities.samples_trained_weights
        self.source = RolloutSource(
            self.engine, producer, self.stream, plan.prompts_per_rollout, plan.samples_per_prompt,
            range(self.rank * per_proc, (self.rank + 1) * per_proc), policy, self.behaviour,
            dynamic=DynamicSampling(ro.max_sampling_rounds, ro.on_sampling_cap) if ro.dynamic_sampling else None,
            accelerator=self.accelerator,
            rescore=Rescoring(ro.temperature, ro.forward_batch_size, cfg.model_fast_paths) if rescore else None)
        # rollout.lag: rollouts made ahead, on a background thread beside the updates (one process, or no collective
        # in the making: dynamic sampling gathers its counts across processes, and a sharded reward model's forward
        # all-gathers its weights), else on this thread when taken.
        collective = ro.dynamic_sampling or any(
            is_sharded(r.fn.model) for r in self.inputs.reward_fns if isinstance(r.fn, RewardModel))
        self.rollouts = Rollouts(self.source, lag=ro.lag, total=plan.rollouts, pad_id=self.pad_id,
                                 background=self.world_size == 1 or not collective)
        self.update_settings = UpdateSettings.of_run(cfg, self.algo, self.spec, self.correction,
                                                     aux_loss_coef(cfg.train.router_aux_loss_coef, policy))

    def run(self) -> TrainResult:
        """The loop (`_run`); an out-of-memory error ends it with where it struck, the planned and the measured
        peak, and what to change (`loops.run.out_of_memory`)."""
        from tidyrl.loops.run.out_of_memory import out_of_memory
        from tidyrl.models.peak_memory import is_out_of_memory

        self.probing = False
        try:
            return self._run()
        except BaseException as err:
            if not is_out_of_memory(err):
                raise
            memory = self.inputs.memory
            raise out_of_memory(err, self.cfg, memory and {p.name: p.total for p in memory.phases},
                                self.accelerator.device, self.out, self.rank, probing=self.probing,
                                share=self.plan.episodes_per_rollout_per_process) from err

    def _probe(self) -> Optional[dict]:
        """train.memory_probe: each phase once at its largest shapes, before the first rollout (`loops.rl.probe`)."""
        if not self.cfg.train.memory_probe:
            return None
        from tidyrl.loops.rl.probe import run_probe
        from tidyrl.loops.run.worst_case import probe_line

        self.probing = True
        probe = run_probe(self)
        self.probing = False
        self._say(probe_line(probe))
        return probe

    def _run(self) -> TrainResult:
        from tidyrl.metrics import STEP_METRICS

        self._load_models()
        cfg, plan = self.cfg, self.plan
        probe = self._probe()
        per_rollout = plan.optimizer_steps_per_rollout
        step, elapsed, self.first_reward, unfinished = 0, 0.0, None, None
        extras = plan_extras(cfg, plan, self.inputs.critic, self.inputs.eval_prompt_ids, self.inputs.memory,
                             self.inputs.paths, self.inputs.auto)
        write_run_header(cfg, plan, self.out, self.accelerator,
                         {**extras, **({"memory_probe": probe} if probe else {})}, resumed=self.resumed is not None)
        if self.resumed is not None:
            step, elapsed, self.first_reward, unfinished, made_ahead = restore_run(
                self.resumed, accelerator=self.accelerator, out=self.out, trainee=self.trainee, state=self.state,
                plan=plan)
            self.rollouts.restore(rollouts_made_ahead(made_ahead, self.rank, self.world_size, self.pad_id))
            t = self.trainee
            self._say(continue_longer(cfg, self.resumed, plan, self.out, self.accelerator,
                                      [s for s in (t.scheduler, t.critic_scheduler) if s is not None]))
        self.start = time.perf_counter() - elapsed
        self.env_errors = []
        self.said_no_signal = False
        row, last_reward = {}, None
        with Steps(cfg, plan, self.out, self.accelerator, first_step=step) as steps:
            try:
                for r in range(step // per_rollout, plan.rollouts):
                    if unfinished is not None:  # resumed inside this rollout: the saved one, not a new one
                        (rollout, stats), unfinished = unfinished, None
                    else:
                        rollout, stats = self._new_rollout(r, step, steps.log.samples)
                    self.first_reward = stats["reward_mean"] if self.first_reward is None else self.first_reward
                    last_reward = stats["reward_mean"]
                    for j in range(step - r * per_rollout, per_rollout):
                        step += 1
                        step_stats, seen = optimizer_step(rollout, minibatch(plan, cfg.seed, r, j), step,
                                                          trainee=self.trainee, settings=self.update_settings,
                                                          plan=plan, accelerator=self.accelerator, out=self.out)
                        if seen is not None:  # the importance weights of its first step, for the later epochs
                            rollout = weights_for_later_epochs(rollout, seen, self.correction)
                        # Measured in the rollout's first step (importance weights from its forward): the rollout's
                        # own figures, on every row of it, as when measured before the update.
                        stats.update({k: v for k, v in step_stats.items() if k.startswith("mismatch/")})
                        values = {"step": step, "rollout": r + 1, "episodes": (r + 1) * plan.episodes_per_rollout,
                                  "epoch": epochs_done(plan, r + 1), **step_stats, **stats,
                                  "time_s": time.perf_counter() - self.start}
                        # The fixed fields of DESIGN §5 first, in their documented order, then the extras.
                        row = {k: values.pop(k) for k in STEP_METRICS} | values
                        self._evaluate_when_due(step, row)
                        steps.record(row)
                        steps.bar.step(stats["reward_mean"], row["episodes"])
                        inside = rollout if j < per_rollout - 1 else None
                        steps.checkpoint_when_due(step, functools.partial(self._save, step, inside, stats))
            finally:
                steps.log.samples.close()
                self.rollouts.close()
                if self.env_pool is not None:
                    self.env_pool.close()
        steps.finished(step)
        return self._finish(row, last_reward, steps.log)

    def _evaluate_when_due(self, step: int, row: dict) -> None:
        every = self.cfg.log.eval_every
        if self.eval_producer and (step == self.plan.total_optimizer_steps or (every and step % every == 0)):
            row.update(self.evaluate())
            self.state.best = keep_if_best(self.accelerator, self.cfg, self.out, self.state.best, row,
                                           self.trainee.model, self.tokenizer)

    def _save(self, step: int, inside, stats: dict) -> None:
        """checkpoint-<step>, with the unfinished rollout (`inside`) and the rollouts made ahead (waited for where
        still under way): a resume takes them instead of making them."""
        ahead = saved_made_ahead(self.rollouts.pending(), self.world_size)
        save_run(step, accelerator=self.accelerator, out=self.out, trainee=self.trainee, tokenizer=self.tokenizer,
                 state=self.state, plan=self.plan, cfg=self.cfg, rollout=inside, stats=stats,
                 elapsed=time.perf_counter() - self.start, first_reward=self.first_reward, ahead=ahead)

    def _finish(self, row: dict, last_reward, log) -> TrainResult:
        from tidyrl.loops.run.setup import kernel_override_lines
        from tidyrl.metrics import format_summary

        critic = self.trainee.critic
        final_dir = save_pretrained_atomic(self.accelerator, self.trainee.model, self.tokenizer, self.out / "final",
                                           extra_models={"critic": critic} if critic is not None else None,
                                           merged=self.cfg.lora.save_merged)
        if self.is_main:
            print(format_summary(self.plan, log.timings, time.perf_counter() - self.start, self.first_reward,
                                 last_reward, self.out, final_dir, log.tracker_locations,
                                 {k: v for k, v in row.items() if k.startswith("eval/")}, self.state.best,
                                 self.state.group_totals, engine=self.engine.name,
                                 distribution=distribution_of(self.accelerator),
                                 overrides=kernel_override_lines(self.cfg)), flush=True)
        return TrainResult(self.out, final_dir, self.plan, row, self.first_reward, last_reward, self.is_main)

    def _new_rollout(self, r: int, step: int, samples_log):
        """take_rollout(r), its samples.jsonl rows written and dynamic sampling's counts added up; a reward that
        fails (raises, NaN, inf, ...) stops the run with where it stopped."""
        from tidyrl.checkpoint import last_good_checkpoint
        from tidyrl.rewards import RewardError

        try:
            rollout, stats, samples = self.take_rollout(r)
        except RewardError as err:
            raise RewardError(f"{err}\nStopped in rollout {r + 1}, after optimizer step {step}; "
                              f"{last_good_checkpoint(self.out)}.") from None
        failed = stats.get("env/error_fraction", 0.0)
        if failed > self.cfg.environment.max_error_fraction:
            self._stop_on_environment_errors(r, step, failed)
        for sample in samples:
            samples_log.write({"rollout": r + 1, "step": step, **sample})
        for key in GROUP_COUNTS:  # dynamic sampling's totals, for the summary
            if key in stats:
                self.state.group_totals[key] = self.state.group_totals.get(key, 0) + stats[key]
        return rollout, stats

    def _stop_on_environment_errors(self, r: int, step: int, failed: float) -> None:
        """More than environment.max_error_fraction of rollout r's episodes failed: keep the steps done (a
        checkpoint, so a resume continues exactly once the environment works) and stop with what to check."""
        if step > 0:
            self._save(step, None, {})
        raise environment_failure(self.cfg, self.plan, r, step, failed, self.env_errors)

    def _scorers(self, policy) -> Scorers:
        """The learner's models as they are now, which score the rollout it takes (`rollouts.scoring`)."""
        ro, plan = self.cfg.rollout, self.plan
        critic = self.trainee.critic
        # Old log-probs are read after the rollout's first optimizer step (E*M > 1), by a KL in the reward, and by
        # a teacher's advantages (log pi_T - log pi_S on each sampled token).
        keep_old = (plan.optimizer_steps_per_rollout > 1 or (self.use_reference and self.spec.kl_in == "reward")
                    or self.teacher is not None)
        return Scorers(policy, self.correction, ro.temperature, ro.forward_batch_size, self.cfg.model_fast_paths,
                       keep_old, replay=ro.routing_replay, use_reference=self.use_reference, reference=self.ref_model,
                       critic=None if critic is None else self.accelerator.unwrap_model(critic), teacher=self.teacher)

    def take_rollout(self, r: int):
        """Rollout `r` (0-based), made (or made ahead at rollout.lag), scored with the learner's models now and
        gathered (every process holds all R, so mini-batches are the same whatever W is: `rollouts.taking`), then
        its rewards and advantages. Returns (the Rollout, its metrics, its samples.jsonl rows)."""
        from tidyrl.metrics import sample_episodes

        policy = self.accelerator.unwrap_model(self.trainee.model)
        policy.eval()
        rollout = self.rollouts.take(r, self._scorers(policy))
        raw_per_fn, scores, overlong = rollout_rewards(rollout, self.source.producer.reward_fns,
                                                       self.state.reward_moments, self.cfg.rollout, self.algo)
        kl_control = self.state.kl_control
        # The KL in the reward reads the old log-probs: the sampler's (with a lag, of older weights) or the trainer's.
        old_version = rollout.version if self.correction.old_from_sampler else r
        estimate = estimate_advantages(self.spec, self.algo, rollout, scores, k=self.plan.samples_per_prompt,
                                       beta=kl_control.value if kl_control else self.algo.kl_coef,
                                       use_reference=self.use_reference, policy_is_reference=(old_version == 0))
        if kl_control is not None and "rollout_kl" in estimate.stats:  # this rollout used beta_t; next beta_t+1
            kl_control.update(estimate.stats["rollout_kl"], n_steps=self.plan.episodes_per_rollout)
        rollout = replace(rollout, advantages=estimate.advantages, returns=estimate.returns)
        stats = rollout_stats(rollout, scores, raw_per_fn, overlong, estimate.stats)
        if stats["advantage_abs_mean"] == 0.0 and not self.said_no_signal:  # said once: a flat reward teaches nothing
            self.said_no_signal = True
            self._say(no_signal_note(r, len(rollout), scores))
        if rollout.action_mask is not None:  # multi-turn: turns, environment errors (said once)
            turns, self.env_errors, notes = multi_turn_stats(r, rollout)
            stats.update(turns)
            for note in notes:
                self._say(note)
        stats.update(rollout.info)  # its making's and scoring's metrics (rollouts.taking)
        if rollout.completion_routes is not None:  # the experts the sampler sent the model's tokens to
            load = expert_load(rollout.completion_routes, self.moe_layers[0].num_experts, model_tokens(rollout))
            stats.update(load_metrics(load, self.moe_layers))
        k = self.plan.samples_per_prompt
        # One sample of each of the first prompts (then second samples...), by global index: the same on any W.
        shown = sample_episodes(len(rollout) // k, k, self.cfg.log.samples_per_rollout) if self.is_main else []
        if self.is_main and rollout.error_texts:  # and every episode that ended on an error, with it
            shown += [e for e, text in enumerate(rollout.error_texts) if text and e not in shown]
        samples = [sample_row(self.tokenizer, rollout, e, k, rollout.prompts[e // k], scores, raw_per_fn)
                   for e in shown]
        return rollout, stats, samples

    def evaluate(self) -> dict:
        """The held-out prompts through the rollout path, with the current policy (`rollouts.evaluation`)."""
        policy = self.accelerator.unwrap_model(self.trainee.model)
        policy.eval()
        k = 1 if self.cfg.log.eval_decoding == "greedy" else self.cfg.rollout.samples_per_prompt
        return self.rollouts.evaluate(self.eval_producer, policy, k, len(self.inputs.eval_prompt_ids))


def load_teacher(cfg: Config, accelerator, tokenizer, eos_ids, say):
    """On-policy distillation's teacher, as the run's `teacher` section names it: served by vLLM
    (`engines.server.ServerScorer`); frozen beside the policy (under FSDP2 sharded like the KL reference: it scores
    the same episodes in the same chunks); or, of another tokenizer, whole on every process, scoring the episodes'
    text mapped by characters (`rollouts.teacher.CrossTokenizerTeacher`)."""
    from tidyrl.models.sharding import frozen_device, place_frozen

    if cfg.teacher.url:
        from tidyrl.engines.server import ServerScorer

        return ServerScorer([cfg.teacher.url], timeout_s=cfg.server.timeout_s, retries=cfg.server.retries)
    if not cfg.teacher.cross_tokenizer:
        teacher = place_frozen(load_causal_lm(cfg.teacher.model, cfg.model_dtype, kernels=cfg.kernels,
                                              device=frozen_device(accelerator)), accelerator)
        if is_sharded(teacher):
            say(f"teacher: sharded like the policy, {accelerator.num_processes} shards")
        return teacher
    from tidyrl.models.loading import load_tokenizer
    from tidyrl.rollouts.teacher import CrossTokenizerTeacher

    ro = cfg.rollout
    teacher = load_causal_lm(cfg.teacher.model, cfg.model_dtype, device=accelerator.device, kernels=cfg.kernels)
    return CrossTokenizerTeacher(teacher.eval().requires_grad_(False), load_tokenizer(cfg.teacher.model), tokenizer,
                                 eos_ids, temperature=ro.temperature, chunk_size=ro.forward_batch_size,
                                 fast_path=cfg.model_fast_paths)
