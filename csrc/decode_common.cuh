// Shared pieces of the paged decode attention kernels (decode_attention.cuh, decode_merge.cuh):
// the parameter block, the split arithmetic both passes must agree on, bf16/fp16 <-> fp32
// packing and the cp.async helpers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace minisgl {
namespace decode {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMaxSplits = 256;
constexpr float kNegBig = -1e30f;  // finite "minus infinity": exp2(kNegBig - kNegBig) == 1, not NaN

struct Params {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* req_to_slot;
  const int32_t* req_rows;
  const int32_t* seq_lens;
  void* out;
  float* part_o;    // [B, Hq, S, D] fp32, only when num_splits > 1
  float* part_lse;  // [B, Hq, S] fp32 (log2 domain)
  int64_t q_stride_b;      // elements
  int64_t out_stride_b;    // elements
  int64_t cache_stride_s;  // elements between consecutive slots
  int64_t table_stride;    // elements between request-table rows
  int kv_heads;
  int group;  // query heads per KV head (runtime; kernels are built for a power of two >= it)
  int max_context;  // L: lengths are clamped to it so a bad length cannot read past the row
  int num_splits;
  int tile;  // tokens per block iteration of the split kernel; chunks are multiples of it
  float scale_log2;  // softmax scale * log2(e) (* the K scale with an FP8 cache): log2-domain scores
  float v_scale;     // output multiplier: 1, or the V scale with an FP8 cache
  int window;          // W > 0: only the last W keys are read (a sliding layer); 0: all
  const float* sinks;  // nullable [Hq] fp32: a logit per head joining the softmax denominator
};

// Loads the compiler must issue where they are written: plain loads whose values are first
// used after a branch get sunk below it, which turned the independent q / length / row
// reads at kernel entry into a chain of dependent memory round trips.
__device__ __forceinline__ int load_int_now(const int32_t* ptr) {
  int v;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(v) : "l"(ptr));
  return v;
}

__device__ __forceinline__ uint4 load_vec_now(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ int request_len(const Params& p, int b) {
  return min(max(load_int_now(p.seq_lens + b), 0), p.max_context);
}

// First key position read: max(0, len - W) under a window W > 0 (older slots may be freed).
__device__ __forceinline__ int window_start(const Params& p, int len) {
  return p.window > 0 ? max(0, len - p.window) : 0;
}

// Folds head hq's sink (natural-log logit, moved to the log2 domain) into a finished softmax
// state (max mx, sum total, both log2 domain): returns the factor c for the accumulator and
// updates total, so that out = acc * c / total. No sinks: c = 1, total unchanged.
__device__ __forceinline__ float fold_sink(const Params& p, int hq, float mx, float& total) {
  if (p.sinks == nullptr) return 1.f;
  const float s = p.sinks[hq] * 1.4426950408889634f;
  const float m2 = fmaxf(mx, s);
  const float c = exp2f(mx - m2);
  total = total * c + exp2f(s - m2);
  return c;
}

// Tokens per split for a request of `len` tokens (>= one tile, a multiple of it).
__device__ __forceinline__ int split_chunk(int len, int num_splits, int tile) {
  const int per = (len + num_splits - 1) / num_splits;
  return max(tile, (per + tile - 1) / tile * tile);
}

// 16-byte global -> shared copy that bypasses L1 (K/V rows are streamed once). With
// `pred` false nothing is read and the 16 bytes are zero-filled, so a masked token never
// touches an unwritten slot (NaN * 0 would still be NaN).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(pred ? 16 : 0)
               : "memory");
}

// 8-byte copy (FP8 caches: 8 e4m3 per thread and row); .ca, the only form with 8-byte copies.
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, bool pred) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(gmem), "r"(pred ? 8 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// L2 (.cg) loads of the split partials another grid just wrote, in program order.
__device__ __forceinline__ float load_f32_l2(const float* ptr) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
  return v;
}

__device__ __forceinline__ float4 load_f4_l2(const float4* ptr) {
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(ptr));
  return v;
}

// 2^x in one MUFU op (flushes denormals; 2^-inf = 0). Scores are already in log2 units.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t bits);

template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t bits) {
  // bf16 -> fp32 is a shift: no conversion instruction needed.
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t bits) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(bits));
  memcpy(&h, &bits, sizeof(bits));
  return __half22float2(h);
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = unpack2<T>(w[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, sizeof(r));
  return r;
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  uint32_t r;
  memcpy(&r, &h, sizeof(r));
  return r;
}

}  // namespace decode
}  // namespace minisgl
