#!/usr/bin/env bash
# Gemma 3 270M (base) on the boxed arithmetic: held-out greedy accuracy of the base model, after SFT into the format,
# and after GRPO from the SFT model, by `tidyrl eval` (README.md has the figures).
#
#     bash examples/gemma3/run.sh [WORK_DIR]        # (default: runs/gemma3)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/gemma3}"
[ -e "$WORK/boxed/sft.jsonl" ] || python "$HERE/prepare.py" "$WORK"
DATA=(data.path="$WORK/boxed/train.jsonl" data.eval_path="$WORK/boxed/eval.jsonl")
COMPARE="$HERE/../smollm2/compare.py"

rm -rf "$WORK"/eval-{base,sft,sft-grpo}
tidyrl eval "$HERE/boxed.yaml" model="$WORK/model" "${DATA[@]}" --output-dir "$WORK/eval-base"
tidyrl train "$HERE/sft.yaml" model="$WORK/model" data.path="$WORK/boxed/sft.jsonl" output_dir="$WORK/sft"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/sft/final" --output-dir "$WORK/eval-sft"
tidyrl train "$HERE/boxed.yaml" model="$WORK/sft/final" "${DATA[@]}" output_dir="$WORK/boxed-grpo"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo/final" --output-dir "$WORK/eval-sft-grpo"

echo "SFT:";             python "$COMPARE" "$WORK/eval-base" "$WORK/eval-sft"
echo "GRPO after SFT:";  python "$COMPARE" "$WORK/eval-sft" "$WORK/eval-sft-grpo"
