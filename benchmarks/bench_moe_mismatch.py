"""The sampler/trainer mismatch of a mixture of experts, side by side: each correction (rollout.correction) with
routing replay, the default correction without it, and the same for a dense model of the same width, in GRPO runs
of one config at rollout.lag 1 (so the rollout's log-probs are a version old: what every correction corrects), or
with `--lag 0` on-policy (the trainer scores the sampler's own weights: the mismatch is the two passes' rounding
and router decisions alone; each correction on with its mode's default bound).

Each variant is one run (tidyrl.train in this process, the same seed and prompts); the figures come from its
metrics.jsonl, averaged over its rollouts:

    reward first / last   reward_mean of the first and the last `--window` rollouts (the learning curve's ends)
    |dlogp| mean, max     mismatch/logprob_abs_mean and _max: |log pi_trainer - log pi_sampler| on the sampled tokens
    changed               routing/changed_fraction: of the sampler's router decisions, those the trainer's own
                          router would have made otherwise (replayed or only compared)
    clipped / masked      mismatch/capped_fraction (truncating modes) or mismatch/masked_fraction (masking modes)
                          of the tokens, and mismatch/masked_sequence_fraction of the sequences
    s / rollout           wall time per rollout

    python benchmarks/bench_moe_mismatch.py                            # bf16 on the CPU, 30 rollouts (~10 min)
    python benchmarks/bench_moe_mismatch.py --lag 0                    # the same weights on both sides
    python benchmarks/bench_moe_mismatch.py --rollouts 4 --variants token_truncate,no-replay   # a quick look

In bfloat16 the sampler's decode step and the trainer's pass round differently, so router decisions flip between
them (float32 on one CPU: almost never); at a lag of 1 the weights also moved by one rollout's updates.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "sequence_reject")
VARIANTS = (*CORRECTIONS, "no-replay")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--window", type=int, default=5, help="rollouts averaged at each end of the learning curve")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--lag", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)} (no-replay: token_truncate, routes only compared)")
    p.add_argument("--dense", default="token_truncate,sequence_mask",
                   help="the corrections also run on the dense model (comma list; empty: none)")
    p.add_argument("--keep", default=None, help="a folder to keep the runs in (default: a temporary one)")
    return p.parse_args()


def prepare(folder: Path) -> dict:
    """The two tiny models (a Qwen3-MoE of 4 experts, 2 a token, and a Llama of the same width) and the demo's
    prompts; the run config every variant shares."""
    from tidyrl.demo import WORDS
    from tidyrl.models.tiny import save_tiny_model

    alphabet = string.ascii_lowercase + " :"
    for name, family in (("moe", "qwen3_moe"), ("dense", None)):
        save_tiny_model(folder / name, seed=0, hidden_size=64, num_layers=2, num_heads=4, alphabet=alphabet,
                        family=family)
    rng = random.Random(0)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(256):
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"{word}:", "word": word}) + "\n")
    return {"algorithm": "grpo", "seed": 0, "data": {"path": str(folder / "prompts.jsonl")},
            "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
            "rollout": {"prompts_per_rollout": 8, "samples_per_prompt": 8, "max_new_tokens": 10},
            "train": {"epochs_per_rollout": 1, "minibatches_per_epoch": 2, "micro_batch_size": 16,
                      "learning_rate": 6.0e-3, "lr_scheduler": "cosine", "warmup_steps": 4},
            "log": {"progress_bar": False, "samples_per_rollout": 0}}


def run(base: dict, folder: Path, model: str, variant: str, args) -> dict:
    import tidyrl

    correction = "token_truncate" if variant == "no-replay" else variant
    out = folder / f"{model}-{variant}"
    cfg = json.loads(json.dumps(base))
    cfg.update(model=str(folder / model), output_dir=str(out), model_dtype=args.dtype, overwrite=True)
    cfg["rollout"].update(lag=args.lag, correction=correction, routing_replay=variant != "no-replay")
    if args.lag == 0:  # on-policy the built-in engine corrects nothing by default: the mode's bound, explicitly
        from tidyrl.algorithms.corrections import DEFAULTS

        cfg["rollout"]["tis_cap"] = DEFAULTS[correction][1]
    cfg["train"]["rollouts"] = args.rollouts
    t0 = time.perf_counter()
    tidyrl.train(cfg)
    wall = time.perf_counter() - t0
    per_rollout = {}
    for row in map(json.loads, open(out / "metrics.jsonl")):
        if "rollout" in row and "reward_mean" in row:
            per_rollout.setdefault(row["rollout"], row)
    rows = [per_rollout[r] for r in sorted(per_rollout)]

    def mean(key, part=rows):
        values = [r[key] for r in part if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    w = min(args.window, len(rows))
    masked = mean("mismatch/masked_fraction")
    return {"model": model, "variant": variant, "first": mean("reward_mean", rows[:w]),
            "last": mean("reward_mean", rows[-w:]), "dlogp": mean("mismatch/logprob_abs_mean"),
            "dlogp_max": mean("mismatch/logprob_abs_max"), "changed": mean("routing/changed_fraction"),
            "cut": mean("mismatch/capped_fraction") if masked is None else masked,
            "seq": mean("mismatch/masked_sequence_fraction"), "s": wall / max(len(rows), 1)}


def show(value, digits=4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main():
    args = parse_args()
    variants = [v for v in args.variants.split(",") if v]
    dense = [v for v in args.dense.split(",") if v]
    for v in variants + dense:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.keep or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        base = prepare(folder)
        results = [run(base, folder, "moe", v, args) for v in variants]
        results += [run(base, folder, "dense", v, args) for v in dense if v != "no-replay"]
    print(f"GRPO at rollout.lag {args.lag}, {args.dtype}, {args.rollouts} rollouts (ends: {args.window} each)")
    header = (f"{'model':6} {'variant':26} {'reward first':>12} {'last':>7} {'|dlogp| mean':>12} {'max':>7} "
              f"{'changed':>8} {'clip/mask':>9} {'seq masked':>10} {'s/rollout':>9}")
    print(header)
    for r in results:
        label = r["variant"] + ("" if r["model"] == "dense" or r["variant"] == "no-replay" else " + replay")
        print(f"{r['model']:6} {label:26} {show(r['first'], 3):>12} {show(r['last'], 3):>7} {show(r['dlogp']):>12} "
              f"{show(r['dlogp_max'], 3):>7} {show(r['changed']):>8} {show(r['cut']):>9} {show(r['seq'], 3):>10} "
              f"{show(r['s'], 2):>9}")


if __name__ == "__main__":
    main()
