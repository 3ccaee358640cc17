// The one-shot all-reduce fused with the residual add and the RMSNorm that follow a
// row-parallel layer (o_proj, down_proj) in a pre-norm block:
//   r        = sum over ranks of in (fp32 in rank order, rounded to the dtype: the all-reduce)
//   residual = r + residual (fp32, rounded)                        written in place
//   out      = weight * rmsnorm(residual) (minisgl.kernels.norm's roundings)
// One kernel instead of two (all-reduce, then fused_add_rmsnorm): at batch 1 each is a few
// microseconds of mostly fixed cost, and a decode step runs two pairs per layer.
//
// Same peer-memory protocol as one_shot_all_reduce_kernel (custom_all_reduce.cuh: staging by
// epoch parity, per-block flags, the last block advances the epoch), with rows in place of
// flat slots: block b owns rows b, b + G, ... on every rank (G depends on rows only), so its
// barrier waits for exactly the rows it reads. A block holds a whole row, to normalise it.
#pragma once
#include "custom_all_reduce.cuh"

namespace minisgl {
namespace car {

constexpr int kNormMaxSlotsPerThread = 4;  // rows of up to 4 * kThreads * 8 = 16384 16-bit elements

__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();  // scratch is reused by the next row
  return total;
}

// 16-bit dtypes only; in, residual, out, weight 16-byte aligned, rows contiguous (hidden % 8 == 0).
template <int kDtype, int W>
__global__ void __launch_bounds__(kThreads)
    one_shot_all_reduce_rmsnorm_kernel(const __grid_constant__ RankBases ranks, int rank, const void* in_ptr,
                                       void* residual_ptr, void* out_ptr, const void* weight_ptr, int64_t rows,
                                       int64_t hidden, float eps, int64_t buffer_bytes) {
  using E = Elem<kDtype>;
  using Bits = typename E::Bits;
  constexpr int V = Slot<Bits>::V;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent (sm_90): the next kernel (a skinny GEMM, which loads
  // its first group of W before its own griddepcontrol.wait) may launch now and stream weights
  // while this grid waits on its peers; this grid first waits until the previous kernel has
  // completed and its writes (in, residual, the epoch) are visible. No-ops without the attribute.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  char* const own = ranks.base[rank];
  Signal* self = signal_of(own);
  __shared__ uint64_t shared_epoch;
  __shared__ float scratch[kThreads / 32];
  if (threadIdx.x == 0) shared_epoch = self->epoch + 1;
  __syncthreads();
  const uint64_t epoch = shared_epoch;
  const int64_t staging = kSignalBytes + static_cast<int64_t>(epoch & 1) * buffer_bytes;
  const int64_t per_row = hidden / V;  // slots of a row

  const uint4* in = static_cast<const uint4*>(in_ptr);
  uint4* residual = static_cast<uint4*>(residual_ptr);
  uint4* out = static_cast<uint4*>(out_ptr);
  const uint4* weight = static_cast<const uint4*>(weight_ptr);
  uint4* mine = reinterpret_cast<uint4*>(own + staging);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    for (int64_t j = threadIdx.x; j < per_row; j += kThreads) mine[row * per_row + j] = in[row * per_row + j];
  }

  if constexpr (W > 1) {
    __syncthreads();
    const int peer = threadIdx.x;
    if (peer < W && peer != rank) {
      store_release_sys(&signal_of(ranks.base[peer])->flags[blockIdx.x][rank], epoch);
      const uint64_t* flag = &self->flags[blockIdx.x][peer];
      while (static_cast<int64_t>(load_acquire_sys(flag) - epoch) < 0) {
      }
    }
    __syncthreads();
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float kept[kNormMaxSlotsPerThread][V];
    float squares = 0.f;
#pragma unroll
    for (int k = 0; k < kNormMaxSlotsPerThread; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * kThreads;
      if (j >= per_row) break;
      const int64_t s = row * per_row + j;
      float acc[V];
#pragma unroll
      for (int e = 0; e < V; ++e) acc[e] = 0.f;
#pragma unroll
      for (int r = 0; r < W; ++r) {
        Slot<Bits> part;
        part.vec = __ldcg(reinterpret_cast<const uint4*>(ranks.base[r] + staging) + s);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = r == 0 ? E::to_float(part.e[e]) : acc[e] + E::to_float(part.e[e]);
      }
      Slot<Bits> res, sum;
      res.vec = residual[s];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float reduced = E::to_float(E::from_float(acc[e]));  // the all-reduce's rounding
        sum.e[e] = E::from_float(reduced + E::to_float(res.e[e]));
        kept[k][e] = E::to_float(sum.e[e]);
        squares += kept[k][e] * kept[k][e];
      }
      residual[s] = sum.vec;
    }
    const float scale = rsqrtf(block_sum(squares, scratch) / static_cast<float>(hidden) + eps);
#pragma unroll
    for (int k = 0; k < kNormMaxSlotsPerThread; ++k) {
      const int64_t j = threadIdx.x + static_cast<int64_t>(k) * kThreads;
      if (j >= per_row) break;
      Slot<Bits> w, o;
      w.vec = weight[j];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float h = E::to_float(E::from_float(kept[k][e] * scale));
        o.e[e] = E::from_float(E::to_float(w.e[e]) * h);
      }
      out[row * per_row + j] = o.vec;
    }
  }

  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&self->blocks_done, 1u) == gridDim.x - 1) {
      self->blocks_done = 0;
      self->epoch = epoch;
    }
  }
}

}  // namespace car
}  // namespace minisgl
