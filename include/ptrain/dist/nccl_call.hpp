#pragma once
// One NCCL call, made and checked: PTRAIN_CHECK_NCCL, ptrain's dtypes and
// reduce ops in NCCL's terms, the nonblocking configuration communicators are
// created with, and the wait for a call to settle (Note [NCCL nonblocking] in
// dist/nccl_communicator.hpp). Part of the NCCL backend (dist/nccl.hpp); empty
// without PTRAIN_NCCL.

#if defined(PTRAIN_NCCL)

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/kernels/cuda/check.hpp"

/// Throws CommError with file:line, the call, NCCL's message (and last error) and the rank when an NCCL call fails.
#define PTRAIN_CHECK_NCCL(call)                                                                               \
  do {                                                                                                        \
    ncclResult_t ptrain_nccl_rc_ = (call);                                                                    \
    if (ptrain_nccl_rc_ != ncclSuccess && ptrain_nccl_rc_ != ncclInProgress)                                  \
      ::ptrain::detail::throw_at<::ptrain::CommError>(                                                        \
          __FILE__, __LINE__,                                                                                 \
          ::ptrain::detail::cat("[ptrain.nccl] ", #call, " failed on rank ",                                  \
                                ::ptrain::detail::cuda_error_rank().load(), ": ",                       \
                                ncclGetErrorString(ptrain_nccl_rc_), " (", ncclGetLastError(nullptr), ")"));  \
  } while (0)

namespace ptrain::dist {
namespace detail {

inline ncclDataType_t nccl_type(DType dt) {
  switch (dt) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default: break;
  }
  PTRAIN_THROW(CommError, "[ptrain.comm.dtype] the NCCL backend has no ", dtype_name(dt),
               "; use F32, F64, BF16, I32 or I64");
}

inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Avg: return ncclAvg;  // integers: truncating division, as documented on ReduceOp
    case ReduceOp::Min: return ncclMin;
    case ReduceOp::Max: return ncclMax;
  }
  return ncclSum;
}

inline bool nccl_ok(ncclResult_t rc) { return rc == ncclSuccess || rc == ncclInProgress; }

inline ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // Note [NCCL nonblocking] in dist/nccl_communicator.hpp
  return config;
}

// Polls comm until it leaves ncclInProgress: its final state (ncclSuccess or an error),
// or ncclInProgress when `deadline` passed first. A call usually settles within tens
// of microseconds, so the first polls only yield; sleeps, growing to 1 ms, follow.
inline ncclResult_t wait_settled(ncclComm_t comm, std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::microseconds(10);
  for (int polls = 0;; ++polls) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &state);
    if (rc != ncclSuccess) return rc;
    if (state != ncclInProgress) return state;
    if (std::chrono::steady_clock::now() >= deadline) return ncclInProgress;
    if (polls < 1000) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace detail
}  // namespace ptrain::dist

#endif  // PTRAIN_NCCL
