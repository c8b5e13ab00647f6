"""Experiment trackers (`log.report_to`): TensorBoard, Weights & Biases, Trackio.

Each tracker receives the same rows as metrics.jsonl, under the same names, at
global step = `step` (the optimizer step), and the samples of samples.jsonl as
a table (wandb and trackio tables; a Markdown table through TensorBoard's text
plugin). Every tracker is an optional extra, imported only when chosen, so
`import tidyrl` never pays for it. Only the main process logs.

    tensorboard  pip install 'tidyrl[tensorboard]'   event files in <output_dir>/tensorboard/
    wandb        pip install 'tidyrl[wandb]'         project $WANDB_PROJECT (default tidyrl), files in <output_dir>/wandb/
    trackio      pip install 'tidyrl[trackio]'       project $TRACKIO_PROJECT (default tidyrl), local database

The run is named after the output folder. W&B reads its other settings
(WANDB_MODE=offline, WANDB_ENTITY, ...) from the environment as usual.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional

TRACKERS = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "trackio": "trackio",
}
"""`log.report_to` name -> the module it needs (also the name of its pip extra: tidyrl[<name>])."""

SAMPLE_COLUMNS = ("rollout", "step", "prompt", "completion", "reward", "rewards", "advantage", "truncated")
"""Columns of the samples table, in the order of samples.jsonl."""


def tracker_problems(names) -> list[str]:
    """Config problems of `log.report_to` (unknown, repeated or not installed trackers), one line each.

    Checked with `importlib.util.find_spec`, which finds a package without importing it, so this runs
    at config validation, before any model is loaded.
    """
    problems = []
    seen = set()
    for name in names:
        if name not in TRACKERS:
            problems.append(f"log.report_to: {name!r} is not a tracker tidyrl knows; use any of "
                            f"{', '.join(TRACKERS)} (or [] for none)")
        elif name in seen:
            problems.append(f"log.report_to: {name!r} is listed twice")
        elif importlib.util.find_spec(TRACKERS[name]) is None:
            problems.append(f"log.report_to: {name!r} is chosen but the {TRACKERS[name]} package is not "
                            f"installed; pip install 'tidyrl[{name}]', or remove {name!r} from log.report_to")
        seen.add(name)
    return problems


def open_trackers(names, output_dir: Path, run_config: dict, first_step: int = 0) -> list:
    """One tracker object per name, in order; `run_config` is stored as the run's hyper-parameters.
    `first_step` > 0 means a resumed run that continues after that optimizer step."""
    problems = tracker_problems(names)
    if problems:  # validate() reports these first; here for callers that bypass it
        from tidyrl.config import ConfigError

        raise ConfigError(problems)
    kinds = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "trackio": TrackioTracker}
    return [kinds[name](Path(output_dir), run_config, first_step) for name in names]


def _scalars(row: dict) -> dict[str, float]:
    """The numeric metrics of a row; `step` is the x-axis, not a metric, and nulls are skipped (not 0)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _cell(value: Any) -> Any:
    """A table cell: text, numbers and booleans as they are, anything else (messages, dicts) as JSON."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return json.dumps(value, ensure_ascii=False)


def sample_table_rows(samples: list[dict]) -> list[list]:
    """samples.jsonl rows -> table rows in SAMPLE_COLUMNS order."""
    return [[_cell(s.get(c)) for c in SAMPLE_COLUMNS] for s in samples]


def _project_name(env: str) -> str:
    return os.environ.get(env) or "tidyrl"


class TensorBoardTracker:
    """`torch.utils.tensorboard.SummaryWriter` into <output_dir>/tensorboard/."""

    name = "tensorboard"

    def __init__(self, output_dir: Path, run_config: dict, first_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.location = output_dir / "tensorboard"
        if first_step == 0:
            # A new run (or `overwrite: true`): old event files would show the previous run's curves next
            # to this one's, so they go like the run's other files.
            if self.location.exists():
                shutil.rmtree(self.location)
            self._writer = SummaryWriter(log_dir=str(self.location))
            self._writer.add_text("config", "```yaml\n" + _yaml(run_config) + "\n```", 0)
        else:
            # Resumed: hide the steps after the checkpoint that the crashed run had logged already.
            self._writer = SummaryWriter(log_dir=str(self.location), purge_step=first_step + 1)

    def log(self, row: dict, step: int, samples: Optional[list[dict]] = None) -> None:
        for key, value in _scalars(row).items():
            self._writer.add_scalar(key, value, global_step=step)
        if samples:
            self._writer.add_text("samples", _markdown_table(samples), global_step=step)

    def close(self) -> None:
        self._writer.close()


def _markdown_table(samples: list[dict]) -> str:
    """TensorBoard has no table type, but its text plugin renders Markdown: the samples as a Markdown table."""

    def text(v):
        return str(_cell(v)).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in sample_table_rows(samples)]
    return "\n".join(lines)


class WandbTracker:
    """`wandb.init` / `wandb.log(row, step=step)` / `wandb.Table` for the samples."""

    name = "wandb"

    def __init__(self, output_dir: Path, run_config: dict, first_step: int = 0):
        import wandb

        self._wandb = wandb
        output_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=_project_name("WANDB_PROJECT"), name=output_dir.name, dir=str(output_dir),
                               config=run_config)
        self.location = getattr(self._run, "url", None) or str(output_dir / "wandb")

    def log(self, row: dict, step: int, samples: Optional[list[dict]] = None) -> None:
        data: dict[str, Any] = _scalars(row)
        if samples:
            data["samples"] = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=sample_table_rows(samples))
        # One call per step: W&B requires steps that only grow, so the table rides with the metrics.
        self._run.log(data, step=step)

    def close(self) -> None:
        self._run.finish()


class TrackioTracker:
    """`trackio.init` / `trackio.log(row, step=step)` / `trackio.Table` for the samples (local-first)."""

    name = "trackio"

    def __init__(self, output_dir: Path, run_config: dict, first_step: int = 0):
        import trackio

        self._trackio = trackio
        self._run = trackio.init(project=_project_name("TRACKIO_PROJECT"), name=output_dir.name, config=run_config)
        self.location = f"trackio project {_project_name('TRACKIO_PROJECT')!r} (trackio show)"

    def log(self, row: dict, step: int, samples: Optional[list[dict]] = None) -> None:
        data: dict[str, Any] = _scalars(row)
        if samples:
            data["samples"] = self._trackio.Table(columns=list(SAMPLE_COLUMNS), data=sample_table_rows(samples))
        self._trackio.log(data, step=step)

    def close(self) -> None:
        self._trackio.finish()


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True).strip()
