// Launchers of the CUDA kernels: plain C++ signatures (pointers, sizes, strides, stream) so
// the binding file needs no CUDA headers and no torch. Each returns the launch's
// cudaError_t as an int (0 = success); the binding turns a failure into a Python error.
#pragma once
#include <cstdint>

namespace minisgl {

int store_kv(void* k_cache, void* v_cache, const void* k, const void* v, const int32_t* slots,
             int64_t num_tokens, int64_t row_bytes, int64_t cache_stride_bytes,
             int64_t k_stride_bytes, int64_t v_stride_bytes, void* stream);

// Paged decode attention (csrc/decode_attention.cuh). dtype: 0 = float16, 1 = bfloat16 (q,
// out); kv_fp8 = 1: the caches are e4m3 holding K / k_scale, V / v_scale (else dtype, scales
// still applied). Strides in elements. num_splits comes from paged_decode_num_splits for the same shape;
// part_o [batch, kv_heads * group, num_splits, head_dim] and part_lse [.., num_splits] are
// fp32 scratch, needed only when num_splits > 1. `device`: the CUDA device the tensors are on
// (its attributes are read once and cached: a launch makes no device queries).
int paged_decode_num_splits(int device, int batch, int kv_heads, int group, int head_dim, int dtype, int kv_fp8,
                            int64_t max_seq_len, int* num_splits);
int paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* req_to_slot, const int32_t* req_rows,
                           const int32_t* seq_lens, void* out, float* part_o, float* part_lse,
                           int batch, int kv_heads, int group, int head_dim, int dtype, int kv_fp8,
                           int64_t q_stride_b, int64_t out_stride_b, int64_t cache_stride_s,
                           int64_t table_stride, int max_context, int num_splits, float scale,
                           float k_scale, float v_scale, int device, void* stream, int window = 0,
                           const float* sinks = nullptr);

// Embedding rows for token ids (csrc/embedding.cuh); ids outside [start, end) give zeros.
int embedding_lookup(void* out, const void* weight, const void* ids, int ids_are_int64, int64_t n,
                     int64_t row_bytes, int64_t weight_stride_bytes, int64_t out_stride_bytes,
                     int64_t start, int64_t end, void* stream);

// ---- One-shot all-reduce over peer memory (csrc/custom_all_reduce.cuh) ----
// Set-up, once per communicator: each rank allocates one zeroed region (signals + two staging
// buffers of buffer_bytes, a multiple of 16), exports it as a CUDA IPC handle, and opens every
// peer's handle. `device` is the CUDA ordinal these calls run on.
constexpr int kIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
constexpr int kCustomAllReduceMaxWorld = 8;
constexpr int kCustomAllReduceMaxBlocks = 128;
int custom_all_reduce_alloc(int device, int64_t buffer_bytes, void** base);
int custom_all_reduce_free(int device, void* base);
int peer_memory_handle(int device, void* base, char* handle);  // writes kIpcHandleBytes bytes
int peer_memory_open(int device, const char* handle, void** base);
int peer_memory_close(int device, void* base);
// Sum of every rank's n elements (dtype: an NcclDataType of nccl.h) into out, which may be in.
// bases: every rank's region in rank order (this rank's own at `rank`). Needs
// round_up(n * element size, 16) <= buffer_bytes; at most max_blocks blocks
// (<= kCustomAllReduceMaxBlocks). Every rank must make the same sequence of calls.
int custom_all_reduce(void* const* bases, int world, int rank, const void* in, void* out, int64_t n, int dtype,
                      int64_t buffer_bytes, int max_blocks, void* stream);
// The all-reduce of `in` [rows, hidden] fused with the residual add and RMSNorm after it
// (all_reduce_norm.cuh): residual += sum of in (in place), out = weight * rmsnorm(residual).
// 16-bit dtypes, hidden % 8 == 0 and <= 16384, every pointer 16-byte aligned, rows
// contiguous; rows * hidden * 2 <= buffer_bytes. Shares the epochs of custom_all_reduce.
constexpr int kCustomAllReduceNormMaxHidden = 16384;
int custom_all_reduce_rmsnorm(void* const* bases, int world, int rank, const void* in, void* residual, void* out,
                              const void* weight, int64_t rows, int64_t hidden, int dtype, float eps,
                              int64_t buffer_bytes, int max_blocks, void* stream);
