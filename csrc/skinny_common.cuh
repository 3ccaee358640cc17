// The skinny GEMM's shared pieces (csrc/skinny_gemm.cuh is the kernel): the launch parameters,
// the predicated 16-byte loads, the m16n8k16 MMA and the fp16/bf16 conversions, and the per-block
// accumulator tile shape. Framework-free.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace minisgl {
namespace skinny {

constexpr int kMaxWarps = 8;

struct Params {
  const void* x;
  const void* w;
  const void* bias;  // [N_w] or null
  void* y;
  float* workspace;  // [tiles, num_splits, RT * MT * 2 * 32] float2, only when num_splits > 1
  int* counters;     // [tiles], zero between launches, only when num_splits > 1
  int64_t x_stride;  // elements between rows
  int64_t w_stride;
  int64_t y_stride;
  int m;      // x rows (1..32)
  int n;      // output columns: N_w, or inter in SiLU mode
  int k;
  int silu;   // 1: SiLU-and-mul epilogue over (gate | up) rows, W has 2 * n rows
  int k_split;     // K elements per split (a multiple of 8)
  int num_splits;
  // FP8 weights only (null / 0 for 16-bit ones): fp32 scales [N_w, KB], row stride s_stride;
  // block_scales 0: one scale per row (KB = 1), applied in the epilogue; 1: per 128-K block.
  const float* scale;
  int64_t s_stride;
  int block_scales;
  // 4-bit weights only (kernels/quant4.py layouts): INT4 scales / zeros [N_w, K / q_group] in x's
  // dtype, MXFP4 e8m0 bytes [N_w, K / 32] (q_group 32, qzero null); row stride q_stride elements.
  const void* qscale;
  const void* qzero;
  int64_t q_stride;
  int q_group;
  // MoE experts (skinny_moe_kernel; all zero for the dense kernels). w and bias point at expert 0;
  // expert e's W is w + e * w_expert_stride elements of the loader's storage (16-bit values, INT4
  // words, MXFP4 bytes), its bias bias + e * b_expert_stride.
  // blockIdx.z is a token-expert pair (the up projection: x row z / top_k, y row z) or a
  // token (the down projection: split s works on the token's expert slot j = s /
  // splits_per_slot, x row z * top_k + j of inter [T * top_k, k], K range (s % splits_per_slot) *
  // k_split.., its partial plus the expert's bias scaled by the routing weight; the sum over every
  // slot is y row z, so the top-k sum needs no kernel of its own). m is 1 in both.
  const int* moe_ids;        // [T, top_k] int32
  const float* moe_weights;  // [T, top_k] fp32 (down)
  int64_t w_expert_stride;
  int64_t b_expert_stride;
  int top_k;
  int splits_per_slot;
  // SiLU mode's activation: 0 silu(gate) * up; 1 GPT-OSS's clamped SwiGLU,
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit).
  int act;
  float alpha;
  float limit;
  // 4-bit MoE experts: expert e's scales (and INT4 zeros) start q_expert_stride elements after
  // expert e - 1's (the loader's W4Base::expert).
  int64_t q_expert_stride;
  // Deterministic mode (16-bit and FP8 dense launches, 16-bit MoE ones; 0 elsewhere): warp w of a block sums its
  // own contiguous share [w * k_split / warps, (w + 1) * k_split / warps) of the block's K range, one
  // group after another, instead of every warps-th group. A 16-bit launch takes the deterministic
  // loader (Bf16DetW: each MMA over 16 contiguous K elements); the block's sum over its warps (in
  // warp order, from zero) is then the batch-invariant Triton GEMM's chain in `warps` splits
  // (kernels/batch_invariant_gemm.py), at the speed of a multi-warp block. An FP8 launch keeps Fp8W,
  // whose order the deterministic FP8 GEMM follows (kernels/batch_invariant_fp8.py). A MoE launch's
  // pairs (up) and slots (down) are one split each: their sums are the deterministic fused MoE's
  // (kernels/fused_moe.py, SPLITS). The host requires k_split to be a whole number of groups per warp.
  int warp_ranges;
  // 4-bit weights: ceil(2^44 / (q_group / 32)), so a K offset's group is ((kk >> 5) * this) >> 44
  // with no division (exact for K <= 2^22, which the host checks); the launcher sets it.
  uint64_t q_group_mul;
  // Grouped MoE (skinny_moe_grouped_kernel; null / 0 elsewhere): kernels/moe_align.py's layout of
  // the moe_pairs = T * top_k (token, expert) pairs, sorted_ids [num_blocks * m] (pair numbers,
  // moe_pairs for padding) and moe_blocks [num_blocks] (each block's expert, -1 past the last). A
  // block's view points moe_sorted at its own m rows; row i is pair s = moe_sorted[i] (none when
  // s == moe_pairs): x row s / top_k (up) or s (down), y row s.
  const int* moe_sorted;
  const int* moe_blocks;
  int moe_pairs;
};

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

// Zeroes an accumulator set (RT row tiles x MT x tiles x the MMA's 4 floats).
template <int RT, int MT>
__device__ __forceinline__ void zero_acc(float (&acc)[RT][MT][4]) {
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.0f;
}

// Streamed once: skip L1 allocation (it would only evict x).
__device__ __forceinline__ uint4 load_w(const void* ptr, bool pred) {
  uint4 v = zero4();
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// x is re-read by every block: keep it in L1.
__device__ __forceinline__ uint4 load_x(const void* ptr, bool pred) {
  uint4 v = zero4();
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " @p ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n}\n"
      : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)
      : "l"(ptr), "r"(static_cast<int>(pred)));
  return v;
}

// Unpredicated forms of the two, for a K loop's steady state (W::kSteady: every address in range):
// kW, W's (streamed once, no L1 allocation), else x's.
template <bool kW>
__device__ __forceinline__ uint4 load_in(const void* ptr) {
  uint4 v;
  if constexpr (kW)
    asm volatile("ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  else
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

__device__ __forceinline__ float2 load_f2_l2(const float2* ptr) {
  float2 v;
  asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(ptr));
  return v;
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                 uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Accumulator pair `item` of a block tile: (row tile r, x tile t, q) holds rows (g, g + 8) of
// the row tile at x row 8t + 2 * quad + q, i.e. accumulators c[q] and c[q + 2].
template <int MT, int RT>
struct Tile {
  static constexpr int kPairs = RT * MT * 2;  // accumulator pairs per thread
  static constexpr int kItems = kPairs * 32;  // per warp (and per block after the reduction)
};

}  // namespace skinny
}  // namespace minisgl
