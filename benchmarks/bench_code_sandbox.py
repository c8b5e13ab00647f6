"""What code_tests' sandbox costs: completions per second with and without it, on this machine.

    python benchmarks/bench_code_sandbox.py                       # 16 completions x 10 rounds, 1 and 4 workers
    python benchmarks/bench_code_sandbox.py --completions 64 --rounds 20 --workers 1 2 4

Every completion is a small correct solution with its tests (the common case: the process starts, runs a few
asserts, ends), scored by the same function code_tests calls (run_python_tests) with `sandbox=True` (bubblewrap:
tidyrl.rewards.sandbox) and `sandbox=False` (the limits only). Rounds alternate the two so that a busy machine
slows both alike. Each row gives the best round (the least disturbed by other work on the machine: the cost
itself) and the median round. "ms / completion" is the latency of one completion scored alone (1 worker);
"completions/s" is the throughput with `workers` at a time; "sandbox cost" is the difference in latency, the
price of isolation per completion (the sandbox is meant to cost at most 20 ms), and "sandbox alone" the time to
build and tear down an empty sandbox (`/bin/true` in it): the floor of that cost, processes and namespaces, no Python.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
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
    parser.add_argument("--completions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=10)
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
    print(f"{'':22s} {'best':>21s} {'median':>34s}")
    for w in args.workers:
        for mode in modes:
            best, median = min(seconds[(mode, w)]), statistics.median(seconds[(mode, w)])
            name = "sandboxed" if mode else "unsandboxed"
            print(f"{name + f' x{w}':22s} {args.completions / best:8.1f} completions/s {best / args.completions * 1000:6.1f} ms"
                  f"   {args.completions / median:8.1f} completions/s {median / args.completions * 1000:6.1f} ms")
            if w == 1:
                latency[mode] = (best / args.completions * 1000, median / args.completions * 1000)
    if True in latency and False in latency:
        print(f"sandbox cost           {latency[True][0] - latency[False][0]:8.1f} ms / completion (best)      "
              f"{latency[True][1] - latency[False][1]:8.1f} ms / completion (median), 1 worker")
        empty = []
        for _ in range(args.rounds * 4):
            start = time.perf_counter()
            subprocess.run(sandbox.command(["/bin/true"]), check=True, env={"PATH": "/usr/bin:/bin"})
            empty.append((time.perf_counter() - start) * 1000)
        print(f"sandbox alone          {min(empty):8.1f} ms (best)                     {statistics.median(empty):8.1f} ms "
              "(median): bwrap ... /bin/true")
    return 0


if __name__ == "__main__":
    sys.exit(main())
