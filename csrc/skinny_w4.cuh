// The skinny GEMM's 4-bit weight loaders (policies of skinny_kernel; the shared mapping is
// described in skinny_weights.cuh): Int4W and Mxfp4W, kernels/quant4.py's two layouts.
#pragma once
#include <type_traits>

#include "skinny_weights.cuh"

namespace minisgl {
namespace skinny {

// The MMAs of one (row tile, x tile) over a thread's 8 * kPieces elements: W pairs a (lo row), b (hi row).
template <typename T, int kPieces>
__device__ __forceinline__ void mma_pairs(float (&c)[4], const uint32_t* a, const uint32_t* b,
                                          const uint4 (&x)[kPieces]) {
#pragma unroll
  for (int i = 0; i < 2 * kPieces; ++i) {
    const uint4 xv = x[i / 2];
    mma16816<T>(c, a[2 * i], b[2 * i], a[2 * i + 1], b[2 * i + 1], i % 2 ? xv.z : xv.x, i % 2 ? xv.w : xv.y);
  }
}

// T pair helpers for the 4-bit loaders.
template <typename T>
__device__ __forceinline__ uint32_t splat2(float v);
template <>
__device__ __forceinline__ uint32_t splat2<__half>(float v) {
  const __half2 h = __float2half2_rn(v);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t splat2<__nv_bfloat16>(float v) {
  const __nv_bfloat162 h = __float2bfloat162_rn(v);
  return *reinterpret_cast<const uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ uint32_t pair2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pair2<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pair2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// A 16-bit value of T from its bits (scales and zeros are loaded as raw 16-bit words).
template <typename T>
__device__ __forceinline__ float bits_to_float(unsigned short b);
template <>
__device__ __forceinline__ float bits_to_float<__half>(unsigned short b) { return __half2float(__ushort_as_half(b)); }
template <>
__device__ __forceinline__ float bits_to_float<__nv_bfloat16>(unsigned short b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// The INT4 magic: the T whose bits ORed with a nibble q are magic + q (exactly: ulp 1 there).
template <typename T>
struct Int4Magic;
template <>
struct Int4Magic<__half> {
  using Pair = __half2;
  static constexpr uint32_t kBits = 0x64006400u;  // 1024 in both halves
  static constexpr uint32_t kOne2 = 0x3C003C00u;  // 1 in both halves
  static constexpr float kValue = 1024.0f;
};
template <>
struct Int4Magic<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static constexpr uint32_t kBits = 0x43004300u;  // 128 in both halves
  static constexpr uint32_t kOne2 = 0x3F803F80u;  // 1 in both halves
  static constexpr float kValue = 128.0f;
};

// (a & mask) | bits as one lop3 (0xEA: (a & b) | c), mask and bits passed in registers.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
  return d;
}

// (magic + q) pairs minus (magic + z), times s: (q - z) * s rounded once to T.
template <typename T>
__device__ __forceinline__ uint32_t sub_mul(uint32_t v, uint32_t off, uint32_t sc) {
  using P = typename Int4Magic<T>::Pair;
  const P r = __hmul2(__hsub2(*reinterpret_cast<const P*>(&v), *reinterpret_cast<const P*>(&off)),
                      *reinterpret_cast<const P*>(&sc));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Shared by the two 4-bit loaders (CRTP: D is the loader): 32 elements (16 bytes) per load, one
// scale set per load and row (D::load_scales), the W pairs of a load from D::pairs.
template <typename D, typename TT, typename Elem>
struct W4Base {
  using T = TT;
  static constexpr int kPerThread = 32, kChunk = 128;
  static constexpr int kPerElem = 2 * sizeof(Elem);  // K elements per Elem: 8 per int32, 2 per byte
  static constexpr bool kChannelScale = false;
  // Unrolled twice: the group's W, scales and x (about 60 registers at RT 1, U 2) were copied
  // from nxt to cur every iteration; unrolled, the copies are renamings.
  static constexpr int kLoopUnroll = 2;
  static __device__ __forceinline__ int piece(int quad) { return kPerThread * quad; }
  // s_lo / s_hi: this row's first scale as a 32-bit element offset into qscale / qzero (the host
  // checks that rows * q_stride fits). Computed once per block: the K loop's scale addresses are
  // then one add and one wide multiply-add (64-bit offsets recomputed per load cost about 40
  // instructions a scale set, thirteenth session).
  // w_lo / w_hi: the rows' first word (INT4) or byte (MXFP4) as 32-bit offsets from p.w (the host
  // checks that n_w * w_stride fits), so a load's address is one add and one wide multiply-add
  // (with 64-bit row pointers, WRows', nvcc recomputed them from the row index every iteration).
  // lo_ok / hi_ok: the row is below N (rows past it keep row 0's offsets).
  template <int RT>
  struct Rows {
    bool lo_ok[RT], hi_ok[RT];
    unsigned w_lo[RT], w_hi[RT];
    int s_lo[RT], s_hi[RT];
  };

  // MoE (skinny_moe_kernel): expert e's W, scales and zeros (D::Scale: their storage type).
  static __device__ __forceinline__ void expert(Params& q, int64_t e) {
    using S = typename D::Scale;
    q.w = static_cast<const Elem*>(q.w) + e * q.w_expert_stride;
    q.qscale = static_cast<const S*>(q.qscale) + e * q.q_expert_stride;
    if (q.qzero != nullptr) q.qzero = static_cast<const S*>(q.qzero) + e * q.q_expert_stride;
  }

  template <int RT>
  static __device__ __forceinline__ void set_row(Rows<RT>& rows, const Params& p, int r, int lo, int hi, bool lo_ok,
                                                 bool hi_ok) {
    rows.lo_ok[r] = lo_ok;
    rows.hi_ok[r] = hi_ok;
    rows.s_lo[r] = lo * static_cast<int>(p.q_stride);
    rows.s_hi[r] = hi * static_cast<int>(p.q_stride);
    rows.w_lo[r] = static_cast<unsigned>(lo) * static_cast<unsigned>(p.w_stride);
    rows.w_hi[r] = static_cast<unsigned>(hi) * static_cast<unsigned>(p.w_stride);
  }

  // kFull (the steady state): the group lies inside K, so nothing is predicated. Rows past N load
  // row 0 (their address, set_row) with its scales: finite values whose sums are never stored.
  template <bool kFull = false, int RT, typename R>
  static __device__ __forceinline__ void load_w(R& g, const Rows<RT>& rows, const Params& p, int k0, int k_end,
                                                int quad) {
    constexpr int U = sizeof(g.lo[0]) / sizeof(uint4);
    const Elem* w = static_cast<const Elem*>(p.w);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kk = k0 + u * kChunk + piece(quad);
      const int grp = D::group_of(p, kk);
      const unsigned at = static_cast<unsigned>(kk) / kPerElem;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const Elem* lo = w + (rows.w_lo[r] + at);
        const Elem* hi = w + (rows.w_hi[r] + at);
        if constexpr (kFull) {
          g.lo[r][u] = skinny::load_in<true>(lo);
          g.hi[r][u] = skinny::load_in<true>(hi);
          D::load_scales(g, p, rows, r, u, grp, true, true);
        } else {
          const bool lo_ok = kk < k_end && rows.lo_ok[r], hi_ok = kk < k_end && rows.hi_ok[r];
          g.lo[r][u] = skinny::load_w(lo, lo_ok);
          g.hi[r][u] = skinny::load_w(hi, hi_ok);
          D::load_scales(g, p, rows, r, u, grp, lo_ok, hi_ok);
        }
      }
    }
  }

  template <int MT, int RT, int U, typename R>
  static __device__ __forceinline__ void mma(float (&acc)[RT][MT][4], const R& g, const uint4 (&x)[MT][U][4]) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        uint32_t a[16], b[16];
        D::pairs(g, r, u, a, b);
#pragma unroll
        for (int t = 0; t < MT; ++t) mma_pairs<T, 4>(acc[r][t], a, b, x[t][u]);
      }
  }
};

