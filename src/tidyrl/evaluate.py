"""`tidyrl eval`: generate on a prompt set with one model and score it with the configured rewards.

Run it on the starting model and on a run's `final/` (or a `checkpoint-N/`) with the same settings to
see what training changed:

    tidyrl eval grpo.yaml                                   # the config's model (before training)
    tidyrl eval grpo.yaml --model runs/my-run/final         # the trained model, same prompts and keys
    tidyrl eval runs/my-run/final --data test.jsonl --reward my_rewards.py:exact_match --greedy

What is evaluated:
- prompts: the first `num_prompts` rows of `data.path`, in file order (default 64; None = all). Point
  `--data` at a held-out file to measure generalisation rather than the training prompts.
- completions: `samples_per_prompt` per prompt (default: the config's rollout.samples_per_prompt, so
  the mean is comparable to training's `reward_mean`), drawn with the config's rollout settings
  (max_new_tokens, temperature, top_p, top_k, ...). Sampling is keyed by (seed, sample index) as in
  training, so two models are compared on the same random numbers, which lowers the noise of the
  difference. `greedy` takes the most likely token at every step (top_k = 1) and one sample per prompt.
- scores: the config's reward functions, raw per function and as the weighted total.

- normalize: a reward with `normalize: true` is reported raw (see `normalize_not_applied` in eval.json).

Writes eval.json (the means and the settings) and eval_samples.jsonl (every sample) into `output_dir`,
by default a folder `eval-<model folder name>` beside the model, or, for a model inside a run's folder, beside
the run (runs/my-run/final -> runs/my-run-eval-final), numbered (-2, ...) when an earlier evaluation is there:
none is ever replaced, and a run's folder gets nothing added.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence

from tidyrl.rollouts.producer import EVAL_SLOT

EVAL_ROLLOUT = EVAL_SLOT
"""The rollout slot of the sampling keys (models.generation.sample_seed): training uses 0, 1, ...; eval its own."""


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
             overrides: Sequence[str] = (), num_prompts: Optional[int] = 64,
             samples_per_prompt: Optional[int] = None, greedy: bool = False, seed: Optional[int] = None,
             output_dir: Optional[str | Path] = None, print_samples: int = 3, quiet: bool = False) -> EvalResult:
    """Evaluate one model; see the module docstring. Returns the summary written to eval.json."""
    import torch

    from tidyrl.data import encode_prompts, fit_prompts, load_prompt_dataset, load_rl_prompts, other_columns
    from tidyrl.engines import SamplingSettings, make_engine
    from tidyrl.models.generation import eos_token_ids, pad_token_id
    from tidyrl.models.loading import load_causal_lm, load_model_config, load_tokenizer
    from tidyrl.rewards import build_reward_functions
    from tidyrl.rewards.functions import rewards_before_run
    from tidyrl.rollouts.episodes import EpisodeSettings
    from tidyrl.rollouts.producer import Columns, Producer

    cfg, base_dir = resolve_eval_config(config, model=model, data=data, rewards=rewards, overrides=overrides)
    ro = cfg.rollout
    if num_prompts is not None and num_prompts < 1:
        raise EvalError(f"--num-prompts (num_prompts) must be >= 1, or `all` (None), got {num_prompts}")
    k = samples_per_prompt if samples_per_prompt is not None else (1 if greedy else ro.samples_per_prompt)
    if k < 1:
        raise EvalError(f"--samples-per-prompt (samples_per_prompt) must be >= 1, got {k}")
    seed = cfg.seed if seed is None else seed
    top_k = 1 if greedy else ro.top_k
    out = Path(output_dir) if output_dir is not None else default_output_dir(cfg.model)
    if output_dir is not None and (out / "eval.json").exists():
        raise EvalError(f"--output-dir {out} already holds an evaluation (eval.json); choose another folder, or "
                        "leave --output-dir out (then each evaluation gets its own eval-<model>[-N] folder).")

    # Cheap checks first (data, rewards, tokenizer, prompt lengths), then the weights.
    dataset = load_rl_prompts(cfg) if data is None else load_prompt_dataset(cfg.data.path, cfg.data.prompt_column,
                                                                             cfg.data.split)
    reward_fns = build_reward_functions(cfg.rewards, base_dir=base_dir)
    for line in rewards_before_run(reward_fns):  # e.g. code_tests: refused here when it cannot sandbox
        if not quiet:
            print(f"tidyrl eval: {line}")
    tokenizer = load_tokenizer(cfg.tokenizer or cfg.model, "tokenizer" if cfg.tokenizer else "model")
    n = len(dataset) if num_prompts is None else min(num_prompts, len(dataset))
    rows = dataset[:n]  # column -> n values
    prompts = rows[cfg.data.prompt_column]
    columns = {c: rows[c] for c in other_columns(dataset, cfg.data.prompt_column)}
    encoded = encode_prompts(prompts, tokenizer)
    context = getattr(load_model_config(cfg.model), "max_position_embeddings", None)
    limit = cfg.data.max_prompt_length or (context - ro.max_new_tokens if context else None)
    if limit is not None and limit < 1:
        raise EvalError(f"rollout.max_new_tokens={ro.max_new_tokens} leaves no room for a prompt in the model's "
                         f"context of {context} tokens; lower rollout.max_new_tokens.")
    if limit is not None:
        kept, encoded, report = fit_prompts(encoded, limit, cfg.data.overlong_prompts)
        if report and not quiet:
            print(f"tidyrl eval: {report}")
        prompts = [prompts[i] for i in kept]
        columns = {c: [values[i] for i in kept] for c, values in columns.items()}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    policy = load_causal_lm(cfg.model, cfg.model_dtype).eval()  # on the host until an engine samples from it
    eos_ids = eos_token_ids(policy, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    # The rollout path of training (tidyrl.rollouts), on the configured engine (rollout.engine).
    engine = make_engine(cfg, policy, device, max(len(p) for p in encoded) + ro.max_new_tokens)
    if engine.capabilities.samples_trained_weights:  # the builtin engine decodes with the policy itself
        policy.to(device)
    # An engine with its own copy (vLLM, servers) gets the weights from the host copy: the GPU holds one copy, the
    # engine's, not a second one for a model that only hands its weights over.
    engine.sync(policy)
    sampling = replace(SamplingSettings.of_rollout(ro, eos_ids, pad_id), top_k=top_k)
    table = Columns({cfg.data.prompt_column: prompts, **columns})
    producer = Producer(engine, tokenizer, table, encoded, prompt_column=cfg.data.prompt_column,
                        columns=list(columns), reward_fns=reward_fns, settings=EpisodeSettings(sampling), seed=seed)
    # Episode e = p * k + j is sample j of prompt p, as in a training rollout, keyed (seed, EVAL_ROLLOUT, e).
    episodes = range(len(prompts) * k)
    t0 = time.perf_counter()
    made = producer.round(EVAL_ROLLOUT, list(episodes), [e // k for e in episodes])
    engine.release()
    t_reward = made.reward_s
    t_generate = time.perf_counter() - t0 - t_reward
    lengths = made.completion_lengths
    truncated = made.episodes.truncated
    scored = made.scored
    completions = made.completions

    total = scored.total
    mean = sum(total) / len(total)
    std = math.sqrt(sum((x - mean) ** 2 for x in total) / (len(total) - 1)) if len(total) > 1 else 0.0
    summary = {
        "model": cfg.model,
        "data": cfg.data.path,
        "num_prompts": len(prompts),
        "samples_per_prompt": k,
        "n": len(total),
        "reward_mean": mean,
        "reward_std": std,
        "rewards": {f"reward/{name}": value for name, value in scored.means().items()},
        "weights": {f"reward/{f.name}": f.weight for f in reward_fns},
        "completion_length_mean": sum(lengths) / len(lengths),
        "truncated_fraction": float(truncated.float().mean()),
        # Training normalises a `normalize: true` reward with the moments of its own run, which a model folder
        # does not carry; normalising on this evaluation's own scores would centre them at 0 for every model
        # and hide the difference an evaluation is for. So eval reports raw scores, and says so.
        "normalize_not_applied": [f"reward/{f.name}" for f, c in zip(reward_fns, cfg.rewards) if c.normalize],
        "settings": {"seed": seed, "greedy": greedy, "max_new_tokens": ro.max_new_tokens,
                     "min_new_tokens": ro.min_new_tokens, "temperature": ro.temperature, "top_p": ro.top_p,
                     "top_k": top_k, "prompt_column": cfg.data.prompt_column},
        "time": {"generate_s": t_generate, "reward_s": t_reward},
    }
    samples = [
        {"prompt_index": e // k, "sample": e % k, "prompt": prompts[e // k], "completion": completions[e],
         "reward": total[e], "rewards": {name: values[e] for name, values in scored.per_function.items()},
         "truncated": bool(truncated[e])}
        for e in episodes
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    with open(out / "eval_samples.jsonl", "w", encoding="utf-8") as f:
        for sample in samples:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
    if not quiet:
        print(format_eval(summary, samples[::k][: max(print_samples, 0)], out))  # one per prompt
    return EvalResult(out, summary, samples)


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
                 f"truncated_fraction: {summary['truncated_fraction']:.3f}")
    for s in samples:
        prompt = s["prompt"] if isinstance(s["prompt"], str) else json.dumps(s["prompt"], ensure_ascii=False)
        lines.append(f"  e.g. {_clip(prompt)!r} -> {_clip(s['completion'])!r}  (reward {s['reward']:.3f})")
    lines.append(f"  written to {output_dir}{os.sep}: eval.json, eval_samples.jsonl")
    return "\n".join(lines)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
