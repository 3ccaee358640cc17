// Paged decode attention (flash-decoding), first pass: one new query token per request
// attends to its whole context, K/V read through the request table. Framework-free.
//
// Shapes: q [B, Hq, D] (heads packed, batch stride free); k_cache/v_cache [S, Hkv, D] (slot
// stride free) in q's type T, or e4m3 (KV = uint8_t: values K / k_scale, V / v_scale; each
// thread copies 8 bytes per row instead of 16 and converts them exactly in registers, the
// 2^-8 of that conversion and the scales folded into scale_log2 and v_scale by the host); req_to_slot [R, L] int32; req_rows, seq_lens [B] int32 (read on the device);
// out [B, Hq, D]. Hq = Hkv * group, group in 1..8.
//
// Work split: block (split, kv_head, request) reads one contiguous token range of one KV
// head once and serves all `group` query heads of that KV head from registers, so K/V bytes
// are read exactly once per step. The split count is fixed by the host (graph-stable); the
// per-request chunk ceil(len / splits) is computed here from the device length, so every
// request spreads over the splits and short ones leave trailing splits empty (they exit after
// griddepcontrol.wait). One split writes `out` directly; more write fp32 partials for decode_merge.cuh.
// Launched with programmatic dependent launch after rope + KV store (both signal at their
// start): the length, table row and first slot ids are read before griddepcontrol.wait, q and
// K/V after it.
// Memory traffic: K + V rows once, 4 bytes of slot id per token, q, out, and with splits
// 2 * B * Hq * splits * (D + 1) * 4 bytes of partials.
#pragma once
#include <type_traits>

#include "decode_common.cuh"
#include "fp8_convert.cuh"

namespace minisgl {
namespace decode {

// Thread layout: kTpr threads share one K/V row (16 bytes each), a warp covers kTpw rows per
// instruction, and each row group takes U tokens per tile.
template <int D, int U>
struct SplitShape {
  static constexpr int kTpr = D / 8;
  static constexpr int kTpw = 32 / kTpr;
  static constexpr int kWarpTokens = kTpw * U;
  static constexpr int kTile = kWarps * kWarpTokens;  // tokens per block per iteration
  static_assert(D % 16 == 0 && kTpr <= 32 && kWarpTokens <= 32, "unsupported head_dim/unroll");
};

constexpr int kStages = 3;  // cp.async ring depth: tiles i+1 and i+2 in flight while i is computed

// GP: query heads per KV head rounded up to a power of two (registers are sized by it).
// K/V go through a kStages-deep cp.async ring in shared memory (48 KB at U = 4): each thread
// copies and later reads back only its own 16-byte pieces (no barrier needed), so up to
// 2 * U * (kStages - 1) 16-byte copies per thread stay in flight while a tile is computed.
// (Loading into registers instead, ptxas sank the V loads below the score shuffles: two
// memory round trips per tile, and only one tile in flight.)
// A thread's 8 elements of one K/V row: 16 bytes of T, or 8 e4m3 bytes.
template <typename KV>
using Piece = std::conditional_t<sizeof(KV) == 1, uint2, uint4>;

template <typename T, typename KV>
__device__ __forceinline__ void unpack_kv(const Piece<KV>& v, float (&f)[8]) {
  if constexpr (sizeof(KV) == 1) {
    fp8::e4m3x8_to_float_div256(v, f);
  } else {
    unpack8<T>(v, f);
  }
}

template <typename T, typename KV, int D, int GP, int U>
__global__ void __launch_bounds__(kThreads) split_kernel(const Params p) {
  using Shape = SplitShape<D, U>;
  constexpr int kTpr = Shape::kTpr, kTpw = Shape::kTpw, kWarpTokens = Shape::kWarpTokens;
  constexpr int kTile = Shape::kTile;
  constexpr int kRows = kWarps * kTpw;  // partial softmax states per block before the merge

  // The staging ring and the end-of-block merge buffer share the shared memory.
  struct Merge {
    float acc[kRows][GP][D];  // 4 KB * GP (kRows * D == 1024 for every D)
    float m[kRows][GP], l[kRows][GP], w[kRows][GP], fin[2][GP];
  };
  union Smem {
    Piece<KV> ring[kStages][U][2][kThreads];  // [stage][token][K or V][thread]: conflict-free
    Merge merge;
  };
  __shared__ Smem sm;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Let the merge grid (launched with programmatic dependent launch) be scheduled as this
  // grid's blocks retire; it waits for this grid's completion before reading anything.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane / kTpr, sub = lane % kTpr;

  // The length, the table row and the first tiles' slot ids come from the step's metadata, which
  // no kernel of this layer writes: they are read before griddepcontrol.wait, while the previous
  // kernel (rope + KV store, which signals at its start) may still run. q and K/V are read after it.
  const int len = request_len(p, b);
  const int row = load_int_now(p.req_rows + b);
  const int lo = window_start(p, len);  // the splits cover keys lo .. len - 1 only
  const int chunk = split_chunk(len - lo, p.num_splits, kTile);
  const int start = lo + split * chunk;
  // No tokens (uniform across the block): returns after the wait below, so that even a grid whose
  // every split is empty completes only after the previous kernel.
  const bool empty = p.num_splits > 1 && start >= len;
  const int end = min(len, start + chunk);

  const int32_t* table = p.req_to_slot + static_cast<int64_t>(row) * p.table_stride;
  const int64_t slot_bytes = p.cache_stride_s * static_cast<int64_t>(sizeof(KV));
  const int64_t col = (static_cast<int64_t>(kvh) * D + sub * 8) * static_cast<int64_t>(sizeof(KV));
  const char* kb = static_cast<const char*>(p.k_cache) + col;
  const char* vb = static_cast<const char*>(p.v_cache) + col;
  const int warp_off = warp * kWarpTokens;

  // Slot ids: lane i of a warp holds the slot of the warp's i-th token of a tile (one
  // coalesced 4-byte load per lane), read one iteration before that tile's copies are issued.
  auto load_slot = [&](int tile_base) {
    const int tok = tile_base + warp_off + lane;
    return (lane < kWarpTokens && tok < end) ? table[tok] : 0;
  };
  auto issue = [&](int stage, int tile_base, int slots) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t slot = __shfl_sync(0xffffffffu, slots, u * kTpw + grp);
      const bool ok = tile_base + warp_off + u * kTpw + grp < end;
      if constexpr (sizeof(KV) == 1) {
        cp_async8(&sm.ring[stage][u][0][tid], kb + slot * slot_bytes, ok);
        cp_async8(&sm.ring[stage][u][1][tid], vb + slot * slot_bytes, ok);
      } else {
        cp_async16(&sm.ring[stage][u][0][tid], kb + slot * slot_bytes, ok);
        cp_async16(&sm.ring[stage][u][1][tid], vb + slot * slot_bytes, ok);
      }
    }
    cp_async_commit();
  };

