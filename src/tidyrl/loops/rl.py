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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from tidyrl.config import Config, algorithm_section
from tidyrl.loops.common import (TrainResult, make_accelerator, prepare_for_training, prepare_output_dir,
                                 save_pretrained_atomic, write_run_header)
from tidyrl.models.loading import (ModelLoadError, load_causal_lm, load_critic, load_model_config, load_policy,
                                   load_tokenizer)
from tidyrl.loops.training import (StopSignals, Sums, TrainingInterrupted, agree, apply_update, check_resume,
                                   keep_if_best, no_sync, reduce_max, reduce_sum)
from tidyrl.lora import adapter_folder_problem, adapter_note, reference_of
from tidyrl.sharding import ShardingError, full_weights, sharding_kind
from tidyrl.plan import epochs_done, plan_from_config


def run(cfg: Config, base_dir: Optional[str] = None) -> TrainResult:
    """Train with GRPO or RLOO from a validated Config (see `tidyrl.train`)."""
    return _RLRun(cfg, base_dir).run()


def encode_prompt_set(cfg: Config, dataset, tokenizer, model_config, tools=None):
    """Encode every prompt once (rendering chat messages) and apply data.overlong_prompts against
    data.max_prompt_length (default: the model's context minus max_new_tokens).
    Returns (the dataset of the prompts kept, their token ids, a one-line report or "")."""
    from tidyrl.data import encode_prompts, fit_prompts

    from tidyrl.config import ConfigError

    limit = cfg.data.max_prompt_length
    context = getattr(model_config, "max_position_embeddings", None)
    new = cfg.rollout.max_new_tokens
    # A prompt and its completion must fit the model's context: beyond it, models with learned positions fail
    # mid-run and rotary ones read positions they were never trained on. Checked before anything is encoded.
    if context is not None and limit is None and new >= context:
        raise ConfigError([f"rollout.max_new_tokens={new} leaves no room for a prompt in the model's context of "
                           f"{context} tokens (max_position_embeddings); lower rollout.max_new_tokens."])
    if context is not None and limit is not None and limit + new > context:
        raise ConfigError([f"data.max_prompt_length={limit} + rollout.max_new_tokens={new} = {limit + new} tokens "
                           f"overflow the model's context of {context} (max_position_embeddings); lower one of them "
                           f"(e.g. data.max_prompt_length={max(context - new, 0)}) or leave data.max_prompt_length "
                           "unset (then it is the context minus max_new_tokens)."])
    encoded = encode_prompts(dataset[cfg.data.prompt_column], tokenizer, tools)
    if limit is None and context is not None:
        limit = context - new
    if limit is None:
        return dataset, encoded, ""
    kept, encoded, report = fit_prompts(encoded, limit, cfg.data.overlong_prompts)
    return (dataset if len(kept) == len(dataset) else dataset.select(kept)), encoded, report


@dataclass
class RLInputs:
    """What `check_rl_inputs` read and checked, for the run to use."""

    tokenizer: Any
    dataset: Any
    """The prompts kept (data.overlong_prompts)."""
    prompt_ids: list
    """Their token ids."""
    report: str
    """A line on overlong prompts, or ""."""
    plan: Any
    columns: list
    """The data columns offered to reward functions."""
    reward_fns: list
    critic: Optional[dict]
    """PPO: {"critic_model": path, "critic_model_reason": why}."""
    eval_dataset: Any = None
    """The held-out prompts (data.eval_path, or data.eval_fraction of data.path), or None."""
    eval_prompt_ids: Optional[list] = None
    """Their token ids."""
    eval_report: str = ""
    """A line on the held-out prompts (and any shared with training), or ""."""
    environment: Any = None
    """environment.factory, imported (multi-turn rollouts), or None."""
    tools: Optional[list] = None
    """The environment's tool schemas (its `tool_schemas()`), rendered into every prompt, or None."""


def plan_extras(cfg, critic_choice: Optional[dict], eval_prompt_ids) -> dict:
    """What plan.json (and `tidyrl plan`) say beside the plan's counts: the engine that generates, PPO's critic
    and why, the held-out prompts."""
    return {"engine": cfg.rollout.engine, **(critic_choice or {}),
            **({"eval_prompts": len(eval_prompt_ids)} if eval_prompt_ids else {})}


def check_rl_inputs(cfg: Config, base_dir: Optional[str], world_size: int) -> RLInputs:
    """Everything an RL run can check before any weights load, in order: the policy and tokenizer exist (at once,
    offline too), the data file reads, every prompt fits the context with max_new_tokens, the plan's sizes
    divide, the reward functions import, the reward models exist, every argument a reward function needs is a
    data column, and PPO's critic can read the policy's tokens. `tidyrl plan` runs the same checks, so a plan
    that prints is a run that starts."""
    from tidyrl.data import load_prompt_dataset, load_rl_prompts, other_columns
    from tidyrl.rewards import build_reward_functions, check_reward_columns

    model_config = load_model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, "tokenizer" if cfg.tokenizer else "model")
    dataset = load_rl_prompts(cfg)
    eval_dataset = None
    if cfg.data.eval_path:
        eval_dataset = load_prompt_dataset(cfg.data.eval_path, cfg.data.prompt_column, cfg.data.split)
    elif cfg.data.eval_fraction:  # held out before anything else: never trained on, not in the plan's N
        from tidyrl.offline_data import held_out_rows

        held = held_out_rows(len(dataset), cfg.data.eval_fraction, cfg.seed)
        eval_dataset = dataset.select(held)
        dataset = dataset.select(sorted(set(range(len(dataset))) - set(held)))
    environment, tools = None, None
    if cfg.environment.factory is not None:  # imported now: a typo fails here, before any weights load
        from tidyrl.rewards import load_reward_function

        environment = load_reward_function(cfg.environment.factory, base_dir, key="environment.factory")
        schemas = getattr(environment, "tool_schemas", None)
        tools = schemas() if callable(schemas) else None
        if tools:
            check_template_renders_tools(tokenizer, tools, cfg.environment.factory)
    dataset, prompt_ids, report = encode_prompt_set(cfg, dataset, tokenizer, model_config, tools)
    plan = plan_from_config(cfg, len(dataset), world_size)
    columns = other_columns(dataset, cfg.data.prompt_column)
    reward_fns = build_reward_functions(cfg.rewards, base_dir=base_dir, forward_batch_size=cfg.rollout.forward_batch_size)
    check_reward_columns(reward_fns, columns)
    eval_prompt_ids, eval_report = None, ""
    if eval_dataset is not None:
        eval_dataset, eval_prompt_ids, fit_report = encode_prompt_set(cfg, eval_dataset, tokenizer, model_config)
        check_reward_columns(reward_fns, other_columns(eval_dataset, cfg.data.prompt_column))
        source = f"data.eval_path = {cfg.data.eval_path!r}" if cfg.data.eval_path else \
            f"data.eval_fraction = {cfg.data.eval_fraction}"
        k = 1 if cfg.log.eval_decoding == "greedy" else cfg.rollout.samples_per_prompt
        eval_report = (f"eval: {len(eval_dataset)} held-out prompts ({source}), {k} {cfg.log.eval_decoding} "
                       f"completion(s) each, after every {cfg.log.eval_every or 'last'} optimizer step"
                       f"{'s' if cfg.log.eval_every != 1 else ''}" + (f"; held-out {fit_report}" if fit_report else ""))
        trained = {tuple(ids) for ids in prompt_ids}
        shared = sum(tuple(ids) in trained for ids in eval_prompt_ids)
        if shared:
            eval_report += (f"\ntidyrl: warning: {shared} of {len(eval_prompt_ids)} held-out prompts are also "
                            "training prompts; their eval metrics measure memory, not generalisation")
    if cfg.rollout.engine == "vllm":  # the KV cache holds a generate call's sequences at once, or the run stops
        from tidyrl.config import ConfigError
        from tidyrl.loops.common import cuda_in_use
        from tidyrl.models.engines import kv_cache_problem, vllm_model_problem

        longest = max(len(p) for p in [*prompt_ids, *(eval_prompt_ids or [])]) + cfg.rollout.max_new_tokens
        problem = vllm_model_problem(model_config, on_cpu=not cuda_in_use()) or \
            kv_cache_problem(model_config, cfg.model_dtype, cfg.vllm.kv_cache_gb,
                             plan.episodes_per_rollout_per_process, longest)
        if problem:
            raise ConfigError([problem])
    critic = None
    if cfg.algorithm == "ppo":
        path, why = choose_critic(cfg, tokenizer.get_vocab())
        critic = {"critic_model": path, "critic_model_reason": why}
    return RLInputs(tokenizer, dataset, prompt_ids, report, plan, columns, reward_fns, critic, eval_dataset,
                    eval_prompt_ids, eval_report, environment, tools)


