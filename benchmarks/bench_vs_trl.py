"""tidyrl vs TRL's GRPOTrainer: the same GRPO work, side by side, in one invocation.

    python benchmarks/bench_vs_trl.py --workload all --repeats 3
    python benchmarks/bench_vs_trl.py --device cuda --workload qwen0.5b --libraries tidyrl,tidyrl-vllm,trl   # a GPU
    python benchmarks/bench_vs_trl.py --device cuda --workload qwen0.5b --repeats 1 --profile   # where time goes

The qwen0.5b / qwen1.5b workloads (Qwen2.5 shapes, bfloat16) are for --device cuda; on CUDA the table adds
each library's peak GPU memory, and every phase's rate is given against the GPU's measured bfloat16 GEMM peak.

Prints, for each workload and library: episodes/s, completion tokens/s, median seconds per optimizer
step, the split of a rollout's time between generation, reward, scoring (old/reference log-probs) and
the updates, peak RSS, the achieved fraction of this CPU's measured float32 matrix-multiply rate, and
the tidyrl/TRL ratios. TRL is an optional extra (`pip install -e ".[bench]"`); without it, tidyrl runs
alone and the script says so.

How the comparison is kept fair
-------------------------------
- Same weights: each workload's Llama and character-level tokenizer are built once (tidyrl.models.tiny) and
  saved to a temporary folder; both libraries load that folder with `from_pretrained`, float32.
- Same prompts (the same token ids: both tokenize plain strings with BOS), the same reward function
  (it does not depend on completion length), the same group size k, prompts per rollout P, optimizer
  batch (all P*k episodes), micro-batch m, AdamW (lr 1e-5, constant schedule, no weight decay,
  clipping at 1.0), epochs per rollout E (TRL: num_iterations), KL (TRL: beta; tidyrl:
  grpo.kl_coef, k3 estimator in both) and the token-mean loss over the whole batch (TRL: loss_type
  "dapo", its default; tidyrl: token_mean, its default). Gradient checkpointing is off in both (TRL
  turns it on by default, which would cost it a recomputed forward per micro-batch: not the same work).
- Same sampling: temperature 1.0, top_p 1.0, top_k off, max_new_tokens T; TRL generates with
  `model.generate` (use_vllm=False), all P*k sequences at once, and so does tidyrl
  (generation_batch_size = P*k). No-grad scoring runs in chunks of m in both (TRL uses
  per_device_train_batch_size; tidyrl forward_batch_size = m).
- Same amount of work: EOS is forbidden until T tokens in both (min_new_tokens = T; TRL passes it
  through generation_kwargs), so every completion has exactly T tokens and neither library gains from
  early stopping.
- Same threads: each library runs in its own fresh subprocess with OMP_NUM_THREADS=MKL_NUM_THREADS=
  --threads and torch.set_num_threads(--threads); nothing else of this script runs meanwhile. Runs
  alternate (tidyrl, TRL, tidyrl, TRL, ...) so that drift on a shared machine hits both alike.
- Same measurement: the first --warmup rollouts of every run are excluded; each run then times
  --steps optimizer steps (rounded up to whole rollouts). Seconds per optimizer step is the median
  over rollouts of (rollout wall time / optimizer steps per rollout); the split uses the libraries'
  own clocks (tidyrl: metrics.jsonl time/*; TRL: timers around GRPOTrainer._generate,
  _calculate_rewards and _generate_and_score_completions, whose remainder after generation and
  rewards is scoring). Peak RSS is the child's ru_maxrss from os.wait4 (model loading and imports
  included). Every figure printed is the median over --repeats runs.
- FLOPs (for the fraction of peak) are the workload's nominal ones, the same figure for both
  libraries: per sequence of L = prompt + T tokens, a forward is 2*N*L + 2*layers*hidden*L^2 (N =
  matmul parameters incl. the LM head; the second term is attention); generation is one forward, each
  scoring pass (old log-probs when E > 1, reference when KL is on) one forward, each training epoch
  three. That is the work as TRL does it; tidyrl skips part of it (shared prompt passes, no old
  log-prob pass), so its nominal rate can exceed what its hardware executes. The peak is the best
  float32 GEMM rate (torch.matmul, 1024..2048 square) measured by this script with the same thread
  count, right before the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKLOADS = {
    # Overhead-bound: ~1M parameters, 4 prompts x 8 samples, 32 tokens, one optimizer step per rollout.
    "tiny": dict(hidden=128, layers=4, heads=4, intermediate=512, prompts=4, k=8, max_new_tokens=32, epochs=1,
                 kl_coef=0.0, micro_batch=32, steps=20, warmup=3),
    # Compute-bound: ~25M parameters, 8 prompts x 8 samples, 128 tokens, E = 2, a reference model with KL.
    "small": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=8, k=8, max_new_tokens=128, epochs=2,
                  kl_coef=0.04, micro_batch=16, steps=4, warmup=1),
    # Generation-bound: the small model, 4 prompts x 8 samples of 512 new tokens, one epoch, KL on.
    "long": dict(hidden=512, layers=8, heads=8, intermediate=1376, prompts=4, k=8, max_new_tokens=512, epochs=1,
                 kl_coef=0.04, micro_batch=16, steps=2, warmup=1),
    # GPU (--device cuda): the shapes of Qwen2.5-0.5B and -1.5B (random init, grouped-query attention, the
    # full vocabulary, tied embeddings), bfloat16 weights, 16 prompts x 8 samples of 256 tokens, E = 1, KL on.
    "qwen0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True,
                     dtype="bfloat16", prompts=16, k=8, max_new_tokens=256, epochs=1, kl_coef=0.04, micro_batch=16,
                     steps=3, warmup=1, gpu=True),
    "qwen1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tied=True,
                     dtype="bfloat16", prompts=16, k=8, max_new_tokens=256, epochs=1, kl_coef=0.04, micro_batch=16,
                     steps=3, warmup=1, gpu=True),
}
SETTABLE = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied", "prompts", "k",
            "max_new_tokens", "epochs", "kl_coef", "micro_batch", "steps", "warmup")
"""The workload keys `--set` may change: the model's shape and the batch."""
ENGINES = {"tidyrl": "builtin", "tidyrl-vllm": "vllm"}
"""tidyrl's children by engine: `tidyrl-vllm` runs the same config with rollout.engine: vllm (vLLM installed)."""
FORCED_LAYOUTS = {"tidyrl-lean": ("lean",), "tidyrl-hf-forward": ("shared",), "tidyrl-onepass": ("onepass",)}
"""tidyrl with one layout of its scoring/update forward forced on the device (models.forward.LAYOUTS), generation
unchanged: `tidyrl-lean` its own Llama pass, `tidyrl-hf-forward` the model's own forward with shared prompts (two
passes), `tidyrl-onepass` the model's forward over whole rows with logits_to_keep (TRL's layout). Plain `tidyrl`
runs what the device's entry of LAYOUTS says."""
SWITCHED_OFF = {"tidyrl-rows": {"fused_logprobs": False}, "tidyrl-whole-head": {"chunked_head": False},
                "tidyrl-unfused-decode": {"fused_decode": False},
                "tidyrl-sdpa-decode": {"decode_attention": "sdpa"},
                "tidyrl-recompute": {"recompute": True},
                "tidyrl-eager-layers": {"layer_kernels": "none"}}