  int slots[kStages];  // an empty split's are 0 and not loaded (its tokens are past `end`)
#pragma unroll
  for (int i = 0; i < kStages; ++i) slots[i] = load_slot(start + i * kTile);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // q and this step's K/V row are written
#endif
  if (empty) return;
  uint4 qraw[GP];
  const T* qb = static_cast<const T*>(p.q) + b * p.q_stride_b + static_cast<int64_t>(kvh) * p.group * D;
#pragma unroll
  for (int h = 0; h < GP; ++h) {
    // Unconditional (a branch would let the compiler sink it): padded heads re-read the last
    // real head and are zeroed below.
    qraw[h] = load_vec_now(qb + min(h, p.group - 1) * D + sub * 8);
  }
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) issue(i, start + i * kTile, slots[i]);
  int slot_next = slots[kStages - 1];

  // This thread's 8 dims of each query head, pre-scaled into the log2 domain.
  float qf[GP][8];
#pragma unroll
  for (int h = 0; h < GP; ++h) {
    unpack8<T>(qraw[h], qf[h]);
    const float s = h < p.group ? p.scale_log2 : 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[h][i] *= s;
  }

  float m[GP], l[GP], acc[GP][8];
#pragma unroll
  for (int h = 0; h < GP; ++h) {
    m[h] = kNegBig;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
  }

  int stage = 0;
  for (int base = start; base < end; base += kTile, stage = stage + 1 == kStages ? 0 : stage + 1) {
    // Tile i + kStages - 1 into the stage tile i - 1 used (its last reader: this thread).
    const int ahead = base + (kStages - 1) * kTile;
    issue(stage == 0 ? kStages - 1 : stage - 1, ahead, slot_next);
    slot_next = load_slot(ahead + kTile);
    cp_async_wait<kStages - 1>();  // this thread's copies of tile i have landed

    float s[U][GP];
    bool valid[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      valid[u] = base + warp_off + u * kTpw + grp < end;
      float kf[8];
      unpack_kv<T, KV>(sm.ring[stage][u][0][tid], kf);
#pragma unroll
      for (int h = 0; h < GP; ++h) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(qf[h][i], kf[i], d);
        s[u][h] = d;
      }
    }
    // Sum the partial dot products across the row's kTpr lanes (aligned lane groups).
