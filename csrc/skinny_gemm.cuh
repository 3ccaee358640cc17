// Skinny GEMM: y[M, N] = x[M, K] W[N, K]^T (+ bias) for M <= 32 activation rows, the shape
// of a low-batch decode step, where the op is a single read of W and nothing else matters.
// Framework-free.
//
// Shapes: x [M, K] (row stride free), W [N_w, K] (row stride free), y [M, N_out] (row
// stride free), bias [N_w] or null. fp16/bf16 in and out, fp32 accumulation. K % 8 == 0 and
// every base/row stride 16-byte aligned (the host checks; 16-byte vector loads need it).
//
// Tensor cores on a transposed problem: y^T = W x^T, so W rows are the MMA's M side (16
// rows per m16n8k16 tile) and x rows its N side (8 per tile; MT = ceil(M / 8) tiles, padding
// rows predicated off: they read nothing and hold zeros). K is a reduction, so it may be
// permuted freely as long as W and x use the same permutation: thread t of a quad loads 8
// contiguous elements [8t, 8t + 8) of a 32-element chunk with one 16-byte load, and feeds
// them to two MMAs as the fragment's k pairs {2t, 2t+1, 2t+8, 2t+9}. So W goes global ->
// registers -> tensor core with no shared memory and no shuffles, and the CUDA cores only
// issue loads. (On CUDA cores M = 16 would need ~50 fp32 TFLOP/s at the read ceiling.)
// Deterministic mode's loader (skinny_weights.cuh Bf16DetW) gives each MMA 16 contiguous K
// elements instead, for two shuffles per load, so its rows match a plain-order GEMM's bits.
//
// Work split: block (tile, split) computes RT row tiles (16 W rows each) over one K range;
// its warps interleave over that range in groups of U chunks (U * 32 contiguous elements
// of every row per group; in deterministic mode each warp takes a contiguous share instead,
// Params::warp_ranges), with the next group's RT * 2 * U 16-byte W loads (+ MT * U of x)
// in flight per thread while the current group's MMAs run. Warps reduce
// in shared memory; with num_splits > 1 blocks of one tile meet through an fp32 workspace
// and a counter, and the last to arrive sums the splits in split order (deterministic) and
// runs the epilogue, then resets its counter (so the counters stay zero between launches
// and a captured CUDA graph may replay freely).
//
// SiLU mode (gate_up -> silu(gate) * up): W is [2 * inter, K] = (gate | up). Row tile r's
// rows 0-7 are gate rows 8r..8r+7 and rows 8-15 the matching up rows inter + 8r..; the MMA
// puts gate row g and up row g of the same x row in one thread (accumulators c0/c2, c1/c3),
// so the epilogue writes silu(gate) * up = y [M, inter] with no exchange.
//
// No residual-add epilogue: in the model the add is already fused into the next RMSNorm
// (fused_add_rmsnorm reads both anyway), and with TP o/down's output is all-reduced before it.
//
// Memory traffic: W once (N_w * K * 2 bytes), x once per block from L2/L1, y written once;
// with splits, 2 * tiles * splits * RT * MT * 512 bytes of fp32 partials through L2.
//
// One template for every weight format: the weight loader is a policy (csrc/skinny_weights.cuh:
// Bf16W for 16-bit W, Fp8W for e4m3 with per-channel / 128-K block scales, Int4W for the INT4
// layout with group scales and zero points, Mxfp4W for e2m1 with e8m0 scales per 32). A policy
// fixes how many K elements one thread's 16-byte W load carries (kPerThread: 8, 16, 32, 32; a
// chunk is 4 * kPerThread), holds its W registers and row pointers, loads a warp group of W
// (and its scales), and runs the group's MMAs after turning W into 16-bit pairs in registers.
// x's loads, the pipeline, the warp reduction, split-K and the epilogue are this file's, shared.
#pragma once
#include "skinny_common.cuh"

