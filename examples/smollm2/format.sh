#!/usr/bin/env bash
# A task the model starts at 0 on, and what it takes: the answer must be in \boxed{} (boxed.yaml, rewards.py:boxed),
# a format SmolLM2-135M-Instruct never writes. GRPO from the base model has nothing to learn from (every sample
# scores 0, so every group's advantages are 0); SFT on a small chat set of worked answers in the format
# (sft.yaml, boxed/sft.jsonl) teaches it; GRPO from the SFT model follows, at 1e-5 and 3e-6. Held-out greedy
# accuracy after each step, by `tidyrl eval` (README.md has the figures).
#
#     bash examples/smollm2/run.sh [WORK_DIR]        # first: the model and the task files (prepare.py)
#     bash examples/smollm2/format.sh [WORK_DIR]     # (default: runs/smollm2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
[ -e "$WORK/boxed/sft.jsonl" ] || python "$HERE/prepare.py" "$WORK"
DATA=(data.path="$WORK/boxed/train.jsonl" data.eval_path="$WORK/boxed/eval.jsonl")

rm -rf "$WORK"/eval-boxed-{base,grpo-from-base,sft,sft-grpo,sft-grpo-lr3e-6}
tidyrl eval "$HERE/boxed.yaml" model="$WORK/model" "${DATA[@]}" --output-dir "$WORK/eval-boxed-base"
# GRPO from the base model, as a user would try first: no sample is right, nothing moves
tidyrl train "$HERE/boxed.yaml" model="$WORK/model" "${DATA[@]}" output_dir="$WORK/boxed-grpo-from-base"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo-from-base/final" \
  --output-dir "$WORK/eval-boxed-grpo-from-base"
# SFT first, then GRPO from the SFT model
tidyrl train "$HERE/sft.yaml" model="$WORK/model" data.path="$WORK/boxed/sft.jsonl" output_dir="$WORK/sft"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/sft/final" --output-dir "$WORK/eval-boxed-sft"
tidyrl train "$HERE/boxed.yaml" model="$WORK/sft/final" "${DATA[@]}" output_dir="$WORK/boxed-grpo"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo/final" --output-dir "$WORK/eval-boxed-sft-grpo"
tidyrl train "$HERE/boxed.yaml" model="$WORK/sft/final" "${DATA[@]}" train.learning_rate=3e-6 \
  output_dir="$WORK/boxed-grpo-lr3e-6"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo-lr3e-6/final" \
  --output-dir "$WORK/eval-boxed-sft-grpo-lr3e-6"

echo "GRPO from the base model:";  python "$HERE/compare.py" "$WORK/eval-boxed-base" "$WORK/eval-boxed-grpo-from-base"
echo "SFT:";                       python "$HERE/compare.py" "$WORK/eval-boxed-base" "$WORK/eval-boxed-sft"
echo "GRPO after SFT:";            python "$HERE/compare.py" "$WORK/eval-boxed-sft" "$WORK/eval-boxed-sft-grpo"
echo "GRPO after SFT, at 3e-6:";   python "$HERE/compare.py" "$WORK/eval-boxed-sft" "$WORK/eval-boxed-sft-grpo-lr3e-6"