#pragma unroll
    for (int off = kTpr / 2; off >= 1; off >>= 1) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int h = 0; h < GP; ++h) s[u][h] += __shfl_xor_sync(0xffffffffu, s[u][h], off);
      }
    }

    // Masked tokens score -inf: they move no max and weigh 2^-inf = 0.
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int h = 0; h < GP; ++h) s[u][h] = valid[u] ? s[u][h] : -INFINITY;
    }
    // Online softmax, one rescale per tile rather than per token.
#pragma unroll
    for (int h = 0; h < GP; ++h) {
      float mx = m[h];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][h]);
      const float alpha = fast_exp2(m[h] - mx);
      m[h] = mx;
      l[h] *= alpha;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= alpha;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      unpack_kv<T, KV>(sm.ring[stage][u][1][tid], vf);
#pragma unroll
      for (int h = 0; h < GP; ++h) {
        const float pr = fast_exp2(s[u][h] - m[h]);
        l[h] += pr;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(pr, vf[i], acc[h][i]);
      }
    }
  }
  cp_async_wait<0>();  // the last (empty) prefetches must land before the ring is reused
  __syncthreads();

  // Merge the kRows partial states (one per row group) through shared memory.
  Merge& mg = sm.merge;
  const int r = warp * kTpw + grp;
#pragma unroll
  for (int h = 0; h < GP; ++h) {
    float4* dst = reinterpret_cast<float4*>(&mg.acc[r][h][sub * 8]);
    dst[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    dst[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
    if (sub == 0) {
      mg.m[r][h] = m[h];
      mg.l[r][h] = l[h];
    }
  }
  __syncthreads();
  if (tid < GP) {
    float mx = kNegBig;
    for (int i = 0; i < kRows; ++i) mx = fmaxf(mx, mg.m[i][tid]);
    float sum = 0.f;
    for (int i = 0; i < kRows; ++i) {
      const float w = fast_exp2(mg.m[i][tid] - mx);
      mg.w[i][tid] = w;
      sum += w * mg.l[i][tid];
    }
    mg.fin[0][tid] = mx;
    mg.fin[1][tid] = sum;
  }
  __syncthreads();

  const int hq0 = kvh * p.group;
  for (int item = tid; item < GP * (D / 8); item += kThreads) {
    const int h = item / (D / 8), d = (item % (D / 8)) * 8;
    if (h >= p.group) continue;
    float o[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int i = 0; i < kRows; ++i) {
      const float w = mg.w[i][h];
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = fmaf(w, mg.acc[i][h][d + j], o[j]);
    }
    float total = mg.fin[1][h];
    // One split writes the final output: the sink joins its denominator here (with splits, the
    // merge kernel adds it); len == 0 (padding) -> zeros.
    const float c = p.num_splits == 1 && total > 0.f ? fold_sink(p, hq0 + h, mg.fin[0][h], total) : 1.f;
    const float inv = total > 0.f ? p.v_scale * c / total : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] *= inv;
    if (p.num_splits == 1) {
      T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + static_cast<int64_t>(hq0 + h) * D + d;
      *reinterpret_cast<uint4*>(dst) = make_uint4(pack2<T>(o[0], o[1]), pack2<T>(o[2], o[3]),
                                                  pack2<T>(o[4], o[5]), pack2<T>(o[6], o[7]));
    } else {
      const int64_t idx = (static_cast<int64_t>(b) * p.kv_heads * p.group + hq0 + h) * p.num_splits + split;
      float4* dst = reinterpret_cast<float4*>(p.part_o + idx * D + d);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (d == 0) p.part_lse[idx] = mg.fin[0][h] + __log2f(total);
    }
  }
}

}  // namespace decode
}  // namespace minisgl
