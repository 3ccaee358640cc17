#!/usr/bin/env bash
# The whole `pytest -m "gpu or triton"` suite on the GPU machine (repo root, after building), file
# by file, in parallel, and resumable across the calls of one warm machine:
#   bash benchmarks/gpu_tests.sh [BUDGET_SECONDS]      (default 540)
# - First, one at a time and alone on the GPU: the files in SOLO (they measure free GPU memory, or
#   load models that fill most of it).
# - Then at once: one worker runs the ENGINE files one after another (each engine sizes its KV pool
#   from the free memory, so two would starve each other), and $KERNEL_WORKERS workers (default 3)
#   share the kernel files (small tensors; Triton's compiles are CPU work, which this overlaps).
# A file that ran to the end (passed or failed) is recorded in $STATE (default
# /tmp/minisgl-gpu-tests) and skipped by the next call on the same machine; a file cut off by the
# budget runs again whole next time. Prints (and writes to $OUT/gpu_tests.txt) one line per file
# and the failures; exits 0 only when every file has run and passed.
set -u
BUDGET=${1:-540}
STATE=${STATE:-/tmp/minisgl-gpu-tests}
OUT=${OUT:-$STATE}
KERNEL_WORKERS=${KERNEL_WORKERS:-3}
mkdir -p "$STATE/logs" "$OUT"
[ -d .gpu_assets/smollm2_tokenizer ] && export MINISGL_TEST_SMOLLM2_TOKENIZER=$PWD/.gpu_assets/smollm2_tokenizer
deadline=$(( $(date +%s) + BUDGET ))
SOLO="test_engine_lifecycle test_moe_gpu test_moe_models test_dp_gpu"
# test_quant4_gpu and test_spec_accept build engines or take tens of GiB too: beside an engine file
# they ran out of memory (twelfth session), so they run in the engine worker's turn.
ENGINE="test_engine_gpu test_deterministic_gpu test_spec_gpu test_graphs_gpu test_fp8_models test_fp8_kv
  test_deterministic test_logits_processing_gpu test_grammar_gpu test_cuda_backend test_nccl_gpu test_host_tier_gpu
  test_hybrid_gpu test_quant4_gpu test_spec_accept"
ALL=$(grep -l -E "pytest.mark.(gpu|triton)|pytestmark.*(gpu|triton)" tests/test_*.py | xargs -n1 basename | sed 's/\.py$//')
NAMED=" $(echo $SOLO $ENGINE) "  # one line: $ENGINE spans two
KERNEL=$(for f in $ALL; do case "$NAMED" in *" $f "*) ;; *) echo "$f" ;; esac; done)

run_file() {  # NAME: runs tests/NAME.py unless it has run; false once the budget is spent
  local name=$1 left t0 rc
  [ -f "$STATE/$name.rc" ] && return 0
  mkdir "$STATE/$name.claim" 2> /dev/null || return 0  # another worker has it
  left=$(( deadline - $(date +%s) ))
  if [ "$left" -le 5 ]; then rmdir "$STATE/$name.claim"; return 1; fi
  t0=$(date +%s)
  timeout "$left" python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" -rfE "tests/$name.py" \
    > "$STATE/logs/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ]; then rmdir "$STATE/$name.claim"; return 1; fi  # cut off: runs again next call
  echo "$rc $(( $(date +%s) - t0 ))" > "$STATE/$name.rc"
}
worker() { for f in "$@"; do run_file "$f" || return; done; }

worker $SOLO
if [ "$(date +%s)" -lt "$deadline" ]; then
  worker $ENGINE &
  for _ in $(seq "$KERNEL_WORKERS"); do worker $KERNEL & done
  wait
fi

pending=0; failed=0
for f in $SOLO $ENGINE $KERNEL; do
  if [ ! -f "$STATE/$f.rc" ]; then pending=$((pending + 1))
  elif [ "$(cut -d' ' -f1 "$STATE/$f.rc")" != 0 ]; then failed=$((failed + 1)); fi
done
{
  echo "| file | result | s |"; echo "|---|---|---|"
  for f in $SOLO $ENGINE $KERNEL; do
    if [ -f "$STATE/$f.rc" ]; then
      read -r _ secs < "$STATE/$f.rc"
      echo "| $f | $(grep -v '^\s*$' "$STATE/logs/$f.log" | tail -1 | tr -d '=|') | $secs |"
    else
      echo "| $f | not run yet | |"
    fi
  done
  echo; echo "files failed: $failed, not run yet: $pending"
  for f in $SOLO $ENGINE $KERNEL; do
    [ -f "$STATE/$f.rc" ] && [ "$(cut -d' ' -f1 "$STATE/$f.rc")" != 0 ] && { echo "== $f"; grep -E "^(FAILED|ERROR)|Error|error" "$STATE/logs/$f.log" | head -30; }
  done
} | tee "$OUT/gpu_tests.txt"
[ "$failed" = 0 ] && [ "$pending" = 0 ]
