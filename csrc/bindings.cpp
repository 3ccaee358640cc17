// The one binding file of minisgl._C. Tensors never cross this boundary: Python passes
// data pointers, sizes, strides (in bytes) and the current CUDA stream as integers, after
// minisgl/ops/ has checked every argument.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "nccl.h"

#ifdef MINISGL_WITH_CUDA
#include "launchers.h"
#endif

namespace py = pybind11;

namespace {

template <typename T = void>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

#ifdef MINISGL_WITH_CUDA
void check(int code, const char* op) {
  if (code != 0) {
    throw std::runtime_error(std::string("minisgl._C.") + op +
                             ": CUDA launch failed: " + minisgl::cuda_error_string(code));
  }
}
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "minisgl compiled kernels (framework-free CUDA behind raw-pointer launchers)";
#ifdef MINISGL_WITH_CUDA
  m.attr("has_cuda") = true;
  m.def(
      "store_kv",
      [](std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k, std::uintptr_t v,
         std::uintptr_t slots, int64_t num_tokens, int64_t row_bytes, int64_t cache_stride,
         int64_t k_stride, int64_t v_stride, std::uintptr_t stream) {
        check(minisgl::store_kv(ptr(k_cache), ptr(v_cache), ptr(k), ptr(v), ptr<const int32_t>(slots),
                                num_tokens, row_bytes, cache_stride, k_stride, v_stride, ptr(stream)),
              "store_kv");
      },
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("slots"),
      py::arg("num_tokens"), py::arg("row_bytes"), py::arg("cache_stride"), py::arg("k_stride"),
      py::arg("v_stride"), py::arg("stream"));
  m.def(
      "pdl_enabled",
      [](int device) {
        int enabled = 0;
        check(minisgl::pdl_enabled(device, &enabled), "pdl_enabled");
        return enabled != 0;
      },
      py::arg("device"));
  m.def(
      "paged_decode_num_splits",
      [](int device, int batch, int kv_heads, int group, int head_dim, int dtype, int64_t max_seq_len, bool kv_fp8) {
        int splits = 0;
        check(minisgl::paged_decode_num_splits(device, batch, kv_heads, group, head_dim, dtype, kv_fp8 ? 1 : 0,
                                               max_seq_len, &splits),
              "paged_decode_num_splits");
        return splits;
      },
      py::arg("device"), py::arg("batch"), py::arg("kv_heads"), py::arg("group"), py::arg("head_dim"), py::arg("dtype"),
      py::arg("max_seq_len"), py::arg("kv_fp8") = false);
  m.def(
      "paged_decode_attention",
      [](std::uintptr_t q, std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t req_to_slot,
         std::uintptr_t req_rows, std::uintptr_t seq_lens, std::uintptr_t out, std::uintptr_t part_o,
         std::uintptr_t part_lse, int batch, int kv_heads, int group, int head_dim, int dtype,
         int64_t q_stride_b, int64_t out_stride_b, int64_t cache_stride_s, int64_t table_stride,
         int max_context, int num_splits, float scale, int device, std::uintptr_t stream, bool kv_fp8,
         float k_scale, float v_scale, int window, std::uintptr_t sinks) {
        check(minisgl::paged_decode_attention(
                  ptr<const void>(q), ptr<const void>(k_cache), ptr<const void>(v_cache),
                  ptr<const int32_t>(req_to_slot), ptr<const int32_t>(req_rows), ptr<const int32_t>(seq_lens),
                  ptr(out), ptr<float>(part_o), ptr<float>(part_lse), batch, kv_heads, group, head_dim, dtype,
                  kv_fp8 ? 1 : 0, q_stride_b, out_stride_b, cache_stride_s, table_stride, max_context, num_splits,
                  scale, k_scale, v_scale, device, ptr(stream), window, ptr<const float>(sinks)),
              "paged_decode_attention");
      },
      py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("req_to_slot"), py::arg("req_rows"),
      py::arg("seq_lens"), py::arg("out"), py::arg("part_o"), py::arg("part_lse"), py::arg("batch"),
      py::arg("kv_heads"), py::arg("group"), py::arg("head_dim"), py::arg("dtype"), py::arg("q_stride_b"),
      py::arg("out_stride_b"), py::arg("cache_stride_s"), py::arg("table_stride"), py::arg("max_context"),
      py::arg("num_splits"), py::arg("scale"), py::arg("device"), py::arg("stream"), py::arg("kv_fp8") = false,
      py::arg("k_scale") = 1.0f, py::arg("v_scale") = 1.0f, py::arg("window") = 0, py::arg("sinks") = 0);
  m.def(
      "embedding_lookup",
      [](std::uintptr_t out, std::uintptr_t weight, std::uintptr_t ids, bool ids_are_int64, int64_t n,
         int64_t row_bytes, int64_t weight_stride, int64_t out_stride, int64_t start, int64_t end,
         std::uintptr_t stream) {
        check(minisgl::embedding_lookup(ptr(out), ptr<const void>(weight), ptr<const void>(ids),
                                        ids_are_int64 ? 1 : 0, n, row_bytes, weight_stride, out_stride, start,
                                        end, ptr(stream)),
              "embedding_lookup");
      },
      py::arg("out"), py::arg("weight"), py::arg("ids"), py::arg("ids_are_int64"), py::arg("n"),
      py::arg("row_bytes"), py::arg("weight_stride"), py::arg("out_stride"), py::arg("start"), py::arg("end"),
      py::arg("stream"));
  m.def(
      "kv_copy_slots",
      [](std::uintptr_t src_k, std::uintptr_t src_v, std::uintptr_t dst_k, std::uintptr_t dst_v,
         std::uintptr_t src_slots, std::uintptr_t dst_slots, int64_t num_slots, int64_t num_layers,
         int64_t row_bytes, int64_t src_layer_stride, int64_t src_slot_stride, int64_t dst_layer_stride,
         int64_t dst_slot_stride, int num_sms, std::uintptr_t stream) {
        check(minisgl::kv_copy_slots(ptr<const void>(src_k), ptr<const void>(src_v), ptr(dst_k), ptr(dst_v),
                                     ptr<const int32_t>(src_slots), ptr<const int32_t>(dst_slots), num_slots,
                                     num_layers, row_bytes, src_layer_stride, src_slot_stride, dst_layer_stride,
                                     dst_slot_stride, num_sms, ptr(stream)),
              "kv_copy_slots");
      },
      py::arg("src_k"), py::arg("src_v"), py::arg("dst_k"), py::arg("dst_v"), py::arg("src_slots"),
      py::arg("dst_slots"), py::arg("num_slots"), py::arg("num_layers"), py::arg("row_bytes"),
      py::arg("src_layer_stride"), py::arg("src_slot_stride"), py::arg("dst_layer_stride"),
      py::arg("dst_slot_stride"), py::arg("num_sms"), py::arg("stream"));
  m.def(
      "host_device_pointer",
      [](std::uintptr_t host) {
        void* device = nullptr;
        check(minisgl::host_device_pointer(ptr(host), &device), "host_device_pointer");
        return reinterpret_cast<std::uintptr_t>(device);
      },
      py::arg("host"));
  // ---- One-shot all-reduce over peer memory (csrc/custom_all_reduce.cu) ----
  m.attr("IPC_HANDLE_BYTES") = minisgl::kIpcHandleBytes;
  m.attr("CUSTOM_ALL_REDUCE_MAX_WORLD") = minisgl::kCustomAllReduceMaxWorld;
  m.attr("CUSTOM_ALL_REDUCE_MAX_BLOCKS") = minisgl::kCustomAllReduceMaxBlocks;
  m.attr("CUSTOM_ALL_REDUCE_NORM_MAX_HIDDEN") = minisgl::kCustomAllReduceNormMaxHidden;
  m.def(
      "custom_all_reduce_alloc",
      [](int device, int64_t buffer_bytes) {
        void* base = nullptr;
        check(minisgl::custom_all_reduce_alloc(device, buffer_bytes, &base), "custom_all_reduce_alloc");
        return reinterpret_cast<std::uintptr_t>(base);
      },
      py::arg("device"), py::arg("buffer_bytes"));
  m.def(
      "custom_all_reduce_free",
      [](int device, std::uintptr_t base) {
        check(minisgl::custom_all_reduce_free(device, ptr(base)), "custom_all_reduce_free");
      },
      py::arg("device"), py::arg("base"));
  m.def(
      "peer_memory_handle",
      [](int device, std::uintptr_t base) {
        std::string handle(minisgl::kIpcHandleBytes, '\0');
        check(minisgl::peer_memory_handle(device, ptr(base), handle.data()), "peer_memory_handle");
        return py::bytes(handle);
      },
      py::arg("device"), py::arg("base"));
  m.def(
      "peer_memory_open",
      [](int device, const py::bytes& handle) {
        std::string h = handle;
        if (h.size() != static_cast<size_t>(minisgl::kIpcHandleBytes)) {
          throw std::invalid_argument("peer_memory_open: an IPC handle is 64 bytes");
        }
        void* base = nullptr;
        check(minisgl::peer_memory_open(device, h.data(), &base), "peer_memory_open");
        return reinterpret_cast<std::uintptr_t>(base);
      },
      py::arg("device"), py::arg("handle"));
  m.def(
      "peer_memory_close",
      [](int device, std::uintptr_t base) {
        check(minisgl::peer_memory_close(device, ptr(base)), "peer_memory_close");
      },
      py::arg("device"), py::arg("base"));
  m.def(
      "custom_all_reduce",
      [](const py::sequence& bases, int rank, std::uintptr_t in, std::uintptr_t out, int64_t n, int dtype,
         int64_t buffer_bytes, int max_blocks, std::uintptr_t stream) {
        const int world = static_cast<int>(bases.size());
        if (world < 1 || world > minisgl::kCustomAllReduceMaxWorld) {
          throw std::invalid_argument("custom_all_reduce: 1 to 8 ranks");
        }
        void* b[minisgl::kCustomAllReduceMaxWorld] = {};
        for (int r = 0; r < world; ++r) b[r] = ptr(bases[r].cast<std::uintptr_t>());
        check(minisgl::custom_all_reduce(b, world, rank, ptr<const void>(in), ptr(out), n, dtype, buffer_bytes,
                                         max_blocks, ptr(stream)),
              "custom_all_reduce");
      },
      py::arg("bases"), py::arg("rank"), py::arg("inp"), py::arg("out"), py::arg("n"), py::arg("dtype"),
      py::arg("buffer_bytes"), py::arg("max_blocks"), py::arg("stream"));
  m.def(
      "custom_all_reduce_rmsnorm",
      [](const py::sequence& bases, int rank, std::uintptr_t in, std::uintptr_t residual, std::uintptr_t out,
         std::uintptr_t weight, int64_t rows, int64_t hidden, int dtype, float eps, int64_t buffer_bytes,
         int max_blocks, std::uintptr_t stream) {
        const int world = static_cast<int>(bases.size());
        if (world < 1 || world > minisgl::kCustomAllReduceMaxWorld) {
          throw std::invalid_argument("custom_all_reduce_rmsnorm: 1 to 8 ranks");
        }
        void* b[minisgl::kCustomAllReduceMaxWorld] = {};
        for (int r = 0; r < world; ++r) b[r] = ptr(bases[r].cast<std::uintptr_t>());
        check(minisgl::custom_all_reduce_rmsnorm(b, world, rank, ptr<const void>(in), ptr(residual), ptr(out),
                                                 ptr<const void>(weight), rows, hidden, dtype, eps, buffer_bytes,
                                                 max_blocks, ptr(stream)),
              "custom_all_reduce_rmsnorm");
      },
      py::arg("bases"), py::arg("rank"), py::arg("inp"), py::arg("residual"), py::arg("out"), py::arg("weight"),
      py::arg("rows"), py::arg("hidden"), py::arg("dtype"), py::arg("eps"), py::arg("buffer_bytes"),
      py::arg("max_blocks"), py::arg("stream"));
  // ---- end of the one-shot all-reduce ----

