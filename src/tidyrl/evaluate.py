"""`tidyrl eval`: the learner's held-out evaluation, run alone, on one model.

Run it on the starting model and on a run's `final/` (or a `checkpoint-N/`) with the same settings to
see what training changed:

    tidyrl eval grpo.yaml                                   # the config's model (before training)
    tidyrl eval grpo.yaml --model runs/my-run/final         # the trained model, same prompts and keys
    tidyrl eval runs/my-run/final --data test.jsonl --reward my_rewards.py:exact_match --greedy

It is built from the parts training uses: the input checks (`loops.run.inputs.check_eval_inputs`), the producer of
the episodes (`rollouts.producer.make_producer`: every engine, servers, environments and tools, multi-turn) and
the held-out evaluation (`rollouts.evaluation.evaluate_held_out`). So a run's `eval/*` metrics of its last step
and `tidyrl eval` of its `final/` give the same numbers.

What is evaluated:
- prompts: the config's held-out prompts (data.eval_path, or data.eval_fraction of data.path: those training
  evaluates), all of them; without a held-out set, the first 64 rows of data.path in file order; `--data`
  replaces either (its first `num_prompts` rows). `num_prompts` (None = all) cuts any of them.
- completions: on the held-out prompts, as training evaluates them (log.eval_decoding: greedy, one per prompt;
  sampled, rollout.samples_per_prompt); elsewhere `samples_per_prompt` sampled ones (default: the config's
  rollout.samples_per_prompt, so the mean is comparable to training's `reward_mean`), drawn with the rollout
  settings (max_new_tokens, temperature, top_p, top_k, ...). Sampling is keyed by (seed, evaluation slot,
  episode) as in training, so two models are compared on the same random numbers, which lowers the noise of the
  difference. `greedy` takes the most likely token at every step (top_k = 1) and one sample per prompt.
- scores: the config's reward functions, raw per function and as the weighted total, plus the environment's
  reward (weight 1) with an environment. A reward with `normalize: true` is reported raw (see
  `normalize_not_applied` in eval.json).

Writes eval.json (the means, the settings and what produced them) and eval_samples.jsonl (every sample) into
`output_dir`, by default a folder `eval-<model folder name>` beside the model, or, for a model inside a run's
folder, beside the run (runs/my-run/final -> runs/my-run-eval-final), numbered (-2, ...) when an earlier
evaluation is there: none is ever replaced, and a run's folder gets nothing added.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from tidyrl.console import say

DEFAULT_PROMPTS = -1
"""`num_prompts`' default: every held-out prompt of the config, else the first 64 of data.path."""


class EvalError(ValueError):
    """An evaluation setting is unusable; the message names the option or config key."""


@dataclass
class EvalResult:
    """What `evaluate` returns; `summary` is the content of eval.json."""

    output_dir: Path
    summary: dict
    samples: list[dict] = field(default_factory=list)


def resolve_eval_config(config=None, *, model: Optional[str] = None, data: Optional[str] = None,
                        rewards: Sequence = (), overrides: Sequence[str] = ()):
    """The Config to evaluate with, and the folder relative reward files are found in.

    `config` is a training YAML path, a dict or a Config (its model, data, rewards and rollout settings
    are used); `model`, `data` and `rewards` replace its model, data.path and rewards. Without a config,
    `model`, `data` and `rewards` are all needed. Trackers (log.report_to) are switched off.
    """
    from tidyrl.config import ConfigError, RewardConfig, config_base_dir, load_config, validate

    overrides = [*overrides, "log.report_to=[]"]  # eval logs to no tracker; none need be installed
    if config is None:
        missing = [flag for flag, value in (("--model", model), ("--data", data), ("--reward", rewards))
                   if not value]
        if missing:
            raise ConfigError([f"without a config file, tidyrl eval needs {', '.join(missing)}: give a training "
                               "YAML (tidyrl eval grpo.yaml --model runs/x/final), or a model folder with "
                               "--config, or --data PROMPTS and --reward module:function"])
        # The training-only keys get placeholders: eval reads model, data, rewards and rollout.
        cfg = load_config({"model": str(model), "data": {"path": str(data)},
                           "rewards": [{"function": r} for r in rewards], "train": {"rollouts": 1}}, overrides)
        return cfg, None
    cfg = load_config(config, overrides)
    if model is not None:
        cfg.model = str(model)
        cfg.tokenizer = None  # a run's final/ and checkpoint-N/ hold the tokenizer training used
    if data is not None:
        cfg.data.path = str(data)
    if rewards:
        cfg.rewards = [RewardConfig(function=r) for r in rewards]
    validate(cfg)
    return cfg, config_base_dir(config)


