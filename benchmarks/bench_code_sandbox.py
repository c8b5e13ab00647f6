"""What code_tests' sandbox costs: completions per second with and without it, on this machine.

    python benchmarks/bench_code_sandbox.py                       # 64 completions x 3 rounds, 1 and 4 workers
    python benchmarks/bench_code_sandbox.py --completions 200 --rounds 5 --workers 1 2 4

Every completion is a small correct solution with its tests (the common case: the process starts, runs a few
asserts, ends), scored by the same function code_tests calls (run_python_tests) with `sandbox=True` (bubblewrap:
tidyrl.rewards.sandbox) and `sandbox=False` (the limits only). Rounds alternate the two so that a busy machine
slows both alike; each row is the median over rounds. "ms / completion" is the latency of one completion scored
alone (1 worker); "completions/s" is the throughput with `workers` at a time; "sandbox cost" is the difference in
latency, the price of isolation per completion (issue 28's target: at most 20 ms).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tidyrl.rewards import sandbox
from tidyrl.rewards.verifiable import run_python_tests

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def one_round(n: int, workers: int, sandboxed: bool) -> float:
    """Seconds to score n completions, `workers` at a time; every one must pass."""
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda _: run_python_tests(SOLUTION, TESTS, sandbox=sandboxed), range(n)))
    elapsed = time.perf_counter() - start
    assert all(passed for passed, _ in results), results[:3]
    return elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)

    problem = sandbox.problem()
    modes = [False] if problem else [False, True]
    print(f"== code_tests: {args.completions} completions x {args.rounds} rounds, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}, euid {os.geteuid()}")
    if problem:
        print(f"sandbox: unavailable here ({problem}); only the unsandboxed rows")
    one_round(4, 1, modes[-1])  # warm-up: the page cache, the sandbox's probe
    seconds = {(mode, w): [] for mode in modes for w in args.workers}
    for _ in range(args.rounds):
        for w in args.workers:
            for mode in modes:
                seconds[(mode, w)].append(one_round(args.completions, w, mode))
    latency = {}
    for w in args.workers:
        for mode in modes:
            median = statistics.median(seconds[(mode, w)])
            name = "sandboxed" if mode else "unsandboxed"
            print(f"{name + f' x{w}':22s} {args.completions / median:8.1f} completions/s  "
                  f"{median / args.completions * 1000:7.1f} ms / completion")
            if w == 1:
                latency[mode] = median / args.completions * 1000
    if True in latency and False in latency:
        print(f"sandbox cost           {latency[True] - latency[False]:8.1f} ms / completion (1 worker)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
