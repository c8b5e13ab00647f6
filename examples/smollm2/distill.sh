#!/usr/bin/env bash
# On-policy distillation on the real model: the untrained SmolLM2-135M-Instruct (the student) learns from the
# GRPO-trained one that run.sh makes (the teacher, WORK_DIR/grpo/final), on the same prompts; the student's greedy
# held-out accuracy is measured with `tidyrl eval` and compared with the base model's and the teacher's.
#
#     bash examples/smollm2/run.sh [WORK_DIR]          # first: the model, the task, the teacher, both evaluations
#     bash examples/smollm2/distill.sh [WORK_DIR]      # (default: runs/smollm2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
for need in "$WORK/grpo/final" "$WORK/eval-before" "$WORK/eval-after"; do
  [ -e "$need" ] || { echo "distill.sh: $need is missing: run bash examples/smollm2/run.sh $WORK first" >&2; exit 2; }
done
SETTINGS=(model="$WORK/model" teacher.model="$WORK/grpo/final" data.path="$WORK/train.jsonl"
          data.eval_path="$WORK/eval.jsonl")

rm -rf "$WORK/eval-distill"
tidyrl train "$HERE/distill.yaml" "${SETTINGS[@]}" output_dir="$WORK/distill"
tidyrl eval "$HERE/distill.yaml" "${SETTINGS[@]}" --model "$WORK/distill/final" --output-dir "$WORK/eval-distill"
echo "the student against the base model:"
python "$HERE/compare.py" "$WORK/eval-before" "$WORK/eval-distill"
echo "the student against its teacher:"
python "$HERE/compare.py" "$WORK/eval-after" "$WORK/eval-distill"