def check_kernel_overrides() -> None:
    """The developer overrides of the kernels set in the environment (`models.kernels`), checked before anything
    loads, as `tidyrl.train` checks them (`api.check_parts`): ConfigError naming each invalid one."""
    from tidyrl.config import ConfigError
    from tidyrl.models.kernels import override_problems

    problems = override_problems()
    if problems:
        raise ConfigError(problems)


def default_output_dir(model: str) -> Path:
    """Where an evaluation goes by default: eval-<name> beside a local model folder, except for a model inside a
    run's folder (a checkpoint-N/, final/, best/ of a folder holding plan.json), whose evaluation goes beside the
    run as <run>-eval-<name> (a run's folder holds what the run wrote, nothing added later); eval/<hub id with / as
    --> for a hub id. When an earlier evaluation is there, the first of ...-2, -3, ... that holds none: an
    evaluation never replaces another (it may be of other prompts, settings or weights)."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path.resolve()
        if (path.parent / "plan.json").is_file():  # inside a run's folder: beside the run
            base = path.parent.parent / f"{path.parent.name}-eval-{path.name}"
        else:
            base = path.parent / f"eval-{path.name}"
    else:
        base = Path("eval") / model.replace("/", "--")
    candidate, n = base, 1
    while (candidate / "eval.json").exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def evaluate(config=None, *, model: Optional[str] = None, data: Optional[str] = None, rewards: Sequence = (),
             overrides: Sequence[str] = (), num_prompts: Optional[int] = DEFAULT_PROMPTS,
             samples_per_prompt: Optional[int] = None, greedy: Optional[bool] = None, seed: Optional[int] = None,
             output_dir: Optional[str | Path] = None, print_samples: int = 3, quiet: bool = False) -> EvalResult:
    """Evaluate one model; see the module docstring. Returns the summary written to eval.json."""
    from tidyrl.loops.run.setup import make_accelerator
    from tidyrl.loops.run.inputs import check_eval_inputs

    cfg, base_dir = resolve_eval_config(config, model=model, data=data, rewards=rewards, overrides=overrides)
    check_kernel_overrides()
    seed = cfg.seed if seed is None else seed  # the sampling keys' (the held-out prompts stay the config's)
    if num_prompts is not None and num_prompts != DEFAULT_PROMPTS and num_prompts < 1:
        raise EvalError(f"--num-prompts (num_prompts) must be >= 1, or `all` (None), got {num_prompts}")
    out = Path(output_dir) if output_dir is not None else default_output_dir(cfg.model)
    if output_dir is not None and (out / "eval.json").exists():
        raise EvalError(f"--output-dir {out} already holds an evaluation (eval.json); choose another folder, or "
                        "leave --output-dir out (then each evaluation gets its own eval-<model>[-N] folder).")
    held_out = data is None and bool(cfg.data.eval_path or cfg.data.eval_fraction)
    if num_prompts == DEFAULT_PROMPTS:  # the held-out prompts all, as training evaluates them; else the first 64
        num_prompts = None if held_out else 64
    if greedy is None:  # the held-out prompts as training decodes them (log.eval_decoding); else sampled
        greedy = held_out and cfg.log.eval_decoding == "greedy"
    k = samples_per_prompt if samples_per_prompt is not None else (1 if greedy else cfg.rollout.samples_per_prompt)
    if k < 1:
        raise EvalError(f"--samples-per-prompt (samples_per_prompt) must be >= 1, got {k}")

    # Everything cheap first, by the learner's own checks (data, environment, rewards, prompt lengths, engine),
    # then the weights.
    inputs = check_eval_inputs(cfg, base_dir, data=data, num_prompts=num_prompts, samples_per_prompt=k)
    accelerator = make_accelerator(cfg)
    speaks = accelerator.is_main_process and not quiet
    say(inputs.report, main=speaks, prefix="tidyrl eval")
    metrics, episodes = _held_out_evaluation(cfg, inputs, accelerator, k, greedy, seed)
    prompts = inputs.dataset[cfg.data.prompt_column]
    totals = [row["reward"] for row in episodes]
    mean = metrics["eval/reward_mean"]
    std = math.sqrt(sum((x - mean) ** 2 for x in totals) / (len(totals) - 1)) if len(totals) > 1 else 0.0
    names = [f.name for f in inputs.reward_fns] + (["env"] if inputs.environment is not None else [])
    ro = cfg.rollout
    summary = {
        "model": cfg.model,
        "data": inputs.source,
        "num_prompts": len(prompts),
        "samples_per_prompt": k,
        "n": len(totals),
        "reward_mean": mean,
        "reward_std": std,
        "rewards": {f"reward/{name}": metrics[f"eval/reward/{name}"] for name in names},
        "weights": {f"reward/{f.name}": f.weight for f in inputs.reward_fns}
        | ({"reward/env": 1.0} if inputs.environment is not None else {}),
        "completion_length_mean": metrics["eval/completion_length_mean"],
        "truncated_fraction": metrics["eval/truncated_fraction"],
        # With an environment: the model's turns per episode (1 + its tool calls, for a tool environment)
        **({"turns_mean": sum(row["turns"] for row in episodes) / len(episodes)}
           if inputs.environment is not None and episodes else {}),
        # Training normalises a `normalize: true` reward with the moments of its own run, which a model folder
        # does not carry; normalising on this evaluation's own scores would centre them at 0 for every model
        # and hide the difference an evaluation is for. So eval reports raw scores, and says so.
        "normalize_not_applied": [f"reward/{f.name}" for f, c in zip(inputs.reward_fns, cfg.rewards) if c.normalize],
        "settings": {"seed": seed, "greedy": greedy, "max_new_tokens": ro.max_new_tokens,
                     "min_new_tokens": ro.min_new_tokens, "temperature": ro.temperature, "top_p": ro.top_p,
                     "top_k": 1 if greedy else ro.top_k, "prompt_column": cfg.data.prompt_column},
        "produced_by": produced_by(cfg),
        "time": {"eval_s": metrics["time/eval_s"]},
    }
    samples = [{"prompt_index": row["prompt_index"], "sample": row["sample"], "prompt": prompts[row["prompt_index"]],
                "completion": row["completion"], "reward": row["reward"], "rewards": row["rewards"],
                "truncated": row["truncated"], **({"turns": row["turns"]} if "turns" in row else {})}
               for row in episodes]
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        with open(out / "eval_samples.jsonl", "w", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        if speaks:
            print(format_eval(summary, samples[::k][: max(print_samples, 0)], out))  # one per prompt
    return EvalResult(out, summary, samples)


def _held_out_evaluation(cfg, inputs, accelerator, k: int, greedy: bool, seed: int):
    """The learner's held-out evaluation (`rollouts.evaluation.evaluate_held_out`) of `inputs`' prompts, with the
    policy loaded as training loads it and the producer training builds (environment and tools included), on the
    configured engine: (its metrics, every episode's row)."""
    from tidyrl.engines import make_engine
    from tidyrl.rollouts.evaluation import evaluate_held_out
    from tidyrl.rollouts.producer import make_producer
    from tidyrl.models.sequences import eos_token_ids, pad_token_id
    from tidyrl.models.loading import load_causal_lm

    ro = cfg.rollout
    # on the host until an engine samples from it
    policy = load_causal_lm(cfg.model, cfg.model_dtype, kernels=cfg.kernels).eval()
    eos_ids = eos_token_ids(policy, inputs.tokenizer)
    pad_id = pad_token_id(inputs.tokenizer, eos_ids)
    device = accelerator.device
    engine = make_engine(cfg, policy, device.type, max(len(p) for p in inputs.prompt_ids) + ro.max_new_tokens)
    # The builtin engine decodes with the policy itself; an engine with its own copy (vLLM, servers) gets the
    # weights from the host copy: the device holds one copy, the engine's.
    if engine.capabilities.samples_trained_weights:
        policy.to(device)
    pool = None
    if inputs.environment is not None:
        from tidyrl.environments import EnvironmentPool

        pool = EnvironmentPool(cfg.environment.timeout_s, cfg.environment.workers)
    try:
        from tidyrl.data import other_columns

        producer = make_producer(cfg, engine, inputs.tokenizer, inputs.dataset, inputs.prompt_ids, eos_ids, pad_id,
                                 columns=other_columns(inputs.dataset, cfg.data.prompt_column),
                                 reward_fns=inputs.reward_fns, environment=inputs.environment, tools=inputs.tools,
                                 pool=pool, greedy=greedy, seed=seed)
        return evaluate_held_out(producer, engine, policy, k, len(inputs.prompt_ids), accelerator, with_episodes=True)
    finally:
        if pool is not None:
            pool.close()


def produced_by(cfg) -> dict:
    """What produced an evaluation: the engine, the model, the data, tidyrl's version and the libraries'."""
    import importlib.metadata

    versions = {}
    for package in ("tidyrl", "torch", "transformers", *(("vllm",) if cfg.rollout.engine.startswith("vllm") else ())):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"engine": cfg.rollout.engine, "model": cfg.model, "tokenizer": cfg.tokenizer or cfg.model,
            "model_dtype": cfg.model_dtype, "data": cfg.data.path, "versions": versions}


