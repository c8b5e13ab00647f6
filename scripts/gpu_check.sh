#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md in one call, at most BUDGET seconds (470: under 8 minutes) on one H100/H200:
#
#   scripts/gpu_check.sh [OUT_DIR]          # OUT_DIR: logs and the summary (default $OUT, else ./gpu-check-out)
#   DEVICE=cpu BUDGET=600 SUITE_PATHS=tests/test_launch.py scripts/gpu_check.sh /tmp/x   # its logic on a CPU
#                                           (tiny shapes, one test file instead of the suite)
#
# Each part runs under its own time limit, cut to one overall deadline, so that one hang does not eat the rest:
#   - first, alone on the GPU: the CUDA tests (pytest -m cuda); then in the background, on cores of their own, the
#     rest of the suite with the GPU visible (pytest -n, pytest-xdist; its runs pin themselves to the CPU,
#     tests/conftest.py);
#   - in the foreground, most wanted first: bench_passes.py on qwen0.5b (each layout of the training forward and
#     TRL's, scoring chunk and update micro-batch, on new shapes too, with a profile); bench_vs_trl.py on qwen0.5b and
#     qwen1.5b, tidyrl beside TRL (LIBS, by default tidyrl,trl-liger,trl; the libraries run in that order, so that a
#     cut part still has the first); one --profile rollout of tidyrl on qwen0.5b (split by phase); bench_passes.py on
#     qwen1.5b; bench_decode.py on qwen0.5b (lean decode vs the model's forward, one profiled generate); bench_lag.py
#     (rollout.lag 0 vs 1 with the in-process engine).
# Prints one summary at the end (the tables) and leaves every log in OUT_DIR/logs.tgz (the profiles' tables too).
# TRL is taken where it is importable (pip install trl==1.16.0; without it the benchmarks run tidyrl alone).
# PARTS, LIBS, LIBS15, SET05, SET15, PASSES_ARGS, TEST_PATHS, CUDA_TESTS_ARGS, RUN_TIMEOUT, BUDGET choose what a call
# runs (see below).
# On a machine without registry access, TRL and Liger Kernel travel as wheels (pip download them where pip works):
#   pip install --no-index --no-deps --target /tmp/site WHEELS/*.whl && PYTHONPATH=/tmp/site scripts/gpu_check.sh OUT
#   (trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 liger-kernel==0.8.5: 2.7 MB)
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu-check-out}}
mkdir -p "$OUT_DIR"
LOGS=$(mktemp -d /tmp/gpu_check_logs.XXXX)
WORK=$(mktemp -d /tmp/gpu_check_work.XXXX)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
BUDGET=${BUDGET:-470}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
SUMMARY="$LOGS/summary.txt"

# Cores: the tests get the last 6 where there are 12 or more, the benchmarks the rest.
NCPU=$(nproc)
if [ "$NCPU" -ge 12 ] && command -v taskset >/dev/null; then
  BENCH_CORES="0-$((NCPU - 7))"; TEST_CORES="$((NCPU - 6))-$((NCPU - 1))"; WORKERS=6
else
  BENCH_CORES=""; TEST_CORES=""; WORKERS=2
fi

log() { echo "[$(date +%T) +$(($(date +%s) - START))s] $*" | tee -a "$SUMMARY"; }

# part NAME LIMIT CORES CMD...: CMD under `timeout`, at most LIMIT seconds and never past the deadline (less 10 s
# for the summary); its output in logs/NAME.log.
part() {
  local name=$1 limit=$2 cores=$3
  shift 3
  local left=$((DEADLINE - $(date +%s) - 10))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then log "$name: skipped (no time left)"; return 124; fi
  [ -n "$cores" ] && set -- taskset -c "$cores" "$@"
  local t0
  t0=$(date +%s)
  timeout -s INT -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1  # (SIGINT: pytest still prints what failed so far)
  local rc=$?
  log "$name: exit $rc after $(($(date +%s) - t0)) s (limit $limit s)"
  return $rc
}

{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -3
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else ''); print('transformers', transformers.__version__)"
  $PY -c "import trl; print('trl', trl.__version__)" 2>&1 | tail -1
  echo "cores $NCPU: benchmarks on '${BENCH_CORES:-all}', tests on '${TEST_CORES:-all}' with $WORKERS workers"
} 2>&1 | tee -a "$SUMMARY"

