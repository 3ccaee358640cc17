// e4m3 (OCP "fn" FP8: 1 sign, 4 exponent (bias 7), 3 mantissa bits) -> fp16 / bf16 by moving
// bits, exact, on any GPU (no FP8 conversion instruction needed). A byte s.eeee.mmm put in a
// 16-bit half as sign | eeee.mmm at the bottom of the target's exponent and mantissa fields
// encodes value * 2^-8 in fp16 (exponent bias 15 = 7 + 8) and value * 2^-120 in bf16 (127 =
// 7 + 120); an e4m3 denormal (eeee = 0) becomes a target denormal with the same factor, so the
// mapping is exact for every finite e4m3 value. kUnscale2 is 2^8 / 2^120 in both halves of a
// 16-bit pair: a pair multiply by it restores the value exactly (a power of two, result normal).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace minisgl {
namespace fp8 {

template <typename T>
struct E4m3Bits;
template <>
struct E4m3Bits<__half> {
  static constexpr int kShift = 1;                 // eeee.mmm: bits 14..8 -> 13..7
  static constexpr uint32_t kUnscale2 = 0x5C005C00u;  // fp16 256.0 twice
};
template <>
struct E4m3Bits<__nv_bfloat16> {
  static constexpr int kShift = 4;                 // eeee.mmm: bits 14..8 -> 10..4
  static constexpr uint32_t kUnscale2 = 0x7B807B80u;  // bf16 2^120 twice
};

// Bytes (b0, b1) and (b2, b3) of `v` (four consecutive e4m3 elements, b0 first) as 16-bit pairs,
// each byte at the top of its half: [b1 00 b0 00] and [b3 00 b2 00].
__device__ __forceinline__ uint32_t spread01(uint32_t v) { return __byte_perm(v, 0u, 0x1404); }
__device__ __forceinline__ uint32_t spread23(uint32_t v) { return __byte_perm(v, 0u, 0x3424); }

// A spread pair -> T pair bits holding value * 2^-8 (fp16) or value * 2^-120 (bf16).
template <typename T>
__device__ __forceinline__ uint32_t scaled_pair(uint32_t h) {
  return (h & 0x80008000u) | ((h & 0x7F007F00u) >> E4m3Bits<T>::kShift);
}

template <typename To, typename From>
__device__ __forceinline__ To bit_cast(const From& v) {
  static_assert(sizeof(To) == sizeof(From));
  To r;
  memcpy(&r, &v, sizeof(r));
  return r;
}

// Exact pair multiply (2 x 16-bit in one register).
template <typename T>
__device__ __forceinline__ uint32_t mul_pair(uint32_t a, uint32_t b);
template <>
__device__ __forceinline__ uint32_t mul_pair<__half>(uint32_t a, uint32_t b) {
  return bit_cast<uint32_t>(__hmul2(bit_cast<__half2>(a), bit_cast<__half2>(b)));
}
template <>
__device__ __forceinline__ uint32_t mul_pair<__nv_bfloat16>(uint32_t a, uint32_t b) {
  return bit_cast<uint32_t>(__hmul2(bit_cast<__nv_bfloat162>(a), bit_cast<__nv_bfloat162>(b)));
}

// Four e4m3 values (one 32-bit word, element 0 in the low byte) -> two T pairs, exact.
template <typename T>
__device__ __forceinline__ void e4m3x4_to_pairs(uint32_t v, uint32_t& p01, uint32_t& p23) {
  p01 = mul_pair<T>(scaled_pair<T>(spread01(v)), E4m3Bits<T>::kUnscale2);
  p23 = mul_pair<T>(scaled_pair<T>(spread23(v)), E4m3Bits<T>::kUnscale2);
}

// Eight e4m3 values (8 bytes, element 0 first) -> fp32 values * 2^-8 (the caller folds 2^8 into
// its scales: fp16 bits convert to fp32 exactly and no fp32 product comes near a denormal).
__device__ __forceinline__ void e4m3x8_to_float_div256(uint2 v, float (&f)[8]) {
  const uint32_t w[2] = {v.x, v.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t a = scaled_pair<__half>(spread01(w[i])), b = scaled_pair<__half>(spread23(w[i]));
    const float2 fa = __half22float2(bit_cast<__half2>(a));
    const float2 fb = __half22float2(bit_cast<__half2>(b));
    f[4 * i] = fa.x;
    f[4 * i + 1] = fa.y;
    f[4 * i + 2] = fb.x;
    f[4 * i + 3] = fb.y;
  }
}

}  // namespace fp8
}  // namespace minisgl
