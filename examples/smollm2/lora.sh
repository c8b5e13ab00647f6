#!/usr/bin/env bash
# LoRA for RL on the real model: the GRPO run of run.sh (12 rollouts) with a LoRA adapter on every linear layer
# (the MLP included) of the ranks and at the learning rates given (by default rank 1 and rank 16, each at 10x and 100x
# full fine-tuning's 1e-5), against full fine-tuning's greedy held-out accuracy (docs/memory.md has the sweep and the
# advice).
#
#     bash examples/smollm2/run.sh [WORK_DIR]       # first: the model, the task, the base model's evaluation
#     bash examples/smollm2/lora.sh [WORK_DIR] [RANK:LR ...]   # default: 1:1e-4 1:1e-3 16:1e-4 16:1e-3
#
# Each run writes WORK_DIR/lora-r<RANK>-lr<LR>/ and its evaluation WORK_DIR/eval-lora-r<RANK>-lr<LR>/; full fine-tuning
# at the same length is WORK_DIR/grpo12/ (made here if missing). RANK `full` is full fine-tuning at another learning
# rate (WORK_DIR/full-lr<LR>/). SEED (default 0) is the run's seed; another seed writes <name>-seed<SEED>/.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(1:1e-4 1:1e-3 16:1e-4 16:1e-3)
[ -e "$WORK/eval-before" ] || { echo "lora.sh: $WORK/eval-before is missing: run bash examples/smollm2/run.sh $WORK first" >&2; exit 2; }
SETTINGS=(model="$WORK/model" data.path="$WORK/train.jsonl" data.eval_path="$WORK/eval.jsonl" train.rollouts=12)
SEED="${SEED:-0}"
SUFFIX=""
[ "$SEED" = 0 ] || SUFFIX="-seed$SEED"

name_of() {  # RANK:LR -> the run's folder name
  local rank="${1%%:*}" lr="${1##*:}"
  if [ "$rank" = full ]; then echo "full-lr$lr$SUFFIX"; else echo "lora-r$rank-lr$lr$SUFFIX"; fi
}

if [ ! -e "$WORK/eval-grpo12" ]; then
  tidyrl train "$HERE/grpo.yaml" "${SETTINGS[@]}" output_dir="$WORK/grpo12"
  tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --model "$WORK/grpo12/final" --output-dir "$WORK/eval-grpo12"
fi
for run in "${RUNS[@]}"; do
  rank="${run%%:*}" lr="${run##*:}" name="$(name_of "$run")"
  adapter=(lora.enabled=true lora.r="$rank")
  [ "$rank" != full ] || adapter=()
  rm -rf "$WORK/eval-$name"
  tidyrl train "$HERE/grpo.yaml" "${SETTINGS[@]}" output_dir="$WORK/$name" "${adapter[@]}" \
    train.learning_rate="$lr" seed="$SEED"
  tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --model "$WORK/$name/final" --output-dir "$WORK/eval-$name"
done
for run in "${RUNS[@]}"; do
  rank="${run%%:*}" lr="${run##*:}" name="$(name_of "$run")"
  echo "$name (rank $rank, lr $lr, seed $SEED) against full fine-tuning (lr 1e-5, seed 0), both 12 rollouts:"
  python "$HERE/compare.py" "$WORK/eval-grpo12" "$WORK/eval-$name"
  grep -h '"time_s"' "$WORK/$name/metrics.jsonl" | tail -1 | python -c \
    "import json, sys; print(f\"  wall time {json.loads(sys.stdin.read())['time_s']:.0f} s\")"
done
