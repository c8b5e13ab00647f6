"""Per-process peak memory of GRPO steps under FSDP2 on 1, 2 and 4 CPU processes, against the memory plan.

    python benchmarks/bench_fsdp_memory.py              # 147M-parameter float32 Llama, W = 1 2 4 (about 4 min)
    python benchmarks/bench_fsdp_memory.py --hidden 256 --layers 4 --processes 1 2        # a quick check

A float32 Llama (character tokenizer, so nearly all of its parameters are in the decoder layers) is built and saved
locally (`tidyrl.models.tiny.save_tiny_model`; nothing is downloaded), then trained for 2 rollouts of GRPO, one
optimizer step each (4 episodes per rollout, micro-batches of 1, `train.sync_each_microbatch: true` so that each
micro-batch's gradients are reduce-scattered at once), as a user runs it: `tidyrl train` on one process, and
`accelerate launch --config_file examples/accelerate/fsdp.yaml --num_processes W` for W > 1. Every process runs
under a wrapper that takes its RSS after the imports as its baseline and, for each rollout (generation, rewards,
gather) and each optimizer step, resets its peak RSS (VmHWM, through /proc/self/clear_refs) at the start and reads
it at the end. The figures are those of the second rollout and the second step, when AdamW's moments exist (as in
every step after the first), the largest over the processes. Beside them: `tidyrl plan CONFIG --num-processes W
--fsdp` (no --fsdp for W = 1), the phase's predicted total and the resident part (weights + AdamW's moments), and
each process's ru_maxrss (the whole run: loading included, when every process holds the whole model read from the
file before `prepare_for_training` shards it).

glibc's malloc is given a fixed mmap threshold (as benchmarks/bench_memory_plan.py) so that freed tensors leave
the RSS. What the plan does not count and the RSS holds: the tokenizer, data, gloo buffers and Python objects
made after the imports (tens of MiB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FSDP_YAML = ROOT / "examples" / "accelerate" / "fsdp.yaml"

WRAPPER = r'''
import gc, json, os, resource, sys

import accelerate, torch, transformers  # noqa: F401  the imports' memory is the baseline
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401  (transformers imports them lazily)
import tidyrl.loops.rl.learner as rl
from tidyrl.cli import main


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def reset_peak():
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    return status("VmRSS:")


base, phases = status("VmRSS:"), []


def measured(name, fn):
    def run(*args, **kwargs):
        before = reset_peak()
        out = fn(*args, **kwargs)
        phases.append({"phase": name, "before": before - base, "peak": status("VmHWM:") - base})
        return out
    return run


rl.RLRun.take_rollout = measured("rollout", rl.RLRun.take_rollout)
rl.optimizer_step = measured("update", rl.optimizer_step)
try:
    code = main(sys.argv[1:])
finally:
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(f"{os.environ['BENCH_REPORT']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump({"base": base, "maxrss": maxrss - base, "phases": phases}, f)
sys.exit(code)
'''

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]
MIB = 2**20


def write_run(folder: Path, hidden: int, layers: int, heads: int) -> Path:
    """The model folder, the prompts and the GRPO config in `folder`; returns the config's path."""
    import yaml

    from tidyrl.models.tiny import save_tiny_model

    model = save_tiny_model(folder / "model", hidden_size=hidden, num_layers=layers, num_heads=heads)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in WORDS))
    cfg = {"algorithm": "grpo", "model": str(model), "seed": 1, "data": {"path": str(prompts)},
           "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
           "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 4,
                       "generation_batch_size": 1, "forward_batch_size": 1},
           "train": {"rollouts": 2, "epochs_per_rollout": 1, "minibatches_per_epoch": 1, "micro_batch_size": 1,
                     "learning_rate": 1e-5, "sync_each_microbatch": True},
           "log": {"progress_bar": False, "save_every": 0}}
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def predicted(config: Path, processes: int, env: dict) -> dict:
    """`tidyrl plan`'s memory for `processes` (FSDP2 over them when more than one): phase -> its parts."""
    cmd = [sys.executable, "-m", "tidyrl", "plan", str(config), "--num-processes", str(processes)]
    done = subprocess.run(cmd + (["--fsdp"] if processes > 1 else []), capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout)["memory"]["per_process_bytes"]


def measure(config: Path, processes: int, folder: Path, env: dict) -> tuple[list[dict], float]:
    """Each process's report (wrapper above) of the run on `processes` processes, and the run's seconds."""
    wrapper = folder.parent / "measure.py"
    wrapper.write_text(WRAPPER)
    report = folder / f"report-{processes}"
    if processes == 1:
        launcher = [sys.executable, str(wrapper)]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML),
                    "--num_processes", str(processes), str(wrapper)]
    start = time.perf_counter()
    done = subprocess.run(launcher + ["train", str(config), f"output_dir={folder / f'run-{processes}'}"],
                          capture_output=True, text=True, env={**env, "BENCH_REPORT": str(report)})
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return ([json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(processes)],
            time.perf_counter() - start)


def second(reports: list[dict], phase: str, key: str) -> int:
    """The largest `key` over the processes of the second call of `phase`."""
    return max([p for p in r["phases"] if p["phase"] == phase][1][key] for r in reports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        sys.exit("bench_fsdp_memory: resets the peak RSS through /proc/self/clear_refs (Linux only)")
    sys.path.insert(0, str(ROOT / "src"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with tempfile.TemporaryDirectory() as tmp:
        big, small = Path(tmp) / "big", Path(tmp) / "small"
        config = write_run(big, args.hidden, args.layers, args.heads)
        overhead_config = write_run(small, 64, 2, 4)  # the same run with a 0.1M-parameter model: the overhead
        weights = sum(f.stat().st_size for f in (big / "model").glob("*.safetensors"))
        print(f"float32 Llama: hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
              f"{weights / 4 / 1e6:.0f}M parameters ({weights / MIB:.0f} MiB); 2 GRPO rollouts x 1 optimizer step, "
              "4 episodes each. Per process, MiB above its RSS after the imports, the largest over the processes, "
              "in the second rollout and step; net: less the same run's with a 0.1M-parameter model (overhead)",
              flush=True)
        print(f"{'W':>2} {'phase':8} {'resident net':>13} {'planned':>8} {'peak':>7} {'overhead':>9} {'net':>7} "
              f"{'planned':>8} {'net/planned':>12}   whole run (ru_maxrss)")
        for processes in args.processes:
            plan = predicted(config, processes, env)
            reports, seconds = measure(config, processes, big, env)
            base, _ = measure(overhead_config, processes, small, env)
            for phase, planned in (("rollout", "generation"), ("update", "update")):
                parts = plan[planned]
                resident = parts.get("policy_weights", 0) + parts.get("optimizer_state", 0)
                peak, overhead = second(reports, phase, "peak"), second(base, phase, "peak")
                before = second(reports, phase, "before") - second(base, phase, "before")
                print(f"{processes:>2} {phase:8} {before / MIB:13.0f} {resident / MIB:8.0f} {peak / MIB:7.0f} "
                      f"{overhead / MIB:9.0f} {(peak - overhead) / MIB:7.0f} {parts['total'] / MIB:8.0f} "
                      f"{(peak - overhead) / parts['total']:12.2f}   "
                      + (f"{max(r['maxrss'] for r in reports) / MIB:.0f} ({seconds:.0f} s)" if phase == "update"
                         else ""), flush=True)

if __name__ == "__main__":
    main()