// INT4 (kernels/quant4.py): word k / 8 of a row holds elements k..k+7, element 2j in nibble j and
// 2j + 1 in nibble j + 4;
// a thread's 32 elements lie in one group (q_group % 32 == 0, the host checks).
//
// Folded path (fold: q_group a multiple of kChunk, so K is one too and a quad's 128 elements,
// the K of its MMAs, share one scale and zero, and lie all inside K or all past it): the MMAs take the raw pairs magic + q (exact
// 16-bit integers) and a group's sum is s * (sum (magic + q) x - (magic + z) * sum x), sum x from
// MMAs with an all-ones W shared by every row. That leaves two integer instructions a pair
// (where the general path adds a subtract and a multiply), fewer rounding steps than the
// reference's rounded W, and an error of the fp32 subtraction, about 2^-24 * magic * |sum x|.
template <typename TT>
struct Int4W : W4Base<Int4W<TT>, TT, uint32_t> {
  using T = TT;
  using Base = W4Base<Int4W<TT>, TT, uint32_t>;
  using Scale = unsigned short;  // scales and zeros: T's bits
  // The K loop's steady state loads with no predicates (skinny_block): an INT4 group's predicates,
  // zero fills and address arithmetic were about a third of its loop's instructions (sm_90 SASS:
  // 216 -> 160 a group at MT 1, RT 1, U 1). MXFP4 takes it too since its table decode (with the old
  // decode it cost that loader registers, 95 -> 113 at the smallest instance, spills at RT 2, U 2).
  static constexpr bool kSteady = true;
  // The scale group of K offset kk (a multiple of 32): Params::q_group_mul's multiply, not a 32-bit
  // division (about 20 instructions, which nvcc computed beside a power-of-two group's shift).
  static __device__ __forceinline__ int group_of(const Params& p, int kk) {
    return static_cast<int>((static_cast<uint64_t>(static_cast<unsigned>(kk) >> 5) * p.q_group_mul) >> 44);
  }
  template <int RT, int U>
  struct Regs {
    uint4 lo[RT][U], hi[RT][U];
    float sc_lo[RT][U], sc_hi[RT][U], z_lo[RT][U], z_hi[RT][U];  // s and z as loaded (0 where off)
    bool fold;
  };

