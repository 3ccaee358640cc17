// Launcher and peer-memory set-up of the one-shot all-reduce (custom_all_reduce.cuh).
#include <cstring>

#include "all_reduce_norm.cuh"
#include "custom_all_reduce.cuh"
#include "launchers.h"
#include "pdl.h"

namespace minisgl {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcHandleBytes, "launchers.h's IPC handle size is wrong");
static_assert(car::kNormMaxSlotsPerThread * car::kThreads * 8 == kCustomAllReduceNormMaxHidden,
              "launchers.h and all_reduce_norm.cuh disagree on the longest row");
static_assert(car::kMaxWorld == kCustomAllReduceMaxWorld && car::kMaxBlocks == kCustomAllReduceMaxBlocks,
              "launchers.h and custom_all_reduce.cuh disagree on the limits");

namespace {

// Makes `device` current for the set-up calls and restores the caller's device after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    err_ = cudaGetDevice(&previous_);
    if (err_ == cudaSuccess && previous_ != device) err_ = cudaSetDevice(device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return err_; }

 private:
  int previous_ = -1;
  cudaError_t err_;
};

// A failed runtime call is also recorded as the thread's last error, which a later launcher's
// cudaGetLastError() would then report as its own failure: clear it here, once returned.
cudaError_t reported(cudaError_t err) {
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

int64_t region_bytes(int64_t buffer_bytes) { return car::kSignalBytes + 2 * buffer_bytes; }

template <int kDtype, int W>
void launch_world(const car::RankBases& ranks, int rank, const void* in, void* out, int64_t n,
                  int64_t buffer_bytes, int blocks, bool aligned, cudaStream_t stream) {
  if (aligned) {
    car::one_shot_all_reduce_kernel<kDtype, W, true>
        <<<blocks, car::kThreads, 0, stream>>>(ranks, rank, in, out, n, buffer_bytes);
  } else {
    car::one_shot_all_reduce_kernel<kDtype, W, false>
        <<<blocks, car::kThreads, 0, stream>>>(ranks, rank, in, out, n, buffer_bytes);
  }
}

template <int kDtype>
cudaError_t launch_dtype(const car::RankBases& ranks, int world, int rank, const void* in, void* out,
                         int64_t n, int64_t buffer_bytes, int blocks, bool aligned, cudaStream_t stream) {
  switch (world) {
    case 1: launch_world<kDtype, 1>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 2: launch_world<kDtype, 2>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 3: launch_world<kDtype, 3>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 4: launch_world<kDtype, 4>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 5: launch_world<kDtype, 5>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 6: launch_world<kDtype, 6>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 7: launch_world<kDtype, 7>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    case 8: launch_world<kDtype, 8>(ranks, rank, in, out, n, buffer_bytes, blocks, aligned, stream); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <int kDtype>
cudaError_t launch_norm_dtype(const car::RankBases& ranks, int world, int rank, const void* in, void* residual,
                              void* out, const void* weight, int64_t rows, int64_t hidden, float eps,
                              int64_t buffer_bytes, int blocks, cudaStream_t stream) {
  // Programmatic dependent launch on sm_90+ (all_reduce_norm.cuh says what it overlaps).
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(static_cast<unsigned>(blocks));
  launch.blockDim = dim3(car::kThreads);
  launch.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  int device = 0;
  bool allowed = false;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = pdl_allowed_on(device, &allowed);
  if (err != cudaSuccess) return reported(err);
  if (allowed) {
    launch.attrs = attr;
    launch.numAttrs = 1;
  }
  const void* in_c = in;
  const void* weight_c = weight;
#define MINISGL_NORM_CASE(W)                                                                                  \
  case W:                                                                                                     \
    err = cudaLaunchKernelEx(&launch, car::one_shot_all_reduce_rmsnorm_kernel<kDtype, W>, ranks, rank, in_c,  \
                             residual, out, weight_c, rows, hidden, eps, buffer_bytes);                       \
    break;
  switch (world) {
    MINISGL_NORM_CASE(1)
    MINISGL_NORM_CASE(2)
    MINISGL_NORM_CASE(3)
    MINISGL_NORM_CASE(4)
    MINISGL_NORM_CASE(5)
    MINISGL_NORM_CASE(6)
    MINISGL_NORM_CASE(7)
    MINISGL_NORM_CASE(8)
    default: return cudaErrorInvalidValue;
  }
#undef MINISGL_NORM_CASE
  return err != cudaSuccess ? reported(err) : cudaGetLastError();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int custom_all_reduce_alloc(int device, int64_t buffer_bytes, void** base) {
  *base = nullptr;
  if (buffer_bytes <= 0 || buffer_bytes % 16 != 0) return cudaErrorInvalidValue;
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return reported(scope.error());
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, static_cast<size_t>(region_bytes(buffer_bytes)));
  if (err != cudaSuccess) return reported(err);
  // Epoch 0, no block running, every flag 0: the state the protocol starts from. Completed
  // before any peer can map the region (the handle is only handed out after this returns).
  err = cudaMemset(p, 0, static_cast<size_t>(region_bytes(buffer_bytes)));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(p);
    return reported(err);
  }
  *base = p;
  return cudaSuccess;
}

int custom_all_reduce_free(int device, void* base) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return reported(scope.error());
  return reported(cudaFree(base));
}

int peer_memory_handle(int device, void* base, char* handle) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return reported(scope.error());
  cudaIpcMemHandle_t h;
  const cudaError_t err = cudaIpcGetMemHandle(&h, base);
  if (err == cudaSuccess) std::memcpy(handle, h.reserved, kIpcHandleBytes);
  return reported(err);
}

