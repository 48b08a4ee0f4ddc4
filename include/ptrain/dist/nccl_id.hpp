#pragma once
// The NCCL unique id that every rank of a new communicator must pass to
// ncclCommInitRankConfig: rank 0 creates it and it reaches the others through
// ptrain's Store or through an existing (MPI or Gloo) communicator's
// broadcast. Part of the NCCL backend (dist/nccl.hpp); empty without
// PTRAIN_NCCL.

#if defined(PTRAIN_NCCL)

#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/nccl_call.hpp"
#include "ptrain/dist/store_interface.hpp"

namespace ptrain::dist {
namespace detail {

/// Rank 0 creates the id and publishes it in `store` under `key`; the other ranks wait for it (at most `timeout`).
inline ncclUniqueId nccl_unique_id(Store& store, int rank, const std::string& key, std::chrono::milliseconds timeout) {
  ncclUniqueId id{};
  if (rank == 0) {
    PTRAIN_CHECK_NCCL(ncclGetUniqueId(&id));
    store.set(key, std::string(id.internal, sizeof(id.internal)));
  } else {
    store.wait({key}, timeout);
    std::string v = store.get(key);
    PTRAIN_CHECK(v.size() == sizeof(id.internal), CommError, "[ptrain.nccl.id] store key '", key, "' holds ",
                 v.size(), " bytes, not an NCCL unique id (", sizeof(id.internal), "); is another job using it?");
    std::memcpy(id.internal, v.data(), v.size());
  }
  return id;
}

/// Rank 0 creates the id; `bootstrap`'s broadcast brings it to every rank.
inline ncclUniqueId nccl_unique_id(Communicator& bootstrap) {
  ncclUniqueId id{};
  static_assert(sizeof(id.internal) % 8 == 0);
  if (bootstrap.rank() == 0) PTRAIN_CHECK_NCCL(ncclGetUniqueId(&id));
  bootstrap.broadcast(id.internal, sizeof(id.internal) / 8, DType::I64, 0);
  return id;
}

}  // namespace detail
}  // namespace ptrain::dist

#endif  // PTRAIN_NCCL
