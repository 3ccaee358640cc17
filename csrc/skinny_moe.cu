// Launchers of the skinny GEMM's MoE kernels (csrc/skinny_moe.cuh): the routed experts of a few tokens
// per (token, expert) pair (skinny_moe, 16-bit or 4-bit experts) and of tens of tokens grouped by expert
// (skinny_moe_grouped, 4-bit), on the dense launchers' tile tables and checks (csrc/skinny_launch.h).
#include <cstdint>

#include "launchers.h"
#include "skinny_launch.h"
#include "skinny_moe.cuh"

namespace minisgl {

using namespace skinny_launch;  // NOLINT: this file is the tables' and checks' user

namespace {

// The MoE kernels (skinny_moe_kernel, one token's x row: no MT) of W's configuration cfg: up
// (kDown false) or down.
template <template <typename> class W, typename T, bool kDown, int I>
KernelFn moe_instance() {
  constexpr TileConfig c = Tiles<W>::kList[I];
  if constexpr (c.max_mt >= 1) return skinny::skinny_moe_kernel<W<T>, c.rt, c.u, kDown>;
  return nullptr;
}

template <template <typename> class W, typename T, bool kDown>
KernelFn pick_moe(int cfg) {
  switch (cfg) {
    case 0: return moe_instance<W, T, kDown, 0>();
    case 1: return moe_instance<W, T, kDown, 1>();
    case 2: return moe_instance<W, T, kDown, 2>();
    case 3: return moe_instance<W, T, kDown, 3>();
    default: return nullptr;
  }
}

// warp_ranges (deterministic mode, 16-bit experts): the loader whose k16 steps are contiguous K.
template <typename T, bool kDown>
KernelFn pick_moe_fmt(int fmt, int cfg, int warp_ranges) {
  if (warp_ranges) return fmt == 0 ? pick_moe<skinny::Bf16DetW, T, kDown>(cfg) : nullptr;
  return fmt == 0   ? pick_moe<skinny::Bf16W, T, kDown>(cfg)
         : fmt == 1 ? pick_moe<skinny::Int4W, T, kDown>(cfg)
         : fmt == 2 ? pick_moe<skinny::Mxfp4W, T, kDown>(cfg)
                    : nullptr;
}

// The grouped MoE kernels (skinny_moe_grouped_kernel) of the 4-bit loader W, configuration I, for
// blocks of 8 * MT pairs (null past the configuration's max_mt).
template <template <typename> class W, typename T, bool kDown, int MT, int I>
KernelFn grouped_instance() {
  constexpr TileConfig c = Tiles<W>::kList[I];
  if constexpr (MT <= c.max_mt) return skinny::skinny_moe_grouped_kernel<W<T>, MT, c.rt, c.u, kDown>;
  return nullptr;
}

template <template <typename> class W, typename T, bool kDown, int MT>
KernelFn pick_grouped_config(int cfg) {
  switch (cfg) {
    case 0: return grouped_instance<W, T, kDown, MT, 0>();
    case 1: return grouped_instance<W, T, kDown, MT, 1>();
    case 2: return grouped_instance<W, T, kDown, MT, 2>();
    case 3: return grouped_instance<W, T, kDown, MT, 3>();
    default: return nullptr;
  }
}

// Blocks of 8 and 16 pairs (one or two x tiles): a decode step's experts hold a few pairs each, and
// the tile count sets the registers (at 4 x tiles most tiles spilled; 32-pair blocks measured no
// faster than 16 at 16 pairs an expert, RESULTS.md).
template <template <typename> class W, typename T, bool kDown>
KernelFn pick_grouped_m(int block_m, int cfg) {
  return block_m == 8 ? pick_grouped_config<W, T, kDown, 1>(cfg)
         : block_m == 16 ? pick_grouped_config<W, T, kDown, 2>(cfg)
                         : nullptr;
}

template <typename T, bool kDown>
KernelFn pick_grouped(int fmt, int block_m, int cfg) {
  return fmt == 1   ? pick_grouped_m<skinny::Int4W, T, kDown>(block_m, cfg)
         : fmt == 2 ? pick_grouped_m<skinny::Mxfp4W, T, kDown>(block_m, cfg)
                    : nullptr;
}

}  // namespace

int skinny_moe(const void* x, const void* w, const void* bias, const int* ids, const float* weights, void* y,
               float* workspace, int64_t workspace_bytes, int* counters, int64_t num_counters, int tokens, int top_k,
               int n, int k, int64_t x_stride, int64_t w_stride, int64_t y_stride, int64_t w_expert_stride,
               int64_t b_expert_stride, int down, int act, float alpha, float limit, int fmt, const void* qscale,
               const void* qzero, int64_t q_stride, int q_group, int64_t q_expert_stride, int dtype, int cfg,
               int warps, int splits, int pdl, void* stream, int warp_ranges) {
  // Up: silu mode over (gate | up) rows, z = token-expert pairs. Down: z = tokens, every slot's splits.
  const int silu = down ? 0 : 1;
  if (ids == nullptr || (down && weights == nullptr) || tokens < 1 || top_k < 1 || (act != 0 && act != 1) ||
      (down && act != 0) || (down && splits * top_k > kMaxSplits) || fmt < 0 || fmt > 2 ||
      (warp_ranges != 0 && warp_ranges != 1) ||
      !common_args_ok(1, 32, n, k, warps, splits, x_stride, x, w, silu))
    return static_cast<int>(cudaErrorInvalidValue);
  int rt = 0;
  int64_t group = 0;
  if (fmt == 0) {  // 16-bit experts: strides in elements, 16-byte rows
    if (cfg < 0 || cfg >= kNumConfigs || w_stride % 8 != 0 || w_expert_stride % 8 != 0)
      return static_cast<int>(cudaErrorInvalidValue);
    rt = kConfigs[cfg].rt;
    group = static_cast<int64_t>(kConfigs[cfg].u) * skinny::Bf16W<__half>::kChunk;
  } else {  // 4-bit experts: as skinny_gemm_w4's weight, per expert
    if (cfg < 0 || cfg >= kNumW4Configs || q_expert_stride < 0 ||
        !w4_args_ok(fmt, k, down ? n : 2 * int64_t{n}, w_stride, w_expert_stride, qscale, qzero, q_stride,
                    q_group))
      return static_cast<int>(cudaErrorInvalidValue);
    rt = kW4Configs[cfg].rt;
    group = static_cast<int64_t>(kW4Configs[cfg].u) * skinny::Int4W<__half>::kChunk;
  }
  KernelFn fn = dtype == 0   ? (down ? pick_moe_fmt<__half, true>(fmt, cfg, warp_ranges)
                                     : pick_moe_fmt<__half, false>(fmt, cfg, warp_ranges))
                : dtype == 1 ? (down ? pick_moe_fmt<__nv_bfloat16, true>(fmt, cfg, warp_ranges)
                                     : pick_moe_fmt<__nv_bfloat16, false>(fmt, cfg, warp_ranges))
                             : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  Params p{x, w, bias, y, nullptr, nullptr, x_stride, w_stride, y_stride, 1, n, k, silu, 0, 0, nullptr, 0, 0,
           qscale, qzero, q_stride, q_group, ids, weights, w_expert_stride, b_expert_stride, top_k, splits, act,
           alpha, limit, q_expert_stride, warp_ranges, fmt == 0 ? 0 : group_mul(q_group),
           nullptr, nullptr, 0};
  // Warp ranges over whole K (one split per pair or slot): the warps' shares are K / warps exactly, where
  // the grouped GEMM in deterministic mode cuts its splits (kernels/fused_moe.py), not K rounded up.
  if (warp_ranges && warps > 1 && k % (group * warps) != 0) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t z = down ? tokens : static_cast<int64_t>(tokens) * top_k;
  return launch_kernel(fn, p, rt, group, warps, down ? splits * top_k : splits, workspace, workspace_bytes, counters,
                       num_counters, pdl, stream, z, splits);
}

int skinny_moe_grouped(const void* x, const void* w, const void* bias, const int* sorted_ids, const int* block_experts,
                       const float* weights, void* y, float* workspace, int64_t workspace_bytes, int* counters,
                       int64_t num_counters, int tokens, int top_k, int num_blocks, int block_m, int n, int k,
                       int64_t x_stride, int64_t w_stride, int64_t y_stride, int64_t w_expert_stride,
                       int64_t b_expert_stride, int down, int act, float alpha, float limit, int fmt,
                       const void* qscale, const void* qzero, int64_t q_stride, int q_group, int64_t q_expert_stride,
                       int dtype, int cfg, int warps, int splits, int pdl, void* stream) {
  // Up: silu mode over (gate | up) rows. Down: the routing weights in the epilogue. Every x row's
  // offset (tokens rows up, tokens * top_k down) within 32 bits, as skinny_gemm_w4's (XRows).
  const int silu = down ? 0 : 1;
  const int64_t pairs = static_cast<int64_t>(tokens) * top_k;
  const int64_t x_rows = down ? pairs : tokens;
  if (sorted_ids == nullptr || block_experts == nullptr || (down && weights == nullptr) || tokens < 1 ||
      top_k < 1 || pairs >= INT32_MAX || num_blocks < 1 || (act != 0 && act != 1) || (down && act != 0) ||
      (block_m != 8 && block_m != 16) || cfg < 0 || cfg >= kNumW4Configs || q_expert_stride < 0 ||
      block_m > kW4Configs[cfg].max_mt * 8 || x_rows * x_stride >= (int64_t{1} << 31) ||
      !w4_args_ok(fmt, k, down ? n : 2 * int64_t{n}, w_stride, w_expert_stride, qscale, qzero, q_stride, q_group) ||
      !common_args_ok(block_m, 32, n, k, warps, splits, x_stride, x, w, silu))
    return static_cast<int>(cudaErrorInvalidValue);
  KernelFn fn = dtype == 0   ? (down ? pick_grouped<__half, true>(fmt, block_m, cfg)
                                     : pick_grouped<__half, false>(fmt, block_m, cfg))
                : dtype == 1 ? (down ? pick_grouped<__nv_bfloat16, true>(fmt, block_m, cfg)
                                     : pick_grouped<__nv_bfloat16, false>(fmt, block_m, cfg))
                             : nullptr;
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  Params p{x, w, bias, y, nullptr, nullptr, x_stride, w_stride, y_stride, block_m, n, k, silu, 0, 0, nullptr, 0, 0,
           qscale, qzero, q_stride, q_group, nullptr, weights, w_expert_stride, b_expert_stride, top_k, 1, act,
           alpha, limit, q_expert_stride, 0, group_mul(q_group), sorted_ids, block_experts, static_cast<int>(pairs)};
  return launch_kernel(fn, p, kW4Configs[cfg].rt,
                       static_cast<int64_t>(kW4Configs[cfg].u) * skinny::Int4W<__half>::kChunk, warps, splits,
                       workspace, workspace_bytes, counters, num_counters, pdl, stream, num_blocks);
}

}  // namespace minisgl
