"""`tidyrl plot`: one PNG per metric, runs overlaid, nulls skipped, missing metrics without a chart."""

from __future__ import annotations

import json

import pytest

from tidyrl.cli import main

pytest.importorskip("matplotlib")  # the `plot` extra, also in the `test` extra
from PIL import Image  # noqa: E402  (comes with matplotlib)

from tidyrl.plot import file_name, run_labels, series  # noqa: E402


def write_run(folder, with_kl: bool, reward_names=("letters",), steps=6):
    """A metrics.jsonl like a run writes: kl null without a reference model, no clip_fraction at all."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            row = {"step": step, "rollout": (step + 1) // 2, "lr": 1e-3 * (1 - step / 10), "reward_mean": step / 10,
                   "kl": 0.01 * step if with_kl else None, "entropy": 3 - step / 10,
                   "completion_length_mean": 4 + step % 2}
            row |= {f"reward/{name}": step / 20 for name in reward_names}
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 7, "rew')  # a last line cut short by a crash is ignored
    return folder


def is_drawn_png(path):
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.size == (700, 400)  # figsize (7, 4) at 100 dpi
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 16)
        # Not a blank canvas: background, axes, text and the coloured lines.
        return colours is None or len(colours) > 20


def line_colours_present(path):
    """Which of matplotlib's first two cycle colours (C0 blue, C1 orange) appear in the image."""
    with Image.open(path) as image:
        pixels = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 24)}
    return {"C0": (31, 119, 180) in pixels, "C1": (255, 127, 14) in pixels}


def test_two_runs_overlaid_one_png_per_metric(tmp_path, capsys):
    a = write_run(tmp_path / "baseline", with_kl=False)
    b = write_run(tmp_path / "with-kl", with_kl=True, reward_names=("letters", "brevity"))
    out = tmp_path / "charts"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    written = sorted(p.name for p in out.iterdir())
    # clip_fraction is in no row: no chart. kl is null in `baseline` but set in `with-kl`: a chart.
    assert written == sorted(["reward_mean.png", "reward-letters.png", "reward-brevity.png", "kl.png", "entropy.png",
                              "completion_length_mean.png", "lr.png"])
    assert capsys.readouterr().out.split() == [str(out / name) for name in
                                               ["reward_mean.png", "reward-brevity.png", "reward-letters.png",
                                                "kl.png", "entropy.png", "completion_length_mean.png", "lr.png"]]
    for name in written:
        assert is_drawn_png(out / name), name
    assert line_colours_present(out / "reward_mean.png") == {"C0": True, "C1": True}  # both runs drawn
    assert line_colours_present(out / "kl.png") == {"C0": True, "C1": False}  # only the run that has kl


def test_default_output_is_the_run_folder_and_nulls_are_skipped(tmp_path):
    run = write_run(tmp_path / "run", with_kl=False)
    assert main(["plot", str(run)]) == 0
    assert (run / "plots" / "reward_mean.png").is_file() and not (run / "plots" / "kl.png").exists()
    rows = [{"step": 1, "kl": None}, {"step": 2, "kl": 0.5}, {"step": 3}, {"step": 4, "kl": float("nan")}]
    assert series(rows, "kl") == ([2], [0.5])


def test_plot_chosen_metric_and_errors(tmp_path, capsys):
    run = write_run(tmp_path / "run", with_kl=False)
    assert main(["plot", str(run), "--metric", "entropy", "--out", str(tmp_path / "one")]) == 0
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["entropy.png"]
    assert main(["plot", str(tmp_path)]) == 2  # no metrics.jsonl there
    assert "holds no metrics.jsonl" in capsys.readouterr().err
    assert main(["plot", str(run), "--metric", "clip_fraction"]) == 2
    assert "no values of clip_fraction" in capsys.readouterr().err


def test_legend_labels_and_file_names(tmp_path):
    assert run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c"]) == ["a/run", "b/run", "c"]
    assert file_name("reward/exact match") == "reward-exact-match.png"