  // Rows and K ranges that are off get scale 0: their (zero) words then give W = 0. The values
  // stay fp32 here; mma converts them in the path it takes (folded or not).
  template <typename R, typename Rw>
  static __device__ __forceinline__ void load_scales(R& g, const Params& p, const Rw& rows, int r, int u, int grp,
                                                     bool lo_ok, bool hi_ok) {
    const unsigned short* sc = static_cast<const unsigned short*>(p.qscale);
    const unsigned short* zr = static_cast<const unsigned short*>(p.qzero);
    const int lo = rows.s_lo[r] + grp, hi = rows.s_hi[r] + grp;
    g.sc_lo[r][u] = lo_ok ? bits_to_float<T>(__ldg(sc + lo)) : 0.0f;
    g.sc_hi[r][u] = hi_ok ? bits_to_float<T>(__ldg(sc + hi)) : 0.0f;
    g.z_lo[r][u] = lo_ok ? bits_to_float<T>(__ldg(zr + lo)) : 0.0f;
    g.z_hi[r][u] = hi_ok ? bits_to_float<T>(__ldg(zr + hi)) : 0.0f;
    // Not for one group a row with K % 128 != 0: in the last chunk a thread past K has scale 0
    // and would zero its MMA sums, which hold the quad's other threads' (valid) K too.
    g.fold = p.q_group % Base::kChunk == 0;
  }

