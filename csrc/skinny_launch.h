// The skinny GEMM launchers' shared host side (csrc/skinny_gemm.cu: the dense launches; csrc/skinny_moe.cu: the
// MoE ones): per weight format the table of tile configurations (template instances, chosen at run time by
// index so that a sweep needs no recompile), the argument checks the kernel's vector loads rely on, the
// split arithmetic and the launch. Included by those two .cu files only.
#pragma once
#include <cstdint>

#include "pdl.h"
#include "skinny_w4.cuh"

namespace minisgl {
namespace skinny_launch {

using skinny::Params;
using KernelFn = void (*)(Params);

// Tile configurations: row tiles per block (16 W rows each) and 32-element chunks per warp
// group (16-byte W loads in flight per thread: 2 * RT * U), and the largest x tile count (MT)
// each is built for (beyond it the registers spill). The index is the Python-visible id;
// append, never reorder (cached tuning tables name configurations by id).
struct TileConfig {
  int rt, u, max_mt;
};
// One table per loader family (Tiles<W>::kList), four entries each (pick_config's cases).
template <template <typename> class W>
struct Tiles;
template <>
struct Tiles<skinny::Bf16W> {
  static constexpr TileConfig kList[] = {{1, 2, 4}, {1, 4, 4}, {2, 2, 4}, {2, 4, 2}};
};
// Deterministic mode's 16-bit loader (skinny_weights.cuh Bf16DetW, with warp_ranges) is built for one
// configuration, ops/gemm/skinny.py DETERMINISTIC_TILE; the others have max_mt 0 (instance() returns
// null, so their launch is refused). The launch sizes it from Bf16W's entry, so the two must agree.
template <>
struct Tiles<skinny::Bf16DetW> {
  static constexpr TileConfig kList[] = {{1, 2, 0}, {1, 4, 4}, {2, 2, 0}, {2, 4, 0}};
};
static_assert(Tiles<skinny::Bf16DetW>::kList[1].rt == Tiles<skinny::Bf16W>::kList[1].rt &&
                  Tiles<skinny::Bf16DetW>::kList[1].u == Tiles<skinny::Bf16W>::kList[1].u &&
                  Tiles<skinny::Bf16DetW>::kList[1].max_mt == Tiles<skinny::Bf16W>::kList[1].max_mt,
              "the deterministic tile is Bf16W's configuration 1");
// FP8 weights (skinny_weights.cuh Fp8W): U counts 64-element chunks (16 e4m3 per 16-byte load) and is
// even (whole 128-K scale spans); max_mt where a group's registers (W 16 * RT * U + x 16 * MT * U
// bytes per thread, twice for the pipeline) stay near the bf16 tiles'.
template <>
struct Tiles<skinny::Fp8W> {
  static constexpr TileConfig kList[] = {{1, 2, 4}, {2, 2, 4}, {1, 4, 2}, {2, 4, 1}};
};
// 4-bit weights (Int4W / Mxfp4W, one table): U counts 128-element chunks (32 nibbles per 16-byte
// load); x takes 4 pieces per chunk, so max_mt is lower than the 16-bit tiles' for the same U.
template <>
struct Tiles<skinny::Int4W> {
  static constexpr TileConfig kList[] = {{1, 1, 4}, {2, 1, 4}, {1, 2, 2}, {2, 2, 1}};
};
template <>
struct Tiles<skinny::Mxfp4W> : Tiles<skinny::Int4W> {};

inline constexpr const TileConfig (&kConfigs)[4] = Tiles<skinny::Bf16W>::kList;
inline constexpr const TileConfig (&kFp8Configs)[4] = Tiles<skinny::Fp8W>::kList;
inline constexpr const TileConfig (&kW4Configs)[4] = Tiles<skinny::Int4W>::kList;
constexpr int kNumConfigs = 4, kNumFp8Configs = 4, kNumW4Configs = 4;

// Bounds the workspace and keeps split * k_split within int.
constexpr int kMaxSplits = 64;

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Checks shared by both weight types, the split arithmetic (each split covers whole warp groups
// of `group` K elements, so every group starts at a multiple of it) and the launch.
// A MoE launch has z planes of tiles (token-expert pairs or tokens), and its K splits per slot:
// k_splits (= num_splits but for the down projection, whose num_splits counts every slot's).
inline int launch_kernel(KernelFn fn, Params p, int rt, int64_t group, int warps, int num_splits, float* workspace,
                         int64_t workspace_bytes, int* counters, int64_t num_counters, int pdl, void* stream,
                         int64_t z = 1, int k_splits = 0) {
  const int mt = (p.m + 7) / 8;
  const int64_t rows_per_block = static_cast<int64_t>(rt) * (p.silu ? 8 : 16);
  const int64_t tiles = (p.n + rows_per_block - 1) / rows_per_block;
  if (tiles > INT32_MAX || z < 1 || z > 65535) return static_cast<int>(cudaErrorInvalidValue);
  if (k_splits < 1) k_splits = num_splits;
  const int64_t per_split = ((p.k + k_splits - 1) / k_splits + group - 1) / group * group;
  // whole groups per warp, and the warps are the (one) split of each tile or MoE slot
  if (p.warp_ranges && (per_split % (group * warps) != 0 || k_splits != 1))
    return static_cast<int>(cudaErrorInvalidValue);
  if (num_splits > 1) {
    const int64_t items = static_cast<int64_t>(rt) * mt * 2 * 32;  // float2 per (tile, split)
    if (workspace == nullptr || counters == nullptr || num_counters < tiles * z ||
        workspace_bytes < tiles * z * num_splits * items * 8)
      return static_cast<int>(cudaErrorInvalidValue);
  }
  p.workspace = workspace;
  p.counters = counters;
  p.k_split = static_cast<int>(per_split);
  p.num_splits = num_splits;
  cudaLaunchConfig_t launch = {};
  launch.gridDim = dim3(static_cast<unsigned>(tiles), num_splits, static_cast<unsigned>(z));
  launch.blockDim = dim3(warps * 32);
  launch.dynamicSmemBytes = static_cast<size_t>(warps) * rt * mt * 128 * sizeof(float);
  launch.stream = static_cast<cudaStream_t>(stream);
  // Programmatic dependent launch (Hopper+): this grid may start while the previous kernel
  // finishes; the kernel loads its first W group, then waits for it (griddepcontrol.wait).
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  if (pdl) {
    int device = 0;
    bool allowed = false;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = pdl_allowed_on(device, &allowed);
    if (err != cudaSuccess) return static_cast<int>(err);
    if (allowed) {
      launch.attrs = attr;
      launch.numAttrs = 1;
    }
  }
  return static_cast<int>(cudaLaunchKernelEx(&launch, fn, p));
}

inline bool common_args_ok(int m, int max_m, int n, int k, int warps, int num_splits, int64_t x_stride, const void* x,
                           const void* w, int silu) {
  return m >= 1 && m <= max_m && n >= 1 && k >= 8 && k % 8 == 0 && warps >= 1 && warps <= skinny::kMaxWarps &&
         num_splits >= 1 && num_splits <= kMaxSplits && x_stride % 8 == 0 && aligned16(x) && aligned16(w) &&
         (silu == 0 || silu == 1);
}

// Params::q_group_mul of a group of q_group elements (a multiple of 32; called after w4_args_ok).
inline uint64_t group_mul(int q_group) {
  const uint64_t d = q_group >= 32 ? static_cast<uint64_t>(q_group) / 32 : 1;
  return ((uint64_t{1} << 44) + d - 1) / d;
}

// A 4-bit weight's arguments (skinny_gemm_w4's, and every expert's of skinny_moe; a dense weight has
// expert stride 0): fmt 1 INT4 / 2 MXFP4, W's row and expert strides in words (INT4) or bytes
// (MXFP4) keeping 16-byte loads aligned, and the scale layout (INT4: zeros and groups of a multiple
// of 32 dividing K; MXFP4: e8m0 per 32, no zeros; one weight's n_w rows of W and of scales within
// 32-bit offsets, which the kernel uses; K <= 2^22, where Params::q_group_mul's group index is exact).
inline bool w4_args_ok(int fmt, int k, int64_t n_w, int64_t w_stride, int64_t w_expert_stride, const void* qscale,
                       const void* qzero, int64_t q_stride, int q_group) {
  const int64_t w_align = fmt == 1 ? 4 : 16;
  return (fmt == 1 || fmt == 2) && k % 32 == 0 && k <= (1 << 22) && w_stride % w_align == 0 && w_expert_stride % w_align == 0 &&
         qscale != nullptr && q_stride * q_group >= k && n_w * q_stride < (int64_t{1} << 31) &&
         n_w * w_stride < (int64_t{1} << 31) &&
         (fmt == 1 ? qzero != nullptr && q_group >= 32 && q_group % 32 == 0 && k % q_group == 0
                   : q_group == 32 && qzero == nullptr);
}

}  // namespace skinny_launch
}  // namespace minisgl
