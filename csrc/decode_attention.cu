// Launchers of the paged decode attention kernels: instance selection, the split policy and
// the two launches. The split count depends only on host values (batch, heads, head_dim,
// dtype, a max-length bound, the GPU), so a captured CUDA graph keeps a valid launch shape.
#include <algorithm>
#include <atomic>

#include "decode_attention.cuh"
#include "decode_merge.cuh"
#include "device_cache.h"
#include "launchers.h"
#include "pdl.h"

namespace minisgl {

namespace {

using decode::Params;
using KernelFn = void (*)(Params);

// Unroll: tokens per row group per tile (2 * U 16-byte copies per thread and stage); small
// head dims put many rows in one warp, and a warp's tile may hold at most 32 tokens.
template <int D>
constexpr int unroll_for() {
  return D >= 32 ? 4 : 2;
}

struct Instance {
  KernelFn split = nullptr;
  KernelFn merge = nullptr;
  int tile = 0;
};

// KV: the cache's element type, T or uint8_t (e4m3).
template <typename T, typename KV, int D, int GP>
Instance make_instance() {
  constexpr int U = unroll_for<D>();
  return Instance{decode::split_kernel<T, KV, D, GP, U>, decode::merge_kernel<T, D>,
                  decode::SplitShape<D, U>::kTile};
}

template <typename T, typename KV, int D>
Instance pick_group(int group) {
  if (group <= 1) return make_instance<T, KV, D, 1>();
  if (group <= 2) return make_instance<T, KV, D, 2>();
  if (group <= 4) return make_instance<T, KV, D, 4>();
  return make_instance<T, KV, D, 8>();
}

template <typename T, typename KV>
Instance pick_dim(int head_dim, int group) {
  switch (head_dim) {
    case 16: return pick_group<T, KV, 16>(group);
    case 32: return pick_group<T, KV, 32>(group);
    case 64: return pick_group<T, KV, 64>(group);
    case 128: return pick_group<T, KV, 128>(group);
    case 256: return pick_group<T, KV, 256>(group);
    default: return Instance{};
  }
}

// dtype: 0 = float16, 1 = bfloat16; kv_fp8: the cache is e4m3 instead of dtype.
Instance pick(int dtype, int kv_fp8, int head_dim, int group) {
  if (group < 1 || group > 8 || (kv_fp8 != 0 && kv_fp8 != 1)) return Instance{};
  if (dtype == 0) return kv_fp8 ? pick_dim<__half, uint8_t>(head_dim, group) : pick_dim<__half, __half>(head_dim, group);
  if (dtype == 1)
    return kv_fp8 ? pick_dim<__nv_bfloat16, uint8_t>(head_dim, group)
                  : pick_dim<__nv_bfloat16, __nv_bfloat16>(head_dim, group);
  return Instance{};
}

// The SM count per device, read once (device_cache.h).
std::atomic<int> g_sms[kMaxDevices];

}  // namespace

int paged_decode_num_splits(int device, int batch, int kv_heads, int group, int head_dim, int dtype, int kv_fp8,
                            int64_t max_seq_len, int* num_splits) {
  const Instance inst = pick(dtype, kv_fp8, head_dim, group);
  if (inst.split == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int sms = 0, per_sm = 0;
  cudaError_t err = cached_per_device(g_sms, device, &sms, [](int d, int* v) {
    return cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, d);
  });
  // Occupancy of the current device's instance: called once per shape (the caller caches it).
  if (err == cudaSuccess)
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, inst.split, decode::kThreads, 0);
  if (err != cudaSuccess) return static_cast<int>(err);
  // Fill the GPU in one wave: about 3/4 of the resident block slots (measured on an H100 at
  // B = 1 and 16: 3/4 beat a full wave by 2-6%, the merge pass shrinking with the split
  // count), and at least one block per SM; no split shorter than kMinSplitTokens of the
  // longest possible request (a 4k context took 13.9 us at 33 splits, 16.5 us at 66), and
  // no more splits than the merge buffer holds.
  constexpr int64_t kMinSplitTokens = 128;
  const int64_t ctas = std::max<int64_t>(1, static_cast<int64_t>(batch) * kv_heads);
  const int64_t resident = static_cast<int64_t>(sms) * std::max(per_sm, 1);
  int64_t s = std::max(3 * resident / (4 * ctas), (sms + ctas - 1) / ctas);
  const int64_t longest = (std::max<int64_t>(max_seq_len, 1) + kMinSplitTokens - 1) / kMinSplitTokens;
  s = std::min({s, longest, static_cast<int64_t>(decode::kMaxSplits)});
  *num_splits = static_cast<int>(std::max<int64_t>(s, 1));
  return 0;
}

int paged_decode_attention(const void* q, const void* k_cache, const void* v_cache,
                           const int32_t* req_to_slot, const int32_t* req_rows,
                           const int32_t* seq_lens, void* out, float* part_o, float* part_lse,
                           int batch, int kv_heads, int group, int head_dim, int dtype, int kv_fp8,
                           int64_t q_stride_b, int64_t out_stride_b, int64_t cache_stride_s,
                           int64_t table_stride, int max_context, int num_splits, float scale,
                           float k_scale, float v_scale, int device, void* stream_ptr, int window,
                           const float* sinks) {
  const Instance inst = pick(dtype, kv_fp8, head_dim, group);
  if (inst.split == nullptr || window < 0 || num_splits < 1 || num_splits > decode::kMaxSplits || kv_heads < 1 ||
      batch > 65535 || kv_heads > 65535 || (num_splits > 1 && (part_o == nullptr || part_lse == nullptr)))
    return static_cast<int>(cudaErrorInvalidValue);
  if (batch <= 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // An e4m3 cache converts to value * 2^-8 in the kernel (fp8_convert.cuh): the 2^8 goes here.
  const float unit = kv_fp8 ? 256.0f : 1.0f;
  Params p{q, k_cache, v_cache, req_to_slot, req_rows, seq_lens, out, part_o, part_lse,
           q_stride_b, out_stride_b, cache_stride_s, table_stride, kv_heads, group,
           max_context, num_splits, inst.tile, scale * k_scale * unit * 1.4426950408889634f, v_scale * unit,
           window < 0 ? 0 : window, sinks};
  // Programmatic dependent launch (Hopper+) for both grids: the split grid may start while the
  // previous kernel (rope + KV store) runs, reading only the step's metadata before its
  // griddepcontrol.wait; the merge grid's launch overlaps the split grid's tail, and it waits
  // for the split grid before reading the partials.
  bool pdl = false;
  cudaError_t err = pdl_allowed_on(device, &pdl);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(num_splits, kv_heads, batch);
  cfg.blockDim = dim3(decode::kThreads);
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, inst.split, p);
  if (err != cudaSuccess || num_splits == 1) return static_cast<int>(err);
  cfg.gridDim = dim3(kv_heads * group, batch);
  return static_cast<int>(cudaLaunchKernelEx(&cfg, inst.merge, p));
}

}  // namespace minisgl
