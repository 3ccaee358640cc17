// A nonzero int per CUDA device, read once per device and process (launches then read the cache:
// no driver queries on the launch path). Shared by the launchers' device facts.
#pragma once
#include <cuda_runtime.h>

#include <atomic>

namespace minisgl {

constexpr int kMaxDevices = 64;

// cache[device], filled on first use by read(device, &value) (which must give a nonzero value);
// 0 in the cache = not read yet. Racing first reads store the same value.
template <typename Read>
cudaError_t cached_per_device(std::atomic<int>* cache, int device, int* value, Read read) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int v = cache[device].load(std::memory_order_relaxed);
  if (v == 0) {
    const cudaError_t err = read(device, &v);
    if (err != cudaSuccess) return err;
    cache[device].store(v, std::memory_order_relaxed);
  }
  *value = v;
  return cudaSuccess;
}

}  // namespace minisgl
