"""SFT tokens per second on a mixed-length set: plain padded micro-batches against the ways tidyrl cuts padding.

    python benchmarks/bench_packing.py                  # hidden 256 x 4 layers, 96 examples of 10..600 tokens
    python benchmarks/bench_packing.py --lengths uniform  # lengths uniform rather than log-uniform (long-tailed)
    python benchmarks/bench_packing.py --repeats 3 --hidden 512

Each variant trains the same model (built here, a char-level Llama) on the same examples with the same plan,
in this one process, variants interleaved over --repeats rounds, and reports the real (non-padding) tokens
trained per second of update time (the `tokens_per_s` metric summed over the run) and the padding fraction:

    padded        train.group_by_length=false, padding_free=false: micro-batches in the stream's order
    grouped       train.group_by_length=true (the default): each process's share of a step sorted by length
    padding-free  train.padding_free=true: each micro-batch one row, positions restarting, no padding
    grouped+flat  both
    packed rows   sft.packing (rows of data.max_length tokens; train.batch_size then counts rows)

The first four take the same steps over the same examples and give the same loss per token (tests/test_padding.py
checks it to 1e-5; the loss/token column shows it); packed rows change the plan (fewer, fuller rows per step),
so their loss differs. The ratio column is tokens/s over `padded`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

VARIANTS = {
    "padded": {"train": {"group_by_length": False, "padding_free": False}},
    "grouped": {"train": {"group_by_length": True, "padding_free": False}},
    "padding-free": {"train": {"group_by_length": False, "padding_free": True}},
    "grouped+flat": {"train": {"group_by_length": True, "padding_free": True}},
    "packed rows": {"train": {"group_by_length": False, "padding_free": False}, "sft": {"packing": True}},
}


def build(root: Path, args) -> tuple[Path, Path]:
    from tidyrl.models.tiny import save_tiny_model

    model = save_tiny_model(root / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    rows = []
    for _ in range(args.examples):
        if args.lengths == "uniform":
            n = rng.randint(args.min_len, args.max_len)
        else:  # log-uniform: most examples short, a long tail (as in instruction-tuning sets)
            n = round(math.exp(rng.uniform(math.log(args.min_len), math.log(args.max_len))))
        rows.append({"prompt": "".join(rng.choice(letters) for _ in range(8)) + ":",
                     "completion": "".join(rng.choice(letters) for _ in range(n))})
    data = root / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def run_variant(root: Path, model: Path, data: Path, name: str, args, round_: int) -> dict:
    import tidyrl

    sections = VARIANTS[name]
    cfg = {
        "algorithm": "sft", "model": str(model), "output_dir": str(root / f"run-{round_}-{name.replace(' ', '-')}"),
        "seed": 0, "data": {"path": str(data), "max_length": args.max_len + 16},
        "train": {"batch_size": args.batch_size, "micro_batch_size": args.micro_batch_size, "dataset_epochs": 1.0,
                  "learning_rate": 1e-4, **sections["train"]},
        "log": {"progress_bar": False},
        **{k: v for k, v in sections.items() if k != "train"},
    }
    if "sft" in sections:  # rows of max_length tokens hold several examples: fewer rows per step, same tokens
        cfg["train"]["batch_size"] = max(args.micro_batch_size, args.batch_size // 4)
    start = time.perf_counter()
    result = tidyrl.train(cfg)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    update = sum(r["time/update_s"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["time/update_s"] for r in rows)
    return {"tokens_per_s": tokens / update, "padding": statistics.mean(r["padding_fraction"] for r in rows),
            "loss_per_token": sum(r["nll_token_mean"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows),
            "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--examples", type=int, default=96)
    parser.add_argument("--min-len", type=int, default=10)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--lengths", choices=("loguniform", "uniform"), default="loguniform",
                        help="completion length distribution between --min-len and --max-len")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    names = args.variants.split(",")
    results: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = build(root, args)
        for round_ in range(args.repeats):
            for name in names:
                results[name].append(run_variant(root, model, data, name, args, round_))
    base = statistics.median(r["tokens_per_s"] for r in results[names[0]])
    print(f"SFT, Llama hidden {args.hidden} x {args.layers} layers (char vocabulary), {args.examples} examples of "
          f"{args.min_len}..{args.max_len} tokens ({args.lengths}), batch {args.batch_size}, micro-batch {args.micro_batch_size}, "
          f"{args.repeats} rounds (median)")
    print(f"{'variant':<14} {'tokens/s':>9} {'x ' + names[0]:>10} {'padding':>8} {'loss/token':>11}")
    for name in names:
        tps = statistics.median(r["tokens_per_s"] for r in results[name])
        pad = statistics.mean(r["padding"] for r in results[name])
        loss = results[name][0]["loss_per_token"]
        print(f"{name:<14} {tps:>9.0f} {tps / base:>9.2f}x {pad:>8.1%} {loss:>11.6f}")


if __name__ == "__main__":
    main()
