#pragma once
// A Work of the NCCL backend: a CUDA event recorded behind the operation on
// the communicator's stream, polled (never waited on inside CUDA) until it
// completes, fails or its timeout passes, and the abort state it shares with
// the communicator's watchdog. Part of the NCCL backend (dist/nccl.hpp);
// empty without PTRAIN_NCCL.
//
// Note [NCCL watchdog]
// A dead peer makes NCCL kernels spin forever, so a watchdog thread per
// communicator (NcclCommunicator::watch in dist/nccl_communicator.hpp) polls
// ncclCommGetAsyncError and the pending Works' events every kWatchdogPeriod.
// On an asynchronous NCCL error, a failed kernel, or when a Work has been
// pending longer than the timeout, it calls ncclCommAbort, which makes the
// spinning kernels return; every later wait and operation then throws
// CommError quoting the reason. The abort frees the handle, so it first takes
// the lock the caller's thread holds around its NCCL calls; no call blocks
// inside NCCL (Note [NCCL nonblocking] in dist/nccl_communicator.hpp), so the
// lock comes within the timeout. The watchdog reads the asynchronous error
// only when the lock is free: a caller holding it is settling a call, which
// reads the same state.
//
// Note [NCCL in a CUDA graph]
// NCCL operations can be captured in a CUDA graph (Note [CUDA graphs of the step]
// in train/step_graph.hpp). An operation enqueued while the caller's stream is
// capturing runs nothing until the graph is replayed, and its event is a node of
// the graph, never recorded on the device's timeline: polling it would be
// meaningless. Such a Work is `captured`: the watchdog never sees it (nor does
// split()'s wait for the last operation), and waiting for it joins the
// communicator's stream back into the capture (cudaStreamWaitEvent on the
// capturing stream), so that the replay orders the work after it behind the
// collective. A replayed collective has no watchdog deadline of its own: a
// dead peer is seen by the next eager operation's, or by NCCL's asynchronous error.

#if defined(PTRAIN_NCCL)

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "ptrain/core/error.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::dist {
namespace detail {

inline constexpr std::chrono::milliseconds kWatchdogPeriod{100};

// State the watchdog and the Works share; outlives the communicator while Works exist.
struct NcclShared {
  std::mutex m;
  std::string abort_reason;  // non-empty once aborted
  std::atomic<bool> aborted{false};
};

class NcclWork : public Work {
 public:
  NcclWork(std::string what, int rank, int peer, std::chrono::milliseconds timeout, std::shared_ptr<NcclShared> s,
           int device)
      : Work(std::move(what), rank, peer, timeout), shared_(std::move(s)), rank_(rank), device_(device),
        timeout_(timeout), deadline_(std::chrono::steady_clock::now() + timeout) {
    mark_enqueued();  // no worker queue: the operation is on the stream already
  }
  kernels::cuda::Event event;  // destroying a pending event is allowed: CUDA frees it on completion
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // The event has been recorded behind the operation (Note [NCCL groups]: at group_end() inside a group);
  // the watchdog's deadline counts from here, not from the call, which may have waited for connections.
  void set_launched() {
    deadline_ = std::chrono::steady_clock::now() + timeout_;
    launched_ = true;
  }
  // Seen complete by the watchdog before any abort: a later abort does not make it fail.
  void set_done() { done_ = true; }
  // Note [NCCL in a CUDA graph]: enqueued while `stream` was capturing.
  void set_captured(cudaStream_t stream) {
    captured_ = true;
    capture_stream_ = stream;
  }
  bool captured() const { return captured_; }
  // The group holding the operation failed at group_end(); waits throw `why`.
  void set_failed(std::string why) {
    {
      std::lock_guard lock(m_);
      failure_ = std::move(why);
    }
    failed_ = true;
  }

  // Event state without throwing: 1 done, 0 pending (or not launched yet), -1 error.
  int poll() {
    if (done_) return 1;
    if (!launched_) return 0;
    cudaError_t e = cudaEventQuery(event.get());
    if (e == cudaSuccess) return 1;
    if (e == cudaErrorNotReady) return 0;
    return -1;
  }

 protected:
  void finish(std::chrono::milliseconds timeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(2);
    while (!try_finish()) {
      if (std::chrono::steady_clock::now() >= deadline) throw_timeout();
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
  }
  bool try_finish() override {
    if (captured_) {  // Note [NCCL in a CUDA graph]: join the capture instead of polling
      if (!done_) PTRAIN_CHECK_CUDA(cudaStreamWaitEvent(capture_stream_, event.get(), 0));
      done_ = true;
      return true;
    }
    if (done_) return true;
    if (failed_) {
      std::lock_guard lock(m_);
      PTRAIN_THROW(CommError, "[ptrain.nccl.group] ", what(), " on rank ", rank_, ": ", failure_);
    }
    // Poll before reading the abort flag: an event complete while the flag was still
    // clear finished before the abort; one seen after it may have been cut short.
    const int s = poll();
    if (shared_->aborted) {
      std::lock_guard lock(shared_->m);
      PTRAIN_THROW(CommError, "[ptrain.nccl.aborted] ", what(), ": the communicator was aborted: ",
                   shared_->abort_reason, "; create a new process group to continue");
    }
    if (s < 0) {
      cudaError_t e = cudaEventQuery(event.get());
      PTRAIN_THROW(CudaError, "[ptrain.cuda] ", what(), " on rank ", rank_, ", device ", device_, ": ",
                   cudaGetErrorName(e), ": ", cudaGetErrorString(e),
                   "; a failed kernel leaves the CUDA context unusable: restart the process "
                   "(CUDA_LAUNCH_BLOCKING=1 names the kernel)");
    }
    if (s == 1) done_ = true;
    return s == 1;
  }

 private:
  std::shared_ptr<NcclShared> shared_;
  int rank_;
  int device_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point deadline_;
  std::atomic<bool> launched_{false}, done_{false}, failed_{false};
  bool captured_ = false;
  cudaStream_t capture_stream_ = nullptr;
  std::mutex m_;
  std::string failure_;
};

}  // namespace detail
}  // namespace ptrain::dist

#endif  // PTRAIN_NCCL
