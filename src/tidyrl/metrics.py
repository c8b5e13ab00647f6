"""What a run writes while it trains: metrics.jsonl, samples.jsonl and the progress bar.

Metric names are part of the API (DESIGN §5); `STEP_METRICS` lists the fields every
metrics.jsonl row carries, and tests check them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

STEP_METRICS = (
    "step",  # 1-based optimizer step
    "rollout",  # 1-based rollout the step belongs to
    "episodes",  # cumulative completions generated
    "epoch",  # fractional passes over the prompt set
    "lr",  # learning rate the optimizer used for this step
    "loss",
    "reward_mean",
    "reward_std",
    "kl",  # mean per-token KL to the reference; null when no reference model is loaded
    "entropy",
    "clip_fraction",
    "grad_norm",  # global norm before clipping
    "completion_length_mean",
    "truncated_fraction",
    "time_s",  # wall-clock seconds since training started
)


def _plain(value: Any) -> Any:
    """JSON-safe scalars: tensors to floats, NaN/inf to null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None

    def write(self, row: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({k: _plain(v) for k, v in row.items()}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ProgressBar:
    """A tqdm bar whose total is the plan's total optimizer steps; it advances once per optimizer step."""

    def __init__(self, total: int, enabled: bool = True, initial: int = 0):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", desc="tidyrl", dynamic_ncols=True)

    def step(self, reward: Optional[float], episodes: int) -> None:
        if self._bar is None:
            return
        postfix = {"episodes": episodes}
        if reward is not None:
            postfix["reward"] = f"{reward:.3f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    @property
    def n(self) -> int:
        return self._bar.n if self._bar is not None else 0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
