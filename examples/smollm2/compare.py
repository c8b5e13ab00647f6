"""Two evaluations of the same held-out prompts (`tidyrl eval ... --output-dir DIR`, greedy, one completion per
prompt), compared: `python compare.py BEFORE_DIR AFTER_DIR` prints each accuracy with its 95 % interval and the
gain with the 95 % interval of the paired difference (the same prompts before and after), and how many completions
are the same text in both (two engines on one model: all of them, where they decode alike)."""

import json
import math
import sys
from pathlib import Path

Z = 1.96  # the normal quantile of a two-sided 95 % interval


def interval(scores: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95 % interval): Z standard errors of the mean."""
    n = len(scores)
    mean = sum(scores) / n
    var = sum((x - mean) ** 2 for x in scores) / (n - 1)
    return mean, Z * math.sqrt(var / n)


def paired_gain(before: list[dict], after: list[dict]) -> tuple[float, float]:
    """(mean gain, half-width of its 95 % interval) over the same prompts, from two evaluations' samples
    (eval_samples.jsonl rows): the interval of the per-prompt differences' mean, tighter than the two
    accuracies' intervals since a prompt's difficulty cancels."""
    got = {(s["prompt_index"], s["sample"]): s["reward"] for s in before}
    return interval([s["reward"] - got[(s["prompt_index"], s["sample"])] for s in after])


def read_samples(folder) -> list[dict]:
    with open(Path(folder) / "eval_samples.jsonl") as f:
        return [json.loads(line) for line in f]


def main(before_dir: str, after_dir: str) -> None:
    before, after = read_samples(before_dir), read_samples(after_dir)
    for name, folder, samples in (("before", before_dir, before), ("after", after_dir, after)):
        mean, half = interval([s["reward"] for s in samples])
        print(f"{name} ({folder}): {mean:.3f} ± {half:.3f} (95 %, n = {len(samples)})")
    gain, half = paired_gain(before, after)
    print(f"gain (after - before): {gain:+.3f} ± {half:.3f} (95 %, paired)")
    texts = {(s["prompt_index"], s["sample"]): s["completion"] for s in before}
    same = sum(texts.get((s["prompt_index"], s["sample"])) == s["completion"] for s in after)
    print(f"identical completions: {same} of {len(after)}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
