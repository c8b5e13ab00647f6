"""Engines: what turns prompts into completions (`rollout.engine`), behind one interface (`engines.base`).

Each engine is a module with its class, `build(cfg, policy, device, max_model_len)`, `config_problems(cfg)`,
`fsdp_problem(cfg)` (what it refuses on a sharded policy), `resume_note(saved_state)` (what a resume from a
checkpoint should be warned of) and, where it reads the model, `input_problems(...)`; `ENGINES` names them. The
learner and the rollouts call only the interface and read each engine's `capabilities`.
"""

from __future__ import annotations

import importlib
from typing import Optional

from tidyrl.engines.base import Capabilities, EngineError, SamplingSettings

ENGINES = {"builtin": "tidyrl.engines.builtin", "vllm": "tidyrl.engines.vllm", "vllm-server": "tidyrl.engines.server"}
"""rollout.engine -> the module of that engine (imported when used: vLLM's takes seconds). vllm-server: vLLM's
OpenAI-compatible servers in their own processes (the `server` section)."""


def engine_module(name: str):
    if name not in ENGINES:
        raise EngineError(f"rollout.engine: {name!r} is not one of {', '.join(ENGINES)}")
    return importlib.import_module(ENGINES[name])


def engine_problems(cfg) -> list[str]:
    """The configured engine's checks of the config (`key: problem` lines), before anything loads."""
    if cfg.rollout.engine not in ENGINES:
        return [f"rollout.engine: {cfg.rollout.engine!r} is not one of {', '.join(ENGINES)}"]
    return engine_module(cfg.rollout.engine).config_problems(cfg)


def fsdp_problem(cfg) -> Optional[str]:
    """What the configured engine refuses when the policy is sharded with FSDP2, or None."""
    return engine_module(cfg.rollout.engine).fsdp_problem(cfg)


def resume_note(engine: str, saved_state: dict) -> Optional[str]:
    """What resuming from an RL checkpoint's state (`saved_state`) with `engine` should warn of, or None."""
    return engine_module(engine).resume_note(saved_state)


def make_engine(cfg, policy, device: str, max_model_len: int):
    """The engine `rollout.engine` names, for this process (vLLM: built now, its weights synced before each
    rollout)."""
    return engine_module(cfg.rollout.engine).build(cfg, policy, device, max_model_len)


__all__ = ["Capabilities", "ENGINES", "EngineError", "SamplingSettings", "engine_module", "engine_problems",
           "fsdp_problem", "make_engine", "resume_note"]
