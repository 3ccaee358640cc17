// The skinny GEMM's MoE kernels: the routed experts of a few tokens per (token, expert) pair
// (skinny_moe_kernel) and of tens of tokens grouped by expert (skinny_moe_grouped_kernel). Both run
// csrc/skinny_gemm.cuh's block (skinny_block) on the expert a block reads on the device; the
// launchers are csrc/skinny_moe.cu's skinny_moe and skinny_moe_grouped. Framework-free.
#pragma once
#include "skinny_gemm.cuh"

namespace minisgl {
namespace skinny {

// The routed experts of 1..few tokens (Params' MoE fields): each block reads its expert id, then
// runs the dense block on that expert's W with m = 1 (16-bit or 4-bit loaders: W::expert). Up and
// down are separate instances (kDown), so the up projection's blocks carry none of the top-k sum's code.
// Programmatic dependent launch: the up launch follows the routing kernel, so it waits before it
// reads the ids, and only then lets the down launch start. So when a down block starts, every up
// block has passed its wait, the routing kernel has completed, and the ids and weights may be read
// before the down block's own wait (for the intermediate): its expert's first W loads overlap the
// up launch's tail, as a dense launch's do.
template <typename W, int RT, int U, bool kDown>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_moe_kernel(const Params p) {
  using T = typename W::T;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (!kDown) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the expert ids come from the previous kernel
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
#endif
  const int z = blockIdx.z;
  int pair = z, split = blockIdx.y;
  if constexpr (kDown) {
    pair = z * p.top_k + static_cast<int>(blockIdx.y) / p.splits_per_slot;
    split = static_cast<int>(blockIdx.y) % p.splits_per_slot;
  }
  const int64_t e = p.moe_ids[pair];
  Params q = p;
  W::expert(q, e);  // the loader moves w (and its scales) to expert e
  const T* bias = p.bias == nullptr ? nullptr : static_cast<const T*>(p.bias) + e * p.b_expert_stride;
  q.x = static_cast<const T*>(p.x) + static_cast<int64_t>(kDown ? pair : z / p.top_k) * p.x_stride;
  q.y = static_cast<T*>(p.y) + static_cast<int64_t>(z) * p.y_stride;
  q.m = 1;
  MoeSlot<T> slot{1.0f, nullptr};
  if constexpr (kDown) {
    slot.weight = p.moe_weights[pair];
    slot.bias = split == 0 ? bias : nullptr;  // the bias once per slot, weighted with its partial
    q.bias = nullptr;
  } else {
    q.bias = bias;
  }
  skinny_block<W, 1, RT, U, true, kDown>(q, split, z * gridDim.x + blockIdx.x, slot);
}

// The routed experts of tens of tokens, grouped by expert (kernels/moe_align.py's blocks of m = 8 * MT
// pairs, one expert each): block z of the grid is align block z, read once for all of its pairs;
// a block past the last used one (expert -1) returns. Up (kDown false): x [T, k] rows s / top_k,
// y [T * top_k, n] = act(gate + b_gate, up + b_up). Down: x = that intermediate, y [T * top_k, n] rows of
// weight_s * (x W_e^T + b_e); the top-k sum is the next kernel's (kernels/fused_moe.py moe_sum).
// Where skinny_moe_kernel reads an expert once per pair, this reads it once per block, so a step
// whose tokens share experts (32 tokens, top 8 of 128: ~2.3 pairs an expert hit) reads each
// expert about once. Programmatic dependent launch as skinny_moe_kernel's: the up launch waits
// before it reads the alignment (the previous kernel's), the down launch's blocks may read it at
// once (every up block has passed its wait when a down block starts).
template <typename W, int MT, int RT, int U, bool kDown>
__global__ void __launch_bounds__(kMaxWarps * 32) skinny_moe_grouped_kernel(const Params p) {
  using T = typename W::T;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (!kDown) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
#endif
  const int z = blockIdx.z;
  const int e = p.moe_blocks[z];
  if (e < 0) return;  // every block of this z (all row tiles and splits) returns: no counter moves
  Params q = p;
  W::expert(q, e);
  q.bias = p.bias == nullptr ? nullptr : static_cast<const T*>(p.bias) + e * p.b_expert_stride;
  q.moe_sorted = p.moe_sorted + static_cast<int64_t>(z) * (8 * MT);
  skinny_block<W, MT, RT, U, true, kDown, true>(q, blockIdx.y, z * gridDim.x + blockIdx.x, {1.0f, nullptr});
}

}  // namespace skinny
}  // namespace minisgl
