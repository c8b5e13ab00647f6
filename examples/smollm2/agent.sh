#!/usr/bin/env bash
# The tool task of tools.sh, trained through an agent written only against the openai client (agent.py), served by
# tidyrl's OpenAI-compatible endpoint (docs/agents.md): the base model, the model after tools.sh's SFT and after
# GRPO through the agent are each evaluated greedy on the 200 held-out products, through the agent too. Needs the
# openai client: pip install "tidyrl[agents]".
#
#     bash examples/smollm2/agent.sh [WORK_DIR]      # after prepare.py (the model); writes into WORK_DIR/agent/
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
[ -e "$WORK/model/config.json" ] || {
  echo "agent.sh: $WORK/model is missing: run python examples/smollm2/prepare.py $WORK first" >&2; exit 2; }
T="$WORK/tools"
A="$WORK/agent"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
EVAL=(data.path="$T/train.jsonl" data.eval_path="$T/eval.jsonl")

python "$HERE/tools_prepare.py" "$WORK"
rm -rf "$A/eval-base" "$A/eval-sft" "$A/eval-grpo"
tidyrl eval "$HERE/agent_grpo.yaml" "${EVAL[@]}" --model "$WORK/model" --output-dir "$A/eval-base"
[ -e "$T/sft/final/config.json" ] ||  # tools.sh's SFT, the same conversations
  tidyrl train "$HERE/tools_sft.yaml" model="$WORK/model" data.path="$T/sft.jsonl" output_dir="$T/sft"
tidyrl eval "$HERE/agent_grpo.yaml" "${EVAL[@]}" --model "$T/sft/final" --output-dir "$A/eval-sft"
tidyrl train "$HERE/agent_grpo.yaml" model="$T/sft/final" data.path="$T/train.jsonl" data.eval_path=null \
    output_dir="$A/grpo"
tidyrl eval "$HERE/agent_grpo.yaml" "${EVAL[@]}" --model "$A/grpo/final" --output-dir "$A/eval-grpo"

python "$HERE/tools_env.py" "$A/eval-base" "$A/eval-sft" "$A/eval-grpo"
echo "GRPO through the agent against SFT:"
python "$HERE/compare.py" "$A/eval-sft" "$A/eval-grpo"
