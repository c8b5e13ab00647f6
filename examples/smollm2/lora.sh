#!/usr/bin/env bash
# LoRA for RL on the real model: the GRPO run of run.sh (12 rollouts) with a LoRA adapter on every linear layer
# (the MLP included) of rank 1 and of rank 16, each at 10x and 100x full fine-tuning's learning rate (1e-5), against
# full fine-tuning's greedy held-out accuracy (docs/memory.md has the figures and the advice).
#
#     bash examples/smollm2/run.sh [WORK_DIR]       # first: the model, the task, the base model's evaluation
#     bash examples/smollm2/lora.sh [WORK_DIR] [RANK:LR ...]   # default: 1:1e-4 1:1e-3 16:1e-4 16:1e-3
#
# Each run writes WORK_DIR/lora-r<RANK>-lr<LR>/ and its evaluation WORK_DIR/eval-lora-r<RANK>-lr<LR>/; full fine-tuning
# at the same length is WORK_DIR/grpo12/ (made here if missing).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
shift || true
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=(1:1e-4 1:1e-3 16:1e-4 16:1e-3)
[ -e "$WORK/eval-before" ] || { echo "lora.sh: $WORK/eval-before is missing: run bash examples/smollm2/run.sh $WORK first" >&2; exit 2; }
SETTINGS=(model="$WORK/model" data.path="$WORK/train.jsonl" data.eval_path="$WORK/eval.jsonl" train.rollouts=12)

if [ ! -e "$WORK/eval-grpo12" ]; then
  tidyrl train "$HERE/grpo.yaml" "${SETTINGS[@]}" output_dir="$WORK/grpo12"
  tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --model "$WORK/grpo12/final" --output-dir "$WORK/eval-grpo12"
fi
for run in "${RUNS[@]}"; do
  rank="${run%%:*}" lr="${run##*:}"
  name="lora-r$rank-lr$lr"
  rm -rf "$WORK/eval-$name"
  tidyrl train "$HERE/grpo.yaml" "${SETTINGS[@]}" output_dir="$WORK/$name" lora.enabled=true lora.r="$rank" \
    train.learning_rate="$lr"
  tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --model "$WORK/$name/final" --output-dir "$WORK/eval-$name"
done
for run in "${RUNS[@]}"; do
  rank="${run%%:*}" lr="${run##*:}"
  echo "LoRA r=$rank, lr $lr, against full fine-tuning (lr 1e-5), both 12 rollouts:"
  python "$HERE/compare.py" "$WORK/eval-grpo12" "$WORK/eval-lora-r$rank-lr$lr"
  grep -h '"time_s"' "$WORK/lora-r$rank-lr$lr/metrics.jsonl" | tail -1 | python -c \
    "import json, sys; print(f\"  wall time {json.loads(sys.stdin.read())['time_s']:.0f} s\")"
done
