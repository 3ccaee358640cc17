// One-shot all-reduce (sum) for small messages over peer memory (CUDA IPC), framework-free.
//
// Every rank owns one registered region, mapped by every peer (cudaIpcOpenMemHandle):
//   [Signal (kSignalBytes)] [staging buffer, parity 0 (buffer_bytes)] [parity 1 (buffer_bytes)]
// A call is one kernel on every rank, the same grid everywhere (the grid depends on n only):
//   1. each block stages its slots of the input into this rank's buffer of parity epoch & 1;
//   2. per-block barrier: the block's flag thread for peer p stores `epoch` into
//      p.flags[block][rank] (release, system scope) and spins until this rank's
//      flags[block][p] >= epoch (acquire): block b of every rank has staged the slots block b
//      reads, because every rank's block b owns the same slots;
//   3. each block reads its slots from every rank's buffer with 16-byte loads, sums them in
//      fp32 in rank order 0, 1, .., W-1 (the same order, hence the same bits, on every rank)
//      and writes the output (which may be the input: each slot is read and written by the
//      same thread);
//   4. the last block to finish advances this rank's epoch in device memory.
//
// Invariants that make this safe without a second barrier and without any host state:
// - Epochs: Signal::epoch counts the calls this rank completed; a call uses epoch + 1. Every
//   rank makes the same sequence of calls, so call k has epoch k on every rank. Flags only
//   grow, and a waiter compares with >=, so no reset is needed between calls, and a replayed
//   CUDA graph reads the epoch from device memory like an eager call.
// - Buffer reuse: call k stages into parity k & 1. When a rank starts call k + 2 (writing the
//   parity that call k read), its call k + 1 has completed, so every block of call k + 1
//   passed its barrier, so every peer has started call k + 1, so every peer's call k (the
//   last one to read that parity) has completed. A peer is therefore at most one call ahead,
//   never two, and the flags it writes early only ever satisfy a >= test.
// - Calls on one rank are serialized on one stream (as NCCL requires of its calls too).
// - Blocks of one call wait only on the same block index of other ranks; grids stay within
//   kMaxBlocks (<= the SM count in practice) so that every block is resident.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "nccl.h"

