"""Peak memory against rollout size: it must stay flat when prompts_per_rollout grows 8x.

    python benchmarks/bench_memory.py                 # GRPO with a reference model (KL on)
    python benchmarks/bench_memory.py --algorithm ppo  # PPO: policy, reference, critic

Runs `tidyrl train` in a fresh subprocess for each rollout size P in --prompts (default 2, 4, 8, 16: 8x),
with the memory knobs fixed (generation_batch_size, forward_batch_size, micro_batch_size) and the optimizer
batch following the rollout (one optimizer step per rollout, so the update covers all P*k episodes through
gradient accumulation). Prints each run's peak RSS (the child's ru_maxrss, imports and model loading
included) and its ratio to the smallest run's.

Why it stays flat: generation, scoring and the update each work on at most one knob's worth of sequences at
a time; what grows with P is only the rollout itself (token ids, masks, log-probs, advantages: a few numbers
per token, kilobytes here), which every process keeps whole so that mini-batches do not depend on the
process count.

As a check that the measurement can see a change, the last row multiplies micro_batch_size by the same 8x at
the largest P: that knob *does* set the activation memory of the update.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REWARD = '''
def length_reward(completions, **_):
    return [len(c) / 64 for c in completions]
'''


def make_config(root: Path, model: Path, data: Path, algorithm: str, prompts: int, args, micro: int) -> Path:
    import yaml

    k = args.samples
    cfg = {
        "algorithm": algorithm, "model": str(model), "output_dir": str(root / f"run-{algorithm}-{prompts}-{micro}"),
        "overwrite": True, "seed": 0,
        "data": {"path": str(data)},
        "rewards": [{"function": f"{root / 'reward.py'}:length_reward"}],
        "rollout": {"prompts_per_rollout": prompts, "samples_per_prompt": k, "max_new_tokens": args.new_tokens,
                    "min_new_tokens": args.new_tokens,  # every completion full length: the same work per episode
                    "generation_batch_size": args.generation_batch_size,
                    "forward_batch_size": args.forward_batch_size},
        "train": {"rollouts": args.rollouts, "micro_batch_size": micro, "learning_rate": 1e-5},
        "log": {"progress_bar": False},
    }
    if algorithm == "grpo":
        cfg["grpo"] = {"kl_coef": 0.04}  # a reference model is scored too
    path = root / f"config-{algorithm}-{prompts}-{micro}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_child(config: Path, threads: int) -> float:
    """Peak RSS (MiB) of one `tidyrl train` child, from the kernel's accounting of that child alone."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "tidyrl", "train", str(config)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"tidyrl train {config} failed:\n{stderr[-3000:]}")
    return usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithm", default="grpo", choices=["grpo", "ppo"])
    parser.add_argument("--prompts", default="2,4,8,16", help="prompts_per_rollout values (comma-separated)")
    parser.add_argument("--samples", type=int, default=4, help="samples_per_prompt k")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--generation-batch-size", type=int, default=8)
    parser.add_argument("--forward-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256, help="model width (Llama, 8 layers, 8 heads)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from tidyrl.models.tiny import save_tiny_model

    sizes = [int(p) for p in args.prompts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = save_tiny_model(root / "model", seed=0, hidden_size=args.hidden, num_layers=8, num_heads=8)
        words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "grape", "melon"]
        data = root / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"spell {w} backwards:"}) + "\n"
                                for w in (words * (max(sizes) // len(words) + 2))))
        (root / "reward.py").write_text(REWARD)

        rows = []
        for p in sizes:
            rss = run_child(make_config(root, model, data, args.algorithm, p, args, args.micro_batch_size), args.threads)
            rows.append((f"prompts_per_rollout={p}", p * args.samples, args.micro_batch_size, rss))
            print(f"  P={p:>3}: peak RSS {rss:7.1f} MiB", flush=True)
        micro = args.micro_batch_size * 8  # at the largest P, where R = P*k episodes can be cut into micro-batches
        rss = run_child(make_config(root, model, data, args.algorithm, sizes[-1], args, micro), args.threads)
        rows.append((f"check: micro_batch_size x8, P={sizes[-1]}", sizes[-1] * args.samples, micro, rss))

    base = rows[0][3]
    print()
    print(f"tidyrl {args.algorithm}, Llama hidden {args.hidden} x 8 layers, k={args.samples}, "
          f"{args.new_tokens} new tokens, generation/forward/micro batch "
          f"{args.generation_batch_size}/{args.forward_batch_size}/{args.micro_batch_size}, {args.threads} threads")
    print("| run | episodes per rollout | micro_batch_size | peak RSS MiB | vs first |")
    print("|---|---|---|---|---|")
    for name, episodes, micro, rss in rows:
        print(f"| {name} | {episodes} | {micro} | {rss:.0f} | {rss / base:.3f}x |")
    growth = rows[len(sizes) - 1][3] / base
    print(f"\nrollout {sizes[-1] // sizes[0]}x larger: peak RSS {growth:.3f}x")


if __name__ == "__main__":
    main()