namespace minisgl {
namespace skinny {

// kFp8: the FP8 epilogue (per-channel scales when p.block_scales == 0); the other formats are
// built without that code (it kept the bf16 kernel's registers as they were). kGrouped: the block's
// row m is pair moe_sorted[m] (Params), written to y row of that number; with kDown its value
// (bias included) times the pair's routing weight.
template <typename T, bool kFp8, bool kGrouped = false, bool kDown = false>
__device__ __forceinline__ void store_pair(const Params& p, int tile_row0, int r, int t, int q, int lane, float lo,
                                           float hi) {
  const int g = lane >> 2, quad = lane & 3;
  const int m = 8 * t + 2 * quad + q;
  if (m >= p.m) return;
  int y_row = m;
  float weight = 1.0f;
  if constexpr (kGrouped) {
    y_row = p.moe_sorted[m];
    if (y_row >= p.moe_pairs) return;  // padding
    if constexpr (kDown) weight = p.moe_weights[y_row];
  }
  T* y = static_cast<T*>(p.y) + static_cast<int64_t>(y_row) * p.y_stride;
  const T* bias = static_cast<const T*>(p.bias);
  const bool chan = kFp8 && !p.block_scales;  // per-channel FP8 scales
  if (p.silu) {
    const int j = tile_row0 + 8 * r + g;  // output column; gate row j, up row n + j
    if (j >= p.n) return;
    if (chan) {
      lo *= p.scale[j * p.s_stride];
      hi *= p.scale[(p.n + j) * p.s_stride];
    }
    if (bias != nullptr) {
      lo += to_float(bias[j]);
      hi += to_float(bias[p.n + j]);
    }
    if (p.act == 1) {
      const float g = fminf(lo, p.limit), u = fminf(fmaxf(hi, -p.limit), p.limit);
      y[j] = from_float<T>(g / (1.0f + __expf(-p.alpha * g)) * (u + 1.0f));
    } else {
      y[j] = from_float<T>(lo / (1.0f + __expf(-lo)) * hi);
    }
    return;
  }
  // lo holds output row `row`, hi row `row + 8`. A per-channel scale and the bias join in one
  // explicit FMA (not left to contraction), which the deterministic FP8 GEMM above 32 rows repeats
  // (kernels/batch_invariant_fp8.py: tl.fma).
  const int row = tile_row0 + 16 * r + g;
  const auto store = [&](int n, float v) {
    if (n >= p.n) return;
    const float b = bias != nullptr ? to_float(bias[n]) : 0.0f;
    const float out = chan ? fmaf(v, p.scale[n * p.s_stride], b) : v + b;
    y[n] = from_float<T>(kGrouped && kDown ? out * weight : out);
  };
  store(row, lo);
  store(row + 8, hi);
}

// A down-projection block's share of the top-k sum (moe 2): its routing weight, and the expert's
// bias where this block is the slot's first split (else null).
template <typename T>
struct MoeSlot {
  float weight;
  const T* bias;
};

// The end of a block: its warps' accumulators summed in shared memory `red` (fixed order), then
// either the epilogue, or (split-K) this split's partials to the workspace and, in the last
// block of the tile to arrive, the sum over splits and the epilogue. `tile` indexes the workspace
// and the counters (a MoE launch's tiles of every z), tile_row0 is the tile's first output row.
// kGrouped: a grouped MoE block (store_pair's rows; `slot` unused, the weights are per row).
template <typename T, bool kFp8, int MT, int RT, bool kMoeDown = false, bool kGrouped = false>
__device__ __forceinline__ void reduce_store(const Params& p, const float (&acc)[RT][MT][4], float* red, int tile,
                                             int split, int tile_row0, MoeSlot<T> slot = {1.0f, nullptr}) {
  using Tl = Tile<MT, RT>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  // Warp reduction in shared memory, laid out [warp][accumulator][lane] (conflict-free).
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[((warp * RT + r) * MT + t) * 128 + i * 32 + lane] = acc[r][t][i];
  __syncthreads();

  // Block thread `it` owns accumulator pairs it, it + blockDim.x, ... of the tile (lane = it % 32).
  float2* part = nullptr;
  if (p.num_splits > 1) {
    part = reinterpret_cast<float2*>(p.workspace) +
           (static_cast<int64_t>(tile) * p.num_splits + split) * Tl::kItems;
  }
  for (int it = threadIdx.x; it < Tl::kItems; it += blockDim.x) {
    const int ln = it & 31, pair = it >> 5;  // pair = (r * MT + t) * 2 + q
    const int rtm = pair >> 1, q = pair & 1;  // rtm = r * MT + t
    float lo = 0.0f, hi = 0.0f;
    for (int wi = 0; wi < warps; ++wi) {  // fixed order: deterministic
      lo += red[(wi * RT * MT + rtm) * 128 + q * 32 + ln];
      hi += red[(wi * RT * MT + rtm) * 128 + (q + 2) * 32 + ln];
    }
    if constexpr (kMoeDown && !kGrouped) {  // rows (g, g + 8) of row tile r; m is 1, so only q 0 holds a row
      const int row = tile_row0 + 16 * (rtm / MT) + (ln >> 2);
      if (slot.bias != nullptr) {
        lo += row < p.n ? to_float(slot.bias[row]) : 0.0f;
        hi += row + 8 < p.n ? to_float(slot.bias[row + 8]) : 0.0f;
      }
      lo *= slot.weight;
      hi *= slot.weight;
    }
    if (part != nullptr) {
      part[it] = make_float2(lo, hi);
    } else {
      store_pair<T, kFp8, kGrouped, kMoeDown>(p, tile_row0, rtm / MT, rtm % MT, q, ln, lo, hi);
    }
  }
  if (part == nullptr) return;

  // Split-K: the last block of this tile to arrive sums every split's partials.
  __shared__ int is_last;
  __threadfence();  // this block's partials are visible device-wide before it is counted
  __syncthreads();
  if (threadIdx.x == 0) {
    const int arrived = atomicAdd(p.counters + tile, 1);
    is_last = arrived == p.num_splits - 1;
    if (is_last) p.counters[tile] = 0;  // every split has arrived: reset for the next launch
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const float2* all = reinterpret_cast<const float2*>(p.workspace) +
                      static_cast<int64_t>(tile) * p.num_splits * Tl::kItems;
  for (int it = threadIdx.x; it < Tl::kItems; it += blockDim.x) {
    float lo = 0.0f, hi = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float2 v = load_f2_l2(all + static_cast<int64_t>(s) * Tl::kItems + it);  // L2: other SMs wrote it
      lo += v.x;
      hi += v.y;
    }
    const int pair = it >> 5, rtm = pair >> 1;
    store_pair<T, kFp8, kGrouped, kMoeDown>(p, tile_row0, rtm / MT, rtm % MT, pair & 1, it & 31, lo, hi);
  }
}


// x rows of this thread, fixed for the whole K loop (rows past M keep row 0's address, loads off).
// off: the same rows as 32-bit offsets from x (the steady state's loads; the 4-bit launchers check
// that m * x_stride fits), one add and one wide multiply-add a load.
template <typename T, int MT>
struct XRows {
  const T* x[MT];
  bool ok[MT];
  const T* base;
  unsigned off[MT];
};

// One warp group's registers: the policy's W (U chunks of RT row tiles) and MT x tiles, each
// thread's kPerThread x elements as 16-byte pieces of 8.
template <typename W, int MT, int RT, int U>
struct Group {
  typename W::template Regs<RT, U> w;
  uint4 x[MT][U][W::kPerThread / 8];
};

// k_end and the offsets are multiples of kPerThread: a thread's piece is all in or all out.
// kFull (a steady-state group, inside K): no predicates; x rows past M read row 0 (XRows), finite
// values in MMA columns that are never stored.
template <typename W, typename T, int MT, int RT, int U, bool kFull = false>
__device__ __forceinline__ void load_group_x(Group<W, MT, RT, U>& grp, const XRows<T, MT>& xr, int k0, int k_end,
                                             int quad) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int kk = k0 + u * W::kChunk + W::piece(quad);
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const bool ok = kk < k_end && xr.ok[t];
#pragma unroll
      for (int j = 0; j < W::kPerThread / 8; ++j)
        if constexpr (!W::kSteady) {
          grp.x[t][u][j] = load_x(xr.x[t] + kk + 8 * j, ok);
        } else {  // one addressing for the steady loop and the tail (one set of registers)
          const T* at = xr.base + (xr.off[t] + static_cast<unsigned>(kk)) + 8 * j;
          grp.x[t][u][j] = kFull ? load_in<false>(at) : load_x(at, ok);
        }
    }
  }
}

