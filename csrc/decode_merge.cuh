// Second pass of paged decode attention when the context was split (num_splits > 1):
// combines the per-split partials (o normalised by its own softmax sum, lse in log2 units)
// into out [B, Hq, D]: out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over the splits
// that had tokens. Memory traffic: num_splits * (D + 1) * 4 bytes read per head (L2-resident:
// the split pass just wrote them), D * sizeof(T) written.
#pragma once
#include "decode_common.cuh"

namespace minisgl {
namespace decode {

// Block (head, request). Thread (g, vec) folds splits g, g + kGroups, ... of one float4
// column with an online max; the groups combine through shared memory (one barrier). The
// partials' addresses do not depend on the length, so the first loads go out at once.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) merge_kernel(const Params p) {
  constexpr int kVecs = D / 4;               // float4 columns of one head
  constexpr int kGroups = kThreads / kVecs;  // splits folded in parallel
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The next grid (the o_proj skinny GEMM, launched with programmatic dependent launch) may be
  // scheduled now: it loads its first W group while the attention finishes and waits for this
  // grid (griddepcontrol.wait) before it reads the output.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");  // the split grid's partials are complete
#endif
  const int hq = blockIdx.x, b = blockIdx.y;
  const int num_heads = p.kv_heads * p.group;
  const int64_t base = (static_cast<int64_t>(b) * num_heads + hq) * p.num_splits;
  const int vec = threadIdx.x % kVecs, g = threadIdx.x / kVecs;

  // The first kPre splits' partials are loaded before the length (volatile asm keeps that
  // order): nothing waits on the length -> split-count division before the loads go out.
  constexpr int kPre = 8;
  const float4* o_src = reinterpret_cast<const float4*>(p.part_o + base * D) + vec;
  float lse_r[kPre];
  float4 o_r[kPre];
#pragma unroll
  for (int k = 0; k < kPre; ++k) {
    const int s = min(g + k * kGroups, p.num_splits - 1);  // in bounds; extra ones masked below
    lse_r[k] = load_f32_l2(p.part_lse + base + s);
    o_r[k] = load_f4_l2(o_src + static_cast<int64_t>(s) * kVecs);
  }
  const int len = request_len(p, b);
  const int win = len - window_start(p, len);  // keys the splits covered
  const int chunk = split_chunk(win, p.num_splits, p.tile);
  const int n = win > 0 ? (win + chunk - 1) / chunk : 0;  // splits that had tokens

  float m = kNegBig, w = 0.f;
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
  auto fold = [&](float lse, const float4& o) {  // online softmax over this thread's splits
    const float mx = fmaxf(m, lse);
    const float c = fast_exp2(m - mx), e = fast_exp2(lse - mx);
    m = mx;
    w = fmaf(w, c, e);
    a.x = fmaf(a.x, c, e * o.x);
    a.y = fmaf(a.y, c, e * o.y);
    a.z = fmaf(a.z, c, e * o.z);
    a.w = fmaf(a.w, c, e * o.w);
  };
#pragma unroll
  for (int k = 0; k < kPre; ++k) {
    if (g + k * kGroups < n) fold(lse_r[k], o_r[k]);
  }
#pragma unroll 4
  for (int s = g + kPre * kGroups; s < n; s += kGroups) {
    fold(load_f32_l2(p.part_lse + base + s), load_f4_l2(o_src + static_cast<int64_t>(s) * kVecs));
  }

  __shared__ float4 part[kGroups][kVecs];
  __shared__ float gm[kGroups], gw[kGroups];
  part[g][vec] = a;
  if (vec == 0) {
    gm[g] = m;  // identical across a group's threads: same splits
    gw[g] = w;
  }
  __syncthreads();
  if (g != 0) return;
  float mx = kNegBig;
#pragma unroll
  for (int i = 0; i < kGroups; ++i) mx = fmaxf(mx, gm[i]);
  float total = 0.f;
  float4 r = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    const float c = fast_exp2(gm[i] - mx);
    const float4 o = part[i][vec];
    total = fmaf(gw[i], c, total);
    r.x = fmaf(o.x, c, r.x);
    r.y = fmaf(o.y, c, r.y);
    r.z = fmaf(o.z, c, r.z);
    r.w = fmaf(o.w, c, r.w);
  }
  const float c = total > 0.f ? fold_sink(p, hq, mx, total) : 1.f;  // the sink: denominator only
  const float inv = total > 0.f ? c / total : 0.f;  // no valid split (length 0) -> zeros
  T* dst = static_cast<T*>(p.out) + b * p.out_stride_b + static_cast<int64_t>(hq) * D + vec * 4;
  *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(r.x * inv, r.y * inv), pack2<T>(r.z * inv, r.w * inv));
}

}  // namespace decode
}  // namespace minisgl