PARTS=${PARTS:-"tests passes05 vs05 vs15 profile passes15 decode lag"}  # which parts run (all by default;
# "cudatests" for the CUDA tests without the rest of the suite)
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
LIBS=${LIBS:-tidyrl,trl-liger,trl}  # bench_vs_trl's --libraries (trl-liger, TRL with Liger's kernels, is left out
# where liger-kernel is not installed; add e.g. tidyrl-eager-layers, tidyrl-lean)
TEST_PATHS=${TEST_PATHS:-}                         # the suite's paths (default: all of tests/)

# ---- the tests, in the background on their own cores
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n $WORKERS"
PTIMEOUT=""
$PY -c "import pytest_timeout" 2>/dev/null && PTIMEOUT="--timeout 240"
TESTS=""
# the CUDA tests first, alone on the GPU (they would share it with the benchmarks' timings); with "tests" (not with
# "cudatests") then the rest of the suite in the background, on the CPU (its runs pin themselves there) and cores of
# its own
if has tests || has cudatests; then
  part cuda-tests ${CUDA_TESTS_LIMIT:-150} "$TEST_CORES" $PY -m pytest -q -m cuda tests/test_cuda.py -rfEs -p no:cacheprovider \
    ${CUDA_TESTS_ARGS:-}  # (e.g. CUDA_TESTS_ARGS="-k layer_kernels": some of them)
fi
if has tests; then
  (
    part suite 600 "$TEST_CORES" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $PY -m pytest -q $XDIST $PTIMEOUT \
      -m "not slow and not cuda" -rfEs -p no:cacheprovider ${SUITE_PATHS:-$TEST_PATHS}
  ) &
  TESTS=$!
fi

# ---- the benchmarks, in the foreground, most wanted first (a part the deadline cuts is cut short or skipped)
if [ "$DEVICE" = cuda ]; then
  W05=qwen0.5b; W15=qwen1.5b; SET05=${SET05:-"--steps 2"}; SET15=${SET15:-"--steps 1"}; PSET=""
else  # the logic on a CPU: the tiny workload twice, with KL on
  W05=tiny; W15=tiny; SET05="--set kl_coef=0.04,steps=2,warmup=1"; SET15="--set kl_coef=0.04,steps=1,warmup=1"
  PSET="--set kl_coef=0.04,warmup=1"
fi
PASSES_ARGS=${PASSES_ARGS:-"--repeats 3 --widths 3 --profile"}
DECODE_ARGS=${DECODE_ARGS:-"--dtype bfloat16 --repeats 2 --profile 16"}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}  # one library's run in bench_vs_trl, loading included (TRL's 0.5B run took 60-80 s,
# its 1.5B run under 110 s): a run that hangs is killed and reported, the next library still runs
# the shipped default end to end beside TRL (and what LIBS adds), most wanted first
has vs05 && part vs-trl-$W05 ${VS05_LIMIT:-170} "$BENCH_CORES" $PY benchmarks/bench_vs_trl.py --device $DEVICE \
  --workload $W05 --libraries $LIBS --repeats 1 $SET05 --run-timeout $RUN_TIMEOUT --keep "$WORK/vs05"
rm -rf "$WORK"/vs05/*/model
# each layout of the training forward and TRL's pass, in one process, with a profile
has passes05 && part passes-$W05 ${PASSES_LIMIT:-90} "$BENCH_CORES" $PY benchmarks/bench_passes.py --device $DEVICE \
  --workload $W05 $PASSES_ARGS
has vs15 && part vs-trl-$W15-b ${VS15_LIMIT:-150} "$BENCH_CORES" $PY benchmarks/bench_vs_trl.py --device $DEVICE \
  --workload $W15 --libraries ${LIBS15:-$LIBS} --repeats 1 $SET15 --run-timeout $RUN_TIMEOUT --keep "$WORK/vs15"
rm -rf "$WORK"/vs15/*/model
# where generation's time goes: the lean decode step against the model's forward, one profiled generate
has decode && part decode-$W05 ${DECODE_LIMIT:-60} "$BENCH_CORES" $PY benchmarks/bench_decode.py --workload $W05 \
  --device $DEVICE $DECODE_ARGS
