"""The command line: a thin layer over the Python API.

    tidyrl train CONFIG.yaml [section.key=value ...]
    tidyrl plan  CONFIG.yaml [section.key=value ...] [--num-processes W] [--memory 24GiB] [--fsdp]
    tidyrl demo  [--output-dir DIR] [section.key=value ...]
    tidyrl eval  CONFIG.yaml|MODEL [section.key=value ...] [--model M] [--data D] [--reward SPEC] ...
    tidyrl plot  RUN_DIR [RUN_DIR ...] [--out DIR]
    tidyrl tiny  OUT_DIR [--reward-model] [--tokenizer chars|bytes] [--context N] [--seed S] [--hidden-size H]
                 [--layers L]
"""

from __future__ import annotations

import argparse
import json

from tidyrl.console import say


def _stages_help() -> str:
    from tidyrl.config import SUMMARIES

    width = max(len(a) for a in SUMMARIES)
    lines = [f"  {a:<{width}}  {summary}" for a, summary in SUMMARIES.items()]
    return ("stages (set `algorithm:` in the YAML, or algorithm=NAME on the command line):\n" + "\n".join(lines)
            + "\n\nEvery configuration key with its type, default and meaning: docs/config-reference.md\n"
            "First steps: docs/quickstart.md; the batch sizes and totals: docs/concepts.md")