namespace minisgl {
namespace car {

constexpr int kMaxWorld = 8;
constexpr int kMaxBlocks = 128;
constexpr int kThreads = 512;
constexpr int64_t kSignalBytes = 16384;  // keeps the staging buffers 16 KB (hence 16 B) aligned

struct Signal {
  uint64_t epoch;           // calls this rank has completed
  uint32_t blocks_done;     // blocks of the running call that have finished (0 between calls)
  uint32_t unused;
  uint64_t flags[kMaxBlocks][kMaxWorld];  // flags[b][src]: last epoch at which src's block b staged
};
static_assert(sizeof(Signal) <= kSignalBytes, "Signal outgrew its slot");

// Each rank's region base, in rank order (this rank's own included); passed by value, so a
// captured graph holds the pointers, which stay valid until the communicator is destroyed.
// A __grid_constant__ parameter: indexed at run time in parameter space, never copied to
// local memory.
struct RankBases {
  char* base[kMaxWorld];
};

__device__ __forceinline__ Signal* signal_of(char* base) { return reinterpret_cast<Signal*>(base); }

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Element types by their NCCL code (nccl.h), as raw bits, with fp32 conversions.
template <int kDtype>
struct Elem;
template <>
struct Elem<kNcclFloat16> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __half2float(__ushort_as_half(b)); }
  __device__ static Bits from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
template <>
struct Elem<kNcclBfloat16> {
  using Bits = uint16_t;
  __device__ static float to_float(Bits b) { return __bfloat162float(__ushort_as_bfloat16(b)); }
  __device__ static Bits from_float(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
};
template <>
struct Elem<kNcclFloat32> {
  using Bits = uint32_t;
  __device__ static float to_float(Bits b) { return __uint_as_float(b); }
  __device__ static Bits from_float(float f) { return __float_as_uint(f); }
};

// One slot: 16 bytes of elements. The last slot of a message may be partial (n % V elements).
template <typename Bits>
union Slot {
  static constexpr int V = 16 / sizeof(Bits);
  uint4 vec;
  Bits e[V];
};

// kAligned: the caller's pointer is 16-byte aligned, so whole slots move as one vector; else
// element by element (the staging buffers are always aligned). Lanes past n read as zero.
template <typename Bits, bool kAligned>
__device__ __forceinline__ Slot<Bits> load_slot(const Bits* src, int64_t s, int64_t n) {
  constexpr int V = Slot<Bits>::V;
  const int64_t i = s * V;
  Slot<Bits> out;
  if (kAligned && i + V <= n) {
    out.vec = *reinterpret_cast<const uint4*>(src + i);
    return out;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) out.e[j] = i + j < n ? src[i + j] : Bits(0);
  return out;
}

template <typename Bits, bool kAligned>
__device__ __forceinline__ void store_slot(Bits* dst, int64_t s, int64_t n, const Slot<Bits>& v) {
  constexpr int V = Slot<Bits>::V;
  const int64_t i = s * V;
  if (kAligned && i + V <= n) {
    *reinterpret_cast<uint4*>(dst + i) = v.vec;
    return;
  }
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (i + j < n) dst[i + j] = v.e[j];
  }
}

// Grid: any number of blocks <= kMaxBlocks of kThreads threads, the same on every rank for
// the same n. Thread t of block b handles slots b * kThreads + t + k * (grid size).
template <int kDtype, int W, bool kAligned>
__global__ void __launch_bounds__(kThreads)
    one_shot_all_reduce_kernel(const __grid_constant__ RankBases ranks, int rank, const void* in_ptr,
                               void* out_ptr, int64_t n, int64_t buffer_bytes) {
  using E = Elem<kDtype>;
  using Bits = typename E::Bits;
  constexpr int V = Slot<Bits>::V;
  char* const own = ranks.base[rank];
  Signal* self = signal_of(own);
  __shared__ uint64_t shared_epoch;
  if (threadIdx.x == 0) shared_epoch = self->epoch + 1;
  __syncthreads();
  const uint64_t epoch = shared_epoch;
  const int64_t staging = kSignalBytes + static_cast<int64_t>(epoch & 1) * buffer_bytes;

  const Bits* in = static_cast<const Bits*>(in_ptr);
  Bits* out = static_cast<Bits*>(out_ptr);
  const int64_t slots = (n + V - 1) / V;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;

  uint4* mine = reinterpret_cast<uint4*>(own + staging);
  for (int64_t s = first; s < slots; s += stride) mine[s] = load_slot<Bits, kAligned>(in, s, n).vec;

  if constexpr (W > 1) {
    __syncthreads();  // the whole block's slots are staged before its flags go out (release below)
    const int peer = threadIdx.x;
    if (peer < W && peer != rank) {
      store_release_sys(&signal_of(ranks.base[peer])->flags[blockIdx.x][rank], epoch);
      const uint64_t* flag = &self->flags[blockIdx.x][peer];
      while (static_cast<int64_t>(load_acquire_sys(flag) - epoch) < 0) {
      }
    }
    __syncthreads();
  }

  for (int64_t s = first; s < slots; s += stride) {
    Slot<Bits> part[W];
#pragma unroll
    for (int r = 0; r < W; ++r) {
      // .cg: straight from the owner's L2 (over NVLink for a peer), never a stale L1 line
      part[r].vec = __ldcg(reinterpret_cast<const uint4*>(ranks.base[r] + staging) + s);
    }
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = E::to_float(part[0].e[j]);
#pragma unroll
    for (int r = 1; r < W; ++r) {
#pragma unroll
      for (int j = 0; j < V; ++j) acc[j] += E::to_float(part[r].e[j]);
    }
    Slot<Bits> sum;
#pragma unroll
    for (int j = 0; j < V; ++j) sum.e[j] = E::from_float(acc[j]);
    store_slot<Bits, kAligned>(out, s, n, sum);
  }

  // The last block to finish advances the epoch. Every block read the epoch before its
  // increment below (the fence orders them), so no block of this call sees the new value.
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
