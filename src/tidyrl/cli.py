"""The command line: a thin layer over the Python API.

    tidyrl train CONFIG.yaml [section.key=value ...]
    tidyrl plan  CONFIG.yaml [section.key=value ...] [--num-processes W]
    tidyrl demo  [--output-dir DIR] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tidyrl",
        description="RL post-training (GRPO, RLOO) for Hugging Face language models, where every number adds up. "
        "Configuration keys: see docs/ (each YAML section maps to a typed config class).",
    )
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a training stage from a YAML config")
    t.add_argument("config", help="YAML config file")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl = sub.add_parser("plan", help="print the derived batch plan as JSON; loads no model")
    pl.add_argument("config", help="YAML config file")
    pl.add_argument("overrides", nargs="*", help="section.key=value overrides")
    pl.add_argument("--num-processes", type=int, default=1, help="number of processes W (default 1)")
    d = sub.add_parser("demo", help="the built-in end-to-end example (tiny local model, CPU, minutes)")
    d.add_argument("--output-dir", default="runs/demo", help="where the demo writes (default runs/demo)")
    d.add_argument("overrides", nargs="*", help="section.key=value overrides of the demo config")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "plan":
            from tidyrl.config import load_config
            from tidyrl.data import load_prompt_dataset
            from tidyrl.plan import plan_from_config

            cfg = load_config(args.config, args.overrides)
            num_prompts = None
            if cfg.data.path:
                num_prompts = len(load_prompt_dataset(cfg.data.path, cfg.data.prompt_column, cfg.data.split))
            plan = plan_from_config(cfg, num_prompts, args.num_processes)
            print(json.dumps(plan.to_dict(), indent=2))
        elif args.command == "train":
            from tidyrl.api import train

            result = train(args.config, args.overrides)
            if result.is_main_process:
                print(f"done: {result.plan.total_optimizer_steps} optimizer steps, "
                      f"{result.plan.total_episodes} episodes; model in {result.final_dir}")
        elif args.command == "demo":
            from tidyrl.demo import run_demo

            run_demo(args.output_dir, tuple(args.overrides))
    except (RuntimeError, ValueError, FileNotFoundError) as err:
        if type(err).__name__ == "TrainingInterrupted":  # Ctrl-C / SIGTERM: a checkpoint was saved
            print(f"tidyrl: {err}", file=sys.stderr)
            return 130
        # Our errors say what is wrong and how to fix it; a traceback would only bury that.
        if type(err).__module__.startswith("tidyrl"):
            print(f"tidyrl: error: {err}", file=sys.stderr)
            return 2
        raise
    return 0
