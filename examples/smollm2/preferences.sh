#!/usr/bin/env bash
# Preference stages on the real model, from its own answers: the base model samples 4 answers to each training
# prompt (`tidyrl eval --sampled`), pairs.py pairs a right one with a wrong one, and
#   - DPO (dpo.yaml) tunes the base model on the pairs;
#   - a reward model (reward.yaml) learns to order them, and PPO (ppo.yaml) trains the base model on its scores alone.
# Each trained model's greedy held-out accuracy is measured by `tidyrl eval` against the base model's
# (README.md has the figures).
#
#     bash examples/smollm2/run.sh [WORK_DIR]             # first: the model, the task, the base model's evaluation
#     bash examples/smollm2/preferences.sh [WORK_DIR]     # (default: runs/smollm2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
[ -e "$WORK/eval-before" ] || { echo "preferences.sh: $WORK/eval-before is missing: run bash examples/smollm2/run.sh $WORK first" >&2; exit 2; }
TASK=(model="$WORK/model" data.path="$WORK/train.jsonl" data.eval_path="$WORK/eval.jsonl")
PAIRS=(model="$WORK/model" data.path="$WORK/pairs.jsonl")

rm -rf "$WORK"/{samples-base,eval-dpo,eval-ppo}
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" --data "$WORK/train.jsonl" --num-prompts all --sampled \
  --samples-per-prompt 4 --output-dir "$WORK/samples-base"
python "$HERE/pairs.py" "$WORK/samples-base" "$WORK/pairs.jsonl"
tidyrl train "$HERE/dpo.yaml" "${PAIRS[@]}" output_dir="$WORK/dpo"
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" --model "$WORK/dpo/final" --output-dir "$WORK/eval-dpo"
tidyrl train "$HERE/reward.yaml" "${PAIRS[@]}" output_dir="$WORK/reward"
tidyrl train "$HERE/ppo.yaml" "${TASK[@]}" rewards.0.model="$WORK/reward/final" output_dir="$WORK/ppo"
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" --model "$WORK/ppo/final" --output-dir "$WORK/eval-ppo"

echo "DPO:";                       python "$HERE/compare.py" "$WORK/eval-before" "$WORK/eval-dpo"
echo "reward model, then PPO:";    python "$HERE/compare.py" "$WORK/eval-before" "$WORK/eval-ppo"
