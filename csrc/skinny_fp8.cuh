// Weight-only FP8 skinny GEMM: y[M, N] = x[M, K] (W[N, K] * S)^T (+ bias) for M <= 32, with W
// e4m3 and fp32 scales S [N, KB] (one row of scales per weight row): per-channel (KB = 1,
// applied in the epilogue) or 128 x 128 block scales expanded to rows (S[n, k / 128], applied
// per 128-K span). x, y, bias fp16/bf16. K % 16 == 0, W's row stride % 16 bytes, x's % 8
// elements, 16-byte aligned bases (the host checks).
//
// The bf16 kernel (skinny_gemm.cuh) with one change of unit: a thread's 16-byte W load carries
// 16 e4m3 elements, so a chunk is 64 K elements (4 threads x 16) and feeds four m16n8k16 MMAs
// instead of two; x is loaded as two 16-byte pieces of the same 16 elements. The bytes are
// turned into exact fp16/bf16 pairs in registers (fp8_convert.cuh: a byte permute, two logic
// ops and a pair multiply per two elements), once per W load and reused for every x tile. The
// MMA fragment mapping is the bf16 kernel's: MMA i takes elements 4i..4i+3 of the thread's 16.
// A warp group is U chunks (U even, so a group is whole 128-K spans and every group starts at
// a multiple of 128: the block scale of a span is one number per row). Each span's MMAs go to
// a fresh accumulator that is then added scaled (by 1 with per-channel scales).
//
// Memory traffic: W once (N_w * K bytes), the scales once per warp group (4 bytes per row and
// 128-K span with block scales: 1/32 of W), x once per block, y once (+ split-K partials).
#pragma once
#include "fp8_convert.cuh"
#include "skinny_gemm.cuh"

namespace minisgl {
namespace skinny {

constexpr int kFp8Chunk = 64;  // K elements per thread-quad 16-byte load of e4m3
constexpr int kSpan = 128;     // K elements per block scale

template <int MT, int RT, int U>
struct Fp8Group {
  uint4 lo[RT][U], hi[RT][U];  // 16 e4m3 each
  uint4 x[MT][U][2];           // 2 x 8 elements of x
  float s_lo[RT][U / 2], s_hi[RT][U / 2];
};

template <typename T, int MT, int RT>
struct Fp8Rows {
  const uint8_t* lo[RT];
  const uint8_t* hi[RT];
  const float* s_lo[RT];  // this row's scales (row 0's for rows past the end)
  const float* s_hi[RT];
  bool lo_ok[RT], hi_ok[RT];
  const T* x[MT];
  bool x_ok[MT];
};

template <typename T, int MT, int RT, int U>
__device__ __forceinline__ void fp8_load_w(Fp8Group<MT, RT, U>& grp, const Fp8Rows<T, MT, RT>& rows, int block_scales,
                                           int k0, int k_end, int quad) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = k0 + u * kFp8Chunk + 16 * quad;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      grp.lo[r][u] = load_w(rows.lo[r] + kk, kk < k_end && rows.lo_ok[r]);
      grp.hi[r][u] = load_w(rows.hi[r] + kk, kk < k_end && rows.hi_ok[r]);
    }
  }
#pragma unroll
  for (int j = 0; j < U / 2; ++j) {
    const int ks = k0 + j * kSpan;
    const int kb = ks / kSpan;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      grp.s_lo[r][j] = !block_scales ? 1.0f : (ks < k_end && rows.lo_ok[r]) ? __ldg(rows.s_lo[r] + kb) : 0.0f;
      grp.s_hi[r][j] = !block_scales ? 1.0f : (ks < k_end && rows.hi_ok[r]) ? __ldg(rows.s_hi[r] + kb) : 0.0f;
    }
  }
}

template <typename T, int MT, int RT, int U>
__device__ __forceinline__ void fp8_load_x(Fp8Group<MT, RT, U>& grp, const Fp8Rows<T, MT, RT>& rows, int k0, int k_end,
                                           int quad) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = k0 + u * kFp8Chunk + 16 * quad;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const bool ok = kk < k_end && rows.x_ok[t];
      grp.x[t][u][0] = load_x(rows.x[t] + kk, ok);
      grp.x[t][u][1] = load_x(rows.x[t] + kk + 8, ok);
    }
  }
}

