"""What `train.exact_gradients: true` costs: time per rollout and per update, and peak memory, with it off and on,
on one process and on FSDP2 shards, side by side in one run.

    python benchmarks/bench_exact_gradients.py                       # tiny and small Llama, 1 process and 2 shards
    python benchmarks/bench_exact_gradients.py --shapes tiny --processes 1

Each shape is a float32 Llama built and saved locally (`tidyrl.models.tiny.save_tiny_model`: nothing is
downloaded). Each run is `tidyrl train` of GRPO with a KL reference, in a fresh process (`accelerate launch
--config_file examples/accelerate/fsdp.yaml --num_processes W` for W > 1), as a user runs it; the figures are the
medians over the run's rollouts after the first (time/update_s summed per rollout, generation, the whole rollout
from time_s) and the largest process's peak RSS over the whole run (ru_maxrss of the launcher's children). What
the option changes: an int64 sum of the gradients (of each shard under FSDP2) and a rounding pass per micro-batch;
under FSDP2 a reduce-scatter per micro-batch; the model's own forward and decode in place of the lean ones.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FSDP_YAML = ROOT / "examples" / "accelerate" / "fsdp.yaml"
SHAPES = {"tiny": dict(hidden_size=32, num_layers=2, num_heads=2),
          "small": dict(hidden_size=256, num_layers=4, num_heads=4)}
WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "grape", "melon"]

RUN = r'''
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:])
print("MAXRSS", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(done.returncode)
'''


def config(model: Path, prompts: Path, out: Path, rollouts: int, exact: bool) -> dict:
    return {
        "algorithm": "grpo", "model": str(model), "output_dir": str(out), "seed": 1, "overwrite": True,
        "data": {"path": str(prompts)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "grpo": {"kl_coef": 0.05},
        "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 4, "max_new_tokens": 16,
                    "forward_batch_size": 4, "generation_batch_size": 8},
        "train": {"rollouts": rollouts, "micro_batch_size": 2, "minibatches_per_epoch": 2, "learning_rate": 1e-3,
                  "exact_gradients": exact},
        "log": {"progress_bar": False},
    }


def run(cfg: dict, folder: Path, processes: int) -> dict:
    import yaml

    path = folder / f"{Path(cfg['output_dir']).name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launcher = [sys.executable, "-m", "tidyrl"] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML), "--num_processes",
        str(processes), "-m", "tidyrl"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-c", RUN, *launcher, "train", str(path)], capture_output=True, text=True,
                          env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    rss = int(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("MAXRSS")))
    rows = [json.loads(line) for line in (Path(cfg["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    by_rollout: dict[int, list] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout"], []).append(row)
    later = [by_rollout[r] for r in sorted(by_rollout)[1:]]
    ends = [by_rollout[r][-1]["time_s"] for r in sorted(by_rollout)]
    return {"rollout_s": statistics.median(b - a for a, b in zip(ends, ends[1:])),
            "update_s": statistics.median(sum(row["time/update_s"] for row in rs) for rs in later),
            "generate_s": statistics.median(rs[0]["time/generate_s"] for rs in later),
            "rss_mib": rss / 2 ** 20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"], choices=sorted(SHAPES))
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rollouts", type=int, default=5)
    args = parser.parse_args()
    import torch

    from tidyrl.models.tiny import save_tiny_model

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, one thread per process; GRPO with a KL reference, "
          f"16 episodes a rollout, 2 optimizer steps of 2 micro-batches of 2 per process; medians over rollouts "
          f"2..{args.rollouts}")
    print(f"{'shape':6} {'W':>2} {'exact':>5} {'rollout s':>10} {'update s':>9} {'generate s':>11} {'peak MiB':>9}"
          f" {'rollout x':>9} {'update x':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = folder / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in WORDS))
        for shape in args.shapes:
            model = save_tiny_model(folder / shape, seed=0, **SHAPES[shape])
            for processes in args.processes:
                figures = {}
                for exact in (False, True):
                    out = folder / f"{shape}-{processes}-{int(exact)}"
                    figures[exact] = run(config(model, prompts, out, args.rollouts, exact), folder, processes)
                    f, base = figures[exact], figures[False]
                    print(f"{shape:6} {processes:>2} {str(exact):>5} {f['rollout_s']:>10.3f} {f['update_s']:>9.3f} "
                          f"{f['generate_s']:>11.3f} {f['rss_mib']:>9.0f} {f['rollout_s'] / base['rollout_s']:>9.2f}"
                          f" {f['update_s'] / base['update_s']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
