"""`tidyrl.train`: one entry point for every stage; the command line is a thin layer over it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

from tidyrl.config import Config, config_base_dir, load_config
from tidyrl.loops.common import TrainResult
from tidyrl.run_lock import release_output_dir

LOOPS = {
    "grpo": "tidyrl.loops.rl",
    "rloo": "tidyrl.loops.rl",
    "ppo": "tidyrl.loops.rl",
    "reinforce_pp": "tidyrl.loops.rl",
    "reinforce_pp_baseline": "tidyrl.loops.rl",
    "sft": "tidyrl.loops.sft",
    "reward": "tidyrl.loops.reward_model",
    "dpo": "tidyrl.loops.dpo",
    "kto": "tidyrl.loops.kto",
}
"""algorithm -> the module whose `run(cfg, base_dir)` trains it (one explicit loop per family)."""


def train(config: Config | dict | str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """Run the stage named by `config.algorithm`.

    `config` is a typed `Config`, a dict, or a YAML path; `overrides` are `section.key=value` strings.
    Reward functions may be Python callables in `rewards[i].function`. Returns a `TrainResult`.
    """
    cfg = load_config(config, overrides)
    if cfg.lora.enabled:
        from tidyrl.lora import require_peft

        require_peft()  # before any data or weights are read
    loop = importlib.import_module(LOOPS[cfg.algorithm])
    try:
        return loop.run(cfg, config_base_dir(config))
    finally:  # the output folder's lock, taken by the loop (tidyrl.run_lock), is given back however it ends
        release_output_dir(cfg.output_dir)