GROUP_COUNTS = ("groups/generated", "groups/kept", "groups/filled", "groups/dropped")
"""rollout.dynamic_sampling's per-rollout counts, summed over the run for the summary."""


def _short_prompt(prompt, limit: int = 60) -> str:
    """A prompt in an error line: its text (a chat prompt: its last message), cut."""
    text = prompt if isinstance(prompt, str) else str((prompt or [{}])[-1].get("content", ""))
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_template_renders_tools(tokenizer, tools: list, factory) -> None:
    """A tool environment's schemas must reach the model: refuse a chat template that renders a conversation the
    same with and without `tools` (it has no tool section, so the model would never learn the tools exist)."""
    from tidyrl.config import ConfigError

    probe = [{"role": "user", "content": "hi"}]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError([f"environment.factory: {factory} offers tools, but the tokenizer has no chat template to "
                           "render them; use a model whose template supports tools"])
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template failed on the schemas
        raise ConfigError([f"environment.factory: the chat template cannot render {factory}'s tool schemas "
                           f"({type(err).__name__}: {err}); check the tools' type hints and docstrings"]) from None
    without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if with_tools == without:
        raise ConfigError([f"environment.factory: {factory} offers tools ({', '.join(t['function']['name'] for t in tools)}), "
                           "but the model's chat template ignores `tools` (no tool section): the model would never "
                           "see them. Use a model whose template renders tools, or describe the tools in the prompt "
                           "and use an environment without tool_schemas"])


class DynamicSamplingError(RuntimeError):
    """rollout.dynamic_sampling ran out of rounds with too few informative groups, and on_sampling_cap=error."""


def choose_critic(cfg: Config, policy_vocab: dict) -> tuple[str, str]:
    """PPO's value model: (path, why it was chosen). `critic.model` when set, else the first reward model that
    shares the policy's vocabulary, else the policy. The critic reads the policy's tokens, so a model of another
    vocabulary cannot be one: as a default it is passed over (the reward model still scores with its own
    tokenizer); named explicitly, it is an error. Reads configs and tokenizer files only, no weights."""
    from transformers import AutoTokenizer

    def vocabulary(path):
        try:
            return AutoTokenizer.from_pretrained(path).get_vocab()
        except (OSError, ValueError):
            return None  # a folder without tokenizer files: trust it

    def usable(path, key):
        load_model_config(path, key)  # exists and loads
        problem = adapter_folder_problem(path, key, "a critic")
        if problem:
            raise ModelLoadError(problem)
        vocab = vocabulary(path)
        return vocab is None or vocab == policy_vocab

    if cfg.critic.model:
        if not usable(cfg.critic.model, "critic.model"):
            raise ModelLoadError(
                f"critic.model={cfg.critic.model!r} has another vocabulary than the policy's tokenizer, but the "
                "critic reads the policy's tokens. Set critic.model to the policy (or a model sharing its "
                "tokenizer), or leave it unset to take the default."
            )
        return cfg.critic.model, "critic.model"
    passed_over = []
    for reward in cfg.rewards:
        if reward.model and reward.model not in passed_over:
            if usable(reward.model, "critic.model (default: the first reward model of the policy's vocabulary)"):
                return reward.model, "the first reward model sharing the policy's vocabulary"
            passed_over.append(reward.model)
    problem = adapter_folder_problem(cfg.model, "critic.model (default: the policy)", "a critic")
    if problem:
        raise ModelLoadError(problem)
    if passed_over:
        return cfg.model, (f"the policy: the reward model{'s' if len(passed_over) > 1 else ''} "
                           f"{', '.join(passed_over)} read{'' if len(passed_over) > 1 else 's'} another vocabulary")
    return cfg.model, "the policy: no reward model to start from"