template <typename T, int MT, int RT, int U>
__device__ __forceinline__ void fp8_mma_group(float (&acc)[RT][MT][4], const Fp8Group<MT, RT, U>& grp) {
#pragma unroll
  for (int j = 0; j < U / 2; ++j) {
    float part[RT][MT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[r][t][i] = 0.0f;
#pragma unroll
    for (int u = 2 * j; u < 2 * j + 2; ++u) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        // a[i], b[i]: pairs (elements 2i, 2i + 1 of this thread's 16) of the lo and hi rows.
        uint32_t a[8], b[8];
        const uint32_t wl[4] = {grp.lo[r][u].x, grp.lo[r][u].y, grp.lo[r][u].z, grp.lo[r][u].w};
        const uint32_t wh[4] = {grp.hi[r][u].x, grp.hi[r][u].y, grp.hi[r][u].z, grp.hi[r][u].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          fp8::e4m3x4_to_pairs<T>(wl[w], a[2 * w], a[2 * w + 1]);
          fp8::e4m3x4_to_pairs<T>(wh[w], b[2 * w], b[2 * w + 1]);
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4 x0 = grp.x[t][u][0], x1 = grp.x[t][u][1];
          mma16816<T>(part[r][t], a[0], b[0], a[1], b[1], x0.x, x0.y);  // elements 0..3
          mma16816<T>(part[r][t], a[2], b[2], a[3], b[3], x0.z, x0.w);  // 4..7
          mma16816<T>(part[r][t], a[4], b[4], a[5], b[5], x1.x, x1.y);  // 8..11
          mma16816<T>(part[r][t], a[6], b[6], a[7], b[7], x1.z, x1.w);  // 12..15
        }
      }
    }
    // c0, c1 belong to the lo row (g), c2, c3 to the hi row (g + 8).
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        acc[r][t][0] = fmaf(part[r][t][0], grp.s_lo[r][j], acc[r][t][0]);
        acc[r][t][1] = fmaf(part[r][t][1], grp.s_lo[r][j], acc[r][t][1]);
        acc[r][t][2] = fmaf(part[r][t][2], grp.s_hi[r][j], acc[r][t][2]);
        acc[r][t][3] = fmaf(part[r][t][3], grp.s_hi[r][j], acc[r][t][3]);
      }
  }
}

template <typename T, int MT, int RT, int U>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_fp8_kernel(const Params p) {
  static_assert(U % 2 == 0, "a warp group must be whole 128-K spans");
  extern __shared__ float red[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, quad = lane & 3;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int tile_row0 = tile * RT * (p.silu ? 8 : 16);

  Fp8Rows<T, MT, RT> rows;
  const uint8_t* w = static_cast<const uint8_t*>(p.w);
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    int lo, hi;
    if (p.silu) {
      lo = tile_row0 + 8 * r + g;
      hi = p.n + lo;
      rows.lo_ok[r] = rows.hi_ok[r] = lo < p.n;
    } else {
      lo = tile_row0 + 16 * r + g;
      hi = lo + 8;
      rows.lo_ok[r] = lo < p.n;
      rows.hi_ok[r] = hi < p.n;
    }
    lo = rows.lo_ok[r] ? lo : 0;
    hi = rows.hi_ok[r] ? hi : 0;
    rows.lo[r] = w + static_cast<int64_t>(lo) * p.w_stride;
    rows.hi[r] = w + static_cast<int64_t>(hi) * p.w_stride;
    rows.s_lo[r] = p.scale + static_cast<int64_t>(lo) * p.s_stride;
    rows.s_hi[r] = p.scale + static_cast<int64_t>(hi) * p.s_stride;
  }
  const T* x = static_cast<const T*>(p.x);
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int m = 8 * t + g;
    rows.x_ok[t] = m < p.m;
    rows.x[t] = x + static_cast<int64_t>(rows.x_ok[t] ? m : 0) * p.x_stride;
  }

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.0f;

  const int k_begin = split * p.k_split;
  const int k_end = min(p.k, k_begin + p.k_split);
  constexpr int kGroup = U * kFp8Chunk;
  const int stride = warps * kGroup;
  int k0 = k_begin + warp * kGroup;
  // As in skinny_gemm_kernel: W and its scales (never written during inference) before
  // griddepcontrol.wait, x and every write after it.
  const bool has_work = k0 < k_end;
  Fp8Group<MT, RT, U> cur, nxt;
  if (has_work) fp8_load_w<T, MT, RT, U>(cur, rows, p.block_scales, k0, k_end, quad);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (has_work) {
    fp8_load_x<T, MT, RT, U>(cur, rows, k0, k_end, quad);
    for (; k0 + stride < k_end; k0 += stride) {
      fp8_load_w<T, MT, RT, U>(nxt, rows, p.block_scales, k0 + stride, k_end, quad);
      fp8_load_x<T, MT, RT, U>(nxt, rows, k0 + stride, k_end, quad);
      fp8_mma_group<T, MT, RT, U>(acc, cur);
      cur = nxt;
    }
    fp8_mma_group<T, MT, RT, U>(acc, cur);
  }

  reduce_store<T, true, MT, RT>(p, acc, red, tile, split, tile_row0);
}

}  // namespace skinny
}  // namespace minisgl
