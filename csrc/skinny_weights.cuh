// The skinny GEMM's 16-bit and FP8 weight loaders (policies of skinny_kernel, csrc/skinny_gemm.cuh;
// the 4-bit ones are in skinny_w4.cuh). Each holds:
//   T, kPerThread (K elements per thread per 16-byte W load), kChunk = 4 * kPerThread,
//   kChannelScale (the epilogue applies p.scale per row: FP8 per-channel),
//   Rows<RT> (this thread's W row pointers), Regs<RT, U> (a warp group's W registers),
//   piece(quad) (where thread q's kPerThread elements of a chunk start, W's and x's alike),
//   set_row, load_w (a warp group of W and its scales), mma (the group's MMAs),
//   kLoopUnroll (the K loop's unroll: 2 lets a pipeline's cur = nxt be a renaming, not copies),
//   kSteady (the K loop's whole groups load with no predicates: load_w<true>, skinny_gemm.cuh).
// The MMA fragment mapping is the same for all but Bf16DetW (below): thread q of a quad holds
// kPerThread contiguous K elements; MMA i takes elements 4i..4i+3 as the fragment's k pairs {2q, 2q+1, 2q+8, 2q+9}
// (K is a reduction: W and x permuted alike), so 16-bit pair p of a thread is its elements
// 2p, 2p + 1, and MMA i reads W pairs 2i, 2i + 1 of the lo and hi rows and x piece i / 2
// (INT4 too: its layout puts a pair's two elements in nibbles j and j + 4 of a word, Int4W).
// 4-bit formats scale before the MMA (one MMA mixes four threads' K ranges, i.e. up to four
// groups; INT4 groups of a multiple of 128 are the exception: skinny_w4.cuh's folded path), so
// their W pairs are dequantised to T in registers: INT4 exactly as (q - z) * s
// rounded once to T (the magic-number trick: 1024 + q in fp16, 128 + q in bf16, both exact),
// MXFP4 as e2m1 * 2^(e8m0 - 127): bf16 by byte-permute tables and one exact power-of-two
// multiply, fp16 built in fp32 and rounded once (both exact where T's range holds it).
#pragma once
#include "fp8_convert.cuh"
#include "skinny_gemm.cuh"

namespace minisgl {
namespace skinny {

// This thread's W rows of a warp group (lo rows g, hi rows g + 8 of each row tile; rows past the
// end keep row 0's address with their loads predicated off).
template <typename Elem, int RT>
struct WRows {
  bool lo_ok[RT], hi_ok[RT];
  const Elem* lo[RT];
  const Elem* hi[RT];
  __device__ __forceinline__ void set(const Params& p, int r, int lo_row, int hi_row, bool lo_okay, bool hi_okay) {
    const Elem* w = static_cast<const Elem*>(p.w);
    lo_ok[r] = lo_okay;
    hi_ok[r] = hi_okay;
    lo[r] = w + static_cast<int64_t>(lo_row) * p.w_stride;
    hi[r] = w + static_cast<int64_t>(hi_row) * p.w_stride;
  }
};

// A warp group's W loads of the 16-bit and FP8 loaders: U chunks of RT row tiles, one 16-byte
// load per (chunk, row) and thread, at `piece` (the loader's piece(quad)) into each chunk.
template <int kChunk, typename Elem, int RT, int U>
__device__ __forceinline__ void load_rows(uint4 (&lo)[RT][U], uint4 (&hi)[RT][U], const WRows<Elem, RT>& rows, int k0,
                                          int k_end, int piece) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = k0 + u * kChunk + piece;
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      lo[r][u] = skinny::load_w(rows.lo[r] + kk, kk < k_end && rows.lo_ok[r]);
      hi[r][u] = skinny::load_w(rows.hi[r] + kk, kk < k_end && rows.hi_ok[r]);
    }
  }
}

// 16-bit W: 8 elements per load, two MMAs per chunk.
template <typename TT>
struct Bf16W {
  using T = TT;
  static constexpr int kPerThread = 8, kChunk = 32;
  static constexpr bool kChannelScale = false;
  static constexpr int kLoopUnroll = 1;
  static constexpr bool kSteady = false;
  static __device__ __forceinline__ int piece(int quad) { return kPerThread * quad; }
  template <int RT>
  using Rows = WRows<T, RT>;
  template <int RT, int U>
  struct Regs {
    uint4 lo[RT][U], hi[RT][U];
  };