"""The shipped config with one CUDA path switched off (or, for `tidyrl-recompute`, on) by the config's `kernels`
section (the child's config.yaml says which), to measure what it gains:
`tidyrl-rows` the row-by-row float32 log-probs instead of the fused kernels (models.fused_logprobs),
`tidyrl-whole-head` the model's own output layer, whole logits, instead of the chunked one (models.chunked_head),
`tidyrl-unfused-decode` generation without the fused decoding kernels (models.fused_decode),
`tidyrl-sdpa-decode` those kernels but the attention SDPA over the whole cache (not the kernel over the positions
written),
`tidyrl-recompute` the norms' and MLP products' intermediates recomputed in backward, not kept (models.recompute;
off by default),
`tidyrl-eager-layers` the trained model's decoder layers as the model runs them, not compiled (models.layer_kernels)."""
MEMORY_TRACE = ("tidyrl-memtrace",)
"""`tidyrl-memtrace`: the shipped config with the update's GPU allocations recorded (torch's memory history, Python
stacks): its line then lists what is alive at the update's peak above what was held as it started, by the code that
allocated it (`transient_at_peak`). Recording slows allocations: its timings are not the shipped run's."""
EXACT_WIDTHS = ("tidyrl-exact-widths",)
"""`tidyrl-exact-widths`: the shipped config with each forward's rows at their own width, not left-padded to a multiple
of 16 as on CUDA (models.devices.WIDTH_MULTIPLE), to measure what recurring shapes gain."""
TRLS = ("trl", "trl-liger")
"""TRL's GRPOTrainer as shipped (`trl`), and with its fast option that runs without a model hub (`trl-liger`:
use_liger_kernel=True, Liger Kernel's RMSNorm, SwiGLU and rotary embedding on the policy; `pip install
liger-kernel`). TRL 1.16's GRPO computes its log-probs in chunks, without the whole logits, in both (its fused
output layer: what `use_liger_loss` did in TRL 0.x, which 1.x no longer has)."""
LIBRARIES = ("tidyrl", "tidyrl-vllm", *FORCED_LAYOUTS, *SWITCHED_OFF, *EXACT_WIDTHS, *MEMORY_TRACE, *TRLS)
LEARNING_RATE = 1e-5
WORDS = ("apple pear fig kiwi lime plum date lemon mango peach grape melon cherry olive berry guava papaya "
         "quince lychee banana orange apricot").split()


def vowel_fraction(completions, **_):
    """The reward of both libraries: the fraction of vowels in the completion (independent of length)."""
    return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in completions]


def prompt_texts(n: int = 64) -> list[str]:
    """Plain-text prompts of varied lengths (8..30 characters)."""
    return [f"{WORDS[i % len(WORDS)]} {WORDS[(3 * i + 1) % len(WORDS)] * (1 + i % 2)} {i}:" for i in range(n)]


