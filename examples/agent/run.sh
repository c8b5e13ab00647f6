#!/usr/bin/env bash
# An agent trained unchanged: a tiny model learns the tool-call format by SFT, then GRPO trains it through an
# agent written only against the openai client (calculator_agent.py), served by tidyrl's endpoint
# (docs/agents.md). Needs the openai client: pip install "tidyrl[agents]".
#
#     bash examples/agent/run.sh [WORK_DIR]        (default: runs/agent)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/agent}"

python "$HERE/prepare.py" "$WORK"
tidyrl train "$HERE/sft.yaml" model="$WORK/base-model" data.path="$WORK/sft.jsonl" output_dir="$WORK/sft"
tidyrl train "$HERE/grpo.yaml" model="$WORK/sft/final" data.path="$WORK/tasks.jsonl" output_dir="$WORK/grpo"