  // Pair 4w + j = elements 8w + 2j and 8w + 2j + 1 (nibbles j and j + 4 of word w: the layout puts
  // them there, kernels/quant4.py NIBBLE_OF), as the T pair (magic + lo, magic + hi): one shift and
  // one and-or (lop3) a pair, in K order, so x's registers are its pairs as loaded (a layout of
  // nibbles in K order cost one byte permute per x pair, twentieth session).
  // The and-or is one explicit lop3 with both constants in registers: SASS's LOP3 takes one
  // immediate, so written in C nvcc spent two instructions on it.
  static __device__ __forceinline__ void raw_pairs(const uint4 v, uint32_t (&out)[16]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
      for (int j = 0; j < 4; ++j) out[4 * w + j] = and_or(words[w] >> (4 * j), 0x000F000Fu, Int4Magic<T>::kBits);
  }

  template <typename R>
  static __device__ __forceinline__ void pairs(const R& g, int r, int u, uint32_t (&a)[16], uint32_t (&b)[16]) {
    raw_pairs(g.lo[r][u], a);
    raw_pairs(g.hi[r][u], b);
    const uint32_t off_lo = splat2<T>(Int4Magic<T>::kValue + g.z_lo[r][u]), sc_lo = splat2<T>(g.sc_lo[r][u]);
    const uint32_t off_hi = splat2<T>(Int4Magic<T>::kValue + g.z_hi[r][u]), sc_hi = splat2<T>(g.sc_hi[r][u]);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      a[i] = sub_mul<T>(a[i], off_lo, sc_lo);
      b[i] = sub_mul<T>(b[i], off_hi, sc_hi);
    }
  }

  template <int MT, int RT, int U, typename R>
  static __device__ __forceinline__ void mma(float (&acc)[RT][MT][4], const R& g, const uint4 (&x)[MT][U][4]) {
    uint32_t ones[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) ones[i] = Int4Magic<T>::kOne2;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!g.fold) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          uint32_t a[16], b[16];
          pairs(g, r, u, a, b);
#pragma unroll
          for (int t = 0; t < MT; ++t) mma_pairs<T, 4>(acc[r][t], a, b, x[t][u]);
        }
        continue;
      }
      float sx[MT][4];  // sum x over the chunk, per token column (the accumulator's layout)
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        sx[t][0] = sx[t][1] = sx[t][2] = sx[t][3] = 0.0f;
        mma_pairs<T, 4>(sx[t], ones, ones, x[t][u]);
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        uint32_t a[16], b[16];
        raw_pairs(g.lo[r][u], a);
        raw_pairs(g.hi[r][u], b);
        const float sl = g.sc_lo[r][u], sh = g.sc_hi[r][u];
        const float ol = Int4Magic<T>::kValue + g.z_lo[r][u], oh = Int4Magic<T>::kValue + g.z_hi[r][u];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
          mma_pairs<T, 4>(c, a, b, x[t][u]);
          acc[r][t][0] = fmaf(sl, fmaf(-ol, sx[t][0], c[0]), acc[r][t][0]);
          acc[r][t][1] = fmaf(sl, fmaf(-ol, sx[t][1], c[1]), acc[r][t][1]);
          acc[r][t][2] = fmaf(sh, fmaf(-oh, sx[t][2], c[2]), acc[r][t][2]);
          acc[r][t][3] = fmaf(sh, fmaf(-oh, sx[t][3], c[3]), acc[r][t][3]);
        }
      }
    }
  }
};