def _parser() -> argparse.ArgumentParser:
    stages = _stages_help()
    p = argparse.ArgumentParser(
        prog="tidyrl",
        description="RL post-training for Hugging Face language models, where every number adds up. "
        "One YAML file maps 1:1 onto typed config classes; section.key=value arguments override it.",
        epilog=stages, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(overrides=None)  # the commands that take section.key=value arguments set a list
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training stage from a YAML config",
                       description="Run the stage named by `algorithm:` in CONFIG.yaml.", epilog=stages,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl = sub.add_parser("plan", help="print the derived batch plan as JSON after train's checks; loads no weights")
    pl.add_argument("config", help="YAML config file")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl.add_argument("--num-processes", type=int, default=1, help="number of processes W (default 1)")
    pl.add_argument("--memory", metavar="SIZE", type=_memory_size,
                    help="memory each process has (e.g. 24GiB, 80GB), or `available` (the host's available memory): "
                    "each phase's predicted peak is checked against it, and a phase that would not fit is an "
                    "error naming what to change (docs/memory.md)")
    pl.add_argument("--fsdp", action="store_true",
                    help="plan the memory as FSDP2 sharding over the --num-processes processes would use")
    d = sub.add_parser("demo", help="the built-in end-to-end example (tiny local model, CPU, minutes)")
    d.add_argument("--output-dir", default="runs/demo", help="where the demo writes (default runs/demo)")
    d.add_argument("overrides", nargs="*", help="section.key=value overrides of the demo config")
    ti = sub.add_parser("tiny", help="write a tiny random model folder to try things with (seconds, no download)",
                        description="Write a tiny Llama (a character tokenizer with a chat template, random weights) "
                        "that AutoModelForCausalLM.from_pretrained loads, the model the demo trains; with "
                        "--reward-model, a tiny sequence-classification reward model with its own tokenizer.")
    ti.add_argument("output_dir", help="the folder to write (must not exist, or be empty)")
    ti.add_argument("--reward-model", action="store_true", help="a reward model (AutoModelForSequenceClassification)")
    ti.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ti.add_argument("--hidden-size", type=int, default=None, help="hidden size (default 64; 32 for a reward model)")
    ti.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ti.add_argument("--tokenizer", choices=("chars", "bytes"), default="chars",
                    help="chars (default): 59 symbols, a 256-token context, the demo's model; bytes: a byte-level "
                    "BPE (every byte, a few hundred merges) with a Qwen2.5-style chat template that renders tools "
                    "and <tool_call> JSON, a 512-token context: a model that can write tool calls")
    ti.add_argument("--context", type=int, default=None,
                    help="context length, max_position_embeddings (default 256 with chars, 512 with bytes)")

    e = sub.add_parser(
        "eval", help="generate with one model and score it with the rewards (compare before/after training)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Generate on a prompt set with one model and score with the reward functions; print and save "
        "the mean rewards (eval.json) and the samples (eval_samples.jsonl).",
        epilog="examples:\n"
        "  tidyrl eval grpo.yaml                              # the config's model, before training\n"
        "  tidyrl eval grpo.yaml --model runs/my-run/final    # after training: same prompts, same sampling keys\n"
        "  tidyrl eval runs/my-run/final --config grpo.yaml   # the same thing\n"
        "  tidyrl eval runs/my-run/final --data test.jsonl --reward my_rewards.py:exact_match --greedy\n"
        "The rollout settings (max_new_tokens, temperature, top_p, ...) come from the config; override them with\n"
        "rollout.key=value. See docs/evaluation-and-plots.md.")
    e.add_argument("target", metavar="CONFIG_OR_MODEL",
                   help="a training YAML (its model, data, rewards and rollout settings), or a model folder / hub id")
    e.add_argument("overrides", nargs="*", help="section.key=value overrides of the config (e.g. rollout.temperature=0.7)")
    e.add_argument("--model", help="evaluate this model instead of the config's `model` (e.g. runs/my-run/final)")
    e.add_argument("--config", help="training YAML to take data, rewards and rollout settings from (with a model folder)")
    e.add_argument("--data", help="prompt file or saved datasets folder; replaces data.path")
    e.add_argument("--reward", action="append", default=[], metavar="SPEC",
                   help="reward function module:function or file.py:function (repeatable, weight 1); replaces rewards")
    from tidyrl.evaluate import DEFAULT_PROMPTS

    e.add_argument("--num-prompts", type=_count_or_all, default=DEFAULT_PROMPTS,
                   help="the first N prompts, or `all` (default: all of the config's held-out prompts, "
                   "data.eval_path or data.eval_fraction; else the first 64 of data.path or --data)")
    e.add_argument("--samples-per-prompt", type=int, default=None,
                   help="completions per prompt (default: rollout.samples_per_prompt; 1 when greedy)")
    decoding = e.add_mutually_exclusive_group()
    decoding.add_argument("--greedy", action="store_true", default=None,
                          help="take the most likely token at every step (top_k = 1)")
    decoding.add_argument("--sampled", dest="greedy", action="store_false",
                          help="sample with the rollout settings (default, except on held-out prompts whose "
                          "log.eval_decoding is greedy)")
    e.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
    e.add_argument("--output-dir", help="where eval.json and eval_samples.jsonl go (default: eval-<model name> "
                   "beside the model folder; <run>-eval-<model name> beside the run for a run's final/ or "
                   "checkpoint)")

    pt = sub.add_parser("plot", help="PNG charts of runs' metrics.jsonl (several runs overlaid)",
                        description="One PNG per metric against optimizer steps: reward_mean, reward/<name>, kl, "
                        "entropy, clip_fraction, completion_length_mean, lr. Several runs are drawn on the same "
                        "axes (legend: run folder name). Needs matplotlib: pip install 'tidyrl[plot]'.")
    pt.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output_dir of a run (holds metrics.jsonl)")
    pt.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/plots of the first run)")
    pt.add_argument("--metric", action="append", default=None, metavar="NAME",
                    help="chart this metric of metrics.jsonl instead of the default set (repeatable; reward/* = "
                    "every reward function)")
    return p


