#!/usr/bin/env bash
# Two minisgl servers behind a router on one machine (README: Scaling out): the SGLang model
# gateway (SMG) when installed, else sglang-router 0.3.2 (both take the flags used below).
#
#   pip install "smg>=1.13"                    # or: pip install sglang-router==0.3.2
#   examples/router.sh                         # the built-in SmolLM2; the router on :30000
#   MODEL=/models/Qwen3-8B examples/router.sh   # any model `python -m minisgl.serve` takes
#
# With two GPUs or more, server i runs on GPU i (--base-gpu-id i); otherwise both run on the
# CPU with half of its cores each. On several hosts, run one `python -m minisgl.serve` per host
# and give the router their URLs. Ctrl-C stops everything. Settings (environment):
#   MODEL (default: built-in), PORT (router, 30000), WORKER_PORTS ("30001 30002"),
#   POLICY (cache_aware | power_of_two | round_robin | random; default cache_aware),
#   SERVER_ARGS (extra flags for each server), LOGS (folder of the logs, default .).
set -euo pipefail
PORT=${PORT:-30000}
LOGS=${LOGS:-.}
WORKER_PORTS=(${WORKER_PORTS:-30001 30002})
POLICY=${POLICY:-cache_aware}
model_args=()
[ -n "${MODEL:-}" ] && model_args=(--model "$MODEL")
if python3 -c "import smg" 2> /dev/null; then
  router=smg.launch_router
elif python3 -c "import sglang_router" 2> /dev/null; then
  router=sglang_router.launch_router
else
  echo 'needs: pip install "smg>=1.13" (or sglang-router==0.3.2)'; exit 1
fi

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt "${#WORKER_PORTS[@]}" ]; then
  # CPU: split the cores, so the two servers do not each start a thread per core.
  export OMP_NUM_THREADS=$(( $(nproc) / ${#WORKER_PORTS[@]} > 0 ? $(nproc) / ${#WORKER_PORTS[@]} : 1 ))
  device_args=(--device cpu)
fi

pids=()
cleanup() { kill "${pids[@]}" 2> /dev/null || true; wait 2> /dev/null || true; }
trap cleanup EXIT INT TERM

urls=()
for i in "${!WORKER_PORTS[@]}"; do
  port=${WORKER_PORTS[$i]}
  if [ "$gpus" -ge "${#WORKER_PORTS[@]}" ]; then device_args=(--base-gpu-id "$i"); fi
  python3 -m minisgl.serve "${model_args[@]}" "${device_args[@]}" --port "$port" ${SERVER_ARGS:-} \
    > "$LOGS/server$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$port")
done
for url in "${urls[@]}"; do  # a server opens its port once every process has loaded
  for _ in $(seq 600); do curl -sf "$url/health" > /dev/null && break; sleep 1; done
  curl -sf "$url/health" > /dev/null || { echo "$url did not start; see $LOGS/server*.log"; exit 1; }
done

python3 -m "$router" --worker-urls "${urls[@]}" --host 127.0.0.1 --port "$PORT" \
  --prometheus-host 127.0.0.1 --prometheus-port $((PORT + 1000)) --policy "$POLICY" --log-level warn \
  > "$LOGS/router.log" 2>&1 &
pids+=($!)
for _ in $(seq 60); do  # ready once the router lists every worker as healthy
  n=$(curl -sf "http://127.0.0.1:$PORT/workers" | python3 -c \
    "import json, sys; print(sum(w['is_healthy'] for w in json.load(sys.stdin)['workers']))" 2> /dev/null || echo 0)
  [ "$n" = "${#urls[@]}" ] && break
  sleep 1
done
name=$(curl -sf "http://127.0.0.1:$PORT/v1/models" | python3 -c "import json, sys; print(json.load(sys.stdin)['data'][0]['id'])")
echo "router at http://127.0.0.1:$PORT (OpenAI API under /v1) -> ${urls[*]}; logs in $LOGS"
echo "try: curl http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' \\"
echo "       -d '{\"model\": \"$name\", \"prompt\": \"Hello\", \"max_tokens\": 16}'"
wait -n "${pids[@]}"  # until Ctrl-C, or until a process dies
