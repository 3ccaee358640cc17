#include "kv_copy.cuh"
#include "launchers.h"

namespace minisgl {

namespace {

// 4 x 16 bytes in flight per thread: a 2 KB row (8 heads x 128 dims, bf16) in one pass of a warp.
constexpr int kUnroll = 4;
constexpr int kThreads = 256;
// Resident blocks per SM at kThreads (2048 threads / SM on sm_80 and sm_90): one full wave.
constexpr int kBlocksPerSm = 8;

bool aligned(int64_t value, int64_t n) { return value % n == 0; }

bool all_aligned(int64_t n, const void* const* ptrs, int num_ptrs, const int64_t* values, int num_values) {
  for (int i = 0; i < num_ptrs; ++i)
    if (!aligned(reinterpret_cast<intptr_t>(ptrs[i]), n)) return false;
  for (int i = 0; i < num_values; ++i)
    if (!aligned(values[i], n)) return false;
  return true;
}

template <typename VecT>
cudaError_t launch(const void* src_k, const void* src_v, void* dst_k, void* dst_v, const int32_t* src_slots,
                   const int32_t* dst_slots, int64_t num_slots, int64_t num_layers, int64_t row_bytes,
                   int64_t src_layer_stride, int64_t src_slot_stride, int64_t dst_layer_stride,
                   int64_t dst_slot_stride, int num_sms, cudaStream_t stream) {
  const int64_t rows = 2 * num_layers * num_slots;
  const int64_t warps = kThreads / 32;
  int64_t blocks = (rows + warps - 1) / warps;
  const int64_t wave = static_cast<int64_t>(num_sms > 0 ? num_sms : 1) * kBlocksPerSm;
  if (blocks > wave) blocks = wave;
  kv_copy_kernel<VecT, kUnroll><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const char*>(src_k), static_cast<const char*>(src_v), static_cast<char*>(dst_k),
      static_cast<char*>(dst_v), src_slots, dst_slots, num_slots, num_layers,
      row_bytes / static_cast<int64_t>(sizeof(VecT)), src_layer_stride, src_slot_stride, dst_layer_stride,
      dst_slot_stride);
  return cudaGetLastError();
}

}  // namespace

int kv_copy_slots(const void* src_k, const void* src_v, void* dst_k, void* dst_v, const int32_t* src_slots,
                  const int32_t* dst_slots, int64_t num_slots, int64_t num_layers, int64_t row_bytes,
                  int64_t src_layer_stride, int64_t src_slot_stride, int64_t dst_layer_stride,
                  int64_t dst_slot_stride, int num_sms, void* stream_ptr) {
  if (num_slots == 0 || num_layers == 0 || row_bytes == 0) return 0;
  if (num_slots < 0 || num_layers < 0 || row_bytes < 0) return static_cast<int>(cudaErrorInvalidValue);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const void* ptrs[] = {src_k, src_v, dst_k, dst_v};
  const int64_t sizes[] = {row_bytes, src_layer_stride, src_slot_stride, dst_layer_stride, dst_slot_stride};
  // The widest access that divides every base, stride and the row: 16 bytes for any real pool
  // (head_dim 64+ at 1+ byte per element); the narrower ones keep odd test shapes correct.
  if (all_aligned(16, ptrs, 4, sizes, 5))
    return launch<uint4>(src_k, src_v, dst_k, dst_v, src_slots, dst_slots, num_slots, num_layers, row_bytes,
                         src_layer_stride, src_slot_stride, dst_layer_stride, dst_slot_stride, num_sms, stream);
  if (all_aligned(4, ptrs, 4, sizes, 5))
    return launch<unsigned int>(src_k, src_v, dst_k, dst_v, src_slots, dst_slots, num_slots, num_layers, row_bytes,
                                src_layer_stride, src_slot_stride, dst_layer_stride, dst_slot_stride, num_sms,
                                stream);
  return launch<unsigned char>(src_k, src_v, dst_k, dst_v, src_slots, dst_slots, num_slots, num_layers, row_bytes,
                               src_layer_stride, src_slot_stride, dst_layer_stride, dst_slot_stride, num_sms,
                               stream);
}

int host_device_pointer(void* host, void** device) {
  // Pinned memory is mapped into the device's address space (UVA); pageable memory is not, and a
  // kernel cannot reach it (ops/kv_copy.py sends such pools down the torch path before asking).
  // The pointer attributes, not cudaHostGetDevicePointer: they also answer for an address inside
  // a registered range (the tier's V half).
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, host);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (attr.type != cudaMemoryTypeHost || attr.devicePointer == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  *device = attr.devicePointer;
  return 0;
}

}  // namespace minisgl
