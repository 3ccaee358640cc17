// pdl.h: whether the code loaded on a device may be launched with programmatic dependent launch.
#include <atomic>

#include "launchers.h"
#include "pdl.h"

namespace minisgl {

namespace {

// Compiled for every target of the build, as every kernel of the extension: the loaded copy's
// ptxVersion is the virtual architecture the device's code came from.
__global__ void pdl_probe_kernel() {}

constexpr int kMaxDevices = 64;
std::atomic<int> g_state[kMaxDevices];  // 0 not read yet, 1 no PDL, 2 PDL

}  // namespace

cudaError_t pdl_allowed_on(int device, bool* allowed) {
  *allowed = false;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  int state = g_state[device].load(std::memory_order_relaxed);
  if (state == 0) {
    cudaFuncAttributes attrs = {};
    const cudaError_t err = cudaFuncGetAttributes(&attrs, pdl_probe_kernel);
    if (err != cudaSuccess) return err;
    state = attrs.ptxVersion >= 90 ? 2 : 1;
    g_state[device].store(state, std::memory_order_relaxed);  // racing first reads store the same value
  }
  *allowed = state == 2;
  return cudaSuccess;
}

int pdl_enabled(int device, int* enabled) {
  bool allowed = false;
  const cudaError_t err = pdl_allowed_on(device, &allowed);
  *enabled = allowed ? 1 : 0;
  return static_cast<int>(err);
}

}  // namespace minisgl
