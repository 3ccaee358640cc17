#include "nccl.h"

#include <dlfcn.h>

#include <stdexcept>

namespace minisgl {

namespace {

struct NcclUniqueId {
  char internal[kNcclUniqueIdBytes];
};
using NcclComm = void*;
using NcclResult = int;  // 0 = ncclSuccess
constexpr int kNcclSum = 0;

struct NcclApi {
  NcclResult (*get_version)(int*) = nullptr;
  NcclResult (*get_unique_id)(NcclUniqueId*) = nullptr;
  NcclResult (*comm_init_rank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  NcclResult (*comm_destroy)(NcclComm) = nullptr;
  NcclResult (*all_reduce)(const void*, void*, size_t, int, int, NcclComm, void*) = nullptr;
  NcclResult (*all_gather)(const void*, void*, size_t, int, NcclComm, void*) = nullptr;
  const char* (*error_string)(NcclResult) = nullptr;
};

NcclApi api;
void* handle = nullptr;

template <typename Fn>
void resolve(void* lib, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr) throw std::runtime_error(std::string("libnccl lacks ") + name);
}

const NcclApi& loaded() {
  if (handle == nullptr) throw std::runtime_error("NCCL is not loaded: call nccl_load first");
  return api;
}

void check(NcclResult r, const char* what) {
  if (r != 0) {
    throw std::runtime_error(std::string("NCCL ") + what + " failed: " + loaded().error_string(r));
  }
}

}  // namespace

void nccl_load(const std::string& path) {
  if (handle != nullptr) return;
  const char* name = path.empty() ? "libnccl.so.2" : path.c_str();
  void* h = dlopen(name, RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) throw std::runtime_error(std::string("cannot load NCCL: ") + dlerror());
  // Resolve everything before committing: a library missing a symbol leaves us unloaded, so a
  // later call fails again with the reason instead of calling a null entry point.
  NcclApi loaded_api;
  try {
    resolve(h, loaded_api.get_version, "ncclGetVersion");
    resolve(h, loaded_api.get_unique_id, "ncclGetUniqueId");
    resolve(h, loaded_api.comm_init_rank, "ncclCommInitRank");
    resolve(h, loaded_api.comm_destroy, "ncclCommDestroy");
    resolve(h, loaded_api.all_reduce, "ncclAllReduce");
    resolve(h, loaded_api.all_gather, "ncclAllGather");
    resolve(h, loaded_api.error_string, "ncclGetErrorString");
  } catch (...) {
    dlclose(h);
    throw;
  }
  api = loaded_api;
  handle = h;
}

std::string nccl_version() {
  int v = 0;
  check(loaded().get_version(&v), "ncclGetVersion");
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." + std::to_string(v % 100);
}

std::string nccl_unique_id() {
  NcclUniqueId id;
  check(loaded().get_unique_id(&id), "ncclGetUniqueId");
  return std::string(id.internal, kNcclUniqueIdBytes);
}

std::uintptr_t nccl_comm_init_rank(int world_size, const std::string& unique_id, int rank) {
  if (unique_id.size() != static_cast<size_t>(kNcclUniqueIdBytes)) {
    throw std::invalid_argument("unique_id must be 128 bytes");
  }
  NcclUniqueId id;
  unique_id.copy(id.internal, kNcclUniqueIdBytes);
  NcclComm comm = nullptr;
  check(loaded().comm_init_rank(&comm, world_size, id, rank), "ncclCommInitRank");
  return reinterpret_cast<std::uintptr_t>(comm);
}

void nccl_comm_destroy(std::uintptr_t comm) {
  check(loaded().comm_destroy(reinterpret_cast<NcclComm>(comm)), "ncclCommDestroy");
}

void nccl_all_reduce(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::int64_t count,
                     int dtype, std::uintptr_t stream) {
  check(loaded().all_reduce(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv),
                            static_cast<size_t>(count), dtype, kNcclSum, reinterpret_cast<NcclComm>(comm),
                            reinterpret_cast<void*>(stream)),
        "ncclAllReduce");
}

void nccl_all_gather(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::int64_t count,
                     int dtype, std::uintptr_t stream) {
  check(loaded().all_gather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv),
                            static_cast<size_t>(count), dtype, reinterpret_cast<NcclComm>(comm),
                            reinterpret_cast<void*>(stream)),
        "ncclAllGather");
}

}  // namespace minisgl