int peer_memory_open(int device, const char* handle, void** base) {
  *base = nullptr;
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return reported(scope.error());
  cudaIpcMemHandle_t h;
  std::memcpy(h.reserved, handle, kIpcHandleBytes);
  return reported(cudaIpcOpenMemHandle(base, h, cudaIpcMemLazyEnablePeerAccess));
}

int peer_memory_close(int device, void* base) {
  DeviceScope scope(device);
  if (scope.error() != cudaSuccess) return reported(scope.error());
  return reported(cudaIpcCloseMemHandle(base));
}

int custom_all_reduce(void* const* bases, int world, int rank, const void* in, void* out, int64_t n, int dtype,
                      int64_t buffer_bytes, int max_blocks, void* stream) {
  if (world < 1 || world > car::kMaxWorld || rank < 0 || rank >= world || n < 0 || max_blocks < 1 ||
      max_blocks > car::kMaxBlocks || buffer_bytes <= 0 || buffer_bytes % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t elem = dtype == kNcclFloat32 ? 4 : 2;
  const int64_t slots = (n * elem + 15) / 16;
  if (slots * 16 > buffer_bytes) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;  // every rank skips alike: the epochs stay in step
  car::RankBases ranks{};
  for (int r = 0; r < world; ++r) ranks.base[r] = static_cast<char*>(bases[r]);
  const int64_t want = (slots + car::kThreads - 1) / car::kThreads;
  const int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  const bool aligned = reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kNcclFloat16:
      return launch_dtype<kNcclFloat16>(ranks, world, rank, in, out, n, buffer_bytes, blocks, aligned, s);
    case kNcclBfloat16:
      return launch_dtype<kNcclBfloat16>(ranks, world, rank, in, out, n, buffer_bytes, blocks, aligned, s);
    case kNcclFloat32:
      return launch_dtype<kNcclFloat32>(ranks, world, rank, in, out, n, buffer_bytes, blocks, aligned, s);
    default:
      return cudaErrorInvalidValue;
  }
}

int custom_all_reduce_rmsnorm(void* const* bases, int world, int rank, const void* in, void* residual, void* out,
                              const void* weight, int64_t rows, int64_t hidden, int dtype, float eps,
                              int64_t buffer_bytes, int max_blocks, void* stream) {
  if (world < 1 || world > car::kMaxWorld || rank < 0 || rank >= world || rows < 0 || hidden <= 0 ||
      hidden % 8 != 0 || hidden > kCustomAllReduceNormMaxHidden || max_blocks < 1 || max_blocks > car::kMaxBlocks || buffer_bytes <= 0 ||
      buffer_bytes % 16 != 0 || rows * hidden * 2 > buffer_bytes || !aligned16(in) || !aligned16(residual) ||
      !aligned16(out) || !aligned16(weight)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;  // every rank skips alike: the epochs stay in step
  car::RankBases ranks{};
  for (int r = 0; r < world; ++r) ranks.base[r] = static_cast<char*>(bases[r]);
  const int blocks = static_cast<int>(rows < max_blocks ? rows : max_blocks);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kNcclFloat16:
      return launch_norm_dtype<kNcclFloat16>(ranks, world, rank, in, residual, out, weight, rows, hidden, eps,
                                             buffer_bytes, blocks, s);
    case kNcclBfloat16:
      return launch_norm_dtype<kNcclBfloat16>(ranks, world, rank, in, residual, out, weight, rows, hidden, eps,
                                              buffer_bytes, blocks, s);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace minisgl
