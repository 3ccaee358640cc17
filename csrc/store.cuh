// KV-cache store: scatter the K and V rows of a batch of new tokens into their cache slots.
// Framework-free: raw pointers, sizes and strides only.
//
// Layout: k_cache/v_cache are [num_slots, row_bytes] (all KV heads of one token are one
// contiguous row); k/v are [num_tokens, row_bytes] with a row stride (they are usually
// column slices of the fused qkv projection output). Memory traffic: 2 * num_tokens *
// row_bytes read + the same written, plus 4 bytes of slot id per token.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace minisgl {

// A group of blockDim.x threads per token row, blockDim.y rows per block. VecT is the widest
// type that divides the row and every base/stride (uint4 = 16 bytes in the common case).
// Each thread issues kInFlight loads of K and kInFlight of V before its first store, so a
// whole row pair (e.g. 2 x 2 KB for 8 heads x 128 dims bf16) is in flight at once.
template <typename VecT, int kInFlight>
__global__ void store_kv_kernel(char* __restrict__ k_cache, char* __restrict__ v_cache,
                                const char* __restrict__ k, const char* __restrict__ v,
                                const int32_t* __restrict__ slots, int64_t num_tokens,
                                int64_t row_vecs, int64_t cache_stride_bytes,
                                int64_t k_stride_bytes, int64_t v_stride_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // A decode step's paged attention after this kernel (launched with programmatic dependent
  // launch) may start now: before its griddepcontrol.wait it reads only the step's metadata.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (token >= num_tokens) return;
  const int64_t slot = slots[token];
  const VecT* ksrc = reinterpret_cast<const VecT*>(k + token * k_stride_bytes);
  const VecT* vsrc = reinterpret_cast<const VecT*>(v + token * v_stride_bytes);
  VecT* kdst = reinterpret_cast<VecT*>(k_cache + slot * cache_stride_bytes);
  VecT* vdst = reinterpret_cast<VecT*>(v_cache + slot * cache_stride_bytes);
  for (int64_t i0 = threadIdx.x; i0 < row_vecs; i0 += kInFlight * blockDim.x) {
    VecT kr[kInFlight], vr[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int64_t i = i0 + j * static_cast<int64_t>(blockDim.x);
      if (i < row_vecs) {
        kr[j] = ksrc[i];
        vr[j] = vsrc[i];
      }
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int64_t i = i0 + j * static_cast<int64_t>(blockDim.x);
      if (i < row_vecs) {
        kdst[i] = kr[j];
        vdst[i] = vr[j];
      }
    }
  }
}

}  // namespace minisgl