// One block's work: row tile blockIdx.x over K split `split` (of p.k_split elements). kMoe: the
// launch is a MoE one (skinny_moe_kernel): p is the block's own view (its expert's W and bias, its
// x and y rows), it already waited for the previous kernel, `ws_tile` indexes its workspace and
// counters and `slot` weights a down projection's partials. kGrouped (skinny_moe_grouped_kernel, kMoe
// too): the block's x rows are pairs through p.moe_sorted (Params).
template <typename W, int MT, int RT, int U, bool kMoe, bool kMoeDown, bool kGrouped = false>
__device__ __forceinline__ void skinny_block(const Params& p, int split, int ws_tile, MoeSlot<typename W::T> slot) {
  using T = typename W::T;
  extern __shared__ float red[];  // [warps][kPairs * 2][32]: the warps' accumulators
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, quad = lane & 3;
  const int tile = blockIdx.x;
  // First output column of the tile: 16 W rows per row tile, or 8 (gate, up) pairs in SiLU mode.
  const int tile_row0 = tile * RT * (p.silu ? 8 : 16);

  typename W::template Rows<RT> rows;
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    int lo, hi;
    bool lo_ok, hi_ok;
    if (p.silu) {
      lo = tile_row0 + 8 * r + g;
      hi = p.n + lo;
      lo_ok = hi_ok = lo < p.n;
    } else {
      lo = tile_row0 + 16 * r + g;
      hi = lo + 8;
      lo_ok = lo < p.n;
      hi_ok = hi < p.n;
    }
    // Rows past the end keep an in-bounds address (row 0): their loads are predicated off.
    W::set_row(rows, p, r, lo_ok ? lo : 0, hi_ok ? hi : 0, lo_ok, hi_ok);
  }
  XRows<T, MT> xr;
  const T* x = static_cast<const T*>(p.x);
  xr.base = x;
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int m = 8 * t + g;
    int row = m;
    bool ok = m < p.m;
    if constexpr (kGrouped) {  // pair s: token s / top_k's x row (up), the intermediate's row s (down)
      const int s = ok ? p.moe_sorted[m] : p.moe_pairs;
      ok = s < p.moe_pairs;
      row = kMoeDown ? s : s / p.top_k;
    }
    xr.ok[t] = ok;
    xr.x[t] = x + static_cast<int64_t>(ok ? row : 0) * p.x_stride;
    xr.off[t] = static_cast<unsigned>(ok ? row : 0) * static_cast<unsigned>(p.x_stride);
  }

  float acc[RT][MT][4];
  zero_acc(acc);

  const int k_begin = split * p.k_split;
  int k_end = min(p.k, k_begin + p.k_split);
  constexpr int kGroup = U * W::kChunk;
  int stride = warps * kGroup;
  int k0 = k_begin + warp * kGroup;
  if (p.warp_ranges) {  // deterministic mode: this warp's contiguous share (Params::warp_ranges)
    const int share = p.k_split / warps;
    k0 = k_begin + warp * share;
    k_end = min(k_end, k0 + share);
    stride = kGroup;
  }
  // Programmatic dependent launch (sm_90, when the launch asks for it): the previous kernel
  // on the stream may still be running here. W and its scales are never written during
  // inference, so the first group of W is loaded before griddepcontrol.wait; x, and every
  // global write (y, the workspace, the counters), only after it. And this grid lets the next
  // one launch as its blocks retire. Without the launch attribute both instructions are no-ops.
  // (An up-projection MoE block waited before it read its expert id: W's address depends on the
  // routing, which the previous kernel wrote. A down-projection block waits here, as the dense ones.)
  const bool has_work = k0 < k_end;
  Group<W, MT, RT, U> cur, nxt;
  if (has_work) W::load_w(cur.w, rows, p, k0, k_end, quad);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (!kMoe || kMoeDown) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
