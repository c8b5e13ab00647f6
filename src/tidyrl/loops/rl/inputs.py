"""What an RL run reads and checks before any weights load (`check_rl_inputs`, also run by `tidyrl plan`): what its
episodes need (`loops.run.inputs`: the policy's config and tokenizer, the prompts and their lengths, the rewards,
the environment, the engine's own checks), then the plan, PPO's critic, a teacher, the memory plan, and which
forward each model takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from tidyrl.algorithms.table import ALGORITHMS
from tidyrl.config import Config, ConfigError
from tidyrl.engines import engine_module
from tidyrl.loops.run.inputs import (check_engine_inputs, encode_prompt_set, held_out_source, held_out_split,
                                    read_environment, read_policy, read_rewards)
from tidyrl.models.loading import ModelLoadError, load_model_config
from tidyrl.models.lora import adapter_folder_problem
from tidyrl.plan import epochs_done, plan_from_config


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
    memory: Any = None
    """The memory plan (tidyrl.memory.plan.MemoryPlan), or None when the model's shape is unknown."""
    paths: Optional[dict] = None
    """Which forward each model takes and why (`model_paths`): plan.json's `paths`."""
    auto: Optional[dict] = None
    """The batch sizes `auto` chose (`memory.rl.resolve_auto`): plan.json's `auto_batch_sizes`."""


def plan_extras(cfg, plan, critic_choice: Optional[dict], eval_prompt_ids, memory=None, paths=None,
                auto=None) -> dict:
    """What plan.json (and `tidyrl plan`) say beside the plan's counts: the engine that generates, the lag of the
    rollouts made ahead (rollout.lag: the counts are the same at any lag), PPO's critic and why, the held-out
    prompts, which forward each model takes and why (`paths`, `model_paths`), and the memory plan (`memory`: per
    process, each phase's predicted peak and its parts in bytes), and the batch sizes `auto` chose (`auto`)."""
    return {"engine": cfg.rollout.engine, **({"lag": cfg.rollout.lag} if cfg.rollout.lag else {}),
            **(critic_choice or {}), **({"eval_prompts": len(eval_prompt_ids)} if eval_prompt_ids else {}),
            **scoring_passes(cfg, plan), **({"paths": paths} if paths else {}),
            **({"memory": memory.to_dict()} if memory is not None else {}),
            **({"auto_batch_sizes": auto} if auto else {})}


CLASSIFIER_PATH = "its own forward (a classifier: the fast path computes causal LMs)"


def model_paths(cfg: Config, model_config, critic: Optional[dict]) -> dict:
    """Which forward each model of the run takes, and why (`models.families.path_description`), from the configs
    alone: the policy (its generation on the built-in engine, its scoring and update), the KL reference (the
    policy's config; with LoRA the policy itself), a teacher, the reward models and the critic (classifiers, their
    own forward). The fast path is the lean passes where the device's layouts take them (`models.forward.LAYOUTS`)."""
    from tidyrl.config import algorithm_section
    from tidyrl.models.families import path_description

    def path(config, policy: bool = False) -> str:
        if not cfg.model_fast_paths:
            return "its own forward (model_fast_paths is false)"
        described = path_description(config)
        # (train.exact_gradients marks the policy, the reference and a teacher: models.forward.exact_forward)
        why = ("train.exact_gradients" if cfg.train.exact_gradients else
               "LoRA: peft's wrappers" if cfg.lora.enabled and policy else None)
        if why and described.startswith("fast path"):
            return f"{described} for generation; its own forward for scoring and the update ({why})" if policy \
                else f"its own forward ({why})"
        return described

    paths = {"policy": path(model_config, policy=True)}
    if algorithm_section(cfg).kl_coef > 0:
        paths["reference"] = "the policy with its adapter off" if cfg.lora.enabled else path(model_config)
    if ALGORITHMS[cfg.algorithm].teacher and cfg.teacher.model:
        paths["teacher"] = path(load_model_config(cfg.teacher.model, "teacher.model"))
    for n, reward in enumerate(cfg.rewards):
        if reward.model:
            paths[f"reward_model_{n}"] = CLASSIFIER_PATH
    if critic:
        paths["critic"] = CLASSIFIER_PATH
    return paths


