// Whether a launch may ask for programmatic dependent launch (PDL). The kernels' griddepcontrol.wait
// is compiled only for sm_90+ targets (#if __CUDA_ARCH__ >= 900), and a GPU runs the built target
// (SASS, or PTX compiled at load) closest below its compute capability: so PDL needs a built target
// of at least 90 that the GPU can run. MINISGL_PDL_ARCH is the smallest built target >= 90, or 0 if
// none (CMakeLists.txt sets it). A build for '80' alone runs its sm_80 code on a Hopper GPU, with no
// wait before the reads of the previous kernel's output: it never launches with PDL.
#pragma once
#include <cuda_runtime.h>

#ifndef MINISGL_PDL_ARCH
#error "MINISGL_PDL_ARCH must be defined (CMakeLists.txt: the smallest built CUDA target >= 90, or 0)"
#endif

namespace minisgl {

// cc: the GPU's compute capability, major * 10 + minor.
inline bool pdl_allowed(int cc) { return MINISGL_PDL_ARCH >= 90 && cc >= MINISGL_PDL_ARCH; }

// The compute capability of `device` as major * 10 + minor (two attribute queries).
inline cudaError_t compute_capability(int device, int* cc) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  *cc = major * 10 + minor;
  return err;
}

// pdl_allowed for `device`, read from the driver.
inline cudaError_t pdl_allowed_on(int device, bool* allowed) {
  int cc = 0;
  const cudaError_t err = compute_capability(device, &cc);
  *allowed = err == cudaSuccess && pdl_allowed(cc);
  return err;
}

}  // namespace minisgl
