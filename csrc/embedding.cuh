// Embedding index: out[i] = weight[ids[i] - start] for ids in [start, end), zeros otherwise
// (the vocab-parallel form; the plain lookup is start = 0, end = vocab). Framework-free.
//
// Layout: weight [rows, row_bytes] with a row stride; out [n, row_bytes] with a row stride;
// ids [n] int32 or int64. Memory traffic: n * row_bytes read (rows outside the range are
// not read) + n * row_bytes written + the ids.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace minisgl {

// A group of blockDim.x threads per output row, blockDim.y rows per block. Each thread
// issues kInFlight VecT loads before its first store, so a 2-8 KB row is in flight at once.
template <typename IdT, typename VecT, int kInFlight>
__global__ void embedding_kernel(char* __restrict__ out, const char* __restrict__ weight,
                                 const IdT* __restrict__ ids, int64_t n, int64_t row_vecs,
                                 int64_t weight_stride_bytes, int64_t out_stride_bytes, int64_t start,
                                 int64_t end) {
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (token >= n) return;
  const int64_t id = static_cast<int64_t>(ids[token]);
  VecT* dst = reinterpret_cast<VecT*>(out + token * out_stride_bytes);
  if (id < start || id >= end) {
    for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) dst[i] = VecT{};
    return;
  }
  const VecT* src = reinterpret_cast<const VecT*>(weight + (id - start) * weight_stride_bytes);
  for (int64_t i0 = threadIdx.x; i0 < row_vecs; i0 += kInFlight * blockDim.x) {
    VecT r[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int64_t i = i0 + j * static_cast<int64_t>(blockDim.x);
      if (i < row_vecs) r[j] = src[i];
    }
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int64_t i = i0 + j * static_cast<int64_t>(blockDim.x);
      if (i < row_vecs) dst[i] = r[j];
    }
  }
}

}  // namespace minisgl
