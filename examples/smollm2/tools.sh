#!/usr/bin/env bash
# Tool use on the real model: SmolLM2-135M-Instruct is offered a `multiply(a, b)` tool (tools_env.py) for products
# of two two-digit numbers, which it cannot work out in its head. The base model, the model after a short SFT on
# tool-calling conversations (tools_sft.yaml) and after multi-turn GRPO with the tool (tools_grpo.yaml) are each
# evaluated greedy on 200 held-out products: accuracy, and the share of episodes that call the tool.
#
#     bash examples/smollm2/run.sh [WORK_DIR]        # or just: python examples/smollm2/prepare.py WORK_DIR (the model)
#     bash examples/smollm2/tools.sh [WORK_DIR]      # (default: runs/smollm2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
[ -e "$WORK/model/config.json" ] || {
  echo "tools.sh: $WORK/model is missing: run python examples/smollm2/prepare.py $WORK first" >&2; exit 2; }
T="$WORK/tools"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
EVAL=(data.path="$T/train.jsonl" data.eval_path="$T/eval.jsonl")

python "$HERE/tools_prepare.py" "$WORK"
rm -rf "$T/eval-base" "$T/eval-sft" "$T/eval-grpo"
tidyrl eval "$HERE/tools_grpo.yaml" "${EVAL[@]}" --model "$WORK/model" --output-dir "$T/eval-base"
tidyrl train "$HERE/tools_sft.yaml" model="$WORK/model" data.path="$T/sft.jsonl" output_dir="$T/sft"
tidyrl eval "$HERE/tools_grpo.yaml" "${EVAL[@]}" --model "$T/sft/final" --output-dir "$T/eval-sft"
# the held-out prompts are scored by the evaluation below, not again at the run's end
tidyrl train "$HERE/tools_grpo.yaml" model="$T/sft/final" data.path="$T/train.jsonl" data.eval_path=null \
    output_dir="$T/grpo"
tidyrl eval "$HERE/tools_grpo.yaml" "${EVAL[@]}" --model "$T/grpo/final" --output-dir "$T/eval-grpo"

python "$HERE/tools_env.py" "$T/eval-base" "$T/eval-sft" "$T/eval-grpo"
echo "SFT against the base model:"
python "$HERE/compare.py" "$T/eval-base" "$T/eval-sft"
echo "GRPO against SFT:"
python "$HERE/compare.py" "$T/eval-sft" "$T/eval-grpo"
