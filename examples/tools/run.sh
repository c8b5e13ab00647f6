#!/usr/bin/env bash
# Tool use that learns on a CPU: a tiny model with a byte-level tokenizer learns the tool-call format by SFT,
# then multi-turn GRPO with a ToolEnvironment (multiply, capital) teaches it to call the tools where only a
# call can find the answer (docs/environments.md).
#
#     bash examples/tools/run.sh [WORK_DIR]        (default: runs/tools)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/tools}"

python "$HERE/prepare.py" "$WORK"
tidyrl train "$HERE/sft.yaml" model="$WORK/base-model" data.path="$WORK/sft.jsonl" output_dir="$WORK/sft"
tidyrl train "$HERE/grpo.yaml" model="$WORK/sft/final" data.path="$WORK/tasks.jsonl" output_dir="$WORK/grpo"
