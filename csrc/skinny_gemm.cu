// Launcher of the skinny GEMM (csrc/skinny_gemm.cuh, weight loaders in skinny_weights.cuh): per
// weight format the table of tile configurations (template instances, chosen at run time by
// index so that a sweep needs no recompile), the argument checks the kernel's vector loads rely
// on, and the launch.
#include <cstdint>

#include "launchers.h"
#include "pdl.h"
#include "skinny_moe.cuh"
#include "skinny_w4.cuh"

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

constexpr const TileConfig (&kConfigs)[4] = Tiles<skinny::Bf16W>::kList;
constexpr const TileConfig (&kFp8Configs)[4] = Tiles<skinny::Fp8W>::kList;
constexpr const TileConfig (&kW4Configs)[4] = Tiles<skinny::Int4W>::kList;
constexpr int kNumConfigs = 4, kNumFp8Configs = 4, kNumW4Configs = 4;

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

// Bounds the workspace and keeps split * k_split within int.
constexpr int kMaxSplits = 64;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

int skinny_gemm_num_configs(int fp8) { return fp8 == 2 ? kNumW4Configs : fp8 ? kNumFp8Configs : kNumConfigs; }

int skinny_gemm_config(int fp8, int cfg, int* row_tiles, int* chunks, int* max_m) {
  const TileConfig* table = fp8 == 2 ? kW4Configs : fp8 ? kFp8Configs : kConfigs;
  if (cfg < 0 || cfg >= skinny_gemm_num_configs(fp8)) return static_cast<int>(cudaErrorInvalidValue);
  *row_tiles = table[cfg].rt;
  *chunks = table[cfg].u;
  *max_m = table[cfg].max_mt * 8;
  return 0;
}

namespace {

// Checks shared by both weight types, the split arithmetic (each split covers whole warp groups
// of `group` K elements, so every group starts at a multiple of it) and the launch.
// A MoE launch has z planes of tiles (token-expert pairs or tokens), and its K splits per slot:
// k_splits (= num_splits but for the down projection, whose num_splits counts every slot's).
int launch_kernel(KernelFn fn, Params p, int rt, int64_t group, int warps, int num_splits, float* workspace,
                  int64_t workspace_bytes, int* counters, int64_t num_counters, int pdl, void* stream, int64_t z = 1,
                  int k_splits = 0) {
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

bool common_args_ok(int m, int max_m, int n, int k, int warps, int num_splits, int64_t x_stride, const void* x,
                    const void* w, int silu) {
  return m >= 1 && m <= max_m && n >= 1 && k >= 8 && k % 8 == 0 && warps >= 1 && warps <= skinny::kMaxWarps &&
         num_splits >= 1 && num_splits <= kMaxSplits && x_stride % 8 == 0 && aligned16(x) && aligned16(w) &&
         (silu == 0 || silu == 1);
}

// Params::q_group_mul of a group of q_group elements (a multiple of 32; called after w4_args_ok).
uint64_t group_mul(int q_group) {
  const uint64_t d = q_group >= 32 ? static_cast<uint64_t>(q_group) / 32 : 1;
  return ((uint64_t{1} << 44) + d - 1) / d;
}

// A 4-bit weight's arguments (skinny_gemm_w4's, and every expert's of skinny_moe; a dense weight has
// expert stride 0): fmt 1 INT4 / 2 MXFP4, W's row and expert strides in words (INT4) or bytes
// (MXFP4) keeping 16-byte loads aligned, and the scale layout (INT4: zeros and groups of a multiple
// of 32 dividing K; MXFP4: e8m0 per 32, no zeros; one weight's n_w rows of W and of scales within
// 32-bit offsets, which the kernel uses; K <= 2^22, where Params::q_group_mul's group index is exact).
bool w4_args_ok(int fmt, int k, int64_t n_w, int64_t w_stride, int64_t w_expert_stride, const void* qscale,
                const void* qzero, int64_t q_stride, int q_group) {
  const int64_t w_align = fmt == 1 ? 4 : 16;
  return (fmt == 1 || fmt == 2) && k % 32 == 0 && k <= (1 << 22) && w_stride % w_align == 0 && w_expert_stride % w_align == 0 &&
         qscale != nullptr && q_stride * q_group >= k && n_w * q_stride < (int64_t{1} << 31) &&
         n_w * w_stride < (int64_t{1} << 31) &&
         (fmt == 1 ? qzero != nullptr && q_group >= 32 && q_group % 32 == 0 && k % q_group == 0
                   : q_group == 32 && qzero == nullptr);
}

}  // namespace

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