# ---------------------------------------------------------------------------------------------- children
def child_tidyrl(spec: dict) -> dict:
    import tidyrl

    w, out = spec["workload"], Path(spec["out"])
    rollouts = spec["warmup"] + spec["rollouts"]
    cfg = {
        "algorithm": "grpo",
        "model": spec["model"],
        "output_dir": str(out / "run"),
        "overwrite": True,  # a child can be rerun by hand (e.g. under a profiler) with its spec.json
        "seed": spec["seed"],
        "data": {"path": spec["prompts"]},
        "rewards": [{"function": vowel_fraction}],
        "rollout": {"prompts_per_rollout": w["prompts"], "samples_per_prompt": w["k"],
                    "max_new_tokens": w["max_new_tokens"], "min_new_tokens": w["max_new_tokens"],
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                    "generation_batch_size": w["prompts"] * w["k"], "forward_batch_size": w["micro_batch"]},
        "train": {"rollouts": rollouts, "epochs_per_rollout": w["epochs"], "minibatches_per_epoch": 1,
                  "micro_batch_size": w["micro_batch"], "learning_rate": LEARNING_RATE, "lr_scheduler": "constant",
                  "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0},
        "grpo": {"kl_coef": w["kl_coef"], "kl_estimator": "k3", "loss_aggregation": "token_mean"},
        "log": {"progress_bar": False, "samples_per_rollout": 1},
        "model_dtype": spec.get("dtype", "float32"),
        "kernels": spec.get("kernels", {}),  # (SWITCHED_OFF)
    }
    if spec.get("engine", "builtin") == "vllm":  # the same work, generated by an in-process vLLM engine
        cfg["rollout"]["engine"] = "vllm"
        cfg["vllm"] = {"kv_cache_gb": 2}
    from tidyrl.loops.rl import learner as rl
    from tidyrl.loops.rl import update as rl_update
    from tidyrl.models import devices, forward
    from tidyrl.rollouts import producer, scoring

    if spec.get("layouts"):  # one layout forced (FORCED_LAYOUTS), on every device type the run may use
        for kind in ("cpu", "cuda"):
            forward.LAYOUTS[kind] = tuple(spec["layouts"])
        forward.LEAN_FROM_SHARE.clear()  # (no lean pass put first for long repeated prompts either)
    if spec.get("exact_widths"):  # EXACT_WIDTHS
        devices.WIDTH_MULTIPLE.clear()
    # The update's clock stops after the optimizer step is queued, not run: synchronised here, so that the step's
    # kernels are billed to the update, not to the next rollout's generation (generation and scoring end with host
    # reads, which wait for the device anyway).
    optimizer_clock: list[float] = []
    rl_update.apply_update = optimizer_step_timed(rl_update.apply_update, optimizer_clock)
    peaks = PhasePeaks()  # (outside the profiler's wrappers: its phases' clocks stay as they were)
    producer.Producer.round = peaks.phase("generate", producer.Producer.round)
    inside = InsideGeneration()
    producer.Producer.round = inside.rollout(producer.Producer.round)
    scoring.score_logprobs = peaks.phase("score", scoring.score_logprobs)
    rl.optimizer_step = peaks.phase("update", rl.optimizer_step)
    trace = MemoryTrace() if spec.get("memory_trace") else None
    if trace is not None:
        rl.optimizer_step = trace.phase(rl.optimizer_step)
    profiler = Profiler(spec)
    if profiler.on:
        rl.RLRun.take_rollout = profiler.starting_at_measured(rl.RLRun.take_rollout)
        producer.Producer.round = profiler.phase("generate", producer.Producer.round)
        scoring.score_logprobs = profiler.phase("score", scoring.score_logprobs)
        rl.optimizer_step = profiler.phase("update", rl.optimizer_step)
    tidyrl.train(cfg)
    profiler.finish()
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    per_rollout: dict[int, list[dict]] = {}
    for row in rows:
        per_rollout.setdefault(row["rollout"], []).append(row)
    rollouts_out, previous_end, stepped = [], 0.0, 0
    for i, r in enumerate(sorted(per_rollout)):
        steps = per_rollout[r]
        end = steps[-1]["time_s"]
        rollouts_out.append({"wall_s": end - previous_end, "steps": len(steps),
                             "generate_s": steps[0]["time/generate_s"], "reward_s": steps[0]["time/reward_s"],
                             "score_s": steps[0]["time/score_s"],
                             "update_s": sum(s["time/update_s"] for s in steps),
                             "optimizer_s": sum(optimizer_clock[stepped: stepped + len(steps)]),
                             "completion_tokens": steps[0]["completion_length_mean"] * w["prompts"] * w["k"],
                             **inside.of(i)})
        previous_end, stepped = end, stepped + len(steps)
    from tidyrl.models import fused_decode

    given_up = fused_decode.failure()
    return {"rollouts": rollouts_out, **gpu_memory(peaks), **({"update_trace": trace.found} if trace else {}),
            **({"fused_decode_failed": given_up} if given_up else {})}


def print_trace(found: dict) -> None:
    """`transient_at_peak`'s findings, one line per allocation site."""
    print(f"    update memory: held {found['held_mib']:.0f} MiB as it started, peak {found['peak_mib']:.0f} MiB; "
          "alive at the peak, allocated inside it:", flush=True)
    for name, mib, count in found["sites"]:
        print(f"      {mib:9.1f} MiB {count:6d} x  {name[:110]}", flush=True)


class MemoryTrace:
    """Each call of the wrapped phase with torch's allocator history recorded (Python stacks); kept, of all calls,
    the one that reached the highest peak: `transient_at_peak` of its events."""

    def __init__(self):
        import torch

        self.torch, self.found = torch, None

    def phase(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            cuda = self.torch.cuda
            if not (cuda.is_available() and cuda.is_initialized()):
                return fn(*a, **kw)
            held = cuda.memory_allocated()
            cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
            try:
                return fn(*a, **kw)
            finally:
                cuda.synchronize()
                events = cuda.memory._snapshot()["device_traces"][cuda.current_device()]
                cuda.memory._record_memory_history(enabled=None)
                found = transient_at_peak(events, held)
                if self.found is None or found["peak_mib"] > self.found["peak_mib"]:
                    self.found = found

        return wrapper


def _internal(filename: str) -> bool:
    """A frame of torch's installed package or of the standard library's wrappers: the site of an allocation is the
    innermost frame outside them (tidyrl's, transformers', the benchmark's). (An installed package, not any path
    with a `torch` folder: the GPU image's site-packages live under /opt/torch/.)"""
    parts = Path(filename).parts
    installed_torch = any(a in ("site-packages", "dist-packages") and b == "torch" for a, b in zip(parts, parts[1:]))
    return installed_torch or filename.startswith("<frozen") or Path(filename).name in ("contextlib.py",
                                                                                          "functools.py")


def transient_at_peak(events: list[dict], held: int, top: int = 12) -> dict:
    """From an allocator history (torch.cuda.memory._snapshot()'s device trace: alloc and free events with their
    Python frames, innermost first) recorded from a moment when `held` bytes were allocated: the peak it reached and
    what was alive then that the recorded span allocated, grouped by allocation site (the innermost frame outside
    torch), largest first. A free of memory allocated before the recording lowers the total; events of other kinds
    (segments, snapshots) are ignored."""
    def site(event):
        for f in event.get("frames") or ():
            if not _internal(f["filename"]):
                return f"{Path(f['filename']).name}:{f['line']} {f['name']}"
        return "(torch internals)"

    def replay(stop):
        live, total, best, best_at = {}, 0, 0, -1
        for i, e in enumerate(events[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], e)
                total += e["size"]
            elif e["action"] in ("free_completed", "free"):
                total -= e["size"]
                live.pop(e["addr"], None)
            else:
                continue
            if total > best:
                best, best_at = total, i
        return live, best, best_at

    _, best, best_at = replay(len(events))
    live, _, _ = replay(best_at + 1)
    sites: dict[str, list] = {}
    for size, e in live.values():
        entry = sites.setdefault(site(e), [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"held_mib": held / 2**20, "peak_mib": (held + best) / 2**20,
            "sites": [(name, size / 2**20, count) for name, (size, count) in ranked]}


# What the profile counts as a host synchronisation: the host waits for the device (CUDA runtime calls) or reads a
# device value / a data-dependent size (aten ops; on CPU these are host reads that cost nothing).
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
               "aten::_local_scalar_dense", "aten::nonzero", "aten::unique_dim", "aten::_unique2")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")


class InsideGeneration:
    """Where a rollout's generate phase goes, in seconds per rollout: inside the builtin engine's `generate`
    (`engine_s`; the rest of the phase is episodes, tensors and detokenising around it) and, within that, in the
    fixed-shape decoding loop (`decoding_s`; the rest is the prefill, the cache's set-up and the first draw). Each
    clock waits for the device at its end; the phase's own kernels are queued before, so it bills nothing twice."""

    def __init__(self):
        from tidyrl.models import generation

        self.rollouts: list[dict] = []
        generation.generate = self.timed("engine_s", generation.generate)
        generation._decode_fixed = self.timed("decoding_s", generation._decode_fixed)

    def rollout(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            self.rollouts.append({})
            return fn(*a, **kw)
        return wrapper

    def timed(self, key: str, fn):
        import functools

        waited = synchronised(fn)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return waited(*a, **kw)
            finally:
                if self.rollouts:
                    self.rollouts[-1][key] = self.rollouts[-1].get(key, 0.0) + time.perf_counter() - start
        return wrapper

    def of(self, i: int) -> dict:
        """The seconds of the run's i-th rollout (0 the first; none for an engine other than the builtin one)."""
        return self.rollouts[i] if i < len(self.rollouts) else {}


def device_sync() -> None:
    """Wait for the device's queued kernels, where this process uses CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def synchronised(fn):
    """`fn`, followed by a wait for the device (CUDA) before it returns: a phase clock read after it counts the
    phase's queued kernels."""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        result = fn(*a, **kw)
        device_sync()
        return result
    return wrapper


def optimizer_step_timed(fn, clock: list[float]):
    """`fn` (the update's optimizer step: clipping, AdamW and the LR schedule, `loops.run.steps.apply_update`) with the
    device waited for before and after it, its seconds appended to `clock`: the update's time splits into its
    micro-batches' forward and backward passes and this. (The wait after it also bills the step's kernels to the
    update, not to the next rollout's generation; the wait before costs only the overlap of the step's first
    launches with the last backward's kernels.)"""
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        device_sync()
        start = time.perf_counter()
        result = fn(*a, **kw)
        device_sync()
        clock.append(time.perf_counter() - start)
        return result
    return wrapper


PHASES = ("generate", "score", "update")
PROFILED_PHASES = ("score", "update")
"""The phases --profile traces kernel by kernel. Generation is timed only: its kernels (a captured graph replayed
per token) are hundreds of thousands of trace events, whose parsing alone outlasted a 90 s limit on an H200."""


class Profiler:
    """--profile: ONE measured rollout of a child (the first after the warmup) with its phases timed (the device
    synchronised at each phase's end) and its scoring and update traced by torch.profiler, each call of a phase in a
    session of its own. Writes profile.txt (each traced phase's top kernels, or ops by self time, and host ops) and
    profile.json (per
    phase: wall time, device time and its top 8 kernels with their share of the phase, the top host ops; over the
    traced phases: kernel launches or, on CPU, dispatched aten ops, host synchronisations by kind, the top 12) into
    the child's folder. The profiler slows the host side: its timings are not the benchmark's figures."""

    def __init__(self, spec: dict):
        self.on, self.spec, self.calls, self.active, self.inside = bool(spec.get("profile")), spec, 0, False, False
        self.cuda = spec.get("device") == "cuda"
        self.walls = {p: 0.0 for p in PHASES}
        self.kernels: dict[str, dict[str, list[float]]] = {p: {} for p in PHASES}  # name -> [us, calls]
        self.host: dict[str, dict[str, list[float]]] = {p: {} for p in PHASES}

    def starting_at_measured(self, fn, per_rollout: int = 1):
        """`fn` is called `per_rollout` times per rollout, first at its start: the phases are profiled from its first
        call after the warmup to its first call of the next rollout (or the end of training)."""
        def wrapper(*a, **kw):
            if self.calls == self.spec["warmup"] * per_rollout:
                self.active = True
            elif self.calls == (self.spec["warmup"] + 1) * per_rollout:
                self.active = False
            self.calls += 1
            return fn(*a, **kw)
        return wrapper

    def phase(self, name: str, fn):
        """`fn`, timed as part of phase `name` in the profiled rollout (and traced when the phase is one of
        PROFILED_PHASES); calls inside another phase's call count as that one's."""
        import functools

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if not self.active or self.inside:
                return fn(*a, **kw)
            import torch
            import torch.profiler as tp

            sync = torch.cuda.synchronize if self.cuda else (lambda: None)
            self.inside = True
            try:
                sync()
                t0 = time.perf_counter()
                if name in PROFILED_PHASES:
                    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if self.cuda else [])
                    with tp.profile(activities=activities) as prof:
                        result = fn(*a, **kw)
                        sync()
                else:
                    result = fn(*a, **kw)
                    sync()
                self.walls[name] += time.perf_counter() - t0
            finally:
                self.inside = False
            if name in PROFILED_PHASES:
                self._collect(name, prof)
            return result
        return wrapper

    def _collect(self, name: str, prof) -> None:
        """Add one traced call of phase `name` to its sums: kernels (CUDA) or ops' self time (CPU) by name, host ops'
        self time, and the runtime calls (launches, synchronisations) by count. Read from the trace as Chrome JSON
        (written by the profiler's C++ side): torch.profiler's own Python summary (key_averages) of one rollout's
        trace took minutes on an H200."""
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
        device, host = self.kernels[name], self.host[name]

        def add(table, key, us, n=1):
            entry = table.setdefault(key, [0.0, 0])
            entry[0] += us
            entry[1] += n

        ops = sorted((e for e in events if e.get("cat") == "cpu_op"),
                     key=lambda e: (e.get("pid"), e.get("tid"), e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [end, own duration, name, thread] of the open ops, innermost last
        for e in ops + [None]:
            while stack and (e is None or (e.get("pid"), e.get("tid")) != stack[-1][3] or e["ts"] >= stack[-1][0]):
                end, own, key, _ = stack.pop()
                add(device if not self.cuda else host, key, own)
            if e is None:
                break
            dur = e.get("dur", 0)
            if stack:
                stack[-1][1] -= dur  # the parent's self time excludes its children's
            stack.append([e["ts"] + dur, dur, e["name"], (e.get("pid"), e.get("tid"))])
        for e in events:
            cat = e.get("cat", "")
            if self.cuda and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
                add(device, e["name"], e.get("dur", 0))
            elif cat in ("cuda_runtime", "cuda_driver") and (e["name"] in SYNC_EVENTS or e["name"] in LAUNCH_EVENTS):
                add(device, e["name"], 0)

    def finish(self) -> None:
        if not self.on:
            return
        out = Path(self.spec["out"])
        lines = []
        for p in PROFILED_PHASES:
            for title, table in (("device" if self.cuda else "ops (self time)", self.kernels[p]),
                                 ("host ops (self time)", self.host[p] if self.cuda else {})):
                if not table:
                    continue
                lines.append(f"== {p}: {title}\n{'ms':>10} {'calls':>8}  name")
                for key, (us, n) in sorted(table.items(), key=lambda kv: kv[1][0], reverse=True)[:30]:
                    lines.append(f"{us / 1e3:10.2f} {int(n):8d}  {key}")
        out.joinpath("profile.txt").write_text("\n".join(lines) + "\n")
        merged: dict[str, list[float]] = {}
        for p in PROFILED_PHASES:
            for key, (us, n) in {**self.kernels[p], **self.host[p]}.items():
                entry = merged.setdefault(key, [0.0, 0])
                entry[0] += us
                entry[1] += n
        launches = sum(n for k, (_, n) in merged.items() if k in LAUNCH_EVENTS) if self.cuda else \
            sum(n for k, (_, n) in merged.items() if k.startswith("aten::"))
        device = {k: v for p in PROFILED_PHASES for k, v in self.kernels[p].items()
                  if k not in SYNC_EVENTS and k not in LAUNCH_EVENTS}
        summary = {
            "rollouts": 1, "launches_per_rollout": launches,
            "launch_kind": ("kernel launches" if self.cuda else "aten ops dispatched") + " in scoring and the update",
            "syncs_per_rollout": {k: n for k, (_, n) in merged.items() if k in SYNC_EVENTS},
            "top": [{"name": k, "calls": v[1], "ms": v[0] / 1e3}
                    for k, v in sorted(device.items(), key=lambda kv: kv[1][0], reverse=True)[:12]],
            "phases": {},
        }
        for p in PHASES:
            kernels = {k: v for k, v in self.kernels[p].items() if k not in SYNC_EVENTS and k not in LAUNCH_EVENTS}
            busy = sum(v[0] for v in kernels.values())
            top = sorted(kernels.items(), key=lambda kv: kv[1][0], reverse=True)[:8]
            host = sorted(self.host[p].items(), key=lambda kv: kv[1][0], reverse=True)[:5]
            summary["phases"][p] = {
                "wall_ms": self.walls[p] * 1e3, "traced": p in PROFILED_PHASES, "busy_ms": busy / 1e3,
                "kernels": int(sum(v[1] for v in kernels.values())),
                "top": [{"name": k, "ms": v[0] / 1e3, "calls": int(v[1]), "share": v[0] / max(busy, 1e-9)}
                        for k, v in top],
                "host_top": [{"name": k, "ms": v[0] / 1e3, "calls": int(v[1])} for k, v in host]}
        out.joinpath("profile.json").write_text(json.dumps(summary, indent=1))


def print_profile(name: str, lib: str, folder: Path) -> None:
    """The child's profile.json as a few lines: launches, host synchronisations, and per phase its wall time, device
    time and top kernels (with their share of the phase) and, on CUDA, its top host ops."""
    summary = json.loads((folder / "profile.json").read_text())
    syncs = ", ".join(f"{k} {v:g}" for k, v in sorted(summary["syncs_per_rollout"].items())) or "none"
    print(f"  profile {name} {lib}: per rollout {summary['launches_per_rollout']:.0f} {summary['launch_kind']}; "
          f"host synchronisations: {syncs}", flush=True)
    unit = "kernels" if "kernel" in summary["launch_kind"] else "ops"
    for phase, p in summary["phases"].items():
        if not p["traced"]:
            print(f"    {phase}: wall {p['wall_ms']:.0f} ms (timed, not traced)", flush=True)
            continue
        print(f"    {phase}: wall {p['wall_ms']:.0f} ms (profiled), busy {p['busy_ms']:.0f} ms in {p['kernels']} {unit}",
              flush=True)
        for e in p["top"]:
            print(f"      {e['share']:6.1%} {e['ms']:9.1f} ms {e['calls']:7d} x  {e['name'][:90]}", flush=True)
        if p["host_top"]:
            print("      host: " + "; ".join(f"{e['name'][:40]} {e['ms']:.0f} ms/{e['calls']}" for e in p["host_top"]),
                  flush=True)
    print(f"    (full tables: {folder / 'profile.txt'})", flush=True)


def gpu_memory(phase_peaks: "PhasePeaks | None" = None) -> dict:
    """The child's peak GPU memory (torch's allocator), where it ran on CUDA; with `phase_peaks`, each phase's too."""
    import torch

    if not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU"):
        return {}
    if phase_peaks is None:
        return {"peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20}
    return {"peak_gpu_mib": phase_peaks.overall() / 2**20,
            "peak_gpu_by_phase": {k: v / 2**20 for k, v in phase_peaks.peaks.items()},
            "held_gpu_by_phase": {k: v / 2**20 for k, v in phase_peaks.held.items()}}


class PhasePeaks:
    """The peak GPU memory (torch's allocator) inside each wrapped phase, over the whole run: which phase sets the
    run's peak. The allocator's peak is reset as a phase starts, so the run's peak is kept here as well. Also what
    is held as each phase starts (its largest over the run): the state that lives across phases (weights,
    optimizer, reference model, engine), apart from what the phase itself allocates on top of it."""

    def __init__(self):
        import torch

        self.torch, self.peaks, self.held, self.before = torch, {}, {}, 0

    def on(self) -> bool:
        return self.torch.cuda.is_available() and self.torch.cuda.is_initialized()

    def overall(self) -> int:
        return max(self.before, self.torch.cuda.max_memory_allocated(), *self.peaks.values())

    def phase(self, name: str, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if not self.on():
                return fn(*a, **kw)
            cuda = self.torch.cuda
            self.before = max(self.before, cuda.max_memory_allocated())
            self.held[name] = max(self.held.get(name, 0), cuda.memory_allocated())
            cuda.reset_peak_memory_stats()
            try:
                return fn(*a, **kw)
            finally:
                self.peaks[name] = max(self.peaks.get(name, 0), cuda.max_memory_allocated())

        return wrapper


def child_trl(spec: dict) -> dict:
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    w, out = spec["workload"], Path(spec["out"])
    R, m = w["prompts"] * w["k"], w["micro_batch"]
    total_steps = (spec["warmup"] + spec["rollouts"]) * w["epochs"]
    texts = [json.loads(line)["prompt"] for line in Path(spec["prompts"]).read_text().splitlines()]
    args = GRPOConfig(
        output_dir=str(out / "run"), seed=spec["seed"], use_cpu=spec.get("device", "cpu") == "cpu", bf16=False,
        fp16=False, model_init_kwargs={"dtype": spec.get("dtype", "float32")},  # the weights themselves, as tidyrl
        per_device_train_batch_size=m, gradient_accumulation_steps=R // m, num_generations=w["k"],
        max_completion_length=w["max_new_tokens"], generation_kwargs={"min_new_tokens": w["max_new_tokens"]},
        temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
        num_iterations=w["epochs"], beta=w["kl_coef"], loss_type="dapo", scale_rewards="group",
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=total_steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
        gradient_checkpointing=False,  # TRL's default is True; tidyrl's is False: the same work for both
        use_liger_kernel=bool(spec.get("liger")),
    )
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=vowel_fraction, args=args,
                          train_dataset=datasets.Dataset.from_list([{"prompt": t} for t in texts]),
                          processing_class=AutoTokenizer.from_pretrained(spec["model"]))
    timers: dict[str, list[float]] = {"generate": [], "reward": [], "rollout": []}
    tokens: list[int] = []

    import torch

    # each timer waits for the device at both ends (device_sync): the phase is billed its own kernels
    def timed(name, fn, count_tokens=False):
        def wrapper(*a, **kw):
            device_sync()
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            device_sync()
            timers[name].append(time.perf_counter() - t0)
            if count_tokens:
                tokens.append(int(result["completion_mask"].sum()))
            return result
        return wrapper

    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions, True)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            step_ends.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            step_ends.append(time.perf_counter())

    trainer.add_callback(StepClock())
    # TRL's own phases (outside the profiler's wrappers: its phases' clocks stay as they were): generation, the
    # no-grad log-prob passes (old and reference policy), the update's loss and backward.
    peaks = PhasePeaks()
    trainer._generate = peaks.phase("generate", trainer._generate)
    logps = trainer._get_per_token_logps_and_entropies
    scored = peaks.phase("score", logps)
    trainer._get_per_token_logps_and_entropies = lambda *a, **kw: (logps if torch.is_grad_enabled()
                                                                   else scored)(*a, **kw)
    trainer.compute_loss = peaks.phase("update", trainer.compute_loss)
    trainer.accelerator.backward = peaks.phase("update", trainer.accelerator.backward)
    profiler = Profiler(spec)
    if profiler.on:  # training_step is called R/m times per optimizer step, its first generating the rollout
        trainer.training_step = profiler.starting_at_measured(trainer.training_step,
                                                              per_rollout=(R // m) * w["epochs"])
        trainer.compute_loss = profiler.phase("update", trainer.compute_loss)  # the update: loss, then backward
        trainer.accelerator.backward = profiler.phase("update", trainer.accelerator.backward)
        trainer._generate = profiler.phase("generate", trainer._generate)
        logps = trainer._get_per_token_logps_and_entropies
        scoring = profiler.phase("score", logps)
        trainer._get_per_token_logps_and_entropies = lambda *a, **kw: (logps if torch.is_grad_enabled()
                                                                       else scoring)(*a, **kw)
    trainer.train()
    profiler.finish()
    E = w["epochs"]
    step_s = [b - a for a, b in zip(step_ends, step_ends[1:])]
    assert len(step_s) == total_steps and len(timers["rollout"]) == total_steps // E, (len(step_s), timers)
    rollouts_out = []
    for r in range(total_steps // E):
        wall = sum(step_s[r * E: (r + 1) * E])
        gen, rew, whole = timers["generate"][r], timers["reward"][r], timers["rollout"][r]
        rollouts_out.append({"wall_s": wall, "steps": E, "generate_s": gen, "reward_s": rew,
                             "score_s": whole - gen - rew, "update_s": wall - whole,
                             "completion_tokens": tokens[r]})
    return {"rollouts": rollouts_out, **gpu_memory(peaks)}


class ChildFailed(RuntimeError):
    """One library's run ended with an error: the others still run (a GPU call is not lost to one failure).
    `summary` is the first line, what failed and how; the message adds the end of the run's log."""

    def __init__(self, library: str, why: str, log_tail: str):
        self.summary = f"{library} run failed ({why})"
        super().__init__(f"{self.summary}; the end of its log:\n{log_tail}")


def run_child(library: str, spec: dict, threads: int, timeout: float | None = None) -> dict:
    """One library in a fresh subprocess; returns its timings and its own peak RSS (ru_maxrss of that child). A run
    past `timeout` seconds (loading included) is killed and fails, so that a hang leaves time for the others."""
    spec_path = Path(spec["out"]) / "spec.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--child", library, "--spec", str(spec_path), "--threads", str(threads)]
    log = open(Path(spec["out"]) / "child.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        proc.kill()

    killer = threading.Timer(timeout, kill) if timeout else None
    if killer:
        killer.start()
    _, status, usage = os.wait4(proc.pid, 0)
    if killer:
        killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    log.close()
    if proc.returncode != 0:
        tail = (Path(spec["out"]) / "child.log").read_text()[-3000:]
        why = f"killed after {timeout:g} s, --run-timeout" if timed_out.is_set() else f"exit {proc.returncode}"
        raise ChildFailed(library, why, tail)
    result = json.loads((Path(spec["out"]) / "result.json").read_text())
    result["peak_rss_mib"] = usage.ru_maxrss / 1024  # KiB on Linux
    return result


# ---------------------------------------------------------------------------------------------- parent
def parse_overrides(text: str, parser: argparse.ArgumentParser) -> dict:
    """`--set hidden=2048,layers=36,tied=false` as {"hidden": 2048, "layers": 36, "tied": False}; a key outside
    SETTABLE or a value that is not a number (or true/false for tied) is a usage error, before anything runs."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SETTABLE:
            parser.error(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(SETTABLE)}")
        if key == "tied":
            if value.strip().lower() not in ("true", "false"):
                parser.error(f"--set {item!r}: tied is true or false")
            overrides[key] = value.strip().lower() == "true"
            continue
        try:
            number = float(value)
        except ValueError:
            parser.error(f"--set {item!r}: {value!r} is not a number")
        if key != "kl_coef" and (number != int(number) or number < (0 if key == "warmup" else 1)):
            parser.error(f"--set {item!r}: {key} is a whole number of at least {0 if key == 'warmup' else 1}")
        overrides[key] = number if key == "kl_coef" else int(number)
    return overrides


def set_workload(name: str, overrides: dict, parser: argparse.ArgumentParser) -> dict:
    """WORKLOADS[name] changed by `overrides` (which workload_model and the children read); a shape the model
    cannot take or a micro-batch that does not divide the rollout is a usage error, before anything runs."""
    from tidyrl.models.tiny import build_char_tokenizer

    WORKLOADS[name] = w = {**WORKLOADS[name], **overrides}
    kv_heads, tokens = w.get("kv_heads", w["heads"]), len(build_char_tokenizer(chat_template=None))
    if w.get("vocab", tokens) < tokens:
        parser.error(f"{name}: vocab={w['vocab']} is smaller than the benchmark tokenizer's {tokens} tokens")
    if w["hidden"] % w["heads"] or w["heads"] % kv_heads:
        parser.error(f"{name}: hidden ({w['hidden']}) must be a multiple of heads ({w['heads']}), and heads a "
                     f"multiple of kv_heads ({kv_heads})")
    if (w["prompts"] * w["k"]) % w["micro_batch"]:
        parser.error(f"{name}: micro_batch={w['micro_batch']} does not divide the rollout's prompts x k = "
                     f"{w['prompts']} x {w['k']} episodes; --set micro_batch= one of its divisors")
    return w


def workload_model(name: str, device: str = "cpu"):
    """(tokenizer, model) of a workload: the character-level tokenizer and the Llama, seed 0, its weights drawn on
    `device` (a GPU draws a 1.5B model's in a blink; the CPU takes many seconds)."""
    import torch

    from tidyrl.models.tiny import build_char_tokenizer, build_tiny_llama

    w = WORKLOADS[name]
    tok = build_char_tokenizer(chat_template=None)
    with torch.device(device):
        model = build_tiny_llama(w.get("vocab", len(tok)), hidden_size=w["hidden"], num_layers=w["layers"],
                                 num_heads=w["heads"], num_kv_heads=w.get("kv_heads"),
                                 intermediate_size=w["intermediate"],
                                 max_position_embeddings=1024, seed=0, bos_token_id=tok.bos_token_id,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 tie_word_embeddings=w.get("tied", False))
    return tok, model


def in_process_setup(doc: str, default_repeats: int, extra_args=None):
    """The command line of the in-process benchmarks (bench_decode.py, bench_update.py): --workload, --repeats,
    --threads, and what `extra_args(parser)` adds. Returns (args, workload dict, tokenizer, model), torch's thread
    count set."""
    import torch

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--repeats", type=int, default=default_repeats)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", dest="overrides", default="", metavar="KEY=VALUE,...",
                        help=f"change the workload's model or batch (keys: {', '.join(SETTABLE)})")
    if extra_args is not None:
        extra_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    w = set_workload(args.workload, parse_overrides(args.overrides, parser), parser)
    return (args, w, *workload_model(args.workload))


def build_workload(name: str, folder: Path, dtype: str = "float32", device: str = "cpu") -> tuple[str, str, dict]:
    """Save the workload's model (its weights in `dtype`, drawn on `device`) and tokenizer and the prompt file;
    return their paths and FLOP facts."""
    import torch

    tok, model = workload_model(name, device)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model_dir = folder / "model"
    model.to(getattr(torch, dtype)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    texts = prompt_texts()
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    n_params = sum(p.numel() for p in model.parameters())
    matmul = sum(mod.weight.numel() for mod in model.modules() if type(mod).__name__ == "Linear")
    prompt_len = statistics.mean(len(tok(t)["input_ids"]) for t in texts)
    facts = {"params": n_params, "matmul_params": matmul, "prompt_len": prompt_len, "vocab": model.config.vocab_size}
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the children, not this process, hold the GPU from here
    return str(model_dir), str(prompts), facts


def phase_flops(w: dict, facts: dict) -> dict[str, float]:
    """Nominal FLOPs of one rollout's phases (see the docstring): generation one forward per sequence, scoring
    one per pass (old log-probs when E > 1, reference when KL is on), training three per epoch."""
    L = facts["prompt_len"] + w["max_new_tokens"]
    forward = w["prompts"] * w["k"] * (2 * facts["matmul_params"] * L + 2 * w["layers"] * w["hidden"] * L * L)
    scoring = (1 if w["epochs"] > 1 else 0) + (1 if w["kl_coef"] > 0 else 0)
    return {"generate": forward, "score": scoring * forward, "update": 3 * w["epochs"] * forward}


def phase_floors(w: dict, facts: dict, flops: dict[str, float], peak: float, bandwidth: float,
                 dtype_bytes: int) -> dict[str, float]:
    """The hardware's floor of each phase of a rollout, in seconds: what its work would take at the GEMM peak, and
    for generation at least the time to read the weights once per new token at `bandwidth` (bytes/s; each decoding
    step reads every matmul weight, the output layer's included, whatever the batch). Scoring and the update are
    FLOP-bound (6 x parameters x tokens for the update: forward and backward). The nominal FLOPs (phase_flops)
    count every prompt token, as TRL runs them."""
    weights = facts["matmul_params"] * dtype_bytes * w["max_new_tokens"] / bandwidth
    floors = {"generate": max(flops["generate"] / peak, weights), "score": flops["score"] / peak,
              "update": flops["update"] / peak}
    return {**floors, "rollout": sum(floors.values())}


def copy_bandwidth(device: str) -> float:
    """Device memory bandwidth (bytes/s): the best of a few 1 GiB device-to-device copies, bytes read and written."""
    import torch

    if device != "cuda":
        return float("nan")
    a = torch.empty(2**29, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = max(best, 2 * a.numel() * a.element_size() / (time.perf_counter() - t0))
    return best


def gemm_peak(threads: int, device: str = "cpu", dtype: str = "float32") -> float:
    """Best GEMM rate (FLOP/s) of torch.matmul in `dtype` on `device` (CPU: with `threads` threads)."""
    import torch

    torch.set_num_threads(threads)
    sizes = (1024, 1536, 2048) if device == "cpu" else (4096, 8192)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
        b = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
        a @ b
        sync()
        for _ in range(3):
            reps, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < 0.5:
                a @ b
                reps += 1
            sync()
            best = max(best, 2 * n ** 3 * reps / (time.perf_counter() - t0))
    return best


def summarise(result: dict, w: dict, warmup: int, flops: dict[str, float]) -> dict:
    """Figures of one run, over the rollouts after the warmup."""
    rs = result["rollouts"][warmup:]
    steps_per_rollout = w["epochs"]
    wall = sum(r["wall_s"] for r in rs)
    return {
        "episodes_per_s": len(rs) * w["prompts"] * w["k"] / wall,
        "tokens_per_s": sum(r["completion_tokens"] for r in rs) / wall,
        "s_per_step": statistics.median(r["wall_s"] / steps_per_rollout for r in rs),
        "generate_s": statistics.median(r["generate_s"] for r in rs),
        "reward_s": statistics.median(r["reward_s"] for r in rs),
        "score_s": statistics.median(r["score_s"] for r in rs),
        "update_s": statistics.median(r["update_s"] for r in rs),
        **{key: statistics.median(r[key] for r in rs) for key in ("engine_s", "decoding_s", "optimizer_s")
           if rs and all(key in r for r in rs)},
        "rollout_s": statistics.median(r["wall_s"] for r in rs),
        "flops_per_s": sum(flops.values()) * len(rs) / wall,
        **{f"{phase}_flops_per_s": flops[phase] / max(statistics.median(r[f"{phase}_s"] for r in rs), 1e-9)
           for phase in ("generate", "score", "update")},
        "peak_rss_mib": result["peak_rss_mib"],
        **({"peak_gpu_mib": result["peak_gpu_mib"]} if "peak_gpu_mib" in result else {}),
        **{f"peak_gpu_{phase}_mib": mib for phase, mib in result.get("peak_gpu_by_phase", {}).items()},
        **{f"held_gpu_{phase}_mib": mib for phase, mib in result.get("held_gpu_by_phase", {}).items()},
    }


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def print_table(name: str, w: dict, facts: dict, figures: dict[str, dict], peak: float, runs: int,
                floors: dict[str, float] | None = None) -> None:
    print(f"\n== {name}: {facts['params'] / 1e6:.2f}M-parameter Llama (hidden {w['hidden']}, {w['layers']} layers, "
          f"{w['heads']}/{w.get('kv_heads', w['heads'])} query/key-value heads, vocabulary {facts['vocab']}), "
          f"{w['prompts']} prompts x {w['k']} samples, {w['max_new_tokens']} new tokens, E={w['epochs']}, "
          f"kl_coef={w['kl_coef']}, micro-batch {w['micro_batch']}; median of {runs} runs ==")
    cols = list(figures)
    width = max(14, *(len(c) + 2 for c in cols))
    header = f"{'':28}" + "".join(f"{c:>{width}}" for c in cols)
    if len(cols) == 2:
        header += f"{cols[0] + '/' + cols[1]:>{len(cols[0]) + len(cols[1]) + 3}}"
    print(header)
    rows = [
        ("episodes/s", "episodes_per_s", "{:.2f}", True),
        ("completion tokens/s", "tokens_per_s", "{:.0f}", True),
        ("s / optimizer step", "s_per_step", "{:.3f}", False),
        ("rollout: generate s", "generate_s", "{:.3f}", False),
        ("rollout: reward s", "reward_s", "{:.4f}", False),
        ("rollout: score s", "score_s", "{:.3f}", False),
        ("rollout: update s", "update_s", "{:.3f}", False),
        ("rollout: total s", "rollout_s", "{:.3f}", False),
        ("peak RSS MiB", "peak_rss_mib", "{:.0f}", False),
        ("peak GPU MiB", "peak_gpu_mib", "{:.0f}", False),
        *((f"  {phase}: held / peak MiB", (f"held_gpu_{phase}_mib", f"peak_gpu_{phase}_mib"), None, False)
          for phase in PHASES),
        ("nominal GFLOP/s", "flops_per_s", "{:.2f}", True),
    ]
    for label, key, fmt, higher_better in rows:
        if isinstance(key, tuple):  # a phase's memory: held as it starts / its peak (CUDA runs only)
            if all(k in figures[c] for c in cols for k in key):
                print(f"{label:28}" + "".join(f"{'{:.0f} / {:.0f}'.format(*(figures[c][k] for k in key)):>{width}}"
                                              for c in cols))
            continue
        if any(key not in figures[c] for c in cols):  # peak GPU memory: CUDA runs only
            continue
        values = [figures[c][key] for c in cols]
        scale = 1e-9 if key == "flops_per_s" else 1.0
        line = f"{label:28}" + "".join(f"{fmt.format(v * scale):>{width}}" for v in values)
        if len(cols) == 2 and values[1]:
            ratio = values[0] / values[1]
            line += f"{ratio:>13.2f}x"
        print(line)
    line = f"{'nominal / GEMM peak':28}" + "".join(f"{figures[c]['flops_per_s'] / peak:>{width}.1%}" for c in cols)
    print(line)
    for phase in ("generate", "score", "update"):  # where each phase stands against the GEMM peak
        key = f"{phase}_flops_per_s"
        print(f"{phase + ' / GEMM peak':28}" + "".join(f"{figures[c][key] / peak:>{width}.1%}" for c in cols))
    for c in cols:  # (tidyrl's clock of its optimizer step, optimizer_step_timed)
        if "optimizer_s" in figures[c]:
            print(f"{c}: update = micro-batches {figures[c]['update_s'] - figures[c]['optimizer_s']:.3f} s + "
                  f"optimizer step (clip, AdamW, schedule) {figures[c]['optimizer_s']:.3f} s")
    if floors:  # (GPU runs) each phase against the hardware's floor for its work (phase_floors)
        print("floor s (GEMM peak; weights read once a token): " + ", ".join(
            f"{phase} {floors[phase]:.3f}" for phase in ("generate", "score", "update", "rollout")))
        for phase in ("generate", "score", "update", "rollout"):
            print(f"{phase + ' / its floor':28}" + "".join(
                f"{figures[c][phase + '_s'] / floors[phase]:>{width - 1}.2f}x" for c in cols))
    for lib in cols:
        for other in ("TRL", "TRL+liger", "tidyrl"):  # (tidyrl's columns against TRL's and tidyrl's)
            if lib != other and other in cols and not lib.startswith("TRL"):
                speed = figures[lib]["episodes_per_s"] / figures[other]["episodes_per_s"]
                rss = figures[lib]["peak_rss_mib"] / figures[other]["peak_rss_mib"]
                print(f"-> {lib} is {speed:.2f}x {other}'s episodes/s, with {rss:.2f}x its peak RSS")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--repeats", type=int, default=3, help="runs per library (figures are their medians)")
    parser.add_argument("--steps", type=int, default=None,
                        help="measured optimizer steps per run (default per workload: tiny 20, small 4)")
    parser.add_argument("--warmup", type=int, default=None, help="rollouts excluded per run (default: tiny 3, small 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each library (default 2)")
    parser.add_argument("--libraries", default="tidyrl,trl",
                        help="comma-separated subset of tidyrl, tidyrl-vllm (rollout.engine: vllm), tidyrl-lean, "
                             "tidyrl-hf-forward, tidyrl-onepass (one layout of the training forward forced: "
                             "FORCED_LAYOUTS), tidyrl-rows, tidyrl-whole-head, tidyrl-unfused-decode, "
                             "tidyrl-sdpa-decode, tidyrl-recompute, tidyrl-eager-layers (a CUDA path "
                             "switched off or on: SWITCHED_OFF), tidyrl-memtrace (the update's memory at its peak, "
                             "by allocation site), tidyrl-exact-widths (rows not padded to a multiple of 16 on CUDA), "
                             "trl and trl-liger (TRLS)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the children train (cuda: accelerate's GPU; the GEMM peak is then not measured)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the weights' dtype in both libraries (default: the workload's: float32; the qwen "
                             "workloads bfloat16); the GEMM peak is measured in it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="profile each run's measured rollouts (torch.profiler): kernel launches, host "
                             "synchronisations and the top kernels per rollout, side by side; the profiler slows "
                             "the runs, so take the timings from a run without it (keeps the tables with --keep)")
    parser.add_argument("--set", dest="overrides", default="", metavar="KEY=VALUE,...",
                        help="change the workload: any model size or batch, e.g. the shape of Qwen2.5-3B on the "
                             "qwen0.5b workload: --set hidden=2048,layers=36,heads=16,kv_heads=2,intermediate=11008 "
                             f"(keys: {', '.join(SETTABLE)})")
    parser.add_argument("--keep", help="keep the models, runs and child logs in this folder")
    parser.add_argument("--run-timeout", type=float, default=None, metavar="S",
                        help="kill a library's run after S seconds, loading included (it is then reported as failed "
                             "and the other libraries still run); default: no limit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # inside one library's subprocess
        import torch

        torch.set_num_threads(args.threads)
        spec = json.loads(Path(args.spec).read_text())
        result = child_trl(spec) if args.child in TRLS else child_tidyrl(spec)
        (Path(spec["out"]) / "result.json").write_text(json.dumps(result))
        return

    import importlib.util

    libraries = [x.strip() for x in args.libraries.split(",") if x.strip()]
    if unknown := [x for x in libraries if x not in LIBRARIES]:
        parser.error(f"--libraries: unknown {', '.join(unknown)}; choose from {', '.join(LIBRARIES)}")
    if args.device == "cpu":
        os.environ["ACCELERATE_USE_CPU"] = "1"  # the children inherit it: CPU even where a GPU is present
    if "tidyrl-vllm" in libraries and importlib.util.find_spec("vllm") is None:
        print("vLLM is not installed: leaving out tidyrl-vllm (docs/engines.md says how to install it)", flush=True)
        libraries = [x for x in libraries if x != "tidyrl-vllm"]
    if set(TRLS) & set(libraries) and importlib.util.find_spec("trl") is None:
        print("TRL is not installed: running tidyrl alone, no ratios. For the comparison: "
              "pip install -e '.[bench]'  (trl==1.16.0)", flush=True)
        libraries = [x for x in libraries if x not in TRLS]
    if "trl-liger" in libraries and importlib.util.find_spec("liger_kernel") is None:
        print("Liger Kernel is not installed: leaving out trl-liger (pip install liger-kernel)", flush=True)
        libraries = [x for x in libraries if x != "trl-liger"]
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]  # GPU workloads: skipped below on CPU
    overrides = parse_overrides(args.overrides, parser)
    for name in names:
        set_workload(name, overrides, parser)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    base.mkdir(parents=True, exist_ok=True)

    import torch
    import transformers

    import tidyrl

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}, tidyrl {tidyrl.__version__}"
    if set(TRLS) & set(libraries):
        import trl

        versions += f", trl {trl.__version__}"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    print(f"{os.cpu_count()} CPUs ({cpu}); {args.threads} torch threads per library; {versions}", flush=True)
    peaks: dict[str, float] = {}
    bandwidth = None
    failed: dict[str, dict[str, str]] = {}  # workload -> library -> what failed and how (ChildFailed.summary)
    for name in names:
        w = WORKLOADS[name]
        if w.get("gpu") and args.device != "cuda":
            print(f"{name}: a GPU workload (--device cuda); on this CPU it would take hours, left out", flush=True)
            continue
        dtype = args.dtype or w.get("dtype", "float32")
        if dtype not in peaks:
            peaks[dtype] = gemm_peak(args.threads, args.device, dtype)
            print(f"measured {dtype} GEMM peak ({args.device}): {peaks[dtype] / 1e9:.1f} GFLOP/s", flush=True)
            if args.device == "cuda" and bandwidth is None:
                bandwidth = copy_bandwidth(args.device)
                print(f"measured copy bandwidth (cuda, read + written): {bandwidth / 1e12:.2f} TB/s", flush=True)
        peak = peaks[dtype]
        folder = base / name
        model_dir, prompts, facts = build_workload(name, folder, dtype, args.device)
        warmup = w["warmup"] if args.warmup is None else args.warmup
        rollouts = -(-(args.steps or w["steps"]) // w["epochs"])
        if args.profile and args.steps is None:
            rollouts = 1  # the profile covers one rollout: no more is run
        flops = phase_flops(w, facts)
        per_lib: dict[str, list[dict]] = {lib: [] for lib in libraries}
        for rep in range(args.repeats):
            for lib in libraries:
                if lib in failed.get(name, {}):  # failed once: its other runs would fail the same way
                    continue
                spec = {"workload": w, "model": model_dir, "prompts": prompts, "seed": args.seed + rep,
                        "warmup": warmup, "rollouts": rollouts, "out": str(folder / f"{lib}-{rep}"),
                        "engine": ENGINES.get(lib, "builtin"), "device": args.device, "dtype": dtype,
                        "profile": args.profile, "layouts": FORCED_LAYOUTS.get(lib),
                        "exact_widths": lib in EXACT_WIDTHS, "memory_trace": lib in MEMORY_TRACE,
                        "liger": lib == "trl-liger", "kernels": SWITCHED_OFF.get(lib, {})}
                t0, load = time.perf_counter(), os.getloadavg()[0]
                try:
                    result = run_child(lib, spec, args.threads, args.run_timeout)
                except ChildFailed as err:
                    failed.setdefault(name, {})[lib] = err.summary
                    print(f"  {name} {lib:11} run {rep + 1}/{args.repeats}: FAILED after "
                          f"{time.perf_counter() - t0:.0f} s, left out of the table: {err}", flush=True)
                    continue
                figures = summarise(result, w, warmup, flops)
                per_lib[lib].append(figures)
                split = [f"{label} {figures[key]:.3f}" for key, label in
                         (("engine_s", "in the engine"), ("decoding_s", "decoding")) if key in figures]
                print(f"  {name} {lib:11} run {rep + 1}/{args.repeats}: {figures['episodes_per_s']:.1f} episodes/s, "
                      f"{figures['s_per_step']:.3f} s/step (generate {figures['generate_s']:.3f}"
                      + (f" [{', '.join(split)}]" if split else "")
                      + f", score "
                      f"{figures['score_s']:.3f}, update {figures['update_s']:.3f} s"
                      + (f" [optimizer step {figures['optimizer_s']:.3f}]" if "optimizer_s" in figures else "")
                      + (f", peak GPU {figures['peak_gpu_mib']:.0f} MiB" if "peak_gpu_mib" in figures else "")
                      + "".join(f" ({phase} {figures[f'peak_gpu_{phase}_mib']:.0f}, held at its start "
                                f"{figures[f'held_gpu_{phase}_mib']:.0f})" for phase in PHASES
                                if f"peak_gpu_{phase}_mib" in figures)
                      + f"), peak RSS {figures['peak_rss_mib']:.0f} MiB "
                      f"({time.perf_counter() - t0:.0f} s with loading; load average {load:.2f} -> "
                      f"{os.getloadavg()[0]:.2f})", flush=True)
                if result.get("fused_decode_failed"):  # (the child's warning is silenced with the others)
                    print(f"    the fused decoding kernels failed in this run and were given up: generation ran "
                          f"without them; {result['fused_decode_failed']}", flush=True)
                if result.get("update_trace"):
                    print_trace(result["update_trace"])
                if args.profile:
                    print_profile(name, lib, Path(spec["out"]))
        labels = {lib: lib for lib in LIBRARIES} | {"trl": "TRL", "trl-liger": "TRL+liger"}
        shown = sorted((lib for lib in per_lib if per_lib[lib]), key=lambda lib: lib in TRLS)  # TRL's columns last
        if shown:
            floors = None
            if args.device == "cuda":
                floors = phase_floors(w, facts, flops, peak, bandwidth, 2 if dtype in ("bfloat16", "float16") else 4)
            print_table(name, w, facts, {labels[lib]: median_of(per_lib[lib]) for lib in shown}, peak,
                        args.repeats, floors)
        # each tidyrl run against the TRL run after it: the machine's drift
        if set(per_lib) == {"tidyrl", "trl"} and name not in failed:
            pairs = [a["episodes_per_s"] / b["episodes_per_s"] for a, b in zip(per_lib["tidyrl"], per_lib["trl"])]
            print("   per pair (tidyrl/TRL episodes/s): " + ", ".join(f"{p:.2f}x" for p in pairs))
    if not args.keep:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    if failed:
        sys.exit("failed runs (the tables leave them out): " + "; ".join(
            f"{name} {why}" for name, libs in failed.items() for why in libs.values()))


if __name__ == "__main__":
    main()
