// The few NCCL entry points minisgl needs, declared here and resolved at run time from the
// libnccl that torch (or the nvidia-nccl package) already ships: the extension needs no NCCL
// headers or library at build time, and always uses the same NCCL as torch.
#pragma once
#include <cstdint>
#include <string>

namespace minisgl {

// ABI-stable NCCL values (nccl.h, unchanged since NCCL 2.0; bfloat16 since 2.10).
enum NcclDataType : int { kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclBfloat16 = 9 };
constexpr int kNcclUniqueIdBytes = 128;

// Loads libnccl from `path` (or the dynamic loader's search path when empty). Throws with
// dlerror() on failure. Idempotent.
void nccl_load(const std::string& path);
std::string nccl_version();
std::string nccl_unique_id();  // kNcclUniqueIdBytes raw bytes
std::uintptr_t nccl_comm_init_rank(int world_size, const std::string& unique_id, int rank);
void nccl_comm_destroy(std::uintptr_t comm);
// In-place sum when send == recv. `stream` is a cudaStream_t (0 = the legacy default stream).
void nccl_all_reduce(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::int64_t count,
                     int dtype, std::uintptr_t stream);
// recv holds world_size * count elements, rank r's block at r * count.
void nccl_all_gather(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::int64_t count,
                     int dtype, std::uintptr_t stream);

}  // namespace minisgl