  // Skinny GEMM (csrc/skinny_gemm.cu): tile configurations by id as (row tiles, chunks, max m), and the launch.
  m.def(
      "skinny_gemm_configs",
      [](bool fp8) {
        py::list out;
        for (int c = 0; c < minisgl::skinny_gemm_num_configs(fp8 ? 1 : 0); ++c) {
          int rt = 0, u = 0, max_m = 0;
          check(minisgl::skinny_gemm_config(fp8 ? 1 : 0, c, &rt, &u, &max_m), "skinny_gemm_configs");
          out.append(py::make_tuple(rt, u, max_m));
        }
        return out;
      },
      py::arg("fp8") = false);
  m.def(
      "skinny_gemm_w4_configs",
      []() {
        py::list out;
        for (int c = 0; c < minisgl::skinny_gemm_num_configs(2); ++c) {
          int rt = 0, u = 0, max_m = 0;
          check(minisgl::skinny_gemm_config(2, c, &rt, &u, &max_m), "skinny_gemm_w4_configs");
          out.append(py::make_tuple(rt, u, max_m));
        }
        return out;
      });
  // 4-bit weights (fmt 1 INT4, 2 MXFP4; kernels/quant4.py layouts); zeros 0 for MXFP4.
  m.def(
      "skinny_gemm_w4",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t scales, std::uintptr_t zeros, int64_t q_stride,
         int q_group, int fmt, std::uintptr_t bias, std::uintptr_t y, std::uintptr_t workspace,
         int64_t workspace_bytes, std::uintptr_t counters, int64_t num_counters, int m, int n, int k,
         int64_t x_stride, int64_t w_stride, int64_t y_stride, bool silu, int dtype, int cfg, int warps,
         int num_splits, bool pdl, std::uintptr_t stream) {
        check(minisgl::skinny_gemm_w4(ptr<const void>(x), ptr<const void>(w), ptr<const void>(scales),
                                      ptr<const void>(zeros), q_stride, q_group, fmt, ptr<const void>(bias), ptr(y),
                                      ptr<float>(workspace), workspace_bytes, ptr<int>(counters), num_counters, m, n,
                                      k, x_stride, w_stride, y_stride, silu ? 1 : 0, dtype, cfg, warps, num_splits,
                                      pdl ? 1 : 0, ptr(stream)),
              "skinny_gemm_w4");
      },
      py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("zeros"), py::arg("q_stride"), py::arg("q_group"),
      py::arg("fmt"), py::arg("bias"), py::arg("y"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("counters"), py::arg("num_counters"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"),
      py::arg("w_stride"), py::arg("y_stride"), py::arg("silu"), py::arg("dtype"), py::arg("cfg"), py::arg("warps"),
      py::arg("num_splits"), py::arg("pdl"), py::arg("stream"));
  m.def(
      "skinny_gemm_fp8",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t scale, int64_t s_stride, bool block_scales,
         std::uintptr_t bias, std::uintptr_t y, std::uintptr_t workspace, int64_t workspace_bytes,
         std::uintptr_t counters, int64_t num_counters, int m, int n, int k, int64_t x_stride, int64_t w_stride,
         int64_t y_stride, bool silu, int dtype, int cfg, int warps, int num_splits, bool pdl, std::uintptr_t stream,
         bool warp_ranges) {
        check(minisgl::skinny_gemm_fp8(ptr<const void>(x), ptr<const void>(w), ptr<const float>(scale), s_stride,
                                       block_scales ? 1 : 0, ptr<const void>(bias), ptr(y), ptr<float>(workspace),
                                       workspace_bytes, ptr<int>(counters), num_counters, m, n, k, x_stride,
                                       w_stride, y_stride, silu ? 1 : 0, dtype, cfg, warps, num_splits, pdl ? 1 : 0,
                                       ptr(stream), warp_ranges ? 1 : 0),
              "skinny_gemm_fp8");
      },
      py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("s_stride"), py::arg("block_scales"), py::arg("bias"),
      py::arg("y"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("counters"), py::arg("num_counters"),
      py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("w_stride"), py::arg("y_stride"),
      py::arg("silu"), py::arg("dtype"), py::arg("cfg"), py::arg("warps"), py::arg("num_splits"), py::arg("pdl"),
      py::arg("stream"), py::arg("warp_ranges") = false);
  m.def(
      "skinny_moe",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t ids, std::uintptr_t weights,
         std::uintptr_t y, std::uintptr_t workspace, int64_t workspace_bytes, std::uintptr_t counters,
         int64_t num_counters, int tokens, int top_k, int n, int k, int64_t x_stride, int64_t w_stride,
         int64_t y_stride, int64_t w_expert_stride, int64_t b_expert_stride, bool down, int act, float alpha,
         float limit, int fmt, std::uintptr_t scales, std::uintptr_t zeros, int64_t q_stride, int q_group,
         int64_t q_expert_stride, int dtype, int cfg, int warps, int splits, bool pdl, std::uintptr_t stream,
         bool warp_ranges) {
        check(minisgl::skinny_moe(ptr<const void>(x), ptr<const void>(w), ptr<const void>(bias), ptr<const int>(ids),
                                  ptr<const float>(weights), ptr(y), ptr<float>(workspace), workspace_bytes,
                                  ptr<int>(counters), num_counters, tokens, top_k, n, k, x_stride, w_stride, y_stride,
                                  w_expert_stride, b_expert_stride, down ? 1 : 0, act, alpha, limit, fmt,
                                  ptr<const void>(scales), ptr<const void>(zeros), q_stride, q_group, q_expert_stride,
                                  dtype, cfg, warps, splits, pdl ? 1 : 0, ptr(stream), warp_ranges ? 1 : 0),
              "skinny_moe");
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("ids"), py::arg("weights"), py::arg("y"),
      py::arg("workspace"), py::arg("workspace_bytes"), py::arg("counters"), py::arg("num_counters"),
      py::arg("tokens"), py::arg("top_k"), py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("w_stride"),
      py::arg("y_stride"), py::arg("w_expert_stride"), py::arg("b_expert_stride"), py::arg("down"), py::arg("act"),
      py::arg("alpha"), py::arg("limit"), py::arg("fmt"), py::arg("scales"), py::arg("zeros"), py::arg("q_stride"),
      py::arg("q_group"), py::arg("q_expert_stride"), py::arg("dtype"), py::arg("cfg"), py::arg("warps"),
      py::arg("splits"), py::arg("pdl"), py::arg("stream"), py::arg("warp_ranges") = false);
  m.def(
      "skinny_moe_grouped",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t sorted_ids,
         std::uintptr_t block_experts, std::uintptr_t weights, std::uintptr_t y, std::uintptr_t workspace,
         int64_t workspace_bytes, std::uintptr_t counters, int64_t num_counters, int tokens, int top_k,
         int num_blocks, int block_m, int n, int k, int64_t x_stride, int64_t w_stride, int64_t y_stride,
         int64_t w_expert_stride, int64_t b_expert_stride, bool down, int act, float alpha, float limit, int fmt,
         std::uintptr_t scales, std::uintptr_t zeros, int64_t q_stride, int q_group, int64_t q_expert_stride,
         int dtype, int cfg, int warps, int splits, bool pdl, std::uintptr_t stream) {
        check(minisgl::skinny_moe_grouped(
                  ptr<const void>(x), ptr<const void>(w), ptr<const void>(bias), ptr<const int>(sorted_ids),
                  ptr<const int>(block_experts), ptr<const float>(weights), ptr(y), ptr<float>(workspace),
                  workspace_bytes, ptr<int>(counters), num_counters, tokens, top_k, num_blocks, block_m, n, k,
                  x_stride, w_stride, y_stride, w_expert_stride, b_expert_stride, down ? 1 : 0, act, alpha, limit,
                  fmt, ptr<const void>(scales), ptr<const void>(zeros), q_stride, q_group, q_expert_stride, dtype,
                  cfg, warps, splits, pdl ? 1 : 0, ptr(stream)),
              "skinny_moe_grouped");
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("sorted_ids"), py::arg("block_experts"),
      py::arg("weights"), py::arg("y"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("counters"),
      py::arg("num_counters"), py::arg("tokens"), py::arg("top_k"), py::arg("num_blocks"), py::arg("block_m"),
      py::arg("n"), py::arg("k"), py::arg("x_stride"), py::arg("w_stride"), py::arg("y_stride"),
      py::arg("w_expert_stride"), py::arg("b_expert_stride"), py::arg("down"), py::arg("act"), py::arg("alpha"),
      py::arg("limit"), py::arg("fmt"), py::arg("scales"), py::arg("zeros"), py::arg("q_stride"),
      py::arg("q_group"), py::arg("q_expert_stride"), py::arg("dtype"), py::arg("cfg"), py::arg("warps"),
      py::arg("splits"), py::arg("pdl"), py::arg("stream"));
  m.def(
      "skinny_gemm",
      [](std::uintptr_t x, std::uintptr_t w, std::uintptr_t bias, std::uintptr_t y, std::uintptr_t workspace,
         int64_t workspace_bytes, std::uintptr_t counters, int64_t num_counters, int m, int n, int k,
         int64_t x_stride, int64_t w_stride, int64_t y_stride, bool silu, int dtype, int cfg, int warps,
         int num_splits, bool pdl, std::uintptr_t stream, bool warp_ranges) {
        check(minisgl::skinny_gemm(ptr<const void>(x), ptr<const void>(w), ptr<const void>(bias), ptr(y),
                                   ptr<float>(workspace), workspace_bytes, ptr<int>(counters), num_counters, m, n,
                                   k, x_stride, w_stride, y_stride, silu ? 1 : 0, dtype, cfg, warps, num_splits,
                                   pdl ? 1 : 0, ptr(stream), warp_ranges ? 1 : 0),
              "skinny_gemm");
      },
      py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("y"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("counters"), py::arg("num_counters"), py::arg("m"), py::arg("n"), py::arg("k"), py::arg("x_stride"),
      py::arg("w_stride"), py::arg("y_stride"), py::arg("silu"), py::arg("dtype"), py::arg("cfg"), py::arg("warps"),
      py::arg("num_splits"), py::arg("pdl"), py::arg("stream"), py::arg("warp_ranges") = false);
#else
  m.attr("has_cuda") = false;
#endif
  // NCCL: loaded at run time (see nccl.h); raw bytes for the 128-byte unique id.
  m.def("nccl_load", &minisgl::nccl_load, py::arg("path"));
  m.attr("NCCL_FLOAT16") = static_cast<int>(minisgl::kNcclFloat16);
  m.attr("NCCL_FLOAT32") = static_cast<int>(minisgl::kNcclFloat32);
  m.attr("NCCL_BFLOAT16") = static_cast<int>(minisgl::kNcclBfloat16);
  m.def("nccl_version", &minisgl::nccl_version);
  m.def("nccl_unique_id", []() { return py::bytes(minisgl::nccl_unique_id()); });
  m.def(
      "nccl_comm_init_rank",
      [](int world_size, const py::bytes& uid, int rank) {
        std::string id = uid;
        py::gil_scoped_release release;  // blocks until every rank has joined
        return minisgl::nccl_comm_init_rank(world_size, id, rank);
      },
      py::arg("world_size"), py::arg("unique_id"), py::arg("rank"));
  m.def("nccl_comm_destroy", &minisgl::nccl_comm_destroy, py::arg("comm"));
  m.def("nccl_all_reduce", &minisgl::nccl_all_reduce, py::arg("comm"), py::arg("send"), py::arg("recv"),
        py::arg("count"), py::arg("dtype"), py::arg("stream"));
  m.def("nccl_all_gather", &minisgl::nccl_all_gather, py::arg("comm"), py::arg("send"), py::arg("recv"),
        py::arg("count"), py::arg("dtype"), py::arg("stream"));
}
