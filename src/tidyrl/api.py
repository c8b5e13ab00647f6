"""`tidyrl.train`: one entry point for every stage; the command line is a thin layer over it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Sequence

from tidyrl.config import RL_ALGORITHMS, Config, ConfigError, config_base_dir, load_config
from tidyrl.loops.run.faults import report_fault, stop_watching
from tidyrl.loops.run.setup import TrainResult
from tidyrl.loops.run.steps import TrainingInterrupted
from tidyrl.run_lock import release_output_dir

LOOPS = {
    **{name: "tidyrl.loops.rl.learner" for name in RL_ALGORITHMS},  # every on-policy algorithm of the algorithm table
    "sft": "tidyrl.loops.offline.sft",
    "reward": "tidyrl.loops.offline.reward_model",
    "dpo": "tidyrl.loops.offline.dpo",
    "kto": "tidyrl.loops.offline.kto",
}
"""algorithm -> the module whose `run(cfg, base_dir)` trains it (one explicit loop per family)."""


def check_parts(cfg: Config) -> None:
    """The checks that live with the parts a config names, before anything loads: its trackers (log.report_to),
    for an RL stage its engine (rollout.engine), and the developer overrides of its kernels set in the environment
    (`models.kernels.override_problems`). Raises ConfigError listing every problem. `tidyrl.train` and `tidyrl plan`
    call it after `load_config`'s own checks."""
    from tidyrl.models.kernels import override_problems
    from tidyrl.trackers import tracker_problems

    problems = override_problems()
    if cfg.algorithm in RL_ALGORITHMS:
        from tidyrl.engines import engine_problems

        problems += engine_problems(cfg)
    problems += tracker_problems(cfg.log.report_to)
    if problems:
        raise ConfigError(problems)


def train(config: Config | dict | str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """Run the stage named by `config.algorithm`.

    `config` is a typed `Config`, a dict, or a YAML path; `overrides` are `section.key=value` strings.
    Reward functions may be Python callables in `rewards[i].function`. Returns a `TrainResult`.
    """
    cfg = load_config(config, overrides)
    check_parts(cfg)
    if cfg.lora.enabled:
        from tidyrl.models.lora import require_peft, require_target_parameters

        require_peft()  # before any data or weights are read
        if cfg.lora.target_parameters:
            require_target_parameters()
    loop = importlib.import_module(LOOPS[cfg.algorithm])
    try:
        return loop.run(cfg, config_base_dir(config))
    except (KeyboardInterrupt, TrainingInterrupted):  # not a fault: every process stops after its step and saves
        raise
    except BaseException as err:  # several processes: the others end at once with this one's message
        report_fault(err)
        raise
    finally:  # the output folder's lock, taken by the loop (tidyrl.run_lock), is given back however it ends
        stop_watching()
        release_output_dir(cfg.output_dir)
