"""The benchmark scripts run and print what the speed issue asks for (tidyrl alone: TRL is an optional extra)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest


BENCH = Path(__file__).parent.parent / "benchmarks"


def run(script: str, *args: str, timeout: int = 300) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def number(row: str, text: str) -> float:
    """The first number on the table row that starts with `row`."""
    match = re.search(rf"^{re.escape(row)}\s+([0-9.]+)", text, re.MULTILINE)
    assert match, (row, text)
    return float(match.group(1))


@pytest.mark.extended
def test_bench_vs_trl_prints_the_table_and_the_run_has_the_time_split(tmp_path):
    out = run("bench_vs_trl.py", "--workload", "tiny", "--repeats", "1", "--steps", "2", "--warmup", "1",
              "--libraries", "tidyrl", "--keep", str(tmp_path))
    for row in ("episodes/s", "completion tokens/s", "s / optimizer step", "rollout: generate s",
                "rollout: score s", "rollout: update s", "peak RSS MiB", "nominal GFLOP/s"):
        assert number(row, out) >= 0
    assert number("episodes/s", out) > 0 and number("peak RSS MiB", out) > 100
    assert re.search(r"measured float32 GEMM peak \(cpu\): [0-9.]+ GFLOP/s", out)
    for phase in ("generate", "score", "update"):  # each phase against the peak (score: 0 FLOPs without KL, E=1)
        assert re.search(rf"^{phase} / GEMM peak\s+[0-9.]+%", out, re.MULTILINE)
    assert "peak GPU MiB" not in out and "its floor" not in out  # CUDA runs only
    # the update's split: its micro-batches and its optimizer step, which is a small part of it
    split = re.search(r"tidyrl: update = micro-batches ([0-9.]+) s \+ optimizer step \(clip, AdamW, schedule\) "
                      r"([0-9.]+) s", out)
    assert split and 0 < float(split.group(2)) < float(split.group(1)), out
    # the generate phase split: inside the builtin engine's generate, a part of the phase (no fixed-shape decoding
    # loop on a CPU)
    split = re.search(r"\(generate ([0-9.]+) \[in the engine ([0-9.]+)\]", out)
    assert split and 0 < float(split.group(2)) <= float(split.group(1)), out
    rows = [json.loads(line) for line in (tmp_path / "tiny" / "tidyrl-0" / "run" / "metrics.jsonl").open()]
    assert len(rows) == 3  # 1 warm-up rollout + 2 measured optimizer steps (E = 1)
    for row in rows:
        assert all(row[f"time/{k}_s"] > 0 for k in ("generate", "update"))


@pytest.mark.slow  # 20-30 s: a benchmark's own runs
def test_bench_vs_trl_takes_any_model_size_and_refuses_a_bad_one_before_running(tmp_path):
    out = run("bench_vs_trl.py", "--workload", "tiny", "--repeats", "1", "--steps", "1", "--warmup", "0",
              "--libraries", "tidyrl", "--keep", str(tmp_path),
              "--set", "hidden=64,layers=2,heads=2,kv_heads=1,prompts=2,k=4,micro_batch=4,vocab=500")
    assert ("== tiny: 0.29M-parameter Llama (hidden 64, 2 layers, 2/1 query/key-value heads, vocabulary 500), "
            "2 prompts x 4 samples") in out
    config = json.loads((tmp_path / "tiny" / "model" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"],
            config["vocab_size"]) == (64, 2, 1, 500)
    assert number("episodes/s", out) > 0
    for bad, says in (("hiden=64", "expected KEY=VALUE with KEY one of hidden"),
                      ("layers=2.5", "layers is a whole number"),
                      ("prompts=3", "micro_batch=32 does not divide the rollout's prompts x k = 3 x 8")):
        done = subprocess.run([sys.executable, str(BENCH / "bench_vs_trl.py"), "--workload", "tiny", "--set", bad,
                               "--keep", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr
        assert not (tmp_path / "bad").exists()


def test_bench_update_compares_both_paths_and_they_agree():
    out = run("bench_update.py", "--workload", "tiny", "--repeats", "1")
    assert re.search(r"lean pass\s+forward\s+[0-9.]+ ms\s+backward\s+[0-9.]+ ms", out)
    assert re.search(r"HF forward\s+forward\s+[0-9.]+ ms", out)
    lp = float(re.search(r"max \|log-prob difference\| ([0-9.e+-]+)", out).group(1))
    grad = float(re.search(r"max gradient difference \(relative to the tensor's largest\) ([0-9.e+-]+)", out).group(1))
    assert lp < 1e-5 and grad < 1e-4
    saved = float(re.search(r"saved-tensor memory ([0-9.]+)x", out).group(1))
    assert saved < 1.0  # the lean pass keeps fewer bytes for backward than the model's own forward


def test_bench_families_times_each_family_on_both_paths_and_they_draw_alike():
    import transformers

    # (transformers 4.x keeps Gemma 3's local rope in a module of its own, which its declaration refuses)
    names = ("qwen3", "gemma3") if int(transformers.__version__.split(".")[0]) >= 5 else ("qwen3", "mistral")
    out = run("bench_families.py", "--workload", "tiny", "--repeats", "1", "--families", ",".join(names))
    for name in names:
        row = re.search(rf"^  {name}\s+fast path \({name}\)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)x\s+([0-9.]+)\s+"
                        rf"([0-9.]+)\s+([0-9.]+)x\s+True$", out, re.MULTILINE)
        assert row, out


def test_bench_logprobs_keeps_half_the_bytes_and_gives_autograds_numbers():
    out = run("bench_logprobs.py", "--rows", "6", "--tokens", "8", "--vocab", "3000", "--repeats", "1")
    assert re.search(r"tidyrl.models.ops\s+forward\s+[0-9.]+ ms\s+backward\s+[0-9.]+ ms", out)
    assert "bit-identical: yes" in out
    kept = float(re.search(r"kept for backward ([0-9.]+)x", out).group(1))
    assert kept == 0.5  # the bf16 logits instead of their float32 copy (plus [B, T] logsumexps, under rounding)


@pytest.mark.extended
def test_bench_vs_trl_runs_in_bfloat16_and_leaves_gpu_workloads_to_a_gpu(tmp_path):
    """--dtype bfloat16 loads both libraries' weights in bfloat16 (the GPU workloads' setting) and measures the
    peak in it; the Qwen-shaped workloads are not run on a CPU."""
    out = run("bench_vs_trl.py", "--workload", "tiny", "--repeats", "1", "--steps", "1", "--warmup", "0",
              "--libraries", "tidyrl", "--dtype", "bfloat16", "--keep", str(tmp_path))
    assert re.search(r"measured bfloat16 GEMM peak \(cpu\): [0-9.]+ GFLOP/s", out)
    assert number("episodes/s", out) > 0
    config = (tmp_path / "tiny" / "tidyrl-0" / "run" / "config.yaml").read_text()
    assert "model_dtype: bfloat16" in config
    skipped = run("bench_vs_trl.py", "--workload", "qwen0.5b", "--libraries", "tidyrl")
    assert "qwen0.5b: a GPU workload (--device cuda)" in skipped and "episodes/s" not in skipped



@pytest.mark.slow  # 20-30 s: a benchmark's own runs
def test_bench_vs_trl_profiles_one_measured_rollout_by_phase(tmp_path):
    """--profile: one measured rollout (and no more is run), its phases timed and its scoring and update traced by
    torch.profiler: summarised (ops or kernel launches, host synchronisations, the top ops) and split by phase (each
    traced one's top ops with their share of it), the tables kept beside the run."""
    out = run("bench_vs_trl.py", "--workload", "tiny", "--repeats", "1", "--warmup", "1", "--set", "kl_coef=0.04",
              "--libraries", "tidyrl", "--profile", "--keep", str(tmp_path))
    match = re.search(r"profile tiny tidyrl: per rollout ([0-9]+) aten ops dispatched in scoring and the update; "
                      r"host synchronisations: (.*)", out)
    assert match and int(match.group(1)) > 1000, out
    folder = tmp_path / "tiny" / "tidyrl-0"
    summary = json.loads((folder / "profile.json").read_text())
    assert summary["rollouts"] == 1 and len(summary["top"]) == 12
    assert any(e["name"].startswith("aten::") for e in summary["top"])
    assert summary["phases"]["generate"]["wall_ms"] > 0 and not summary["phases"]["generate"]["traced"]
    assert "    generate: wall " in out and "(timed, not traced)" in out
    for phase in ("score", "update"):  # traced: the top ops with their share of the phase
        p = summary["phases"][phase]
        assert p["traced"] and p["wall_ms"] > 0 and p["kernels"] > 0 and p["top"]
        assert 0 < sum(e["share"] for e in p["top"]) <= 1 + 1e-9
        assert f"    {phase}: wall " in out and "(profiled)" in out
    assert len((folder / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # warmup + the profiled rollout
    table = (folder / "profile.txt").read_text()
    assert "== score: ops (self time)" in table and "== update: ops (self time)" in table and "aten::mm" in table


def test_bench_passes_times_every_layout_of_the_training_forward_and_they_agree():
    out = run("bench_passes.py", "--workload", "tiny", "--repeats", "1")
    for name in ("lean", "shared", "onepass", "onepass-rows", "onepass-exact", "trl"):
        row = re.search(rf"^{name}\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+\S+\s+([0-9.e+-]+)$", out,
                        re.MULTILINE)
        assert row, out
        assert float(row.group(1)) > 0 and float(row.group(3)) > 0 and float(row.group(5)) < 1e-4


def test_bench_passes_traces_each_layout_op_by_op_on_the_meta_device():
    out = run("bench_passes.py", "--workload", "tiny", "--trace", "--passes", "lean,onepass")
    for name in ("lean", "onepass"):
        for phase in ("score ", "update"):
            assert re.search(rf"^  {name}\s+{phase}:\s+[0-9]+ ops; matmul GFLOP float32 [0-9.]+", out, re.MULTILINE), out
    assert "vocabulary-sized" in out and "host reads" in out


def test_count_decode_ops_counts_a_captured_token_and_the_fused_kernels_cut_it():
    """A fixed-shape token of a 24-layer Qwen2 shape: ~42 ops per layer unfused (RMSNorm alone 8, twice); with the
    fused kernels (where Triton is installed, in its interpreter) under 9, sampling included: q/k/v and gate/up
    each one matmul, silu(gate) * up one kernel, rope, the cache writes and the attention one kernel."""
    import importlib.util
    import os

    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(BENCH / "count_decode_ops.py")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {kind: int(n) for kind, n in re.findall(r"^(unfused|fused): (\d+) ops per token", done.stdout, re.M)}
    assert 40 * 24 <= counts["unfused"] <= 46 * 24, done.stdout
    if importlib.util.find_spec("triton") is not None:
        assert counts["fused"] <= 9 * 24 and "triton rope_cache_attend 24" in done.stdout, done.stdout
        assert "rope_and_cache" not in done.stdout and "scaled_dot_product_attention" not in done.stdout
        assert "linear 97" in done.stdout and "triton silu_and_mul 24" in done.stdout  # 4 matmuls a layer, + head
    else:
        assert "fused" not in counts and "needs Triton" in done.stdout


def test_phase_peaks_keep_what_each_phase_holds_and_reaches_and_the_table_shows_both(capsys):
    """On CUDA each phase of a benchmarked run records the memory held as it starts (the state living across
    phases) and its own peak, so that a run's peak is traced to a phase and to held state or transients. torch's
    allocator counters faked here (no GPU); the table prints `held / peak` per phase for each library."""
    from types import SimpleNamespace

    sys.path.insert(0, str(BENCH))
    import bench_vs_trl as bench

    mem = {"now": 1000, "peak": 1000}

    def allocate(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    cuda = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: True,
                           memory_allocated=lambda: mem["now"], max_memory_allocated=lambda: mem["peak"],
                           reset_peak_memory_stats=lambda: mem.update(peak=mem["now"]))
    peaks = bench.PhasePeaks()
    peaks.torch = SimpleNamespace(cuda=cuda)

    def generate():  # a transient 400 on top of what is held
        allocate(400)
        allocate(-400)

    def update():  # keeps 100 (say, gradients) and a transient 900
        allocate(1000)
        allocate(-900)

    generate, update = peaks.phase("generate", generate), peaks.phase("update", update)
    for _ in range(2):
        generate()
        update()
    assert peaks.held == {"generate": 1100, "update": 1100} and peaks.peaks == {"generate": 1500, "update": 2100}
    assert peaks.overall() == 2100

    base = {"episodes_per_s": 1.0, "tokens_per_s": 1.0, "s_per_step": 1.0, "generate_s": 1.0, "reward_s": 0.1,
            "score_s": 1.0, "update_s": 1.0, "rollout_s": 1.0, "peak_rss_mib": 1.0, "flops_per_s": 1.0,
            "generate_flops_per_s": 1.0, "score_flops_per_s": 1.0, "update_flops_per_s": 1.0, "peak_gpu_mib": 2100}
    mine = {**base, "held_gpu_update_mib": 1100, "peak_gpu_update_mib": 2100}
    theirs = {**base, "held_gpu_update_mib": 900, "peak_gpu_update_mib": 1800}
    w = dict(hidden=8, layers=1, heads=1, prompts=1, k=1, max_new_tokens=1, epochs=1, kl_coef=0.0, micro_batch=1)
    bench.print_table("x", w, {"params": 1e6, "vocab": 10}, {"tidyrl": mine, "TRL": theirs}, 1.0, 1)
    out = capsys.readouterr().out
    assert re.search(r"update: held / peak MiB\s+1100 / 2100\s+900 / 1800", out), out
    assert "generate: held / peak" not in out  # (not recorded for either: no row)


def test_each_phase_has_its_floor_at_the_gemm_peak_and_decoding_at_the_weights_read_once_a_token(capsys):
    """phase_floors by hand, Qwen2.5-0.5B's shape: 494.03 M matmul parameters (bf16: 2 bytes), 16 x 8 rows of
    17 + 256 tokens, KL on, E = 1, a 700 TFLOP/s GEMM peak and 3.3 TB/s. One forward's FLOPs are
    128 x (2 x 494.03e6 x 273 + 2 x 24 x 896 x 273^2) = 128 x (269.74e9 + 3.205e9) = 34.94e12: generation one
    (0.0499 s of GEMM, less than 256 reads of 988.06 MB at 3.3 TB/s: 0.0766 s), scoring one (0.0499 s), the update
    three (0.1497 s); the rollout's floor 0.2763 s. The table then gives each phase over its floor."""
    sys.path.insert(0, str(BENCH))
    import bench_vs_trl as bench

    w = dict(bench.WORKLOADS["qwen0.5b"])
    facts = {"matmul_params": 494.03e6, "prompt_len": 17, "params": 494.03e6, "vocab": 151936}
    flops = bench.phase_flops(w, facts)
    assert flops["generate"] == pytest.approx(128 * (2 * 494.03e6 * 273 + 2 * 24 * 896 * 273 ** 2))
    assert flops["score"] == flops["generate"] and flops["update"] == 3 * flops["generate"]
    floors = bench.phase_floors(w, facts, flops, 700e12, 3.3e12, 2)
    assert floors["generate"] == pytest.approx(494.03e6 * 2 * 256 / 3.3e12)  # the weights' reads: 0.0766 s
    assert floors["generate"] == pytest.approx(0.07665, abs=1e-4)
    assert floors["score"] == pytest.approx(flops["score"] / 700e12) == pytest.approx(0.04991, abs=1e-4)
    assert floors["update"] == pytest.approx(0.14974, abs=1e-4)
    assert floors["rollout"] == pytest.approx(floors["generate"] + floors["score"] + floors["update"])
    figures = {"episodes_per_s": 1.0, "tokens_per_s": 1.0, "s_per_step": 1.0, "generate_s": 0.4, "reward_s": 0.1,
               "score_s": 0.2, "update_s": 0.75, "rollout_s": 1.45, "peak_rss_mib": 1.0, "flops_per_s": 1.0,
               "generate_flops_per_s": 1.0, "score_flops_per_s": 1.0, "update_flops_per_s": 1.0}
    bench.print_table("qwen0.5b", w, facts, {"tidyrl": figures}, 700e12, 1, floors)
    out = capsys.readouterr().out
    assert "floor s (GEMM peak; weights read once a token): generate 0.077, score 0.050, update 0.150, " \
           "rollout 0.276" in out, out
    for phase, ratio in (("generate", 0.4 / 0.07665), ("update", 0.75 / 0.14974), ("rollout", 1.45 / 0.27630)):
        assert re.search(rf"^{phase} / its floor\s+{ratio:.2f}x", out, re.MULTILINE), out


def test_transient_at_peak_finds_what_is_alive_at_the_peak_by_allocation_site():
    """The update's memory trace (bench_vs_trl --libraries tidyrl-memtrace): replayed from the allocator's history,
    the peak above what was held as the phase began, and what the phase allocated that is alive then, by the
    innermost frame outside torch; frees of memory from before the recording lower the total, other events don't
    count. Worked by hand: +100 (a), +50 (b), -100 pre-existing, +300 (c), peak 350 there; then c freed, +20 (a)."""
    sys.path.insert(0, str(BENCH))
    import bench_vs_trl as bench

    def frames(*sites):
        return [{"filename": f, "line": line, "name": name} for f, line, name in sites]

    torch_frame = ("/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/functional.py", 10, "linear")
    a = frames(torch_frame, ("/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/qwen2/"
                             "modeling_qwen2.py", 60, "forward"))
    b = frames(("/x/src/tidyrl/models/chunked_head.py", 120, "backward"))
    c = frames(("/x/src/tidyrl/models/forward.py", 200, "_onepass_logits"))
    MiB = 2**20
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 999 * MiB, "frames": a},  # not an allocation: ignored
        {"action": "alloc", "addr": 1, "size": 100 * MiB, "frames": a},
        {"action": "alloc", "addr": 2, "size": 50 * MiB, "frames": b},
        {"action": "free_requested", "addr": 9, "size": 100 * MiB, "frames": []},  # (counted when completed)
        {"action": "free_completed", "addr": 9, "size": 100 * MiB, "frames": []},  # allocated before the recording
        {"action": "alloc", "addr": 3, "size": 300 * MiB, "frames": c},
        {"action": "free_completed", "addr": 3, "size": 300 * MiB, "frames": c},
        {"action": "alloc", "addr": 4, "size": 20 * MiB, "frames": a},
    ]
    found = bench.transient_at_peak(events, held=1000 * MiB)
    assert found["held_mib"] == 1000 and found["peak_mib"] == 1000 + 350
    assert found["sites"] == [("forward.py:200 _onepass_logits", 300.0, 1),
                              ("modeling_qwen2.py:60 forward", 100.0, 1),
                              ("chunked_head.py:120 backward", 50.0, 1)]
    assert "tidyrl-memtrace" in bench.LIBRARIES and "tidyrl-whole-head" in bench.LIBRARIES
    trace = bench.MemoryTrace()  # without CUDA, the wrapped phase just runs
    assert trace.phase(lambda x: x + 1)(1) == 2 and trace.found is None


def test_count_saved_bytes_shows_each_memory_lever_keeping_less_for_backward():
    """benchmarks/count_saved_bytes.py at tiny shapes: the whole logits' path keeps the most (and writes their gradient
    as backward starts), the chunked head less, the recomputed norms and MLP products less again."""
    done = subprocess.run([sys.executable, str(BENCH / "count_saved_bytes.py"), "--layers", "2", "--rows", "4",
                           "--hidden", "64", "--intermediate", "256", "--heads", "4", "--kv-heads", "2", "--vocab",
                           "4096", "--completion", "48"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    totals = [float(x) for x in re.findall(r"24 layers:\s+([0-9.]+)", done.stdout)]
    assert len(totals) == 3 and "+ gradient" in done.stdout, done.stdout
    whole, chunked, both = totals
    assert whole > chunked > both, done.stdout


def bench_vs_trl_module():
    """benchmarks/bench_vs_trl.py imported as a module of its own (its functions patched per test)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vs_trl_under_test", BENCH / "bench_vs_trl.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.slow  # 20-30 s: a benchmark's own runs
def test_bench_vs_trl_goes_on_past_a_failed_run_and_says_which_failed(tmp_path, monkeypatch, capsys):
    """One library's run failing (on a GPU call: a kernel, an out-of-memory, TRL's install) leaves the others' runs
    and table whole: the failure is printed with the end of its log, that library is not run again, and the exit
    names it."""
    bench = bench_vs_trl_module()
    real, calls = bench.run_child, []

    def run_child(library, spec, threads, timeout):
        calls.append(library)
        if library == "tidyrl-lean":
            raise bench.ChildFailed(library, "exit 1", "RuntimeError: no kernel")
        result = real(library, spec, threads, timeout)
        if calls.count("tidyrl") == 2:  # as a CUDA run whose decoding kernels were given up reports it
            result["fused_decode_failed"] = "RuntimeError: PTX compile failed"
        return result

    monkeypatch.setattr(bench, "run_child", run_child)
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--workload", "tiny", "--repeats", "2", "--steps", "1", "--warmup", "0",
                    "--libraries", "tidyrl-lean,tidyrl", "--set", "prompts=2,k=4,micro_batch=4",
                    "--keep", str(tmp_path)])
    out = capsys.readouterr().out
    assert calls == ["tidyrl-lean", "tidyrl", "tidyrl"]  # the failed library is not run again
    assert re.search(r"tiny tidyrl-lean run 1/2: FAILED after \d+ s, left out of the table: tidyrl-lean run "
                     r"failed \(exit 1\); the end of its log:\nRuntimeError: no kernel", out), out
    assert len(re.findall(r"tiny tidyrl +run [12]/2: [0-9.]+ episodes/s", out)) == 2
    assert out.count("the fused decoding kernels failed in this run and were given up: generation ran without "
                     "them; RuntimeError: PTX compile failed") == 1  # the second run's line only
    assert out.index("run 2/2") < out.index("given up")
    header = next(line for line in out.splitlines() if line.startswith(" " * 28))
    assert header.split() == ["tidyrl"] and number("episodes/s", out) > 0  # the table: tidyrl's column alone
    assert str(exit_.value.code) == "failed runs (the tables leave them out): tiny tidyrl-lean run failed (exit 1)"


def test_bench_vs_trl_kills_a_run_past_its_timeout_and_says_so(tmp_path, monkeypatch):
    """--run-timeout: a run that hangs (on a GPU call, a kernel that never returns) is killed at the limit and reported
    as failed, with the end of its log: the other libraries keep their time."""
    bench = bench_vs_trl_module()
    hang = tmp_path / "hang.py"  # the child's script: prints a line, then never returns
    hang.write_text("import time\nprint('loading the model', flush=True)\ntime.sleep(600)\n")
    monkeypatch.setattr(bench, "__file__", str(hang))
    started = time.monotonic()
    with pytest.raises(bench.ChildFailed, match=r"(?s)tidyrl run failed \(killed after 3 s, --run-timeout\); "
                                                r"the end of its log:\nloading the model"):
        bench.run_child("tidyrl", {"out": str(tmp_path / "run")}, 1, timeout=3)
    assert time.monotonic() - started < 60


def test_bench_recompute_times_each_mode_and_checks_they_agree():
    out = run("bench_recompute.py", "--layers", "2", "--repeats", "2", timeout=120)
    assert "7 parts recomputed" in out and "the same log-probs and gradients in every mode" in out
    kept = {mode: float(re.search(rf"^  {mode}\s+[0-9.]+ ms per pass,\s+([0-9.]+) MiB kept", out, re.MULTILINE)[1])
            for mode in ("kept", "checkpoint", "functions")}
    assert kept["functions"] == kept["checkpoint"] < kept["kept"]  # the same tensors kept, fewer than the model's


@pytest.mark.slow  # 20-30 s: a benchmark's own runs
def test_bench_loading_shows_a_copy_on_the_host_first_costs_a_model_that_placing_does_not():
    out = run("bench_loading.py", "--device", "meta", "--hidden", "512", "--intermediate", "1536", "--layers", "2",
              "--heads", "8", "--vocab", "64000", timeout=180)
    assert re.search(r"26 of its 26 tensors off 64-byte alignment", out), out  # the host way copies every one
    times_model = {mode: float(re.search(rf"^{mode}\s+[0-9]+\s+-?[0-9]+\s+(-?[0-9.]+)\s", out, re.MULTILINE)[1])
                   for mode in ("imports", "host", "copy-then-move", "placed")}
    assert times_model["imports"] == 0
    assert times_model["host"] > 2.5 and times_model["copy-then-move"] > 2.5  # two held, the third being copied
    assert times_model["placed"] < 0.5  # (meta reads no page: on a GPU, ~1 model of the file's mapped pages)


def learning_bench():
    sys.path.insert(0, str(BENCH))
    import bench_learning

    return bench_learning


def test_bench_learning_gives_trl_the_tidyrl_configs_numbers_and_prompt_order_without_trl(tmp_path, monkeypatch):
    """bench_learning.py's TRL settings are read off the tidyrl config (no TRL import, nothing trained): the batch,
    sampling, loss, clipping, optimizer and schedule; its prompts are tidyrl's prompt stream in order, across an
    epoch's end; a config with no TRL counterpart, a reused run of other settings and bad options are refused."""
    from argparse import Namespace

    from tidyrl.config import config_to_dict
    from tidyrl.data import PromptStream

    bench = learning_bench()
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
                                         "answer": str(i + 1)}) + "\n" for i in range(10)))
    args = Namespace(config=str(bench.EXAMPLE / "grpo.yaml"), model=str(tmp_path / "model"), train=str(train),
                     rollouts=5, output=str(tmp_path / "out"))
    cfg = bench.tidyrl_config(args)
    trl = bench.trl_settings(cfg)
    r, t = cfg.rollout, cfg.train
    assert (trl["num_generations"], trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (
        r.samples_per_prompt, t.micro_batch_size, r.prompts_per_rollout * r.samples_per_prompt // t.micro_batch_size)
    assert (trl["temperature"], trl["top_p"], trl["top_k"], trl["max_completion_length"]) == (0.7, 1.0, 0, 32)
    assert (trl["learning_rate"], trl["lr_scheduler_type"], trl["warmup_steps"], trl["max_grad_norm"]) == (
        1e-5, t.lr_scheduler, 2, t.max_grad_norm)
    assert (trl["weight_decay"], trl["adam_beta1"], trl["adam_beta2"], trl["adam_epsilon"]) == (
        t.weight_decay, t.adam_beta1, t.adam_beta2, t.adam_epsilon)
    assert (trl["max_steps"], trl["num_iterations"], trl["beta"], trl["epsilon"]) == (5, 1, 0.0, 0.2)
    assert (trl["loss_type"], trl["scale_rewards"], trl["shuffle_dataset"], trl["use_vllm"]) == (
        "dapo", "group", False, False)
    assert trl["gradient_checkpointing"] is False and trl["model_init_kwargs"] == {"dtype": "float32"}

    other = bench.trl_settings(bench.load_config_with(args, ["train.micro_batch_size=8", "grpo.kl_coef=0.04",
                                                             "train.epochs_per_rollout=2", "train.warmup_steps=0",
                                                             "train.warmup_ratio=0.15"]))
    assert (other["gradient_accumulation_steps"], other["beta"], other["num_iterations"], other["max_steps"],
            other["warmup_steps"]) == (4, 0.04, 2, 10, 2)  # warm-up: ceil(0.15 * 10 steps)
    for setting, says in (("grpo.loss_aggregation=sequence_mean", "grpo.loss_aggregation='sequence_mean'"),
                          ("rollout.min_new_tokens=4", "rollout.min_new_tokens=4"),
                          ("train.micro_batch_size=12", "does not divide a rollout's 32 episodes")):
        with pytest.raises(SystemExit, match=re.escape(says)):
            bench.trl_settings(bench.load_config_with(args, [setting]))

    rows = bench.stream_rows(cfg)  # 5 rollouts of 4 prompts: 20 stream positions, two epochs of 10
    stream = PromptStream(10, cfg.seed)
    expected = [i for e in (0, 1) for i in stream.epoch_order(e)]
    assert [row["answer"] for row in rows] == [str(i + 1) for i in expected]

    run = tmp_path / "reused"
    (run / "final").mkdir(parents=True)
    import yaml

    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    bench.check_reused_run(run, cfg)
    (run / "config.yaml").write_text(yaml.safe_dump(config_to_dict(bench.load_config_with(
        args, ["rollout.temperature=1.0"]))))
    with pytest.raises(SystemExit, match="made from other settings than asked \\(rollout\\)"):
        bench.check_reused_run(run, cfg)

    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    (evaluation / "eval_samples.jsonl").write_text("")
    (evaluation / "eval.json").write_text(json.dumps({"model": str(run / "final"), "settings": {"greedy": True},
                                                      "data": f"held out: data.eval_path = '{train}'"}))
    assert bench.evaluation_of(evaluation, str(run / "final"), str(train))
    assert not bench.evaluation_of(evaluation, str(tmp_path / "model"), str(train))

    for bad, says in ((["--libraries", "tidyrl,vllm"], "--libraries: unknown vllm"),
                      (["--reuse-eval", "after=x"], "--reuse-eval: unknown after"),
                      (["--trl-python", str(tmp_path / "none"), "--train", str(train)], "cannot import trl")):
        done = subprocess.run([sys.executable, str(BENCH / "bench_learning.py"), "--output", str(tmp_path / "o"),
                               *bad], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr, done.stderr


@pytest.mark.extended
def test_bench_moe_mismatch_prints_each_variants_mismatch_and_router_changes():
    out = run("bench_moe_mismatch.py", "--rollouts", "2", "--window", "1", "--dtype", "float32",
              "--variants", "sequence_mask,no-replay", "--dense", "token_truncate")
    rows = {line.split()[0] + " " + line.split()[1]: line.split() for line in out.splitlines()
            if line.startswith(("moe ", "dense "))}
    assert set(rows) == {"moe sequence_mask", "moe no-replay", "dense token_truncate"}
    # from the end: s/rollout, seq masked, clip/mask, changed
    assert float(rows["moe no-replay"][-4]) >= 0  # routing/changed_fraction: a mixture's, compared
    assert rows["dense token_truncate"][-4] == "-"  # a dense model has no router
    assert 0 <= float(rows["moe sequence_mask"][-2]) <= 1  # what the mask took, of the sequences
    assert rows["moe no-replay"][-2] == "-"  # (token_truncate masks no sequence)


def test_bench_routes_times_each_phase_with_and_without_routes_and_counts_their_bytes():
    out = run("bench_routes.py", "--hidden", "32", "--layers", "2", "--prompts", "2", "--samples", "2",
              "--prompt-tokens", "4", "--new-tokens", "4", "--repeats", "1")
    for phase in ("generate", "score", "update"):
        assert number(phase, out) > 0
    # 2 layers x top-2 x 2 bytes = 8 a position, over 4 episodes x (4 + 4) positions
    assert re.search(r"^bytes\s+routes 256 \(8 a position\)", out, re.MULTILINE), out


def test_bench_agents_times_the_endpoint_against_the_engine_and_they_make_the_same_tokens():
    pytest.importorskip("openai")
    out = run("bench_agents.py", "--episodes", "4", "--calls", "2", "--new-tokens", "4", "--repeats", "1")
    assert number("direct", out) > 0 and number("endpoint", out) > 0 and number("ratio", out) > 0
    assert re.search(r"\(8 calls in \d engine batches\)", out) and "same tokens True" in out, out
