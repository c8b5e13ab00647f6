#!/usr/bin/env bash
# GRPO after SFT on the \boxed{} task, four ways past few informative groups (README.md has the figures): from the
# SFT model of format.sh, a KL anchor to it, 4x the prompts a rollout, dynamic sampling; and SFT on half the
# problems (boxed/sft_half.jsonl) with GRPO on the other half's prompts (boxed/train_other_half.jsonl), which SFT
# never saw. Held-out greedy accuracy of each by `tidyrl eval`, compared with the model it started from.
#
#     bash examples/smollm2/format.sh [WORK_DIR]     # first: the SFT model (WORK_DIR/sft/final)
#     bash examples/smollm2/after_sft.sh [WORK_DIR]  # (default: runs/smollm2)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
[ -e "$WORK/sft/final" ] || { echo "no $WORK/sft/final: run format.sh $WORK first" >&2; exit 2; }
[ -e "$WORK/boxed/sft_half.jsonl" ] || python "$HERE/prepare.py" "$WORK"
DATA=(data.path="$WORK/boxed/train.jsonl" data.eval_path="$WORK/boxed/eval.jsonl")
[ -e "$WORK/eval-boxed-sft/eval.json" ] || \
  tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/sft/final" --output-dir "$WORK/eval-boxed-sft"

# grpo NAME OVERRIDES...: GRPO from the SFT model with the overrides, then its evaluation
grpo() {
  local name=$1
  shift
  rm -rf "$WORK/boxed-grpo-$name" "$WORK/eval-boxed-sft-grpo-$name"
  tidyrl train "$HERE/boxed.yaml" model="$WORK/sft/final" "${DATA[@]}" "$@" output_dir="$WORK/boxed-grpo-$name"
  tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo-$name/final" \
    --output-dir "$WORK/eval-boxed-sft-grpo-$name"
}
grpo kl grpo.kl_coef=0.1
grpo p16 rollout.prompts_per_rollout=16
grpo dyn rollout.dynamic_sampling=true rollout.max_sampling_rounds=6

# SFT on half the problems, GRPO on the other half's prompts
rm -rf "$WORK"/{sft-half,boxed-grpo-fresh,eval-boxed-sft-half,eval-boxed-sft-half-grpo-fresh}
tidyrl train "$HERE/sft.yaml" model="$WORK/model" data.path="$WORK/boxed/sft_half.jsonl" output_dir="$WORK/sft-half"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/sft-half/final" --output-dir "$WORK/eval-boxed-sft-half"
tidyrl train "$HERE/boxed.yaml" model="$WORK/sft-half/final" data.path="$WORK/boxed/train_other_half.jsonl" \
  data.eval_path="$WORK/boxed/eval.jsonl" output_dir="$WORK/boxed-grpo-fresh"
tidyrl eval "$HERE/boxed.yaml" "${DATA[@]}" --model "$WORK/boxed-grpo-fresh/final" \
  --output-dir "$WORK/eval-boxed-sft-half-grpo-fresh"

for name in kl p16 dyn; do
  echo "GRPO after SFT, $name:"; python "$HERE/compare.py" "$WORK/eval-boxed-sft" "$WORK/eval-boxed-sft-grpo-$name"
done
echo "SFT on half the problems:"; python "$HERE/compare.py" "$WORK/eval-boxed-base" "$WORK/eval-boxed-sft-half"
echo "GRPO on the other half's prompts:"
python "$HERE/compare.py" "$WORK/eval-boxed-sft-half" "$WORK/eval-boxed-sft-half-grpo-fresh"
