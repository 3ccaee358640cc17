// Whether a launch may ask for programmatic dependent launch (PDL). The kernels' griddepcontrol.wait
// is compiled only for sm_90+ targets (#if __CUDA_ARCH__ >= 900), so PDL is allowed only where the code
// the GPU loaded for this extension was compiled for compute_90 or later: a build for '80' runs its
// compute_80 PTX on a Hopper GPU (without the waits), and an sm_90a / 90-real build beside a portable
// 80 does the same on a Blackwell GPU. Read from the loaded code itself (cudaFuncGetAttributes'
// ptxVersion, the virtual architecture it came from; every .cu file of the extension is compiled for
// the same targets), once per device.
#pragma once
#include <cuda_runtime.h>

namespace minisgl {

// `device`: the current CUDA device (the attribute query reads the current context's code).
cudaError_t pdl_allowed_on(int device, bool* allowed);

}  // namespace minisgl