// ---- end of the one-shot all-reduce ----

// Skinny GEMM y = x W^T (+ bias) for 1..32 rows of x (csrc/skinny_gemm.cuh). dtype: 0 =
// float16, 1 = bfloat16. Strides in elements. silu = 1: W is (gate | up) [2n, k] and y [m, n]
// = silu(gate) * up. cfg indexes the tile configurations (skinny_gemm_config gives its row
// tiles, chunks per warp group, and the largest m it takes); warps 1..8 per block; num_splits 1..64 K splits,
// with num_splits > 1 an fp32 workspace and `tiles` zeroed int counters (left zeroed).
// pdl: launch as a programmatic dependent of the previous kernel on the stream (sm_90+).
// warp_ranges = 1 (deterministic mode; cfg 1 only, one split): each warp sums a contiguous share of K
// with the loader whose MMAs take 16 contiguous K elements (skinny_weights.cuh Bf16DetW).
// skinny_gemm_fp8 takes warp_ranges too (one split; the FP8 loader as it is, whose order the
// deterministic FP8 GEMM above 32 rows follows: kernels/batch_invariant_fp8.py).
// fp8 = 1: the FP8-weight kernel's configurations (chunks of 64 K elements instead of 32); 2: the
// 4-bit kernels' (chunks of 128).
int skinny_gemm_num_configs(int fp8);
int skinny_gemm_config(int fp8, int cfg, int* row_tiles, int* chunks, int* max_m);
int skinny_gemm(const void* x, const void* w, const void* bias, void* y, float* workspace,
                int64_t workspace_bytes, int* counters, int64_t num_counters, int m, int n, int k,
                int64_t x_stride, int64_t w_stride, int64_t y_stride, int silu, int dtype, int cfg,
                int warps, int num_splits, int pdl, void* stream, int warp_ranges = 0);
// The same with e4m3 weights (csrc/skinny_weights.cuh (Fp8W)): w [n_w, k] bytes (w_stride in bytes, % 16),
// scale fp32 [n_w, KB] (s_stride elements): block_scales 0: KB = 1 per-channel; 1: one per 128-K
// block of each row. k % 16 == 0. x, bias, y in `dtype`.
int skinny_gemm_fp8(const void* x, const void* w, const float* scale, int64_t s_stride, int block_scales,
                    const void* bias, void* y, float* workspace, int64_t workspace_bytes, int* counters,
                    int64_t num_counters, int m, int n, int k, int64_t x_stride, int64_t w_stride,
                    int64_t y_stride, int silu, int dtype, int cfg, int warps, int num_splits, int pdl,
                    void* stream, int warp_ranges = 0);
// The same with 4-bit weights in kernels/quant4.py's layouts: fmt 1 = INT4 (w int32 [n_w, k / 8],
// w_stride in words % 4; qscale / qzero [n_w, k / q_group] in `dtype`, q_group % 32 == 0), fmt 2 =
// MXFP4 (w uint8 [n_w, k / 2], w_stride in bytes % 16; qscale e8m0 bytes [n_w, k / 32], q_group
// 32, qzero null). q_stride: scale row stride in elements. k % 32 == 0. skinny_gemm_config's
// table 2 lists its tiles.
int skinny_gemm_w4(const void* x, const void* w, const void* qscale, const void* qzero, int64_t q_stride,
                   int q_group, int fmt, const void* bias, void* y, float* workspace, int64_t workspace_bytes,
                   int* counters, int64_t num_counters, int m, int n, int k, int64_t x_stride, int64_t w_stride,
                   int64_t y_stride, int silu, int dtype, int cfg, int warps, int num_splits, int pdl, void* stream);
