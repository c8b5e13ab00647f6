#!/usr/bin/env bash
# The small sweep that chose boxed.yaml's settings: GRPO from the SFT model at SmolLM2's learning rate (1e-5) and at
# 1e-6, each with and without dynamic sampling (rollout.dynamic_sampling: groups whose samples all score alike are
# dropped and replaced, so that every rollout has a signal). Held-out greedy accuracy of each, against the SFT model's
# (README.md has the figures).
#
#     bash examples/gemma3/run.sh [WORK_DIR]      # first: the model, the task and the SFT model
#     bash examples/gemma3/sweep.sh [WORK_DIR]    # (default: runs/gemma3)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/gemma3}"
DATA=(data.path="$WORK/boxed/train.jsonl" data.eval_path="$WORK/boxed/eval.jsonl")
for lr in 1e-5 1e-6; do
  for dynamic in false true; do
    name="grpo-lr$lr$([ "$dynamic" = true ] && echo -dynamic || true)"
    tidyrl train "$HERE/boxed.yaml" model="$WORK/sft/final" "${DATA[@]}" train.learning_rate="$lr" \
      rollout.dynamic_sampling="$dynamic" output_dir="$WORK/$name"
    tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/$name/final" --output-dir "$WORK/eval-$name"
    echo "$name:"; python "$HERE/../smollm2/compare.py" "$WORK/eval-sft" "$WORK/eval-$name"
  done
done