# generation beside training: lag 0 vs 1, the in-process engine, on the GPU
has lag && part lag ${LAG_LIMIT:-90} "$BENCH_CORES" $PY benchmarks/bench_lag.py --device $DEVICE \
  --hidden ${LAG_HIDDEN:-1024} --layers ${LAG_LAYERS:-8} --lags ${LAGS:-0,1} --rollouts ${LAG_ROLLOUTS:-6}
has profile && part profile-$W05 ${PROFILE_LIMIT:-60} "$BENCH_CORES" $PY benchmarks/bench_vs_trl.py --device $DEVICE --workload $W05 \
  --libraries ${PROFILE_LIBS:-tidyrl} --repeats 1 --profile $PSET --keep "$WORK/prof"
rm -rf "$WORK"/prof/*/model
has passes15 && part passes-$W15 60 "$BENCH_CORES" $PY benchmarks/bench_passes.py --device $DEVICE --workload $W15 \
  --repeats 3
# not by default: host memory while a policy and its reference load, per way of placing them (PARTS="... loading")
has loading && part loading ${LOADING_LIMIT:-90} "$BENCH_CORES" $PY benchmarks/bench_loading.py --device $DEVICE
# not by default: where long shared prompts make running each prompt once pay (PARTS="... passeslong")
# (PROMPT_WIDTHS="64 128 256 512": where the lean pass starts to win, models.forward.LEAN_FROM_SHARE's threshold)
if has passeslong; then
  for width in ${PROMPT_WIDTHS:-512}; do
    part passes-long-$W05-$width 60 "$BENCH_CORES" $PY benchmarks/bench_passes.py --device $DEVICE \
      --workload $W05 --repeats 3 --passes lean,onepass,trl --prompt-width $width
  done
fi

[ -n "$TESTS" ] && wait $TESTS  # (its parts end by the deadline: their limits are cut to it)

# ---- the summary: the tables, then the tests' results
{
  echo
  echo "================================ SUMMARY ($(($(date +%s) - START)) s) ================================"
  for f in "$LOGS"/passes-*.log; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .log)"
    grep -E "^(== |-- |pass |lean |shared |onepass[ -]|trl )|^  profile |^ +[0-9.]+% " "$f" | cut -c1-220
  done
  for f in "$LOGS"/decode-*.log "$LOGS"/lag.log "$LOGS"/loading.log; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .log)"
    grep -vE "Warning|warn\(|USDT|given up|^\s*$" "$f" | tail -24 | cut -c1-160
    grep -E "given up" "$f" | head -2 | cut -c1-300  # (once, whether or not the tail above reaches it)
  done
  for f in "$LOGS"/vs-trl-*.log "$LOGS"/profile-*.log; do
    [ -f "$f" ] || continue
    echo "--- $(basename "$f" .log)"
    grep -E "GEMM peak \(|run [0-9]+/[0-9]+:|given up|^  profile |^    (generate|score|update): |^ {6} *[0-9.]+% |^    update memory: |^ {6} *[0-9.]+ MiB " "$f" | cut -c1-300
    sed -n '/^== /,$p' "$f" | grep -vE "Warning|warn\(|^\s*$" | cut -c1-160
    grep -E "Error|Traceback" "$f" | head -5
  done
  for name in cuda-tests suite; do
    [ -f "$LOGS/$name.log" ] || continue
    echo "--- $name"
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$LOGS/$name.log" | cut -c1-220 | tail -25
  done
  echo "--- parts"
  cat "$SUMMARY" | grep -E "exit|skipped"
} > "$LOGS/tables.txt" 2>&1
cat "$LOGS/tables.txt"
for d in vs05 vs15 prof; do  # the children's logs and profile tables
  for f in "$WORK"/$d/*/*/child.log "$WORK"/$d/*/*/profile.txt "$WORK"/$d/*/*/profile.json; do
    [ -f "$f" ] && cp "$f" "$LOGS/$d-$(basename "$(dirname "$f")")-$(basename "$f")"
  done
done
tar -czf "$OUT_DIR/logs.tgz" -C "$LOGS" . && cp "$LOGS/tables.txt" "$OUT_DIR/tables.txt"
rm -rf "$WORK"