// The routed experts of a few tokens on the same kernel (csrc/skinny_moe.cuh, skinny_moe_kernel),
// experts stacked: w [E, n_w, k] (expert stride w_expert_stride, row stride w_stride, both in
// elements of w's storage), bias [E, n_w] or null (b_expert_stride), ids int32 [tokens, top_k].
// fmt 0: 16-bit experts, cfg a 16-bit tile configuration, qscale / qzero null. fmt 1 / 2: 4-bit
// experts as skinny_gemm_w4's weight (INT4 / MXFP4 layouts, q_stride, q_group), each expert's
// scales (and zeros) q_expert_stride elements after the previous one's, cfg a 4-bit tile. down 0 (up): x [tokens, k], w = (gate | up) [E, 2n, k], y [tokens * top_k, n]
// = act(gate, up) per token-expert pair (act 0 silu, 1 GPT-OSS's clamped SwiGLU with alpha,
// limit); splits K splits per pair. down 1: x = inter [tokens * top_k, k], w [E, n, k], y
// [tokens, n] = sum over the token's slots of weights * (x W_e^T + b_e), weights fp32 [tokens,
// top_k]; splits K splits per slot (splits * top_k <= 64). The workspace and counters as the
// dense op's, times the z planes (pairs or tokens). warp_ranges = 1 (deterministic mode; 16-bit
// experts, cfg 1, one split per pair or slot): as skinny_gemm's, each warp a contiguous share of K.
int skinny_moe(const void* x, const void* w, const void* bias, const int* ids, const float* weights, void* y,
               float* workspace, int64_t workspace_bytes, int* counters, int64_t num_counters, int tokens, int top_k,
               int n, int k, int64_t x_stride, int64_t w_stride, int64_t y_stride, int64_t w_expert_stride,
               int64_t b_expert_stride, int down, int act, float alpha, float limit, int fmt, const void* qscale,
               const void* qzero, int64_t q_stride, int q_group, int64_t q_expert_stride, int dtype, int cfg,
               int warps, int splits, int pdl, void* stream, int warp_ranges = 0);

// 4-bit routed experts grouped by expert (csrc/skinny_moe.cuh, skinny_moe_grouped_kernel): the
// weights, strides and formats as skinny_moe's (fmt 1 INT4 / 2 MXFP4 only), the routing as
// kernels/moe_align.py's blocks of block_m (8 or 16) pairs: sorted_ids [num_blocks * block_m] (pair
// t * top_k + j, tokens * top_k for padding), block_experts [num_blocks] (-1 past the last used).
// down 0 (up): x [tokens, k] -> y [tokens * top_k, n] = act(gate, up) per pair. down 1: x = that
// -> y [tokens * top_k, n] = weights[pair] * (x W_e^T + b_e), weights fp32 [tokens * top_k] (the
// top-k sum is the caller's). splits: K splits per block (workspace and counters as skinny_moe's,
// one tile per block of every row tile).
int skinny_moe_grouped(const void* x, const void* w, const void* bias, const int* sorted_ids, const int* block_experts,
                       const float* weights, void* y, float* workspace, int64_t workspace_bytes, int* counters,
                       int64_t num_counters, int tokens, int top_k, int num_blocks, int block_m, int n, int k,
                       int64_t x_stride, int64_t w_stride, int64_t y_stride, int64_t w_expert_stride,
                       int64_t b_expert_stride, int down, int act, float alpha, float limit, int fmt,
                       const void* qscale, const void* qzero, int64_t q_stride, int q_group, int64_t q_expert_stride,
                       int dtype, int cfg, int warps, int splits, int pdl, void* stream);

// KV rows between two pools by slot lists, K and V of every layer in one launch
// (csrc/kv_copy.cuh): for t in {K, V}, layer < num_layers, i < num_slots,
// dst_t[layer * dst_layer_stride + dst_slots[i] * dst_slot_stride] = the same row of src_t
// (row_bytes bytes; strides in bytes). Either side may be pinned host memory passed by its device
// address (host_device_pointer). The slot lists are int32 device arrays; num_sms sizes the grid.
int kv_copy_slots(const void* src_k, const void* src_v, void* dst_k, void* dst_v, const int32_t* src_slots,
                  const int32_t* dst_slots, int64_t num_slots, int64_t num_layers, int64_t row_bytes,
                  int64_t src_layer_stride, int64_t src_slot_stride, int64_t dst_layer_stride,
                  int64_t dst_slot_stride, int num_sms, void* stream);
// The device address of pinned (page-locked, mapped) host memory, also inside a registered range;
// cudaErrorInvalidValue for pageable memory.
int host_device_pointer(void* host, void** device);

const char* cuda_error_string(int code);

// Whether the launchers overlap kernels by programmatic dependent launch on the current device
// `device` (csrc/pdl.h: the loaded code has the sm_90 waits).
int pdl_enabled(int device, int* enabled);

}  // namespace minisgl
