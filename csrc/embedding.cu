#include <cstdint>

#include "embedding.cuh"
#include "launchers.h"

namespace minisgl {

namespace {

constexpr int kInFlight = 4;

bool aligned(int64_t n, const void* a, const void* b, int64_t s0, int64_t s1, int64_t s2) {
  return reinterpret_cast<intptr_t>(a) % n == 0 && reinterpret_cast<intptr_t>(b) % n == 0 &&
         s0 % n == 0 && s1 % n == 0 && s2 % n == 0;
}

template <typename IdT, typename VecT>
cudaError_t launch(void* out, const void* weight, const void* ids, int64_t n, int64_t row_bytes,
                   int64_t weight_stride, int64_t out_stride, int64_t start, int64_t end,
                   cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(VecT));
  // Threads per row: enough that one pass of kInFlight loads covers the row, >= one warp.
  int tx = 32;
  while (tx < 256 && tx * kInFlight < row_vecs) tx *= 2;
  const int ty = 256 / tx;
  const int64_t blocks = (n + ty - 1) / ty;
  embedding_kernel<IdT, VecT, kInFlight><<<static_cast<unsigned>(blocks), dim3(tx, ty), 0, stream>>>(
      static_cast<char*>(out), static_cast<const char*>(weight), static_cast<const IdT*>(ids), n,
      row_vecs, weight_stride, out_stride, start, end);
  return cudaGetLastError();
}

template <typename IdT>
cudaError_t dispatch_vec(void* out, const void* weight, const void* ids, int64_t n, int64_t row_bytes,
                         int64_t weight_stride, int64_t out_stride, int64_t start, int64_t end,
                         cudaStream_t stream) {
  if (aligned(16, out, weight, row_bytes, weight_stride, out_stride))
    return launch<IdT, uint4>(out, weight, ids, n, row_bytes, weight_stride, out_stride, start, end, stream);
  if (aligned(4, out, weight, row_bytes, weight_stride, out_stride))
    return launch<IdT, uint32_t>(out, weight, ids, n, row_bytes, weight_stride, out_stride, start, end, stream);
  return launch<IdT, uint16_t>(out, weight, ids, n, row_bytes, weight_stride, out_stride, start, end, stream);
}

}  // namespace

int embedding_lookup(void* out, const void* weight, const void* ids, int ids_are_int64, int64_t n,
                     int64_t row_bytes, int64_t weight_stride_bytes, int64_t out_stride_bytes,
                     int64_t start, int64_t end, void* stream_ptr) {
  if (n <= 0) return 0;
  if (n > INT32_MAX || row_bytes % 2 != 0) return static_cast<int>(cudaErrorInvalidValue);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (ids_are_int64)
    return static_cast<int>(dispatch_vec<int64_t>(out, weight, ids, n, row_bytes, weight_stride_bytes,
                                                  out_stride_bytes, start, end, stream));
  return static_cast<int>(dispatch_vec<int32_t>(out, weight, ids, n, row_bytes, weight_stride_bytes,
                                                out_stride_bytes, start, end, stream));
}

}  // namespace minisgl
