"""What a run's episodes need, read and checked before any weights load, by training and `tidyrl eval` alike: the
policy's config and tokenizer, the prompt set encoded to fit the context (and its held-out split), the rewards,
the environment and its tools, the engine's own checks; and what `tidyrl eval` evaluates (`check_eval_inputs`).
The RL learner's further checks (the plan, the critic, the teacher, the memory) are `loops.rl.inputs`'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tidyrl.config import Config, ConfigError
from tidyrl.engines import engine_module
from tidyrl.models.loading import load_model_config, load_tokenizer


def encode_prompt_set(cfg: Config, dataset, tokenizer, model_config, tools=None):
    """Encode every prompt once (rendering chat messages) and apply data.overlong_prompts against
    data.max_prompt_length (default: the model's context minus max_new_tokens).
    Returns (the dataset of the prompts kept, their token ids, a one-line report or "")."""
    from tidyrl.data import encode_prompts, fit_prompts

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
class EvalInputs:
    """What `check_eval_inputs` read and checked: the prompts `tidyrl eval` evaluates and what scores them."""

    tokenizer: Any
    dataset: Any
    """The prompts evaluated (those kept by data.overlong_prompts)."""
    prompt_ids: list
    """Their token ids."""
    report: str
    """Lines on overlong prompts and the rewards, or ""."""
    reward_fns: list
    source: str
    """Where the prompts come from, in words (eval.json's `data`)."""
    held_out: bool
    """They are the config's held-out prompts, as training evaluates them (log.eval_decoding applies)."""
    environment: Any = None
    tools: Optional[list] = None


def check_eval_inputs(cfg: Config, base_dir: Optional[str], *, data: Optional[str] = None,
                      num_prompts: Optional[int] = None, samples_per_prompt: Optional[int] = None) -> EvalInputs:
    """What `tidyrl eval` reads and checks before any weights load, by the learner's own checks (the policy and
    tokenizer, the environment and its tools, the prompts' fit in the context, the rewards and their columns, the
    engine's own). The prompts: those of `data` (a file or saved folder; its first `num_prompts`, None = all);
    else the config's held-out prompts (data.eval_path, or data.eval_fraction of data.path: the very prompts
    training evaluates, all of them unless `num_prompts`); else the first `num_prompts` of data.path (None = all).
    `samples_per_prompt`: the completions asked of each prompt (None: rollout.samples_per_prompt), which the engine
    generates in one call."""
    from tidyrl.data import load_prompt_dataset, load_rl_prompts, other_columns

    model_config, tokenizer = read_policy(cfg)
    held_out = data is None and bool(cfg.data.eval_path or cfg.data.eval_fraction)
    if data is not None:
        dataset, source = load_prompt_dataset(data, cfg.data.prompt_column, cfg.data.split), str(data)
    elif held_out:
        dataset, source = held_out_split(cfg, load_rl_prompts(cfg))[1], f"held out: {held_out_source(cfg)}"
    else:
        dataset = load_rl_prompts(cfg)
        source = cfg.data.path if cfg.data.reasoning_gym is None else f"reasoning_gym: {cfg.data.reasoning_gym}"
    if num_prompts is not None and num_prompts < len(dataset):
        dataset = dataset.select(range(num_prompts))
        source = f"{source}, the first {num_prompts}"
    environment, tools = read_environment(cfg, base_dir, tokenizer)
    dataset, prompt_ids, report = encode_prompt_set(cfg, dataset, tokenizer, model_config, tools)
    reward_fns, lines = read_rewards(cfg, base_dir, other_columns(dataset, cfg.data.prompt_column))
    k = cfg.rollout.samples_per_prompt if samples_per_prompt is None else samples_per_prompt
    check_engine_inputs(cfg, model_config, prompt_ids, len(prompt_ids) * k, training=False)
    return EvalInputs(tokenizer, dataset, prompt_ids, "\n".join(filter(None, [report, *lines])), reward_fns, source,
                      held_out, environment, tools)


def read_policy(cfg: Config):
    """(the policy's model config, its tokenizer): read at once, offline too, no weights."""
    model_config = load_model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, "tokenizer" if cfg.tokenizer else "model")
    return model_config, tokenizer


def held_out_split(cfg: Config, dataset):
    """(the training prompts, the held-out prompts or None): data.eval_path's prompts, or data.eval_fraction of
    data.path held out before anything else (never trained on, not in the plan's N), by the run's seed."""
    from tidyrl.data import load_prompt_dataset

    if cfg.data.eval_path:
        return dataset, load_prompt_dataset(cfg.data.eval_path, cfg.data.prompt_column, cfg.data.split)
    if cfg.data.eval_fraction:
        from tidyrl.data.offline import held_out_rows

        held = held_out_rows(len(dataset), cfg.data.eval_fraction, cfg.seed)
        return dataset.select(sorted(set(range(len(dataset))) - set(held))), dataset.select(held)
    return dataset, None


def held_out_source(cfg: Config) -> str:
    return f"data.eval_path = {cfg.data.eval_path!r}" if cfg.data.eval_path else \
        f"data.eval_fraction = {cfg.data.eval_fraction}"


def read_environment(cfg: Config, base_dir: Optional[str], tokenizer):
    """(environment.factory imported, its tool schemas), (environment.agent imported and checked as a
    `rollouts.agents.Agent`, None) or (None, None): imported now, so that a typo fails before any weights load; a
    template that cannot render the tools is refused."""
    from tidyrl.rewards import load_reward_function

    if cfg.environment.agent is not None:  # an agent: its calls bring their own tools
        from tidyrl.rollouts.agents import AgentError, check_agent

        fn = load_reward_function(cfg.environment.agent, base_dir, key="environment.agent")
        try:
            return check_agent(fn, cfg.environment.agent), None
        except AgentError as err:
            raise ConfigError([str(err)]) from None
    if cfg.environment.factory is None:
        return None, None

    environment = load_reward_function(cfg.environment.factory, base_dir, key="environment.factory")
    schemas = getattr(environment, "tool_schemas", None)
    tools = schemas() if callable(schemas) else None
    if tools:
        check_template_renders_tools(tokenizer, tools, cfg.environment.factory)
    return environment, tools


def read_rewards(cfg: Config, base_dir: Optional[str], columns: list):
    """(the reward functions and models, built; the lines they have to say before the run): each function imports,
    each model exists, every argument a function needs is offered (a standard one or one of `columns`)."""
    from tidyrl.rewards import build_reward_functions, check_reward_columns
    from tidyrl.rewards.functions import rewards_before_run

    reward_fns = build_reward_functions(cfg.rewards, base_dir=base_dir,
                                        forward_batch_size=cfg.rollout.forward_batch_size)
    lines = list(rewards_before_run(reward_fns))  # e.g. code_tests refused where it cannot sandbox: first
    check_reward_columns(reward_fns, columns)
    return reward_fns, lines


def check_engine_inputs(cfg: Config, model_config, prompt_ids: list, episodes_per_process: int, *,
                        training: bool = True) -> None:
    """The engine's own checks of the model and the longest sequence (e.g. vLLM: the architecture, the key/value
    cache's size). `training`: whether the run trains on the sampler's log-probs (rollout.behaviour_logprobs:
    sampler); an evaluation reads the completions alone, so a server's log-probs mode is no concern of it."""
    engine = engine_module(cfg.rollout.engine)
    if hasattr(engine, "input_problems"):
        from tidyrl.models.devices import cuda_in_use

        longest = max(len(p) for p in prompt_ids) + cfg.rollout.max_new_tokens
        problems = engine.input_problems(cfg, model_config, not cuda_in_use(), episodes_per_process, longest,
                                         sampler_logprobs=training and cfg.rollout.behaviour_logprobs == "sampler")
        if problems:
            raise ConfigError(problems)


def check_template_renders_tools(tokenizer, tools: list, factory) -> None:
    """A tool environment's schemas must reach the model: refuse a chat template that cannot render them or renders a
    conversation the same with and without `tools` (it has no tool section, so the model would never learn the tools
    exist)."""
    from tidyrl.data.prompts import tools_problem

    problem = tools_problem(tokenizer, tools)
    if problem is not None:
        raise ConfigError([f"environment.factory: {factory} offers tools ({', '.join(t['function']['name'] for t in tools)}), "
                           f"but {problem}. Use a model whose template renders tools (check the tools' type hints and "
                           "docstrings where it failed on them), or describe the tools in the prompt and use an "
                           "environment without tool_schemas"])