  // MoE (skinny_moe_kernel): expert e's W.
  static __device__ __forceinline__ void expert(Params& q, int64_t e) {
    q.w = static_cast<const T*>(q.w) + e * q.w_expert_stride;
  }

  template <int RT>
  static __device__ __forceinline__ void set_row(Rows<RT>& rows, const Params& p, int r, int lo, int hi, bool lo_ok,
                                                 bool hi_ok) {
    rows.set(p, r, lo, hi, lo_ok, hi_ok);
  }

  template <int RT, int U>
  static __device__ __forceinline__ void load_w(Regs<RT, U>& g, const Rows<RT>& rows, const Params&, int k0, int k_end,
                                                int quad) {
    load_rows<kChunk>(g.lo, g.hi, rows, k0, k_end, piece(quad));
  }

  template <int MT, int RT, int U>
  static __device__ __forceinline__ void mma(float (&acc)[RT][MT][4], const Regs<RT, U>& g,
                                             const uint4 (&x)[MT][U][1]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint4 a = g.lo[r][u], b = g.hi[r][u];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4 xv = x[t][u][0];
          mma16816<T>(acc[r][t], a.x, b.x, a.y, b.y, xv.x, xv.y);  // elements 8q + 0..3
          mma16816<T>(acc[r][t], a.z, b.z, a.w, b.w, xv.z, xv.w);  // elements 8q + 4..7
        }
      }
    }
  }
};

// 16-bit W in deterministic mode (skinny_gemm with warp_ranges): Bf16W's MMAs, but each MMA holds
// the products of 16 contiguous K elements (the chunk's first [0, 16), its second [16, 32)), as a
// dot over K in plain order does (the batch-invariant Triton GEMM, kernels/batch_invariant_gemm.py).
// On sm_90 a k16 step's result depends only on which products it holds, not on their k slots
// (mma.sync and wgmma alike; tests/test_deterministic_gpu.py checks it), so the two kernels give
// the same bits. For that thread q must feed elements [4q, 4q + 4) and [16 + 4q, 20 + 4q) (x's
// alike). Loads stay 16-byte (two 8-byte ones made the mode's batch-1 decode 20% slower, seventeenth
// session): thread q loads 8 elements at piece(q), [0, 8), [16, 24), [8, 16), [24, 32) for
// q = 0..3, and at MMA time the threads of a pair (q, q ^ 1) swap halves with two shuffles: the
// even one keeps its low half and takes its partner's low half; the odd one takes its partner's
// high half and keeps its own.
__device__ __forceinline__ uint4 det_pieces(uint4 v, bool odd) {
  const uint32_t a = __shfl_xor_sync(0xffffffffu, odd ? v.x : v.z, 1);
  const uint32_t b = __shfl_xor_sync(0xffffffffu, odd ? v.y : v.w, 1);
  return odd ? make_uint4(a, b, v.z, v.w) : make_uint4(v.x, v.y, a, b);
}

template <typename TT>
struct Bf16DetW : Bf16W<TT> {
  template <int RT>
  using Rows = WRows<TT, RT>;
  template <int RT, int U>
  using Regs = typename Bf16W<TT>::template Regs<RT, U>;
  static __device__ __forceinline__ int piece(int quad) { return 8 * (((quad & 1) << 1) | (quad >> 1)); }

  template <int RT, int U>
  static __device__ __forceinline__ void load_w(Regs<RT, U>& g, const Rows<RT>& rows, const Params&, int k0, int k_end,
                                                int quad) {
    load_rows<Bf16W<TT>::kChunk>(g.lo, g.hi, rows, k0, k_end, piece(quad));
  }

  // The pieces exchanged here, not at the loads: a shuffle waits for its load's data, and the
  // pipeline keeps the next group's loads in flight while this group's MMAs run.
  template <int MT, int RT, int U>
  static __device__ __forceinline__ void mma(float (&acc)[RT][MT][4], const Regs<RT, U>& g,
                                             const uint4 (&x)[MT][U][1]) {
    const bool odd = threadIdx.x & 1;  // quad & 1: lane = 4 g + quad
    Regs<RT, U> w;
    uint4 xs[MT][U][1];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        w.lo[r][u] = det_pieces(g.lo[r][u], odd);
        w.hi[r][u] = det_pieces(g.hi[r][u], odd);
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) xs[t][u][0] = det_pieces(x[t][u][0], odd);
    }
    Bf16W<TT>::template mma<MT, RT, U>(acc, w, xs);
  }
};

