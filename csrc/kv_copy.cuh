// KV copy between two pools by slot lists: dst[t][layer][dst_slots[i]] = src[t][layer][src_slots[i]]
// for t in {K, V}, every layer and every i, in one launch. Framework-free: raw pointers, sizes
// and byte strides only.
//
// Either side may be pinned host memory read or written through its device-accessible (UVA)
// address: the host KV tier's pool. A copy of scattered slots then needs no staging buffer and
// no per-page cudaMemcpyAsync; each warp moves whole rows (one slot of one layer of K or V,
// e.g. 8 heads x 128 dims x 2 bytes = 2 KB) with 16-byte loads, all of a thread's loads issued
// before its stores, so that enough PCIe read requests are in flight to cover the link's latency
// (~1-2 us x ~50 GB/s = ~100 KB: a few dozen of the thousands of resident warps).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace minisgl {

// Loads and stores that bypass the caches' normal allocation policy (__ldcs / __stcs): every
// byte is touched once, and a load-back of gigabytes should not flush L2 of the forward's data.
template <typename VecT>
__device__ __forceinline__ VecT kv_copy_load(const VecT* p) {
  return __ldcs(p);
}
template <typename VecT>
__device__ __forceinline__ void kv_copy_store(VecT* p, VecT v) {
  __stcs(p, v);
}

// Rows are numbered (tensor, layer, i) with i fastest: neighbouring warps copy neighbouring
// entries of the slot lists, which are mostly runs of consecutive slots (pages of consecutive
// slots, host pages handed out in order), so the host side sees long sequential bursts.
// Grid-stride over rows: the launcher sizes the grid to fill the GPU once.
template <typename VecT, int kUnroll>
__global__ void kv_copy_kernel(const char* __restrict__ src_k, const char* __restrict__ src_v,
                               char* __restrict__ dst_k, char* __restrict__ dst_v,
                               const int32_t* __restrict__ src_slots, const int32_t* __restrict__ dst_slots,
                               int64_t num_slots, int64_t num_layers, int64_t row_vecs,
                               int64_t src_layer_stride, int64_t src_slot_stride,
                               int64_t dst_layer_stride, int64_t dst_slot_stride) {
  const int lane = threadIdx.x & 31;
  const int64_t warps_per_block = blockDim.x >> 5;
  const int64_t rows = 2 * num_layers * num_slots;
  const int64_t step = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = blockIdx.x * warps_per_block + (threadIdx.x >> 5); row < rows; row += step) {
    const int64_t i = row % num_slots;
    const int64_t tl = row / num_slots;  // tensor * num_layers + layer
    const bool is_v = tl >= num_layers;
    const int64_t layer = is_v ? tl - num_layers : tl;
    const VecT* src = reinterpret_cast<const VecT*>((is_v ? src_v : src_k) + layer * src_layer_stride +
                                                    static_cast<int64_t>(src_slots[i]) * src_slot_stride);
    VecT* dst = reinterpret_cast<VecT*>((is_v ? dst_v : dst_k) + layer * dst_layer_stride +
                                        static_cast<int64_t>(dst_slots[i]) * dst_slot_stride);
    for (int64_t v0 = lane; v0 < row_vecs; v0 += kUnroll * 32) {
      VecT r[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t v = v0 + j * 32;
        if (v < row_vecs) r[j] = kv_copy_load(src + v);
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t v = v0 + j * 32;
        if (v < row_vecs) kv_copy_store(dst + v, r[j]);
      }
    }
  }
}

}  // namespace minisgl