def format_eval(summary: dict, samples: list[dict], output_dir: Path) -> str:
    """The printed report: the means, a few samples, where the files are."""
    lines = [f"tidyrl eval: {summary['model']} on {summary['num_prompts']} prompts x {summary['samples_per_prompt']} "
             f"samples = {summary['n']} completions of {summary['data']}",
             f"  reward_mean: {summary['reward_mean']:.4f}  (std {summary['reward_std']:.4f})"]
    for name, value in summary["rewards"].items():
        shown = "n/a (scored no sample)" if value is None else f"{value:.4f}"
        lines.append(f"  {name}: {shown}  (weight {summary['weights'][name]:g})")
    if summary.get("normalize_not_applied"):
        lines.append(f"  note: {', '.join(summary['normalize_not_applied'])} set normalize: true; eval scores are raw "
                     "(training normalises with its run's moments), so reward_mean is the weighted total of raw "
                     "scores, not training's reward_mean")
    lines.append(f"  completion_length_mean: {summary['completion_length_mean']:.1f} tokens, "
                 f"truncated_fraction: {summary['truncated_fraction']:.3f}"
                 + (f", turns_mean: {summary['turns_mean']:.3f}" if "turns_mean" in summary else ""))
    for s in samples:
        prompt = s["prompt"] if isinstance(s["prompt"], str) else json.dumps(s["prompt"], ensure_ascii=False)
        lines.append(f"  e.g. {_clip(prompt)!r} -> {_clip(s['completion'])!r}  (reward {s['reward']:.3f})")
    lines.append(f"  written to {output_dir}{os.sep}: eval.json, eval_samples.jsonl")
    return "\n".join(lines)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
