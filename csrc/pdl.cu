// pdl.h: whether the code loaded on a device may be launched with programmatic dependent launch.
#include <atomic>

#include "device_cache.h"
#include "launchers.h"
#include "pdl.h"

namespace minisgl {

namespace {

// Compiled for every target of the build, as every kernel of the extension: the loaded copy's
// ptxVersion is the virtual architecture the device's code came from.
__global__ void pdl_probe_kernel() {}

std::atomic<int> g_state[kMaxDevices];  // 1 no PDL, 2 PDL (device_cache.h; 0 not read yet)

}  // namespace

cudaError_t pdl_allowed_on(int device, bool* allowed) {
  int state = 0;
  const cudaError_t err = cached_per_device(g_state, device, &state, [](int, int* v) {
    cudaFuncAttributes attrs = {};
    const cudaError_t e = cudaFuncGetAttributes(&attrs, pdl_probe_kernel);
    *v = attrs.ptxVersion >= 90 ? 2 : 1;
    return e;
  });
  *allowed = err == cudaSuccess && state == 2;
  return err;
}

int pdl_enabled(int device, int* enabled) {
  bool allowed = false;
  const cudaError_t err = pdl_allowed_on(device, &allowed);
  *enabled = allowed ? 1 : 0;
  return static_cast<int>(err);
}

}  // namespace minisgl
