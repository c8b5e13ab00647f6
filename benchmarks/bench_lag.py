"""Generation beside training: rollout.lag 0 vs 1 vs 2, in-process engine vs a vLLM server.

Each (engine, lag) is one GRPO run of the same config, in its own process; the figures come from its metrics.jsonl,
over the steady rollouts (the first lag + 2 left out: warm-up, and the rollouts a lag makes before any overlap):

    make s      the making side per rollout: weight sync + generation + rewards (time/weight_sync_s, generate, reward)
    learn s     the learner's side per rollout: scoring + every optimizer step (time/score_s + time/update_s)
    wall s      wall time per rollout (time_s between rollouts)
    wait s      what the learner waited for its rollout (time/wait_rollout_s; lag 0: the making itself)
    overlap     wall / max(make, learn): 1.0 = the two sides fully overlapped (target with lag 1: <= 1.15)
    ep/s        episodes per second, and against lag 0 of the same engine

    python benchmarks/bench_lag.py                        # builtin engine, lags 0,1,2 (CPU: a few minutes)
    python benchmarks/bench_lag.py --engines builtin,vllm-server --vllm-python .venv-vllm/bin/python
    python benchmarks/bench_lag.py --device cuda --hidden 1024 --layers 8      # the same on a GPU

On a CPU a vLLM server gets the last core and its trainer the others (`--trainer-cores`), each with as many
threads as cores (taskset), so the two sides do not share a core; an in-process engine's run gets every core,
its background thread sharing them with the learner.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="builtin", help="comma list of builtin, vllm-server")
    p.add_argument("--lags", default="0,1,2")
    p.add_argument("--rollouts", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout (P)")
    p.add_argument("--k", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--epochs", type=int, default=2, help="E: passes over each rollout (more learner work)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--vllm-python", default=sys.executable, help="the Python that has vLLM, for the server")
    p.add_argument("--trainer-cores", default=None, help="taskset list for the trainer (CPU); default all but last")
    return p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cores() -> tuple[str, str]:
    n = os.cpu_count() or 1
    if n < 2:
        return "0", "0"
    return f"0-{n - 2}" if n > 2 else "0", str(n - 1)


def start_server(python: str, model: Path, device: str, core: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]
    if device == "cpu":  # its own core; prompts prefilled whole (seeded requests, docs/engines.md)
        cmd = ["taskset", "-c", core, *cmd, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]
    proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the vLLM server did not start; its log: {log}")
            time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """The server and the engine process it started (its process group)."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def config(args, model: Path, prompts: Path, out: Path, engine: str, lag: int, url: str | None) -> dict:
    cfg = {
        "algorithm": "grpo", "model": str(model), "output_dir": str(out), "seed": 0, "overwrite": True,
        "data": {"path": str(prompts)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": args.prompts, "samples_per_prompt": args.k,
                    "max_new_tokens": args.max_new_tokens, "engine": engine, "lag": lag, "tis_cap": 2.0},
        "train": {"rollouts": args.rollouts, "epochs_per_rollout": args.epochs, "micro_batch_size": 16,
                  "learning_rate": 1e-4},
        "log": {"progress_bar": False, "samples_per_rollout": 0},
    }
    if url:
        cfg["server"] = {"urls": [url]}
    return cfg


def figures(out: Path, lag: int, episodes: int) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_rollout: dict[int, list] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout"], []).append(row)
    ends = {r: steps[-1]["time_s"] for r, steps in by_rollout.items()}
    steady = [r for r in sorted(by_rollout) if r > lag + 2]
    if not steady:
        raise SystemExit("too few rollouts for steady figures: raise --rollouts")

    def mean(values):
        return sum(values) / len(values)

    first = {r: by_rollout[r][0] for r in steady}
    make = mean([first[r].get("time/weight_sync_s", 0.0) + first[r]["time/generate_s"] + first[r]["time/reward_s"]
                 for r in steady])
    learn = mean([first[r]["time/score_s"] + sum(s["time/update_s"] for s in by_rollout[r]) for r in steady])
    wall = mean([ends[r] - ends[r - 1] for r in steady])
    wait = mean([first[r].get("time/wait_rollout_s", make) for r in steady])
    return {"make": make, "learn": learn, "wall": wall, "wait": wait, "overlap": wall / max(make, learn),
            "eps": episodes / wall}


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tidyrl.models.tiny import save_tiny_model

    import yaml

    trainer_cores, server_core = cores()
    trainer_cores = args.trainer_cores or trainer_cores
    work = Path(tempfile.mkdtemp(prefix="bench-lag-"))
    model = save_tiny_model(work / "model", hidden_size=args.hidden, num_layers=args.layers, num_heads=4)
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "olive", "grape"]
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in words))
    episodes = args.prompts * args.k
    results = []
    for engine in args.engines.split(","):
        server, url = (None, None)
        if engine == "vllm-server":
            server, url = start_server(args.vllm_python, model, args.device, server_core, work / "server.log")
        try:
            base = None
            for lag in [int(x) for x in args.lags.split(",")]:
                out = work / f"{engine}-lag{lag}"
                path = work / f"{engine}-lag{lag}.yaml"
                path.write_text(yaml.safe_dump(config(args, model, prompts, out, engine, lag, url)))
                cmd = [sys.executable, "-m", "tidyrl", "train", str(path)]
                env = dict(os.environ)
                if args.device == "cpu":  # the trainer: every core the server does not have
                    mine = trainer_cores if server is not None else f"0-{(os.cpu_count() or 1) - 1}"
                    n = len(range(int(mine.split("-")[0]), int(mine.split("-")[-1]) + 1))
                    cmd = ["taskset", "-c", mine, *cmd]
                    env["OMP_NUM_THREADS"] = str(n)
                    env["CUDA_VISIBLE_DEVICES"] = ""
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"{engine} lag {lag} failed:\n{done.stderr[-3000:]}")
                f = figures(out, lag, episodes)
                base = base or f
                results.append((engine, lag, f, f["eps"] / base["eps"]))
                print(f"  {engine:12s} lag {lag}: done", flush=True)
        finally:
            if server is not None:
                stop(server)
    print(f"\nGRPO, P={args.prompts} x k={args.k}, {args.max_new_tokens} new tokens, E={args.epochs}, "
          f"hidden {args.hidden} x {args.layers} layers, {args.device}"
          + (f"; with a server: trainer cores {trainer_cores}, server core {server_core}"
             if "vllm-server" in args.engines else "")
          + f"; means over rollouts after lag + 2 of {args.rollouts}")
    print(f"{'engine':12s} {'lag':>3s} {'make s':>7s} {'learn s':>7s} {'wall s':>7s} {'wait s':>7s} "
          f"{'overlap':>7s} {'ep/s':>6s} {'vs lag 0':>8s}")
    for engine, lag, f, speedup in results:
        print(f"{engine:12s} {lag:3d} {f['make']:7.2f} {f['learn']:7.2f} {f['wall']:7.2f} {f['wait']:7.2f} "
              f"{f['overlap']:7.2f} {f['eps']:6.1f} {speedup:7.2f}x")


if __name__ == "__main__":
    main()
