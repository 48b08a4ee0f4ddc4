#pragma once
// NCCL backend (CUDA device buffers). Built when PTRAIN_NCCL is set.
//
// Unlike the CPU backends there is no worker thread: NCCL calls are enqueued
// from the caller's thread on the communicator's own CUDA stream, which is
// ordered after the caller's current stream (kernels::cuda::current_stream, where
// ptrain's kernels run; an event, so the host never waits). A
// Work is a CUDA event recorded after the operation; wait() polls it up to the
// timeout.
//
// The backend is in four parts, each of which compiles on its own (and is
// empty without PTRAIN_NCCL); this header includes them all:
//   dist/nccl_call.hpp          PTRAIN_CHECK_NCCL, dtypes and reduce ops in NCCL's terms, the
//                               nonblocking config, waiting for a call to settle
//   dist/nccl_id.hpp            the unique id from rank 0, through a Store or a bootstrap
//                               communicator's broadcast
//   dist/nccl_work.hpp          NcclWork and the abort state it shares with the watchdog
//                               (Note [NCCL watchdog])
//   dist/nccl_communicator.hpp  NcclCommunicator (Notes [NCCL groups], [Host buffers],
//                               [NCCL nonblocking])

#include "ptrain/dist/nccl_call.hpp"
#include "ptrain/dist/nccl_communicator.hpp"
#include "ptrain/dist/nccl_id.hpp"
#include "ptrain/dist/nccl_work.hpp"

#if defined(PTRAIN_NCCL)
#include "ptrain/dist/store.hpp"  // the whole store API, as this header has always provided
#endif
