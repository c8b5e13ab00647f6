#!/usr/bin/env bash
# GRPO on two machines by hand: vLLM servers on host A, the tidyrl trainer on host B (README.md here).
#
#   host A:  SHARED=/nfs/me/tidyrl bash examples/two-nodes/run.sh server
#   host B:  SHARED=/nfs/me/tidyrl SERVER_HOST=host-a bash examples/two-nodes/run.sh trainer [key=value ...]
#
# Set the same variables on both hosts. Host B waits until every server answers GET /v1/models, then trains;
# host A's servers run until stopped (Ctrl-C). Extra key=value arguments of `trainer` override the config.
#
#   MODEL           hub id or folder, the same on both hosts (a folder: the same path)  [Qwen/Qwen2.5-1.5B-Instruct]
#   SHARED          a folder on a file system both hosts mount at the same path (required)
#   SERVER_HOST     host A's name or address as host B reaches it (trainer: required)
#   PORT            the first server's port; server i listens on PORT+i                 [8000]
#   NUM_SERVERS     servers (replicas) on host A                                        [1]
#   GPUS_PER_SERVER GPUs of each server: > 1 = vLLM's tensor parallelism               [1]
#                   (8 GPUs: NUM_SERVERS=8 GPUS_PER_SERVER=1, or NUM_SERVERS=1 GPUS_PER_SERVER=8, or 4 x 2, ...)
#   BIND            the address the servers listen on                                   [0.0.0.0]
#   BATCH_INVARIANT 1: the servers run vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT; CUDA)    [1]
#   DTYPE, MAX_MODEL_LEN  the servers' --dtype and --max-model-len (grpo-server.yaml's model_dtype and
#                   data.max_prompt_length + rollout.max_new_tokens)                   [bfloat16, 2048]
#   CONFIG          the trainer's config                                                [grpo-server.yaml here]
#   OUTPUT_DIR      the run's folder                                                    [$SHARED/runs/grpo-server]
#   WAIT_S          seconds the trainer waits for the servers to load the model         [1800]
#   PYTHON          the Python with tidyrl (host B) or vllm (host A)                    [python]
#   TRAINER_PROCS   training processes on host B (torchrun, one per GPU)                [1]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

MODEL="${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}"
SHARED="${SHARED:?set SHARED to a folder both hosts mount at the same path}"
PORT="${PORT:-8000}"
NUM_SERVERS="${NUM_SERVERS:-1}"
GPUS_PER_SERVER="${GPUS_PER_SERVER:-1}"
BIND="${BIND:-0.0.0.0}"
DTYPE="${DTYPE:-bfloat16}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-2048}"
CONFIG="${CONFIG:-$HERE/grpo-server.yaml}"
OUTPUT_DIR="${OUTPUT_DIR:-$SHARED/runs/grpo-server}"
WAIT_S="${WAIT_S:-1800}"
PYTHON="${PYTHON:-python}"

servers() {  # host A: NUM_SERVERS vLLM servers, each on its own GPUS_PER_SERVER GPUs; stops them all when one stops
  local i first gpus
  PIDS=()
  trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
  for ((i = 0; i < NUM_SERVERS; i++)); do
    first=$((i * GPUS_PER_SERVER))
    gpus="$(seq -s, "$first" $((first + GPUS_PER_SERVER - 1)))"
    # VLLM_SERVER_DEV_MODE=1 adds /collective_rpc and /reset_prefix_cache, through which the trainer reloads the
    # weights before each rollout. Anyone who reaches the port can replace the weights: keep it on a private network.
    # VLLM_BATCH_INVARIANT=1 (BATCH_INVARIANT=0 turns it off): vLLM's batch-invariant kernels, so a completion does
    # not depend on what else the server batched with it (docs/async.md), at some speed.
    CUDA_VISIBLE_DEVICES="$gpus" VLLM_SERVER_DEV_MODE=1 VLLM_BATCH_INVARIANT="${BATCH_INVARIANT:-1}" \
      "$PYTHON" -m vllm.entrypoints.openai.api_server \
      --model "$MODEL" --host "$BIND" --port $((PORT + i)) --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" \
      --tensor-parallel-size "$GPUS_PER_SERVER" &
    PIDS+=("$!")
  done
  wait -n
}

urls() {  # the servers' URLs as a YAML list, for server.urls
  local list="" i
  for ((i = 0; i < NUM_SERVERS; i++)); do
    list+="${list:+, }\"http://$SERVER_HOST:$((PORT + i))\""
  done
  echo "[$list]"
}

wait_for_servers() {  # until every server answers GET /v1/models (it does once the model is loaded)
  local deadline=$((SECONDS + WAIT_S)) i url
  for ((i = 0; i < NUM_SERVERS; i++)); do
    url="http://$SERVER_HOST:$((PORT + i))"
    until curl -sf --max-time 5 "$url/v1/models" > /dev/null; do
      if ((SECONDS >= deadline)); then
        echo "run.sh: $url/v1/models did not answer within $WAIT_S s; is the server running on $SERVER_HOST?" >&2
        exit 1
      fi
      sleep 5
    done
    echo "run.sh: $url is up"
  done
}

trainer() {  # host B: TRAINER_PROCS training processes; the first syncs the weights through SHARED for all
  SERVER_HOST="${SERVER_HOST:?set SERVER_HOST to host A as host B reaches it}"
  mkdir -p "$SHARED/weights-for-servers"
  wait_for_servers
  local launch=("$PYTHON")
  if [ "${TRAINER_PROCS:-1}" -gt 1 ]; then
    launch=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$TRAINER_PROCS")
  fi
  exec "${launch[@]}" -m tidyrl train "$CONFIG" model="$MODEL" output_dir="$OUTPUT_DIR" \
    "server.urls=$(urls)" server.sync_dir="$SHARED/weights-for-servers" "$@"
}

case "${1:-}" in
  server) servers ;;
  trainer) shift; trainer "$@" ;;
  *) echo "usage: run.sh server (on host A) | run.sh trainer [key=value ...] (on host B); see README.md" >&2; exit 2 ;;
esac
