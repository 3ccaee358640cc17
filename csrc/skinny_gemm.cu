// Launcher of the skinny GEMM (csrc/skinny_gemm.cuh): the table of tile configurations
// (template instances, chosen at run time by index so that a sweep needs no recompile), the
// argument checks the kernel's vector loads rely on, and the launch.
#include <cstdint>

#include "launchers.h"
#include "skinny_gemm.cuh"

namespace minisgl {

namespace {

using skinny::Params;
using KernelFn = void (*)(Params);

// Tile configurations: row tiles per block (16 W rows each) and 32-element chunks per warp
// group (16-byte W loads in flight per thread: 2 * RT * U), and the largest x tile count (MT)
// each is built for (beyond it the registers spill). The index is the Python-visible id;
// append, never reorder (cached tuning tables name configurations by id).
struct TileConfig {
  int rt, u, max_mt;
};
constexpr TileConfig kConfigs[] = {{1, 2, 4}, {1, 4, 4}, {2, 2, 4}, {2, 4, 2}};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);

template <typename T, int MT>
KernelFn pick_config(int cfg) {
  switch (cfg) {
    case 0: return skinny::skinny_gemm_kernel<T, MT, 1, 2>;
    case 1: return skinny::skinny_gemm_kernel<T, MT, 1, 4>;
    case 2: return skinny::skinny_gemm_kernel<T, MT, 2, 2>;
    case 3:
      if constexpr (MT <= kConfigs[3].max_mt) return skinny::skinny_gemm_kernel<T, MT, 2, 4>;
      return nullptr;
    default: return nullptr;
  }
}
static_assert(kNumConfigs == 4, "pick_config must list every configuration");

template <typename T>
KernelFn pick_m(int m, int cfg) {
  switch ((m + 7) / 8) {
    case 1: return pick_config<T, 1>(cfg);
    case 2: return pick_config<T, 2>(cfg);
    case 3: return pick_config<T, 3>(cfg);
    case 4: return pick_config<T, 4>(cfg);
    default: return nullptr;
  }
}

// Bounds the workspace and keeps split * k_split within int.
constexpr int kMaxSplits = 64;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

int skinny_gemm_num_configs() { return kNumConfigs; }

int skinny_gemm_config(int cfg, int* row_tiles, int* chunks, int* max_m) {
  if (cfg < 0 || cfg >= kNumConfigs) return static_cast<int>(cudaErrorInvalidValue);
  *row_tiles = kConfigs[cfg].rt;
  *chunks = kConfigs[cfg].u;
  *max_m = kConfigs[cfg].max_mt * 8;
  return 0;
}

int skinny_gemm(const void* x, const void* w, const void* bias, void* y, float* workspace,
                int64_t workspace_bytes, int* counters, int64_t num_counters, int m, int n, int k,
                int64_t x_stride, int64_t w_stride, int64_t y_stride, int silu, int dtype, int cfg,
                int warps, int num_splits, int pdl, void* stream) {
  if (cfg < 0 || cfg >= kNumConfigs || m < 1 || m > kConfigs[cfg].max_mt * 8 || n < 1 || k < 8 || k % 8 != 0 || warps < 1 ||
      warps > skinny::kMaxWarps || num_splits < 1 || num_splits > kMaxSplits || x_stride % 8 != 0 ||
      w_stride % 8 != 0 || !aligned16(x) || !aligned16(w) || (silu != 0 && silu != 1))
    return static_cast<int>(cudaErrorInvalidValue);
  KernelFn fn = dtype == 0 ? pick_m<__half>(m, cfg) : dtype == 1 ? pick_m<__nv_bfloat16>(m, cfg) : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  const TileConfig c = kConfigs[cfg];
  const int mt = (m + 7) / 8;
  const int64_t rows_per_block = static_cast<int64_t>(c.rt) * (silu ? 8 : 16);
  const int64_t tiles = (n + rows_per_block - 1) / rows_per_block;
  if (tiles > INT32_MAX) return static_cast<int>(cudaErrorInvalidValue);
  // Each split covers whole warp groups (U * 32 elements), so every group starts 64-byte aligned.
  const int64_t group = static_cast<int64_t>(c.u) * skinny::kChunk;
  const int64_t per_split = ((k + num_splits - 1) / num_splits + group - 1) / group * group;
  if (num_splits > 1) {
    const int64_t items = static_cast<int64_t>(c.rt) * mt * 2 * 32;  // float2 per (tile, split)
    if (workspace == nullptr || counters == nullptr || num_counters < tiles ||
        workspace_bytes < tiles * num_splits * items * 8)
      return static_cast<int>(cudaErrorInvalidValue);
  }
  Params p{x, w, bias, y, workspace, counters, x_stride, w_stride, y_stride, m, n, k, silu,
           static_cast<int>(per_split), num_splits};
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(static_cast<unsigned>(tiles), num_splits);
  launch.blockDim = dim3(warps * 32);
  launch.dynamicSmemBytes = static_cast<size_t>(warps) * c.rt * mt * 128 * sizeof(float);
  launch.stream = static_cast<cudaStream_t>(stream);
  // Programmatic dependent launch (Hopper+): this grid may start while the previous kernel
  // finishes; the kernel loads its first W group, then waits for it (griddepcontrol.wait).
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    int device = 0, major = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (major >= 9) {
      launch.attrs = attr;
      launch.numAttrs = 1;
    }
  }
  return static_cast<int>(cudaLaunchKernelEx(&launch, fn, p));
}

}  // namespace minisgl