class _RLRun:
    """State of one run; `run()` is the loop. Split into small methods only where it reads better."""

    def __init__(self, cfg: Config, base_dir: Optional[str]):
        import torch

        from tidyrl.data import PromptStream
        from tidyrl.reward_model import RunningMoments

        self.cfg = cfg
        self.algo = algorithm_section(cfg)  # cfg.grpo, cfg.rloo, cfg.ppo or cfg.reinforce_pp
        self.accelerator = make_accelerator(cfg)
        self.world_size = self.accelerator.num_processes
        self.rank = self.accelerator.process_index
        self.is_main = self.accelerator.is_main_process
        self.out = Path(cfg.output_dir)

        # Everything cheap and checkable first: checkpoint, model and tokenizer paths, data, prompt
        # lengths, plan, rewards, output folder. No weights are loaded before all of it has passed.
        self.resume_path, self.resumed = check_resume(cfg, self.out, self.accelerator)
        inputs = check_rl_inputs(cfg, base_dir, self.world_size)
        self.tokenizer, self.dataset, self.prompt_ids = inputs.tokenizer, inputs.dataset, inputs.prompt_ids
        self.plan, self.columns, self.reward_fns = inputs.plan, inputs.columns, inputs.reward_fns
        self.eval_dataset, self.eval_prompt_ids = inputs.eval_dataset, inputs.eval_prompt_ids
        self.environment, self.tools = inputs.environment, inputs.tools
        self.env_pool = None
        if self.environment is not None:
            from tidyrl.environments import EnvironmentPool

            self.env_pool = EnvironmentPool(cfg.environment.timeout_s, cfg.environment.workers)
        from tidyrl.models.generation import sampler_change_note

        sampler_note = self.resumed and sampler_change_note(self.resumed["state"], cfg.rollout.engine)
        for line in (inputs.report, inputs.eval_report, sampler_note):
            if line and self.is_main:
                print(f"tidyrl: {line}", flush=True)
        # rewards[i].normalize: running moments of that reward's scores over the whole run (global batch).
        self.reward_moments = {f.name: RunningMoments() for f, c in zip(self.reward_fns, cfg.rewards) if c.normalize}
        self.stream = PromptStream(len(self.dataset), cfg.seed)
        self.critic_choice = inputs.critic  # PPO: {"critic_model": path, "critic_model_reason": why}, for plan.json
        self.critic_path = inputs.critic["critic_model"] if inputs.critic else None
        if inputs.critic and self.is_main:
            print(f"tidyrl: critic initialised from {inputs.critic['critic_model']} "
                  f"({inputs.critic['critic_model_reason']})", flush=True)
        if self.resumed is None:
            prepare_output_dir(self.out, cfg.overwrite, self.accelerator)
        torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ setup
    def _load_models(self) -> None:
        from tidyrl.reward_model import RewardModel
        from tidyrl.models.generation import eos_token_ids, pad_token_id

        cfg = self.cfg
        # A resumed run continues from the checkpoint's weights; the reference stays the starting model.
        self.model = load_policy(cfg, self.resume_path)
        # The reference of the KL penalty: a second, frozen copy of the starting model; with LoRA, none is
        # loaded: the policy with its adapter disabled is the starting model (`lora.reference_of`).
        self.use_reference = self.algo.kl_coef > 0
        self.ref_model = None
        if self.use_reference and not cfg.lora.enabled:
            self.ref_model = load_causal_lm(cfg.model, cfg.model_dtype).to(self.accelerator.device)
            self.ref_model.eval().requires_grad_(False)
        note = adapter_note(self.model)
        if note and self.is_main:
            print(f"tidyrl: {note}", flush=True)
        for reward in self.reward_fns:  # reward models: weights now, on this process's device
            if isinstance(reward.fn, RewardModel):
                reward.fn.load(self.accelerator.device)
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self.pad_id = pad_token_id(self.tokenizer, self.eos_ids)
        self.model, self.optimizer, self.scheduler = prepare_for_training(self.accelerator, self.model, cfg.train,
                                                                          self.plan)
        self.critic = self.critic_optimizer = self.critic_scheduler = None
        self.kl_control = None
        if cfg.algorithm == "ppo":
            from dataclasses import replace

            from tidyrl.algorithms.ppo import AdaptiveKLController, FixedKLController

            critic_path = str(self.resume_path / "critic") if self.resume_path else self.critic_path
            # Its own learning rate and schedule, on the same optimizer-step count and warmup as the policy.
            critic_train = replace(cfg.train, learning_rate=cfg.critic.learning_rate
                                   if cfg.critic.learning_rate is not None else cfg.train.learning_rate)
            self.critic, self.critic_optimizer, self.critic_scheduler = prepare_for_training(
                self.accelerator, load_critic(critic_path, cfg.model_dtype), critic_train, self.plan,
                cfg.critic.lr_scheduler)
            a = self.algo
            self.kl_control = (AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.adaptive_kl
                               else FixedKLController(a.kl_coef))
        self._make_engine()

    def _weights_for_engine(self, policy):
        """Around a generate call: the builtin engine samples from the policy itself, whose FSDP2 shards are then
        gathered once for the whole call (`full_weights`); vLLM samples from its own copy, nothing to gather."""
        return full_weights(policy) if self.engine.name == "builtin" else contextlib.nullcontext()

    def _make_engine(self) -> None:
        """rollout.engine: the builtin decode loop on the policy, or an in-process vLLM engine per process."""
        from tidyrl.models.engines import make_engine

        cfg = self.cfg
        longest = max(len(p) for p in [*self.prompt_ids, *(self.eval_prompt_ids or [])])
        self.engine = make_engine(cfg, self.accelerator.unwrap_model(self.model), self.accelerator.device.type,
                                  longest + cfg.rollout.max_new_tokens)
        ro = cfg.rollout
        # Truncated importance sampling (Yao et al. 2025): on by default where the sampler is another program.
        self.tis_cap = ro.tis_cap if ro.tis_cap is not None else (2.0 if self.engine.name == "vllm" else 0.0)

    def _restore(self) -> tuple[int, float, Optional[float], Optional[tuple]]:
        """Load the trainer state of the checkpoint being resumed; drop the metrics and samples rows that
        the remaining steps will write again. Returns (step, elapsed seconds, first reward, the unfinished
        rollout and its stats or None)."""
        from tidyrl.checkpoint import set_rng_state, truncate_jsonl
        from tidyrl.rollout import Rollout

        loaded, plan = self.resumed, self.plan
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        set_rng_state(loaded["rng"])
        state = loaded["state"]
        for name, moments in self.reward_moments.items():
            moments.load_state_dict(state["reward_moments"][name])
        if self.critic is not None:
            self.critic_optimizer.load_state_dict(loaded["critic_optimizer"])
            self.critic_scheduler.load_state_dict(loaded["critic_scheduler"])
            self.kl_control.load_state_dict(state["kl_control"])
        step = state["step"]
        self.best = state.get("best")
        self.group_totals = state.get("group_totals") or {}
        started = -(-step // plan.optimizer_steps_per_rollout)  # rollouts begun: ceil(step / (E*M))
        self.accelerator.wait_for_everyone()
        if self.is_main:
            truncate_jsonl(self.out / "metrics.jsonl", lambda row: row["step"] <= step)
            truncate_jsonl(self.out / "samples.jsonl", lambda row: row["rollout"] <= started)
        self.accelerator.wait_for_everyone()
        unfinished = None
        if loaded["rollout"] is not None:
            saved = loaded["rollout"]
            unfinished = (Rollout(**saved["rollout"]), saved["stats"])
        return step, state["elapsed_s"], state.get("first_reward_mean"), unfinished

    def _save_checkpoint(self, step: int, rollout, stats: dict, elapsed: float, first_reward) -> None:
        """checkpoint-<step> (main process), with the unfinished rollout when the save falls inside one."""
        import dataclasses

        from tidyrl.checkpoint import save_checkpoint
        from tidyrl.config import config_to_dict
        from tidyrl.models.generation import SAMPLER

        if sharding_kind(self.accelerator) != "none":  # only a stop signal gets here (save_every is refused)
            raise ShardingError(f"stopped after optimizer step {step}; under FSDP no checkpoint can be written yet "
                                "(docs/memory.md), so the run must start again.")
        self.accelerator.wait_for_everyone()
        if self.is_main:
            state = {"step": step, "rollouts_started": -(-step // self.plan.optimizer_steps_per_rollout),
                     "elapsed_s": elapsed, "first_reward_mean": first_reward,
                     "reward_moments": {name: m.state_dict() for name, m in self.reward_moments.items()},
                     "kl_control": self.kl_control.state_dict() if self.kl_control else None,
                     "best": self.best, "group_totals": self.group_totals,
                     "world_size": self.world_size, "plan": self.plan.to_dict(), "config": config_to_dict(self.cfg),
                     "sampler": SAMPLER}
            unfinished = None
            if rollout is not None:
                tensors = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
                unfinished = {"rollout": tensors, "stats": stats}
            save_checkpoint(self.out, step, model=self.accelerator.unwrap_model(self.model),
                            tokenizer=self.tokenizer, optimizer=self.optimizer, scheduler=self.scheduler,
                            state=state, rollout=unfinished, keep_last=self.cfg.log.keep_last,
                            critic=None if self.critic is None else (self.accelerator.unwrap_model(self.critic),
                                                                     self.critic_optimizer, self.critic_scheduler))
        self.accelerator.wait_for_everyone()

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        from tidyrl.metrics import STEP_METRICS, ProgressBar, RunLogger, format_summary

        self._load_models()
        cfg, plan = self.cfg, self.plan
        steps_per_rollout = plan.optimizer_steps_per_rollout
        step, elapsed, first_reward, unfinished = 0, 0.0, None, None
        self.best, self.group_totals = None, {}
        if self.resumed is not None:
            step, elapsed, first_reward, unfinished = self._restore()
        else:
            write_run_header(cfg, plan, self.out, self.accelerator,
                             plan_extras(cfg, self.critic_choice, self.eval_prompt_ids))
        # metrics.jsonl + samples.jsonl, forwarded to the trackers of log.report_to (main process only).
        metrics_log = RunLogger(self.out, cfg, plan, enabled=self.is_main, first_step=step)
        samples_log = metrics_log.samples
        bar = ProgressBar(plan.total_optimizer_steps, enabled=self.is_main and cfg.log.progress_bar, initial=step)

        self.start = time.perf_counter() - elapsed
        row, last_reward = {}, None
        try:
            with StopSignals() as stop:
                for r in range(step // steps_per_rollout, plan.rollouts):
                    if unfinished is not None:  # resumed inside this rollout: the saved one, not a new one
                        rollout, stats = unfinished
                        unfinished = None
                    else:
                        rollout, stats = self._make_rollout_or_stop(r, step)
                        for sample in stats.pop("_samples"):
                            samples_log.write({"rollout": r + 1, "step": step, **sample})
                        for key in GROUP_COUNTS:  # dynamic sampling's totals, for the summary
                            if key in stats:
                                self.group_totals[key] = self.group_totals.get(key, 0) + stats[key]
                    first_reward = stats["reward_mean"] if first_reward is None else first_reward
                    last_reward = stats["reward_mean"]
                    for j in range(step - r * steps_per_rollout, steps_per_rollout):
                        epoch, mb = divmod(j, plan.minibatches_per_epoch)
                        size = plan.episodes_per_minibatch
                        minibatch = self._episode_order(r, epoch)[mb * size: (mb + 1) * size]
                        step += 1
                        step_stats = self.optimizer_step(rollout, minibatch, step)
                        # Measured in the rollout's first step (importance weights from its forward): the rollout's
                        # own figures, on every row of it, as when measured before the update.
                        stats.update({k: v for k, v in step_stats.items() if k.startswith("mismatch/")})
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
                        if self.eval_prompt_ids and (step == plan.total_optimizer_steps or (
                                cfg.log.eval_every and step % cfg.log.eval_every == 0)):
                            row.update(self.evaluate())
                            self.best = keep_if_best(self.accelerator, cfg, self.out, self.best, row, self.model,
                                                     self.tokenizer)
                        if step % cfg.log.log_every == 0 or step == plan.total_optimizer_steps:
                            metrics_log.write(row)
                        metrics_log.observe(row)  # every step: totals for the end-of-run summary
                        bar.step(stats["reward_mean"], row["episodes"])
                        inside = rollout if j < steps_per_rollout - 1 else None
                        if agree(self.accelerator, stop.requested):
                            self._save_checkpoint(step, inside, stats, time.perf_counter() - self.start,
                                                  first_reward)
                            raise TrainingInterrupted(
                                f"stopped by {stop.name} after optimizer step {step} of "
                                f"{plan.total_optimizer_steps}; checkpoint saved to {self.out}/checkpoint-{step}. "
                                f"Resume with: tidyrl train CONFIG.yaml resume_from=latest"
                            )
                        if cfg.log.save_every and step % cfg.log.save_every == 0 and step < plan.total_optimizer_steps:
                            self._save_checkpoint(step, inside, stats, time.perf_counter() - self.start,
                                                  first_reward)
        finally:  # whatever happens, the bar is closed and every row written so far is on disk
            bar.close()
            metrics_log.close()
            samples_log.close()
            if self.env_pool is not None:
                self.env_pool.close()
        if bar.n not in (0, plan.total_optimizer_steps) or step != plan.total_optimizer_steps:
            raise AssertionError(f"ran {step} optimizer steps, plan says {plan.total_optimizer_steps}")
        final_dir = save_pretrained_atomic(self.accelerator, self.model, self.tokenizer, self.out / "final",
                                           extra_models={"critic": self.critic} if self.critic is not None else None,
                                           merged=cfg.lora.save_merged)
        if self.is_main:
            print(format_summary(plan, metrics_log.timings, time.perf_counter() - self.start, first_reward,
                                 last_reward, self.out, final_dir, metrics_log.tracker_locations,
                                 {k: v for k, v in row.items() if k.startswith("eval/")}, self.best,
                                 self.group_totals, engine=self.engine.name), flush=True)
        return TrainResult(self.out, final_dir, plan, row, first_reward, last_reward, self.is_main)

    def _make_rollout_or_stop(self, r: int, step: int):
        """make_rollout(r); a reward that fails (raises, NaN, inf, ...) stops the run with where it stopped."""
        from tidyrl.checkpoint import last_good_checkpoint
        from tidyrl.rewards import RewardError

        try:
            return self.make_rollout(r)
        except RewardError as err:
            raise RewardError(f"{err}\nStopped in rollout {r + 1}, after optimizer step {step}; "
                              f"{last_good_checkpoint(self.out)}.") from None

    def make_rollout(self, r: int):
        """Generate, reward and score rollout `r` (0-based). Returns the global Rollout (every process
        holds all R episodes, so mini-batches are the same whatever W is) and its metrics."""
        import torch

        from tidyrl.algorithms.losses import masked_mean
        from tidyrl.metrics import sample_episodes
        from tidyrl.models.generation import left_pad
        from tidyrl.rollout import Rollout, score_logprobs, score_values

        cfg, plan, ro = self.cfg, self.plan, self.cfg.rollout
        k = plan.samples_per_prompt
        policy = self.accelerator.unwrap_model(self.model)
        policy.eval()

        indices = self.stream.rollout_indices(r, plan.prompts_per_rollout)  # P prompt rows
        per_proc = plan.episodes_per_rollout_per_process
        episodes = range(self.rank * per_proc, (self.rank + 1) * per_proc)  # this process's global episode ids
        # The engine holds exactly the policy's weights before it samples (the builtin one is the policy: nothing
        # to copy; vLLM's sync gathers an FSDP-sharded policy one parameter at a time).
        t_sync = self.engine.sync(policy)
        t0 = time.perf_counter()
        sampled = self._sample_round(policy, r, 0, indices, episodes)
        group_prompts = self.dataset[indices][cfg.data.prompt_column]  # the P groups' prompts, for samples.jsonl
        sampling_stats: dict[str, Any] = {}
        if ro.dynamic_sampling:  # DAPO: more rounds until P groups have unequal rewards
            sampled, group_prompts, sampling_stats = self._dynamic_sampling(policy, r, indices, episodes, sampled)
        self.engine.release()  # vLLM on CUDA: its memory goes to scoring and the update until the next sync
        t_reward = sampled["reward_s"]
        t_generate = time.perf_counter() - t0 - t_reward
        ids, mask, truncated, sampled_logprobs = sampled["ids"], sampled["mask"], sampled["truncated"], \
            sampled["logprobs"]

        p_ids, p_mask = left_pad(sampled["prompt_ids"], self.pad_id)
        local = Rollout(p_ids, p_mask, ids, mask, truncated, action_mask=sampled.get("action"))
        t0 = time.perf_counter()
        # Each process scores its own R/W episodes; the results are gathered with the rollout.
        # Old log-probs differ from the current ones only after the first optimizer step of the rollout,
        # so they are kept only when E*M > 1, or when the KL penalty sits in the reward (all but GRPO). The
        # sampling pass computed them with the same weights (no second forward pass; equal up to rounding).
        kl_in_reward = self.use_reference and cfg.algorithm != "grpo"
        if plan.optimizer_steps_per_rollout > 1 or kl_in_reward:
            local.old_logprobs = sampled_logprobs
        mismatch = {}
        if self.tis_cap > 0 and ro.behaviour_logprobs == "sampler" and plan.minibatches_per_epoch == 1:
            # The rollout's first optimizer step covers all of it (one mini-batch per epoch), and the policy that
            # takes it IS the trainer at sampling time: the importance weights come from that step's own forward
            # (optimizer_step), which also records the trainer's log-probs for the later epochs. No extra pass.
            local.sampler_logprobs = sampled_logprobs
        elif self.tis_cap > 0 or ro.behaviour_logprobs == "trainer":
            mismatch = self._behaviour_correction(policy, local, sampled_logprobs)
        if self.use_reference:
            with full_weights(policy), reference_of(policy, self.ref_model) as reference:
                local.ref_logprobs = score_logprobs(reference, local, ro.temperature, ro.forward_batch_size,
                                                   fast_path=cfg.model_fast_paths)
        if self.critic is not None:
            critic = self.accelerator.unwrap_model(self.critic)
            critic.eval()
            with full_weights(critic):
                local.old_values = score_values(critic, local, ro.forward_batch_size)
        t_score = time.perf_counter() - t0
        per_fn_local = sampled["per_fn"]
        rollout = self._gather_rollout(local)
        per_fn = {name: self._gather(v) for name, v in per_fn_local.items()}  # name -> (R,), NaN = no score
        raw_per_fn = dict(per_fn)  # metrics show raw scores; the advantages use the normalised ones
        for name, moments in self.reward_moments.items():  # normalised on the global batch: W-invariant
            scored = per_fn[name][~torch.isnan(per_fn[name])]
            moments.update(scored.tolist())
            per_fn[name] = (per_fn[name] - moments.mean) / max(moments.std, 1e-8)
        scores = self._weighted_scores(per_fn)  # (R,)
        overlong = None
        if self.algo.overlong_buffer:  # DAPO's soft overlong punishment, part of the reward
            from tidyrl.algorithms.losses import overlong_penalty

            overlong = overlong_penalty(rollout.completion_mask.sum(1), ro.max_new_tokens, self.algo.overlong_buffer,
                                        self.algo.overlong_penalty)
            scores = scores + overlong

        algo_stats = self._advantages(rollout, scores, policy_is_reference=(r == 0))
        lengths_R = rollout.completion_mask.sum(1)
        adv = rollout.advantages
        stats: dict[str, Any] = {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "completion_length_mean": float(lengths_R.mean()),
            "truncated_fraction": float(rollout.truncated.float().mean()),
            "advantage_abs_mean": float(adv.abs().mean() if adv.dim() == 1 else
                                        masked_mean(adv.abs(), rollout.completion_mask)),
            **algo_stats,
        }
        for name, v in raw_per_fn.items():
            scored = v[~torch.isnan(v)]
            stats[f"reward/{name}"] = float(scored.mean()) if len(scored) else None
        if overlong is not None:
            stats["overlong_penalty_mean"] = float(overlong.mean())  # included in reward_mean
        if rollout.action_mask is not None:  # multi-turn: how the trajectories split between model and environment
            model_tokens = (rollout.action_mask * rollout.completion_mask).sum(1)
            stats["tokens/model_mean"] = float(model_tokens.mean())
            stats["tokens/env_mean"] = float((rollout.completion_mask.sum(1) - model_tokens).mean())
            stats["turns_mean"] = float(self._gather(sampled["turns"]).mean())
            stats["env/error_fraction"] = float(self._gather(sampled["errors"]).mean())
            errors = [text for text in sampled["error_texts"] if text]
            if errors and self.is_main:
                print(f"tidyrl: rollout {r + 1}: {len(errors)} episode(s) of this process ended on an environment "
                      f"error, e.g. {errors[0]}", flush=True)
        stats.update(mismatch)
        if self.engine.name != "builtin":
            stats["time/weight_sync_s"] = t_sync
        stats["time/generate_s"] = t_generate
        stats["time/reward_s"] = t_reward
        stats["time/score_s"] = t_score
        # One sample of each of the first prompts (then second samples...), by global index: the same on any W.
        shown = sample_episodes(len(rollout) // k, k, cfg.log.samples_per_rollout)
        stats.update(sampling_stats)
        stats["_samples"] = [self._sample_row(rollout, e, group_prompts[e // k], scores,
                                              raw_per_fn) for e in shown] if self.is_main else []
        return rollout, stats

    def evaluate(self) -> dict:
        """The held-out prompts, generated and scored with the current policy: eval/reward_mean (the weighted sum
        of the raw scores: a `normalize: true` reward is not normalised, as in `tidyrl eval`), eval/reward/<name>,
        eval/completion_length_mean, eval/truncated_fraction, time/eval_s.

        log.eval_decoding greedy: one completion per prompt, the most likely token each step; sampled:
        rollout.samples_per_prompt each, keyed by (seed, EVAL_ROLLOUT, episode) at every evaluation, so two
        evaluations differ by the policy only. Each process takes a contiguous share of the episodes and the sums
        are reduced by name: the same numbers on any number of processes."""
        from tidyrl.evaluate import EVAL_ROLLOUT
        from tidyrl.rewards import compute_rewards
        from tidyrl.models.generation import sample_seed

        cfg, ro = self.cfg, self.cfg.rollout
        greedy = cfg.log.eval_decoding == "greedy"
        k = 1 if greedy else ro.samples_per_prompt
        total = len(self.eval_prompt_ids) * k
        episodes = range(total * self.rank // self.world_size, total * (self.rank + 1) // self.world_size)
        names = [f.name for f in self.reward_fns]
        sums = Sums("reward", "length", "truncated", *[f"{n}:sum" for n in names], *[f"{n}:count" for n in names])
        t0 = time.perf_counter()
        policy = self.accelerator.unwrap_model(self.model)
        policy.eval()
        rows = self.eval_dataset[[e // k for e in episodes]] if len(episodes) else {}
        self.engine.sync(policy)  # the weights of this step
        with self._weights_for_engine(policy):  # a collective under FSDP: every process enters, even with no episode
            if len(episodes):
                ids, mask, truncated, _ = self.engine.generate(
                    [self.eval_prompt_ids[e // k] for e in episodes],
                    [sample_seed(cfg.seed, EVAL_ROLLOUT, e) for e in episodes], self._sampling(greedy))
            self.engine.release()
        if len(episodes):
            lengths = mask.sum(1).long().tolist()
            completion_ids = [ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
            result = compute_rewards(
                self.reward_fns, prompts=rows[cfg.data.prompt_column],
                completions=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
                completion_ids=completion_ids, columns={c: v for c, v in rows.items() if c != cfg.data.prompt_column})
            sums.add(reward=sum(result.total), length=sum(lengths), truncated=truncated.sum())
            for name, values in result.per_function.items():
                scored = [v for v in values if v is not None]
                sums.add(**{f"{name}:sum": sum(scored), f"{name}:count": len(scored)})
        totals = sums.reduced(self.accelerator)
        metrics = {"eval/reward_mean": totals["reward"] / total}
        for name in names:
            count = totals[f"{name}:count"]
            metrics[f"eval/reward/{name}"] = totals[f"{name}:sum"] / count if count else None
        metrics.update({"eval/completion_length_mean": totals["length"] / total,
                        "eval/truncated_fraction": totals["truncated"] / total,
                        "time/eval_s": time.perf_counter() - t0})
        return metrics

    def _sample_round(self, policy, r: int, q: int, indices, episodes) -> dict:
        """Generate and reward this process's `episodes` (global ids) of one round: episode e is sample e % k of
        prompt row indices[e // k], keyed (seed, rollout r, q * R + e), so round 0 is the rollout without
        dynamic sampling and every later round draws new random numbers. Returns the completions (ids, mask,
        truncated, the sampling pass's log-probs), the prompts' ids, each reward's raw scores (NaN = none) and
        the seconds spent rewarding."""
        import torch

        from tidyrl.rewards import compute_rewards
        from tidyrl.models.generation import sample_seed

        cfg, k = self.cfg, self.plan.samples_per_prompt
        R = self.plan.episodes_per_rollout
        prompt_rows = self.dataset[indices]  # column -> P values
        prompts = [prompt_rows[cfg.data.prompt_column][e // k] for e in episodes]
        columns = {c: [prompt_rows[c][e // k] for e in episodes] for c in self.columns}
        prompt_ids = [self.prompt_ids[indices[e // k]] for e in episodes]
        extra = {}
        if self.environment is not None:  # multi-turn: model and environment turns (tidyrl.multiturn)
            ids, mask, truncated, logprobs, extra = self._converse(policy, r, q, prompts, prompt_ids, columns, episodes)
        else:
            # The sampling pass also returns each token's log-prob under the policy (the old log-probs below).
            # Under FSDP the builtin engine has the full weights gathered once for the whole call, not at every
            # token (sharding.py); vLLM samples from its own copy.
            with self._weights_for_engine(policy):
                ids, mask, truncated, logprobs = self.engine.generate(
                    prompt_ids, [sample_seed(cfg.seed, r, q * R + e) for e in episodes], self._sampling())
        lengths = mask.sum(1).long().tolist()
        completion_ids = [ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        t0 = time.perf_counter()
        per_fn = {}
        if self.reward_fns:  # with an environment, the reward functions are optional
            result = compute_rewards(self.reward_fns, prompts=prompts, completions=completions,
                                     completion_ids=completion_ids, columns=columns)
            per_fn = {name: torch.tensor([math.nan if v is None else float(v) for v in values])
                      for name, values in result.per_function.items()}
        if "env_reward" in extra:  # the environment's reward, beside the reward functions' (weight 1)
            per_fn["env"] = extra.pop("env_reward")
        return {"ids": ids, "mask": mask, "truncated": truncated, "logprobs": logprobs, "prompt_ids": prompt_ids,
                "per_fn": per_fn, "reward_s": time.perf_counter() - t0, **extra}

    def _behaviour_correction(self, policy, local, sampled_logprobs) -> dict:
        """The sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you
        off-policy RL training"): the trainer's log-probs of the sampled tokens, recomputed by the policy's
        forward. rollout.behaviour_logprobs=trainer makes them the old log-probs; otherwise (sampler) they are
        the old log-probs of the PPO ratio and each token's loss is weighted by the truncated importance ratio
        w = min(pi_trainer / pi_sampler, tis_cap) (local.is_weights). Returns the mismatch metrics (this
        process's tokens; summed over processes where logged)."""
        from tidyrl.algorithms.losses import truncated_importance_weights
        from tidyrl.rollout import score_logprobs

        ro = self.cfg.rollout
        with full_weights(policy):
            trainer = score_logprobs(policy, local, ro.temperature, ro.forward_batch_size,
                                     fast_path=self.cfg.model_fast_paths)
        mask = local.completion_mask.bool()
        weights, delta, capped = truncated_importance_weights(trainer, sampled_logprobs, mask, self.tis_cap)
        local.old_logprobs = trainer
        totals = Sums("abs", "tokens", "capped")
        if ro.behaviour_logprobs == "sampler" and self.tis_cap > 0:
            local.is_weights = weights
        totals.add(abs=delta.abs().sum(), tokens=mask.sum(),
                   capped=capped.sum() if local.is_weights is not None else 0.0)
        summed = totals.reduced(self.accelerator)
        peak = reduce_max(self.accelerator, float(delta.abs().max()) if delta.numel() else 0.0)
        tokens = max(summed["tokens"], 1.0)
        stats = {"mismatch/logprob_abs_mean": summed["abs"] / tokens, "mismatch/logprob_abs_max": peak}
        if local.is_weights is not None:
            stats["mismatch/capped_fraction"] = summed["capped"] / tokens
        return stats

    def _weighted_scores(self, per_fn: dict):
        """Each episode's reward: the weighted sum over the functions that scored it (every episode has one:
        checked), plus the environment's reward (weight 1) in multi-turn rollouts. `per_fn`: name -> (R,),
        NaN where a function gave no score."""
        import torch

        scores = sum(f.weight * torch.nan_to_num(per_fn[f.name], nan=0.0) for f in self.reward_fns)
        return scores + per_fn["env"] if "env" in per_fn else scores

    def _sampling(self, greedy: bool = False):
        """The rollout's sampling settings for the engine (greedy: top_k = 1)."""
        from tidyrl.models.engines import SamplingSettings

        ro = self.cfg.rollout
        return SamplingSettings(max_new_tokens=ro.max_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                batch_size=ro.generation_batch_size, min_new_tokens=ro.min_new_tokens,
                                temperature=ro.temperature, top_p=ro.top_p, top_k=1 if greedy else ro.top_k)

    def _converse(self, policy, r: int, q: int, prompts, prompt_ids, columns, episodes):
        """This process's episodes as conversations with the environment (tidyrl.multiturn), laid out as a
        rollout's tensors: ids, mask (every real token), truncated, the sampling log-probs, and in `extra` the
        action mask (the model's tokens), the environment's rewards, turns and errors per episode. Keys: turn t
        of episode e samples with (seed, rollout, "<round*R + e>.<t>"); its environment gets the seed
        (seed, rollout, "<round*R + e>.env"), so a resumed rollout replays the same conversations."""
        import torch

        from tidyrl.multiturn import build_environments, run_conversations
        from tidyrl.models.generation import sample_seed

        cfg, ro, env_cfg = self.cfg, self.cfg.rollout, self.cfg.environment
        R = self.plan.episodes_per_rollout
        keys = [q * R + e for e in episodes]
        rows = [{c: columns[c][i] for c in columns} | {cfg.data.prompt_column: prompts[i]} for i in range(len(keys))]
        envs = build_environments(self.environment, rows, [sample_seed(cfg.seed, r, f"{key}.env") for key in keys],
                                  self.env_pool)
        messages = [list(p) if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
        name = getattr(self.environment, "__name__", type(self.environment).__name__)
        with full_weights(policy):
            conversations = run_conversations(
                policy, self.tokenizer, prompt_ids, messages, envs,
                sample_key=lambda i, t: sample_seed(cfg.seed, r, f"{keys[i]}.{t}"), budget=ro.max_new_tokens,
                max_turns=env_cfg.max_turns, max_turn_tokens=env_cfg.max_turn_tokens or ro.max_new_tokens,
                pool=self.env_pool, env_names=[name] * len(keys), tools=self.tools, error_reward=env_cfg.error_reward,
                generate_kwargs=dict(min_new_tokens=ro.min_new_tokens, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                     batch_size=ro.generation_batch_size, temperature=ro.temperature,
                                     top_p=ro.top_p, top_k=ro.top_k, fast_path=cfg.model_fast_paths))
        B, T = len(conversations), ro.max_new_tokens
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        mask, logprobs, action = torch.zeros((B, T)), torch.zeros((B, T)), torch.zeros((B, T))
        for b, c in enumerate(conversations):
            n = len(c.ids)
            ids[b, :n] = torch.tensor(c.ids, dtype=torch.long)
            mask[b, :n], action[b, :n] = 1.0, torch.tensor(c.action, dtype=torch.float32)
            logprobs[b, :n] = torch.tensor(c.logprobs)
        truncated = torch.tensor([c.truncated for c in conversations])
        extra = {"action": action, "env_reward": torch.tensor([c.reward for c in conversations]),
                 "turns": torch.tensor([float(c.turns) for c in conversations]),
                 "errors": torch.tensor([float(c.error is not None) for c in conversations]),
                 "error_texts": [None if c.error is None else f"{c.error} (episode of prompt {_short_prompt(p)})"
                                 for c, p in zip(conversations, prompts)]}
        return ids, mask, truncated, logprobs, extra

    def _dynamic_sampling(self, policy, r: int, indices, episodes, first: dict):
        """DAPO's dynamic sampling (Yu et al. 2025, §3.2, eq. 11's constraint 0 < |{correct}| < G): keep the groups
        whose k raw weighted rewards are not all equal, drawing rounds of P more prompts (a keyed draw per
        (rollout, round), apart from the prompt stream) until P such groups exist or rollout.max_sampling_rounds
        is reached; then rollout.on_sampling_cap fills the rest with equal-reward groups (first generated first)
        or stops. Every round is gathered, so every process makes the same choice; the rollout holds the chosen
        groups in (round, group) order and this process gets its usual share of them. The plan is unchanged."""
        import torch

        from tidyrl.models.generation import sample_seed

        cfg, ro, plan = self.cfg, self.cfg.rollout, self.plan
        P, k = plan.prompts_per_rollout, plan.samples_per_prompt
        names = list(first["per_fn"])
        rounds, kept, spare = [], [], []
        reward_s = 0.0
        data, round_indices = first, list(indices)
        for q in range(ro.max_sampling_rounds):
            if q > 0:  # a keyed draw of P prompts: the same on every process and on resume
                generator = torch.Generator().manual_seed(sample_seed(cfg.seed, r, -q))
                round_indices = torch.randperm(len(self.dataset), generator=generator)[:P].tolist()
                data = self._sample_round(policy, r, q, round_indices, episodes)
            reward_s += data["reward_s"]
            every = {"ids": self._gather(data["ids"]), "mask": self._gather(data["mask"]),
                     "truncated": self._gather(data["truncated"]), "logprobs": self._gather(data["logprobs"]),
                     "per_fn": {n: self._gather(data["per_fn"][n]) for n in names}, "indices": round_indices}
            rounds.append(every)
            total_R = self._weighted_scores(every["per_fn"])  # raw: before `normalize`
            groups = total_R.view(P, k)
            informative = (groups.max(dim=1).values - groups.min(dim=1).values) > 0
            for p in range(P):
                (kept if informative[p] else spare).append((q, p))
            if len(kept) >= P:
                break
        chosen = kept[:P]
        filled = P - len(chosen)
        if filled and ro.on_sampling_cap == "error":
            raise DynamicSamplingError(
                f"rollout {r + 1}: {len(rounds)} rounds (rollout.max_sampling_rounds) of {P} prompts gave {len(kept)} "
                f"groups whose {k} rewards differ, fewer than prompts_per_rollout = {P}; the rest all scored alike. "
                "Raise rollout.max_sampling_rounds, use easier (or harder) prompts, or set "
                "rollout.on_sampling_cap=fill to complete rollouts with such groups.")
        chosen = sorted(chosen + spare[:filled])
        rows = [rounds[q] for q, _ in chosen]
        take = lambda t_of: torch.cat([t_of(rd)[p * k:(p + 1) * k] for rd, (_, p) in zip(rows, chosen)])  # noqa: E731
        mine = slice(episodes.start, episodes.stop)
        selected = {
            "ids": take(lambda rd: rd["ids"])[mine], "mask": take(lambda rd: rd["mask"])[mine],
            "truncated": take(lambda rd: rd["truncated"])[mine], "logprobs": take(lambda rd: rd["logprobs"])[mine],
            "per_fn": {n: take(lambda rd, n=n: rd["per_fn"][n])[mine] for n in names},
            "prompt_ids": [self.prompt_ids[rounds[chosen[e // k][0]]["indices"][chosen[e // k][1]]] for e in episodes],
            "reward_s": reward_s,
        }
        prompts = [self.dataset[rounds[q]["indices"][p]][cfg.data.prompt_column] for q, p in chosen]
        generated = P * len(rounds)
        stats = {"sampling/rounds": len(rounds), "groups/generated": generated, "groups/kept": P - filled,
                 "groups/filled": filled, "groups/dropped": generated - P}
        return selected, prompts, stats

    def _sample_row(self, rollout, e: int, prompt, scores, raw_per_fn) -> dict:
        """One samples.jsonl row for global episode e."""
        import math

        from tidyrl.algorithms.losses import masked_mean

        n = int(rollout.completion_mask[e].sum())
        adv = rollout.advantages
        return {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "sample": e % self.cfg.rollout.samples_per_prompt,  # which of the prompt's k completions
            "completion": self.tokenizer.decode(rollout.completion_ids[e, :n].tolist(), skip_special_tokens=True),
            "reward": float(scores[e]),
            "rewards": {name: None if math.isnan(float(v[e])) else float(v[e]) for name, v in raw_per_fn.items()},
            # token-level advantages (PPO, REINFORCE++): the mean over the completion's tokens
            "advantage": float(adv[e] if adv.dim() == 1 else masked_mean(adv[e], rollout.completion_mask[e])),
            "truncated": bool(rollout.truncated[e]),
        }

    def _advantages(self, rollout, scores, policy_is_reference: bool = False) -> dict:
        """Set rollout.advantages (and PPO's returns) by the algorithm (DESIGN §3, step 4); returns the
        algorithm's rollout metrics. Every statistic is over the global rollout, so W does not change it."""
        import torch

        from tidyrl.algorithms import ppo
        from tidyrl.algorithms.advantages import grpo_advantages, kl_shaped_rewards, rloo_advantages
        from tidyrl.algorithms.kl import kl_per_token

        a, k, name = self.algo, self.plan.samples_per_prompt, self.cfg.algorithm
        mask = rollout.completion_mask  # the model's tokens: multi-turn environment tokens carry no KL or advantage
        if rollout.action_mask is not None:
            mask = mask * rollout.action_mask.to(mask.dtype)
        if name == "grpo":  # KL, if any, goes into the loss (optimizer_step)
            rollout.advantages = grpo_advantages(scores, k, scale=a.scale_rewards)
            return {}
        # Before the first update the policy is the reference (the same starting weights; with LoRA, B = 0), so
        # the KL is exactly 0. Its estimate is not: the sampler's and the scorer's log-probs of the same weights
        # differ by float rounding (~1e-7, and differently with another batch split). Where a group's scores tie,
        # the baseline leaves only that rounding, the whitening scales it up, and AdamW turns a gradient of
        # rounding into steps of the full learning rate: the run trained on noise and drifted ~lr per step
        # between 1 and 2 processes (REINFORCE++-baseline, RLOO). So the first rollout's KL is taken as the 0 it is.
        kl_BT = (kl_per_token(rollout.old_logprobs, rollout.ref_logprobs, a.kl_estimator)
                 if self.use_reference and not policy_is_reference else torch.zeros_like(mask))
        if name == "rloo":  # KL in the sequence reward, then the leave-one-out baseline
            rollout.advantages = rloo_advantages(kl_shaped_rewards(scores, kl_BT, mask, a.kl_coef), k)
            return {}
        # PPO and REINFORCE++: token-level rewards: -beta * KL on every token, the score on the last one.
        if a.missing_eos_penalty is not None:
            scores = scores - a.missing_eos_penalty * rollout.truncated.float()
        if name == "reinforce_pp_baseline":
            scores = ppo.group_baseline_scores(scores, k)
        beta = self.kl_control.value if name == "ppo" else a.kl_coef
        rewards_BT = ppo.token_level_rewards(scores, kl_BT, mask, beta)
        sequence_kl = float((kl_BT * mask).sum(1).mean())
        stats = {"kl_coef": beta, "rollout_kl": sequence_kl}
        # Multi-turn: the recursions run over the model's tokens only (environment tokens are not actions).
        over = (lambda fn, *ts: fn(*ts, mask)) if rollout.action_mask is None else \
            (lambda fn, *ts: ppo.over_actions(fn, mask, *ts))
        if name == "ppo":
            advantages, rollout.returns = over(lambda r, v, m: ppo.gae(r, v, m, a.gamma, a.lam), rewards_BT,
                                               rollout.old_values)
            rollout.advantages = ppo.masked_whiten(advantages, mask) if a.whiten_advantages else advantages
            stats["explained_variance"] = ppo.explained_variance(rollout.old_values, rollout.returns, mask)
            stats["returns_mean"] = float((rollout.returns * mask).sum() / mask.sum().clamp(min=1))
            # Ziegler et al. 2019: this rollout used beta_t; the next one uses beta_{t+1}.
            self.kl_control.update(sequence_kl, n_steps=self.plan.episodes_per_rollout)
        else:  # REINFORCE++: returns whitened over the global batch (Hu 2025)
            returns = over(lambda r, m: ppo.discounted_returns(r, m, a.gamma), rewards_BT)
            rollout.advantages = ppo.masked_whiten(returns, mask)
        return stats

    def _episode_order(self, r: int, epoch: int):
        """A fresh shuffle of the R episodes for each pass, keyed by (seed, rollout, pass); the same on
        every process, so the global mini-batches do not depend on W."""
        import torch

        from tidyrl.models.generation import sample_seed

        gen = torch.Generator().manual_seed(sample_seed(self.cfg.seed, r, -1 - epoch))
        return torch.randperm(self.plan.episodes_per_rollout, generator=gen)

    # ------------------------------------------------------------------ one optimizer step
    def optimizer_step(self, rollout, minibatch, step: int) -> dict:
        """One optimizer step over a global mini-batch of episode indices: this process takes its slice,
        in micro-batches of m with gradient accumulation; the loss is normalised over the whole mini-batch."""
        import torch

        from tidyrl.algorithms.kl import kl_per_token
        from tidyrl.algorithms.losses import (aggregate_loss, clipped_policy_loss, loss_normaliser,
                                              sequence_clipped_policy_loss, truncated_importance_weights)
        from tidyrl.algorithms.ppo import clipped_value_loss
        from tidyrl.devices import to_device
        from tidyrl.models.forward import completion_logprobs, completion_values
        from tidyrl.rollout import chunks

        cfg, plan, algo = self.cfg, self.plan, self.algo
        model, critic = self.model, self.critic
        models = [model] if critic is None else [model, critic]
        for m in models:
            m.train()
        t0 = time.perf_counter()
        # Normaliser of the whole global mini-batch (every process holds the global rollout, so no all-reduce).
        mb_mask = self._loss_mask(rollout.completion_mask[minibatch], rollout.truncated[minibatch],
                                  None if rollout.action_mask is None else rollout.action_mask[minibatch])
        normaliser = loss_normaliser(algo.loss_aggregation, num_tokens=float(mb_mask.sum()),
                                     num_sequences=len(minibatch), max_new_tokens=cfg.rollout.max_new_tokens)
        per_proc = plan.episodes_per_minibatch_per_process
        mine = minibatch[self.rank * per_proc: (self.rank + 1) * per_proc].tolist()
        # Samples of one prompt side by side, so a micro-batch runs each shared prompt once (models/forward.py). The
        # split into micro-batches changes only the summation order: the normaliser is the mini-batch's.
        mine.sort(key=lambda e: e // plan.samples_per_prompt)
        micro_batches = list(chunks(mine, plan.micro_batch_size))
        assert len(micro_batches) == plan.gradient_accumulation_steps
        sums = Sums("loss", "kl_x_tokens", "entropy_x_tokens", "clipped_tokens", "tokens", "value_loss",
                    "value_clipped_tokens", "mismatch_abs", "mismatch_capped")
        mismatch_peak = 0.0
        # The rollout's first step takes the importance weights from its own forward (see _make_rollout).
        in_update_weights = rollout.sampler_logprobs is not None
        # Later epochs need the trainer's log-probs at sampling time (their old log-probs and weights): this
        # step's forwards compute them, for this process's episodes (kept on the device until the step's end).
        device = self.accelerator.device
        trainer_logprobs = torch.zeros(rollout.completion_ids.shape, device=device) \
            if in_update_weights and plan.optimizer_steps_per_rollout > 1 else None
        for i, idx in enumerate(micro_batches):
            # The micro-batch stays on the host (where its padding is trimmed and its shared prompts found); each
            # tensor the step reads goes to the device without a synchronisation (tidyrl.devices).
            part = rollout.select(idx)
            mask = to_device(self._loss_mask(part.completion_mask, part.truncated, part.action_mask), device)
            sync = cfg.train.sync_each_microbatch or i == len(micro_batches) - 1
            with no_sync(self.accelerator, models, sync):  # the last micro-batch synchronises (DESIGN §2)
                logprobs, entropy = completion_logprobs(model, *part.sequences, cfg.rollout.temperature,
                                                        with_entropy=True, fast_path=cfg.model_fast_paths)
                # The ratio's old log-probs are the trainer's at sampling time. With one step per rollout that is
                # this very forward (the weights have not moved), also where old_logprobs holds the sampler's for
                # a KL in the reward: against those the ratio would count the sampler/trainer mismatch that the
                # importance weights below already correct, a second time, and clip on it.
                if part.old_logprobs is None or in_update_weights:
                    old = logprobs.detach()
                else:
                    old = to_device(part.old_logprobs, device)
                adv = to_device(part.advantages, device)
                if algo.policy_loss == "sequence":  # GSPO: one ratio per completion
                    token_loss, clipped = sequence_clipped_policy_loss(logprobs, old, adv, mask, algo.clip_eps,
                                                                       algo.clip_eps_high)
                else:
                    token_loss, clipped = clipped_policy_loss(logprobs, old, adv, algo.clip_eps, algo.clip_eps_high)
                if part.is_weights is not None:  # truncated importance sampling: the sampler was not the trainer
                    token_loss = token_loss * to_device(part.is_weights, device).to(token_loss.dtype)
                elif in_update_weights:  # the same, its weights from this forward
                    weights, delta, capped = truncated_importance_weights(
                        logprobs.detach(), to_device(part.sampler_logprobs, device), mask, self.tis_cap)
                    token_loss = token_loss * weights
                    sums.add(mismatch_abs=delta.abs().sum(), mismatch_capped=capped.sum())
                    mismatch_peak = torch.maximum(delta.abs().max(), torch.as_tensor(mismatch_peak))
                    if trainer_logprobs is not None:  # (index_copy_ with a device index: a list index would sync)
                        trainer_logprobs[:, : logprobs.shape[1]].index_copy_(
                            0, to_device(torch.as_tensor(idx), device),
                            logprobs.detach().float() * to_device(part.completion_mask, device))
                kl = None
                if part.ref_logprobs is not None:
                    # At step 1 the policy is the reference: its own log-probs are the reference's exactly, while
                    # the scored ones differ by rounding, whose KL gradient AdamW would turn into full steps
                    # where a group's advantages tie at 0 (see _advantages). k2/k3 and their gradients are then
                    # exactly 0; k1 keeps its gradient (that of log pi).
                    ref = logprobs.detach() if step == 1 else to_device(part.ref_logprobs, device)
                    kl = kl_per_token(logprobs, ref, algo.kl_estimator)
                    if cfg.algorithm == "grpo":  # GRPO: KL in the loss (Shao et al. 2024, eq. 3)
                        token_loss = token_loss + algo.kl_coef * kl
                loss = aggregate_loss(token_loss, mask, algo.loss_aggregation, normaliser)
                value_loss, value_clipped = torch.zeros(()), torch.zeros_like(mask)
                if critic is not None:  # PPO: the clipped value loss on the GAE returns, same normaliser
                    values = completion_values(critic, *part.sequences)
                    value_BT, value_clipped = clipped_value_loss(
                        values, to_device(part.old_values, device), to_device(part.returns, device), algo.value_clip)
                    value_loss = aggregate_loss(value_BT, mask, algo.loss_aggregation, normaliser)
                    loss = loss + algo.vf_coef * value_loss
                # DDP averages gradients over W processes; our loss is already this process's share of the
                # global mean, so scale by W to make the synchronised gradient the global one.
                self.accelerator.backward(loss * self.world_size)
            with torch.no_grad():
                sums.add(loss=loss, kl_x_tokens=(kl * mask).sum() if kl is not None else 0.0,
                         entropy_x_tokens=(entropy * mask).sum(), clipped_tokens=(clipped.float() * mask).sum(),
                         tokens=mask.sum(), value_loss=value_loss,
                         value_clipped_tokens=(value_clipped.float() * mask).sum())
        sums = sums.reduced(self.accelerator)
        if trainer_logprobs is not None:  # every episode was in this step, on one process each: a sum gathers them
            self._weights_for_later_epochs(rollout, reduce_sum(self.accelerator, trainer_logprobs).cpu())
        parts = [(model, self.optimizer, self.scheduler)]
        if critic is not None:  # the critic's own optimizer and schedule, also stepped once per optimizer step
            parts.append((critic, self.critic_optimizer, self.critic_scheduler))
        updates = apply_update(self.accelerator, parts, cfg.train.max_grad_norm, step, sums["loss"], self.out,
                               "Lower train.learning_rate, check the rewards' scale, or set train.max_grad_norm.")
        (lr, grad_norm), critic_norm = updates[0], (updates[1][1] if critic is not None else 0.0)
        tokens = max(sums["tokens"], 1.0)
        out = {
            "lr": lr,
            "loss": sums["loss"],
            "kl": sums["kl_x_tokens"] / tokens if rollout.ref_logprobs is not None else None,
            "entropy": sums["entropy_x_tokens"] / tokens,
            "clip_fraction": sums["clipped_tokens"] / tokens,
            "grad_norm": grad_norm,
            "time/update_s": time.perf_counter() - t0,
        }
        if in_update_weights:  # truncated importance sampling inside the update (the rollout's first step)
            out.update({"mismatch/logprob_abs_mean": sums["mismatch_abs"] / tokens,
                        "mismatch/logprob_abs_max": reduce_max(self.accelerator, float(mismatch_peak)),
                        "mismatch/capped_fraction": sums["mismatch_capped"] / tokens})
        if critic is not None:
            out["critic_lr"] = updates[1][0]
            out.update({"value_loss": sums["value_loss"], "value_clip_fraction": sums["value_clipped_tokens"] / tokens,
                        "critic_grad_norm": critic_norm, "time/update_s": time.perf_counter() - t0})
        return out

    def _weights_for_later_epochs(self, rollout, trainer_logprobs) -> None:
        """After the rollout's first step took its importance weights from its own forward: the trainer's
        log-probs of that forward become the old log-probs of the later epochs, and their weights
        min(pi_trainer / pi_sampler, tis_cap) are kept (as `_behaviour_correction` would have computed them with
        one more forward). Saved with the rollout in a checkpoint, so a resume continues with them."""
        from tidyrl.algorithms.losses import truncated_importance_weights

        rollout.is_weights, _, _ = truncated_importance_weights(trainer_logprobs, rollout.sampler_logprobs,
                                                                rollout.completion_mask, self.tis_cap)
        rollout.old_logprobs = trainer_logprobs
        rollout.sampler_logprobs = None

    def _loss_mask(self, completion_mask, truncated, action_mask=None):
        """The tokens the loss (and its normaliser, KL and entropy metrics) covers: every completion token the
        model sampled (multi-turn: not the environment's, `action_mask`), and with mask_truncated (DAPO's
        overlong filtering) only those of completions that ended with EOS."""
        mask = completion_mask if action_mask is None else completion_mask * action_mask.to(completion_mask.dtype)
        if not self.algo.mask_truncated:
            return mask
        return mask * (~truncated.bool()).to(mask.dtype)[:, None]

    # ------------------------------------------------------------------ multi-process helpers
    def _gather(self, tensor):
        """Concatenate a per-process tensor over processes (rank order = global episode order)."""
        if self.world_size == 1:
            return tensor
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def _gather_rollout(self, local):
        """Every process gets all R episodes (ids and masks are small), padded to common widths."""
        if self.world_size == 1:
            return local

        from tidyrl.rollout import Rollout

        acc = self.accelerator

        def cat(t, pad_first=False, pad_index=0):
            if t is None:
                return None
            t = acc.pad_across_processes(t.to(acc.device), dim=1, pad_index=pad_index, pad_first=pad_first)
            return acc.gather(t).cpu()

        return Rollout(
            prompt_ids=cat(local.prompt_ids, pad_first=True, pad_index=self.pad_id),
            prompt_mask=cat(local.prompt_mask, pad_first=True),
            completion_ids=cat(local.completion_ids, pad_index=self.pad_id),
            completion_mask=cat(local.completion_mask),
            truncated=acc.gather(local.truncated.to(acc.device)).cpu(),
            old_logprobs=cat(local.old_logprobs),
            ref_logprobs=cat(local.ref_logprobs),
            old_values=cat(local.old_values),
            action_mask=cat(local.action_mask),
            is_weights=cat(local.is_weights),
            sampler_logprobs=cat(local.sampler_logprobs),
        )