// PTX prmt (default mode): byte i of the result is byte c[4i+2 : 4i] of {b, a}, or, where c[4i+3]
// is set, that byte's sign bit copied to all 8 bits (which __byte_perm does not promise).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two bf16 products of bf16 pairs given as bits (round to nearest; subnormals kept).
__device__ __forceinline__ uint32_t bf16_mul2(uint32_t a, uint32_t b) {
  const __nv_bfloat162 r =
      __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// e2m1 nibble times 2^(s - 127), built as fp32 bits: exponent e + s - 1 and mantissa m for
// e > 0; 0.5 * 2^(s - 127) (exponent s - 1) or 0 for e = 0. s is clamped to 1..253.
__device__ __forceinline__ float e2m1_scaled(uint32_t nib, int s) {
  const uint32_t e = (nib >> 1) & 3u, m = nib & 1u;
  const uint32_t mag = e ? (((e + s - 1) << 23) | (m << 22)) : (m ? static_cast<uint32_t>(s - 1) << 23 : 0u);
  return __uint_as_float(mag | ((nib & 8u) << 28));
}

// MXFP4 (kernels/quant4.py): byte j of a row holds elements 2j (low nibble) and 2j + 1; one
// e8m0 scale per 32 elements, i.e. exactly one per thread per load.
template <typename TT>
struct Mxfp4W : W4Base<Mxfp4W<TT>, TT, uint8_t> {
  using T = TT;
  using Scale = uint8_t;  // e8m0
  static constexpr bool kSteady = true;
  static __device__ __forceinline__ int group_of(const Params&, int kk) {  // one per 32
    return static_cast<int>(static_cast<unsigned>(kk) >> 5);
  }
  template <int RT, int U>
  struct Regs {
    uint4 lo[RT][U], hi[RT][U];
    int s_lo[RT][U], s_hi[RT][U];
  };

  template <typename R, typename Rw>
  static __device__ __forceinline__ void load_scales(R& g, const Params& p, const Rw& rows, int r, int u, int grp,
                                                     bool lo_ok, bool hi_ok) {
    const uint8_t* sc = static_cast<const uint8_t*>(p.qscale);
    g.s_lo[r][u] = lo_ok ? min(max(static_cast<int>(__ldg(sc + rows.s_lo[r] + grp)), 1), 253) : 1;
    g.s_hi[r][u] = hi_ok ? min(max(static_cast<int>(__ldg(sc + rows.s_hi[r] + grp)), 1), 253) : 1;
  }

  // Pair p = byte p: its low nibble is element 2p, its high nibble 2p + 1.
  static __device__ __forceinline__ void to_pairs(const uint4 v, int s, uint32_t (&out)[16]) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      // bf16 by table: byte permutes look up a nibble's magnitude (e e m, 3 bits) in two 8-byte
      // tables (the low and high bytes of e2m1's eight bf16 magnitudes), four nibbles a permute; a
      // permute in sign-replicating mode puts each nibble's sign on its high byte; two more
      // interleave low and high bytes into pairs; one multiply by 2^(s - 127) (a bf16 for every
      // clamped s) scales them exactly (the products are bf16 values, subnormal at the bottom).
      // About 5 instructions a pair, against 8 and a branch for the shift-and-mask build (twentieth
      // session); the fp32 route below took about 20.
      const uint32_t f = static_cast<uint32_t>(s) << 7, fx2 = f | (f << 16);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t mag = words[w] & 0x77777777u, shifted = words[w] << 4;  // sign bits at each byte's msb
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // nibbles 4h .. 4h + 3: pairs 2h, 2h + 1 of the word
          const uint32_t sel = h ? mag >> 16 : mag;
          const uint32_t lo = prmt(0xC0800000u, 0xC0804000u, sel);  // low bytes of 0, .5, 1, 1.5 | 2, 3, 4, 6
          const uint32_t hi = and_or(prmt(shifted, words[w], h ? 0xFBEAu : 0xD9C8u), 0x80808080u,
                                     prmt(0x3F3F3F00u, 0x40404040u, sel));
          out[4 * w + 2 * h] = bf16_mul2(prmt(lo, hi, 0x5140u), fx2);
          out[4 * w + 2 * h + 1] = bf16_mul2(prmt(lo, hi, 0x7362u), fx2);
        }
      }
    } else {
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t byte = (words[w] >> (8 * j)) & 0xFFu;
          out[4 * w + j] = pair2<T>(e2m1_scaled(byte & 0xFu, s), e2m1_scaled(byte >> 4, s));
        }
    }
  }

  template <typename R>
  static __device__ __forceinline__ void pairs(const R& g, int r, int u, uint32_t (&a)[16], uint32_t (&b)[16]) {
    to_pairs(g.lo[r][u], g.s_lo[r][u], a);
    to_pairs(g.hi[r][u], g.s_hi[r][u], b);
  }
};

}  // namespace skinny
}  // namespace minisgl
