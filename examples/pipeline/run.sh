#!/usr/bin/env bash
# SFT -> reward model -> GRPO, and SFT -> SimPO, on a tiny model built locally; each stage starts from the previous
# stage's final/.
# A few minutes on a laptop CPU (WITH_PPO=1 adds a PPO stage, about two minutes more). Run from anywhere:
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
tidyrl train "$HERE/simpo.yaml" model="$WORK/sft/final" data.path="$WORK/preferences.jsonl" output_dir="$WORK/simpo"
tidyrl train "$HERE/grpo.yaml" model="$WORK/sft/final" data.path="$WORK/prompts.jsonl" output_dir="$WORK/grpo" rewards.1.model="$WORK/reward/final"

# PPO from the same SFT model: the reward model scores the completions and its backbone starts the critic.
if [ "${WITH_PPO:-0}" = 1 ]; then
  tidyrl train "$HERE/ppo.yaml" model="$WORK/sft/final" data.path="$WORK/prompts.jsonl" output_dir="$WORK/ppo" rewards.1.model="$WORK/reward/final"
fi
