#!/usr/bin/env bash
# A multi-turn tool-use task that learns on a CPU: a tiny model is taught to call a calculator (SFT), then
# trained against the calculator environment with GRPO, rewarded by its final answer (docs/environments.md).
#
#     bash examples/multiturn/run.sh [WORK_DIR]        (default: runs/multiturn; about 16 s)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/multiturn}"

python "$HERE/prepare.py" "$WORK"
tidyrl train "$HERE/sft.yaml" model="$WORK/base-model" data.path="$WORK/sft.jsonl" output_dir="$WORK/sft"
tidyrl train "$HERE/grpo.yaml" model="$WORK/sft/final" data.path="$WORK/tasks.jsonl" output_dir="$WORK/grpo"
