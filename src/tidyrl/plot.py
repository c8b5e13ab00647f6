"""`tidyrl plot RUN_DIR [RUN_DIR ...]`: PNG charts of a run's metrics.jsonl against optimizer steps.

One PNG per metric (easy to put in a README, a report or a pull request), every run given drawn on the
same axes so runs can be compared; the legend is the run folder's name. Written to RUN_DIR/plots/ of the
first run, or to `--out DIR`. A metric that no run logged gets no chart; null values (e.g. `kl` without
a reference model) are left out of the line rather than drawn as 0.

matplotlib is an optional extra (pip install 'tidyrl[plot]'), imported only here. The figures are drawn
with matplotlib's object API on the Agg canvas, never through pyplot, so plotting neither opens a window
nor changes the backend of a program that imports tidyrl.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_METRICS = ("reward_mean", "reward/*", "kl", "entropy", "clip_fraction", "completion_length_mean",
                   "loss", "eval/*", "rewards/accuracy", "rewards/margin", "nll_token_mean", "padding_fraction", "lr")
"""Charts drawn by default, in order, each only where a run logged it (RL stages: the rewards, KL, entropy, ...;
sft, reward, dpo: the loss, the eval/ metrics, accuracy and margin); `reward/*` is one chart per reward function
(`reward/<name>`), `eval/*` one per held-out metric."""

TITLES = {
    "reward_mean": "mean reward (weighted sum)",
    "kl": "KL to the reference (per token)",
    "entropy": "policy entropy (per token)",
    "clip_fraction": "fraction of tokens clipped",
    "completion_length_mean": "mean completion length (tokens)",
    "lr": "learning rate",
    "loss": "training loss (per optimizer step)",
    "rewards/accuracy": "fraction of pairs ranked right (chosen > rejected)",
    "rewards/margin": "mean reward margin (chosen - rejected)",
    "nll_token_mean": "NLL per target token",
    "padding_fraction": "fraction of batch cells that are padding",
    "eval/loss": "held-out loss",
    "eval/accuracy": "held-out accuracy",
    "eval/margin": "held-out reward margin",
}


class PlotError(RuntimeError):
    """A run folder cannot be plotted; the message says why."""


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (a line cut short by a crash is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{run_dir} holds no metrics.jsonl: give the output_dir of a training run")
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a run killed while writing it
    return rows


def series(rows: list[dict], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric`, leaving out rows where it is missing, null or not finite."""
    steps, values = [], []
    for row in rows:
        value = row.get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(row["step"])
            values.append(float(value))
    return steps, values


def chart_metrics(runs: dict[str, list[dict]], metrics: Sequence[str] = DEFAULT_METRICS) -> list[str]:
    """The metrics that get a chart: `metrics` in order, `reward/*` expanded to the reward functions seen
    in any run, keeping only those with at least one value."""
    chosen: list[str] = []
    for metric in metrics:
        if metric.endswith("/*"):
            prefix = metric[:-1]
            names = sorted({k for rows in runs.values() for row in rows for k in row if k.startswith(prefix)})
        else:
            names = [metric]
        for name in names:
            if name not in chosen and any(series(rows, name)[0] for rows in runs.values()):
                chosen.append(name)
    return chosen


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """Legend labels: each run folder's name, with its parent's name too where two names clash."""
    paths = [Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def file_name(metric: str) -> str:
    """reward/exact_match -> reward-exact_match.png"""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", metric) + ".png"


def plot_runs(run_dirs: Sequence[str | Path], out_dir: Optional[str | Path] = None,
              metrics: Sequence[str] = DEFAULT_METRICS) -> list[Path]:
    """Write one PNG per metric, the runs overlaid; return the files written.

    `out_dir` defaults to <first run>/plots. Raises PlotError when a folder has no metrics.jsonl or no
    chosen metric has a value in any run.
    """
    if not run_dirs:
        raise PlotError("give at least one run folder")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("tidyrl plot needs matplotlib: pip install 'tidyrl[plot]'") from None

    labels = run_labels(run_dirs)
    runs = {label: read_metrics(d) for label, d in zip(labels, run_dirs)}
    chosen = chart_metrics(runs, metrics)
    if not chosen:
        raise PlotError(f"no values of {', '.join(metrics)} in the metrics.jsonl of {', '.join(map(str, run_dirs))}")
    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "plots"
    out.mkdir(parents=True, exist_ok=True)

    written = []
    for metric in chosen:
        fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
        ax = fig.subplots()
        for label, rows in runs.items():
            steps, values = series(rows, metric)
            if steps:
                # Markers only when the points are few: a line alone hides single logged values.
                ax.plot(steps, values, label=label, linewidth=1.5, marker="o" if len(steps) <= 30 else None,
                        markersize=3)
        ax.set_title(TITLES.get(metric, metric.replace("reward/", "reward: ")))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        if metric == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.legend(loc="best", fontsize="small")
        path = out / file_name(metric)
        fig.savefig(path, format="png")
        written.append(path)
    return written
