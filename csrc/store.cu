#include "launchers.h"
#include "store.cuh"

namespace minisgl {

namespace {

constexpr int kInFlight = 2;

bool aligned_to(int64_t value, int64_t n) { return value % n == 0; }

bool all_aligned(int64_t n, const void* a, const void* b, const void* c, const void* d,
                 int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
  return aligned_to(reinterpret_cast<intptr_t>(a), n) && aligned_to(reinterpret_cast<intptr_t>(b), n) &&
         aligned_to(reinterpret_cast<intptr_t>(c), n) && aligned_to(reinterpret_cast<intptr_t>(d), n) &&
         aligned_to(s0, n) && aligned_to(s1, n) && aligned_to(s2, n) && aligned_to(s3, n);
}

template <typename VecT>
cudaError_t launch(void* k_cache, void* v_cache, const void* k, const void* v,
                   const int32_t* slots, int64_t num_tokens, int64_t row_bytes,
                   int64_t cache_stride, int64_t k_stride, int64_t v_stride, cudaStream_t stream) {
  const int64_t row_vecs = row_bytes / static_cast<int64_t>(sizeof(VecT));
  // Threads per row: enough that one pass of kInFlight loads per tensor covers the row, at
  // least one warp; 256 threads per block.
  int tx = 32;
  while (tx < 256 && tx * kInFlight < row_vecs) tx *= 2;
  const int ty = 256 / tx;
  const int64_t blocks = (num_tokens + ty - 1) / ty;
  store_kv_kernel<VecT, kInFlight><<<static_cast<unsigned>(blocks), dim3(tx, ty), 0, stream>>>(
      static_cast<char*>(k_cache), static_cast<char*>(v_cache), static_cast<const char*>(k),
      static_cast<const char*>(v), slots, num_tokens, row_vecs, cache_stride, k_stride, v_stride);
  return cudaGetLastError();
}

}  // namespace

int store_kv(void* k_cache, void* v_cache, const void* k, const void* v, const int32_t* slots,
             int64_t num_tokens, int64_t row_bytes, int64_t cache_stride_bytes,
             int64_t k_stride_bytes, int64_t v_stride_bytes, void* stream_ptr) {
  if (num_tokens == 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const bool row16 = aligned_to(row_bytes, 16);
  if (row16 && all_aligned(16, k_cache, v_cache, k, v, cache_stride_bytes, k_stride_bytes,
                           v_stride_bytes, 16)) {
    return launch<uint4>(k_cache, v_cache, k, v, slots, num_tokens, row_bytes, cache_stride_bytes,
                         k_stride_bytes, v_stride_bytes, stream);
  }
  if (aligned_to(row_bytes, 4) && all_aligned(4, k_cache, v_cache, k, v, cache_stride_bytes,
                                              k_stride_bytes, v_stride_bytes, 4)) {
    return launch<uint32_t>(k_cache, v_cache, k, v, slots, num_tokens, row_bytes,
                            cache_stride_bytes, k_stride_bytes, v_stride_bytes, stream);
  }
  return launch<uint16_t>(k_cache, v_cache, k, v, slots, num_tokens, row_bytes, cache_stride_bytes,
                          k_stride_bytes, v_stride_bytes, stream);
}

const char* cuda_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace minisgl