#endif
  // Software pipeline: the next group's loads are issued before this group's MMAs, so a
  // thread always has a whole group in flight. (Without it, ptxas moved each load down to
  // its MMA: 3 loads in flight per thread instead of RT * 2 * U + MT * U.)
  if (has_work) {
    load_group_x<W, T, MT, RT, U>(cur, xr, k0, k_end, quad);
    if constexpr (W::kSteady) {
      // While the next group lies wholly inside K, its loads need no predicate (loaders with
      // kSteady; the others keep one loop, their SASS as measured). The loop below is then the
      // tail: at most one group that ends past k_end.
#pragma unroll(W::kLoopUnroll)
      for (; k0 + stride + kGroup <= k_end; k0 += stride) {
        W::template load_w<true>(nxt.w, rows, p, k0 + stride, k_end, quad);
        load_group_x<W, T, MT, RT, U, true>(nxt, xr, k0 + stride, k_end, quad);
        W::mma(acc, cur.w, cur.x);
        cur = nxt;
      }
    }
#pragma unroll(W::kSteady ? 1 : W::kLoopUnroll)
    for (; k0 + stride < k_end; k0 += stride) {
      W::load_w(nxt.w, rows, p, k0 + stride, k_end, quad);
      load_group_x<W, T, MT, RT, U>(nxt, xr, k0 + stride, k_end, quad);
      W::mma(acc, cur.w, cur.x);
      cur = nxt;
    }
    W::mma(acc, cur.w, cur.x);
  }

  reduce_store<T, W::kChannelScale, MT, RT, kMoeDown, kGrouped>(p, acc, red, ws_tile, blockIdx.y, tile_row0, slot);
}

template <typename W, int MT, int RT, int U>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_kernel(const Params p) {
  skinny_block<W, MT, RT, U, false, false>(p, blockIdx.y, blockIdx.x, {1.0f, nullptr});
}

}  // namespace skinny
}  // namespace minisgl
