// Launchers of the dense skinny GEMM (csrc/skinny_gemm.cuh, weight loaders in skinny_weights.cuh and
// skinny_w4.cuh): 16-bit, FP8 and 4-bit weights, each format's tile table (csrc/skinny_launch.h) picked
// by index and x tile count. The MoE launchers are csrc/skinny_moe.cu.
#include <cstdint>

#include "launchers.h"
#include "skinny_launch.h"

namespace minisgl {

using namespace skinny_launch;  // NOLINT: this file is the tables' and checks' user

namespace {

// Configuration I of W's table for MT x tiles (null past its max_mt: the registers would spill).
template <template <typename> class W, typename T, int MT, int I>
KernelFn instance() {
  constexpr TileConfig c = Tiles<W>::kList[I];
  if constexpr (MT <= c.max_mt) return skinny::skinny_kernel<W<T>, MT, c.rt, c.u>;
  return nullptr;
}

template <template <typename> class W, typename T, int MT>
KernelFn pick_config(int cfg) {
  static_assert(sizeof(Tiles<W>::kList) == 4 * sizeof(TileConfig), "pick_config and pick_moe list 4 configurations");
  switch (cfg) {
    case 0: return instance<W, T, MT, 0>();
    case 1: return instance<W, T, MT, 1>();
    case 2: return instance<W, T, MT, 2>();
    case 3: return instance<W, T, MT, 3>();
    default: return nullptr;
  }
}

template <template <typename> class W, typename T>
KernelFn pick_m(int m, int cfg) {
  switch ((m + 7) / 8) {
    case 1: return pick_config<W, T, 1>(cfg);
    case 2: return pick_config<W, T, 2>(cfg);
    case 3: return pick_config<W, T, 3>(cfg);
    case 4: return pick_config<W, T, 4>(cfg);
    default: return nullptr;
  }
}

// warp_ranges (deterministic mode) also takes the loader whose k16 steps are contiguous K (Bf16DetW).
template <typename T>
KernelFn pick_16bit(int m, int cfg, int warp_ranges) {
  return warp_ranges ? pick_m<skinny::Bf16DetW, T>(m, cfg) : pick_m<skinny::Bf16W, T>(m, cfg);
}

template <typename T>
KernelFn pick_w4(int fmt, int m, int cfg) {
  return fmt == 1 ? pick_m<skinny::Int4W, T>(m, cfg) : fmt == 2 ? pick_m<skinny::Mxfp4W, T>(m, cfg) : nullptr;
}

}  // namespace

int skinny_gemm_num_configs(int fp8) { return fp8 == 2 ? kNumW4Configs : fp8 ? kNumFp8Configs : kNumConfigs; }

int skinny_gemm_config(int fp8, int cfg, int* row_tiles, int* chunks, int* max_m) {
  const TileConfig* table = fp8 == 2 ? kW4Configs : fp8 ? kFp8Configs : kConfigs;
  if (cfg < 0 || cfg >= skinny_gemm_num_configs(fp8)) return static_cast<int>(cudaErrorInvalidValue);
  *row_tiles = table[cfg].rt;
  *chunks = table[cfg].u;
  *max_m = table[cfg].max_mt * 8;
  return 0;
}

int skinny_gemm(const void* x, const void* w, const void* bias, void* y, float* workspace,
                int64_t workspace_bytes, int* counters, int64_t num_counters, int m, int n, int k,
                int64_t x_stride, int64_t w_stride, int64_t y_stride, int silu, int dtype, int cfg,
                int warps, int num_splits, int pdl, void* stream, int warp_ranges) {
  if (cfg < 0 || cfg >= kNumConfigs || w_stride % 8 != 0 || (warp_ranges != 0 && warp_ranges != 1) ||
      !common_args_ok(m, kConfigs[cfg].max_mt * 8, n, k, warps, num_splits, x_stride, x, w, silu))
    return static_cast<int>(cudaErrorInvalidValue);
  KernelFn fn = dtype == 0   ? pick_16bit<__half>(m, cfg, warp_ranges)
                : dtype == 1 ? pick_16bit<__nv_bfloat16>(m, cfg, warp_ranges)
                             : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  Params p{x, w, bias, y, nullptr, nullptr, x_stride, w_stride, y_stride, m, n, k, silu, 0, 0, nullptr, 0, 0,
           nullptr, nullptr, 0, 0,
           nullptr, nullptr, 0, 0, 0, 0, 0, 0.0f, 0.0f, 0, warp_ranges, 0,
           nullptr, nullptr, 0};
  return launch_kernel(fn, p, kConfigs[cfg].rt, static_cast<int64_t>(kConfigs[cfg].u) * skinny::Bf16W<__half>::kChunk, warps,
                       num_splits, workspace, workspace_bytes, counters, num_counters, pdl, stream);
}

int skinny_gemm_fp8(const void* x, const void* w, const float* scale, int64_t s_stride, int block_scales,
                    const void* bias, void* y, float* workspace, int64_t workspace_bytes, int* counters,
                    int64_t num_counters, int m, int n, int k, int64_t x_stride, int64_t w_stride,
                    int64_t y_stride, int silu, int dtype, int cfg, int warps, int num_splits, int pdl,
                    void* stream, int warp_ranges) {
  if (cfg < 0 || cfg >= kNumFp8Configs || k % 16 != 0 || w_stride % 16 != 0 || scale == nullptr ||
      (block_scales != 0 && block_scales != 1) || s_stride < 1 || (warp_ranges != 0 && warp_ranges != 1) ||
      !common_args_ok(m, kFp8Configs[cfg].max_mt * 8, n, k, warps, num_splits, x_stride, x, w, silu))
    return static_cast<int>(cudaErrorInvalidValue);
  KernelFn fn = dtype == 0   ? pick_m<skinny::Fp8W, __half>(m, cfg)
                : dtype == 1 ? pick_m<skinny::Fp8W, __nv_bfloat16>(m, cfg)
                             : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  Params p{x, w, bias, y, nullptr, nullptr, x_stride, w_stride, y_stride, m, n, k, silu, 0, 0,
           scale, s_stride, block_scales, nullptr, nullptr, 0, 0,
           nullptr, nullptr, 0, 0, 0, 0, 0, 0.0f, 0.0f, 0, warp_ranges, 0,
           nullptr, nullptr, 0};
  return launch_kernel(fn, p, kFp8Configs[cfg].rt, static_cast<int64_t>(kFp8Configs[cfg].u) * skinny::Fp8W<__half>::kChunk,
                       warps, num_splits, workspace, workspace_bytes, counters, num_counters, pdl, stream);
}

int skinny_gemm_w4(const void* x, const void* w, const void* qscale, const void* qzero, int64_t q_stride,
                   int q_group, int fmt, const void* bias, void* y, float* workspace, int64_t workspace_bytes,
                   int* counters, int64_t num_counters, int m, int n, int k, int64_t x_stride, int64_t w_stride,
                   int64_t y_stride, int silu, int dtype, int cfg, int warps, int num_splits, int pdl, void* stream) {
  // (m * x_stride within 32 bits: the steady state's x offsets, XRows)
  if (cfg < 0 || cfg >= kNumW4Configs || !w4_args_ok(fmt, k, silu ? 2 * int64_t{n} : n, w_stride, 0, qscale, qzero, q_stride, q_group) ||
      int64_t{m} * x_stride >= (int64_t{1} << 31) ||
      !common_args_ok(m, kW4Configs[cfg].max_mt * 8, n, k, warps, num_splits, x_stride, x, w, silu))
    return static_cast<int>(cudaErrorInvalidValue);
  KernelFn fn = dtype == 0 ? pick_w4<__half>(fmt, m, cfg) : dtype == 1 ? pick_w4<__nv_bfloat16>(fmt, m, cfg) : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  Params p{x, w, bias, y, nullptr, nullptr, x_stride, w_stride, y_stride, m, n, k, silu, 0, 0, nullptr, 0, 0,
           qscale, qzero, q_stride, q_group,
           nullptr, nullptr, 0, 0, 0, 0, 0, 0.0f, 0.0f, 0, 0, group_mul(q_group), nullptr, nullptr, 0};
  return launch_kernel(fn, p, kW4Configs[cfg].rt, static_cast<int64_t>(kW4Configs[cfg].u) * skinny::Int4W<__half>::kChunk,
                       warps, num_splits, workspace, workspace_bytes, counters, num_counters, pdl, stream);
}

}  // namespace minisgl