def _memory_size(text: str) -> str:
    """`available`, or a size such as 24GiB (checked here, read by tidyrl.memory.rl)."""
    from tidyrl.memory.plan import parse_size

    if text != "available":
        try:
            parse_size(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _count_or_all(text: str):
    """`all` -> None (every prompt), else a positive integer."""
    if text == "all":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or `all`, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or `all`, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # argparse stops filling a positional list at the first option: take key=value given after options too.
    if extra and args.overrides is not None and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "plan":
            from tidyrl.api import check_parts
            from tidyrl.config import config_base_dir, load_config
            from tidyrl.loops.stage_plan import stage_plan

            cfg = load_config(args.config, args.overrides)
            check_parts(cfg)
            plan, notes = stage_plan(cfg, config_base_dir(args.config), args.num_processes, args.memory,
                                     args.fsdp or None)
            say(notes, err=True)
            print(json.dumps(plan, indent=2))
        elif args.command == "train":
            from tidyrl.api import train

            result = train(args.config, args.overrides)
            if result.is_main_process:
                plan = result.plan
                print(f"done: {plan.total_optimizer_steps} optimizer steps, {plan.drawn}; model in {result.final_dir}")
        elif args.command == "demo":
            from tidyrl.demo import run_demo

            run_demo(args.output_dir, tuple(args.overrides))
        elif args.command == "eval":
            _eval(args)
        elif args.command == "tiny":
            _tiny(args)
        elif args.command == "plot":
            from tidyrl.plot import DEFAULT_METRICS, plot_runs

            for path in plot_runs(args.runs, args.out, args.metric or DEFAULT_METRICS):
                print(path)
    except (RuntimeError, ValueError, FileNotFoundError, ImportError) as err:
        if type(err).__name__ == "TrainingInterrupted":  # Ctrl-C / SIGTERM: a checkpoint was saved
            say(str(err), err=True)
            return 130
        # Our errors say what is wrong and how to fix it; a traceback would only bury that.
        if type(err).__module__.startswith("tidyrl"):
            say(f"error: {err}", err=True)
            return 2
        raise
    return 0


def _tiny(args) -> None:
    from pathlib import Path

    from tidyrl.config import ConfigError
    from tidyrl.models.tiny import save_tiny_model, save_tiny_reward_model

    out = Path(args.output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError([f"{out} already exists and is not an empty folder; choose a new OUT_DIR "
                           "(tidyrl tiny never writes over files)"])
    size = {"hidden_size": args.hidden_size} if args.hidden_size else {}
    if args.reward_model and (args.tokenizer != "chars" or args.context):
        raise ConfigError(["--tokenizer and --context shape a policy; the tiny reward model has its own character "
                           "tokenizer: drop them, or drop --reward-model"])
    if args.reward_model:
        save_tiny_reward_model(out, seed=args.seed, num_layers=args.layers, **size)
        say(f"a tiny reward model is in {out}/ (AutoModelForSequenceClassification, its own tokenizer and chat "
            f"template); use it as  rewards: [{{model: {out}}}]")
    else:
        save_tiny_model(out, seed=args.seed, num_layers=args.layers, tokenizer=args.tokenizer,
                        max_position_embeddings=args.context, **size)
        kind = ("a byte-level BPE tokenizer with a tool-calling chat template" if args.tokenizer == "bytes" else
                "a character tokenizer with a chat template")
        say(f"a tiny model is in {out}/ (AutoModelForCausalLM, {kind}, random weights); use it as  model: {out}")


def _eval(args) -> None:
    """`tidyrl eval`: the positional is a YAML file (a config) or else a model folder / hub id."""
    from pathlib import Path

    from tidyrl.config import ConfigError
    from tidyrl.evaluate import evaluate

    target = Path(args.target)
    if target.is_file():
        if args.config:
            raise ConfigError([f"{args.target} is a config file already; drop --config (use --model to pick the model)"])
        config, model = args.target, args.model
    else:
        if args.model:
            raise ConfigError([f"{args.target} is taken as the model; drop --model, or give a config file first"])
        config, model = args.config, args.target
    evaluate(config, model=model, data=args.data, rewards=args.reward, overrides=args.overrides,
             num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt, greedy=args.greedy,
             seed=args.seed, output_dir=args.output_dir)
