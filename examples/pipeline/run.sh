#!/usr/bin/env bash
# SFT -> reward model -> GRPO on a tiny model built locally; each stage starts from the previous stage's final/.
# A few minutes on a laptop CPU. Run from anywhere:
#
#     bash examples/pipeline/run.sh [WORK_DIR]        (default: runs/pipeline)
#
# Each `tidyrl train` line is what you would type; the key=value overrides point the stage at WORK_DIR.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/pipeline}"

python "$HERE/prepare.py" "$WORK"
tidyrl train "$HERE/sft.yaml" model="$WORK/base-model" data.path="$WORK/sft.jsonl" output_dir="$WORK/sft"
tidyrl train "$HERE/reward.yaml" model="$WORK/sft/final" data.path="$WORK/preferences.jsonl" output_dir="$WORK/reward"
tidyrl train "$HERE/grpo.yaml" model="$WORK/sft/final" data.path="$WORK/prompts.jsonl" output_dir="$WORK/grpo" rewards.1.model="$WORK/reward/final"