def scoring_passes(cfg: Config, plan) -> dict:
    """What the frozen models that score every rollout cost (plan.json's `scoring`): the KL reference (a KL term;
    with LoRA the policy with its adapter off) and a teacher (on-policy distillation: teacher.model), each a
    no-grad forward pass over each process's episodes in chunks of rollout.forward_batch_size."""
    from tidyrl.config import algorithm_section

    models = {}
    if algorithm_section(cfg).kl_coef > 0:
        models["reference"] = "the policy with its adapter off" if cfg.lora.enabled else cfg.model
    if ALGORITHMS[cfg.algorithm].teacher:
        models["teacher"] = cfg.teacher.model or cfg.teacher.url
    per_process = plan.episodes_per_rollout_per_process
    chunks = -(-per_process // cfg.rollout.forward_batch_size)
    return {"scoring": {name: {"model": model, "episodes_per_rollout_per_process": per_process,
                               "forward_passes_per_rollout_per_process": chunks}
                        for name, model in models.items()}} if models else {}


def loaded_path_note(role: str, model, predicted: Optional[dict]) -> Optional[str]:
    """A line where the loaded model's modules refuse the fast path its config promised (a hook on a module, a
    projection that is not a plain linear layer: `models.lean_decode.refusal`), or None."""
    from tidyrl.models.lean_decode import refusal

    if not predicted or not predicted.get(role, "").startswith("fast path"):
        return None
    reason = refusal(model, lora=True)
    return None if reason is None else f"{role}: its own forward after all, as loaded ({reason})"


def check_exact_chunks(cfg: Config, plan) -> None:
    """train.exact_gradients promises the weights of any number of processes, which holds where each no-grad
    chunk holds the same episodes on any split: rollout.forward_batch_size (and, on an engine that samples from the
    policy itself, whose sampled log-probs are read, rollout.generation_batch_size) must divide each process's episodes. A batch of
    other episodes is another matmul shape, other padding, other last bits. Raises PlanError naming the fix."""
    if not cfg.train.exact_gradients:
        return
    from tidyrl.plan import PlanError


    share = plan.episodes_per_rollout_per_process
    declared = getattr(engine_module(cfg.rollout.engine), "CAPABILITIES", None)  # (an engine known when built: not)
    sampled_here = declared is not None and declared.samples_trained_weights  # its chunks are the policy's forward
    knobs = ["forward_batch_size"] + (["generation_batch_size"] if sampled_here else [])
    problems = [f"train.exact_gradients: rollout.{knob}={getattr(cfg.rollout, knob)} does not divide each "
                f"process's {share} episodes ({plan.episodes_per_rollout} a rollout over {plan.world_size} "
                f"process(es)), so its chunks would hold other episodes on another number of processes and round "
                f"otherwise; set it to a divisor of {share} (of R/W for every W you compare)"
                for knob in knobs if share % getattr(cfg.rollout, knob)]
    if problems:
        raise PlanError(problems)


def check_rl_inputs(cfg: Config, base_dir: Optional[str], world_size: int, memory: Optional[str] = None,
                    fsdp: Optional[bool] = None, recorded_auto: Optional[dict] = None,
                    smallest: Optional[Callable[[int], int]] = None) -> RLInputs:
    """Everything an RL run can check before any weights load, in order: the policy and tokenizer exist (at once,
    offline too), the data file reads, every prompt fits the context with max_new_tokens, the plan's sizes
    divide, the reward functions import, the reward models exist, every argument a reward function needs is a
    data column, PPO's critic can read the policy's tokens, and each phase's predicted memory fits the memory a
    process has (`memory`: a size, 'available', or None: the CUDA device's; `fsdp`: plan FSDP2's sharding, None: as
    the launch asks; tidyrl.memory.rl). `tidyrl plan`
    runs the same checks, so a plan that prints is a run that starts.

    The batch-size knobs set to `auto` are resolved here, in `cfg` itself, before anything reads them
    (`memory.rl.resolve_auto`; `recorded_auto`: plan.json's `auto_batch_sizes` of the run a resume continues;
    `smallest`: the least of a number over the run's processes, so that all take the same sizes)."""
    from tidyrl.data import load_rl_prompts, other_columns
    from tidyrl.memory.rl import auto_knobs, auto_line, check_memory, plans_fsdp2, resolve_auto, set_knob
    from tidyrl.rewards import check_reward_columns

    model_config, tokenizer = read_policy(cfg)
    dataset, eval_dataset = held_out_split(cfg, load_rl_prompts(cfg))
    environment, tools = read_environment(cfg, base_dir, tokenizer)
    dataset, prompt_ids, report = encode_prompt_set(cfg, dataset, tokenizer, model_config, tools)
    # The held-out prompts and PPO's critic first: the memory plan that chooses `auto` batch sizes reads them.
    eval_prompt_ids, fit_report = None, ""
    if eval_dataset is not None:
        eval_dataset, eval_prompt_ids, fit_report = encode_prompt_set(cfg, eval_dataset, tokenizer, model_config,
                                                                      tools)
    critic = None
    if ALGORITHMS[cfg.algorithm].critic:
        path, why = choose_critic(cfg, tokenizer.get_vocab())
        critic = {"critic_model": path, "critic_model_reason": why}
    auto = auto_knobs(cfg)
    for name in auto:  # the batch plan at 1 (which every rule allows), then each knob from the memory plan
        set_knob(cfg, name, 1)
    plan = plan_from_config(cfg, len(dataset), world_size)
    auto_sizes = None
    if auto:
        auto_sizes = resolve_auto(cfg, auto, model_config, [*prompt_ids, *(eval_prompt_ids or [])], plan, critic,
                                  memory=memory, fsdp=plans_fsdp2(plan, fsdp), exact_chunks=cfg.train.exact_gradients,
                                  recorded=recorded_auto, smallest=smallest)
        plan = plan_from_config(cfg, len(dataset), world_size)
        report = "\n".join(filter(None, [report, auto_line(auto_sizes)]))
    check_exact_chunks(cfg, plan)
    if plan.prompts_per_rollout > len(dataset):  # correct by the plan's formula, rarely what was meant
        report = "\n".join(filter(None, [report, repeated_prompts_warning(plan, len(dataset))]))
    columns = other_columns(dataset, cfg.data.prompt_column)
    reward_fns, lines = read_rewards(cfg, base_dir, columns)
    for line in lines:
        report = f"{report}\n{line}" if report else line
    # An engine generates a rollout's share in one call, and the held-out evaluation's share in one call too.
    eval_report, eval_share = "", 0
    if eval_dataset is not None:
        check_reward_columns(reward_fns, other_columns(eval_dataset, cfg.data.prompt_column))
        k = 1 if cfg.log.eval_decoding == "greedy" else cfg.rollout.samples_per_prompt
        eval_share = -(-len(eval_prompt_ids) * k // plan.world_size)
        eval_report = (f"eval: {len(eval_dataset)} held-out prompts ({held_out_source(cfg)}), {k} "
                       f"{cfg.log.eval_decoding} completion(s) each, "
                       + (f"after every {cfg.log.eval_every} optimizer step{'s' if cfg.log.eval_every != 1 else ''}"
                          if cfg.log.eval_every else "after the last optimizer step")
                       + (f"; held-out {fit_report}" if fit_report else ""))
        trained = {tuple(ids) for ids in prompt_ids}
        shared = sum(tuple(ids) in trained for ids in eval_prompt_ids)
        if shared:
            eval_report += (f"\nwarning: {shared} of {len(eval_prompt_ids)} held-out prompts are also "
                            "training prompts; their eval metrics measure memory, not generalisation")
    check_engine_inputs(cfg, model_config, [*prompt_ids, *(eval_prompt_ids or [])],
                        max(plan.episodes_per_rollout_per_process, eval_share))
    if ALGORITHMS[cfg.algorithm].teacher:
        check_teacher(cfg, tokenizer)

    memory_plan, line = check_memory(cfg, model_config, [*prompt_ids, *(eval_prompt_ids or [])], plan, critic, memory,
                                     fsdp)
    report = f"{report}\n{line}" if report else line
    paths = model_paths(cfg, model_config, critic)
    report = "\n".join(filter(None, [report, *(f"{role}: {path}" for role, path in paths.items())]))
    return RLInputs(tokenizer, dataset, prompt_ids, report, plan, columns, reward_fns, critic, eval_dataset,
                    eval_prompt_ids, eval_report, environment, tools, memory_plan, paths, auto_sizes)


def check_teacher(cfg: Config, tokenizer) -> None:
    """teacher.model exists and reads the policy's tokens: its tokenizer's vocabulary is the policy's (the teacher
    scores the student's sampled token ids as they are); teacher.url answers and tokenises as the policy's
    tokenizer does. Reads configs and tokenizer files only, no weights."""
    from transformers import AutoTokenizer

    if cfg.teacher.url is not None:
        from tidyrl.engines.server import teacher_problems

        problems = teacher_problems(cfg.teacher.url, tokenizer)
        if problems:
            raise ConfigError(problems)
        return
    load_model_config(cfg.teacher.model, "teacher.model")
    problem = adapter_folder_problem(cfg.teacher.model, "teacher.model", "a teacher")
    if problem:
        raise ModelLoadError(problem)
    try:
        vocab = AutoTokenizer.from_pretrained(cfg.teacher.model).get_vocab()
    except (OSError, ValueError):
        return  # a folder without tokenizer files: it reads the policy's tokens by construction
    if vocab != tokenizer.get_vocab() and not cfg.teacher.cross_tokenizer:
        policy_tokenizer = cfg.tokenizer or cfg.model
        raise ConfigError([f"teacher.model: {cfg.teacher.model!r} has another tokenizer than the policy's "
                           f"({policy_tokenizer!r}: {len(tokenizer.get_vocab())} tokens, the teacher's: {len(vocab)}); "
                           "the teacher scores the student's sampled token ids, so both must share one vocabulary. "
                           "Use a teacher of the policy's family (the same tokenizer), or set "
                           "teacher.cross_tokenizer: true to have it score the episodes' text with its own tokenizer "
                           "and chat template."])


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


def repeated_prompts_warning(plan, prompts: int) -> str:
    """The line that says a rollout holds more prompts than the data set: every rollout repeats prompts, so the
    run makes many passes over the data (the `epoch` metric counts them)."""
    P = plan.prompts_per_rollout
    total = epochs_done(plan, plan.rollouts)
    return (f"warning: rollout.prompts_per_rollout = {P} is more than the {prompts} prompts of the data set: every "
            f"rollout repeats prompts ({P / prompts:g} passes over the data per rollout, {total:g} in all over "
            f"{plan.rollouts} rollouts). Lower rollout.prompts_per_rollout, or add prompts, if that is not meant.")