// e4m3 W: 16 elements per load, a chunk of 64; fp32 scales per row (per-channel, in the
// epilogue) or per 128-K span (U even: a group is whole spans; each span's MMAs go to a fresh
// accumulator added scaled, per-channel ones with a scale of 1). Bytes become exact T pairs in
// fp8_convert.cuh. Deterministic mode's FP8 GEMM above 32 rows repeats this order
// (kernels/batch_invariant_fp8.py). (Per-channel MMAs chained straight into the accumulator behind
// a run-time branch cost 18-56 more registers an instance and made the default qkv_proj 12% slower
// at batch 1: not kept, twenty-first session.)
template <typename TT>
struct Fp8W {
  using T = TT;
  static constexpr int kPerThread = 16, kChunk = 64, kSpan = 128;
  static constexpr bool kChannelScale = true;
  static constexpr int kLoopUnroll = 1;
  static constexpr bool kSteady = false;
  static __device__ __forceinline__ int piece(int quad) { return kPerThread * quad; }
  template <int RT>
  struct Rows : WRows<uint8_t, RT> {
    const float* s_lo[RT];  // this row's scales (row 0's for rows past the end)
    const float* s_hi[RT];
  };
  template <int RT, int U>
  struct Regs {
    uint4 lo[RT][U], hi[RT][U];  // 16 e4m3 each
    float s_lo[RT][U / 2], s_hi[RT][U / 2];
  };

  template <int RT>
  static __device__ __forceinline__ void set_row(Rows<RT>& rows, const Params& p, int r, int lo, int hi, bool lo_ok,
                                                 bool hi_ok) {
    rows.set(p, r, lo, hi, lo_ok, hi_ok);
    rows.s_lo[r] = p.scale + static_cast<int64_t>(lo) * p.s_stride;
    rows.s_hi[r] = p.scale + static_cast<int64_t>(hi) * p.s_stride;
  }

  template <int RT, int U>
  static __device__ __forceinline__ void load_w(Regs<RT, U>& g, const Rows<RT>& rows, const Params& p, int k0,
                                                int k_end, int quad) {
    static_assert(U % 2 == 0, "a warp group must be whole 128-K spans");
    load_rows<kChunk>(g.lo, g.hi, rows, k0, k_end, piece(quad));
    const int block_scales = p.block_scales;
#pragma unroll
    for (int j = 0; j < U / 2; ++j) {
      const int ks = k0 + j * kSpan;
      const int kb = ks / kSpan;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        g.s_lo[r][j] = !block_scales ? 1.0f : (ks < k_end && rows.lo_ok[r]) ? __ldg(rows.s_lo[r] + kb) : 0.0f;
        g.s_hi[r][j] = !block_scales ? 1.0f : (ks < k_end && rows.hi_ok[r]) ? __ldg(rows.s_hi[r] + kb) : 0.0f;
      }
    }
  }

  template <int MT, int RT, int U>
  static __device__ __forceinline__ void mma(float (&acc)[RT][MT][4], const Regs<RT, U>& g,
                                             const uint4 (&x)[MT][U][2]) {
#pragma unroll
    for (int j = 0; j < U / 2; ++j) {
      float part[RT][MT][4];
      zero_acc(part);
#pragma unroll
      for (int u = 2 * j; u < 2 * j + 2; ++u) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          uint32_t a[8], b[8];
          const uint32_t wl[4] = {g.lo[r][u].x, g.lo[r][u].y, g.lo[r][u].z, g.lo[r][u].w};
          const uint32_t wh[4] = {g.hi[r][u].x, g.hi[r][u].y, g.hi[r][u].z, g.hi[r][u].w};
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            fp8::e4m3x4_to_pairs<T>(wl[w], a[2 * w], a[2 * w + 1]);
            fp8::e4m3x4_to_pairs<T>(wh[w], b[2 * w], b[2 * w + 1]);
          }
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint4 x0 = x[t][u][0], x1 = x[t][u][1];
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
          acc[r][t][0] = fmaf(part[r][t][0], g.s_lo[r][j], acc[r][t][0]);
          acc[r][t][1] = fmaf(part[r][t][1], g.s_lo[r][j], acc[r][t][1]);
          acc[r][t][2] = fmaf(part[r][t][2], g.s_hi[r][j], acc[r][t][2]);
          acc[r][t][3] = fmaf(part[r][t][3], g.s_hi[r][j], acc[r][t][3]);
        }
    }
  }
};

}  // namespace skinny
}  // namespace minisgl
