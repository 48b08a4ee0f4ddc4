#pragma once
// NcclCommunicator: the Communicator over an NCCL communicator on one CUDA
// device. Part of the NCCL backend (dist/nccl.hpp, which describes it);
// empty without PTRAIN_NCCL.
//
// Note [NCCL groups]
// Between group_start() and group_end() NCCL only records the calls; their
// kernels reach the stream at ncclGroupEnd. A Work's event (and the copy that
// moves an in-place reduce_scatter's result to the front) must therefore be
// queued at group_end(), not at the call, or it would complete before the
// operation ran. Host buffers are refused inside a group: staging waits for
// the operation, which has not started yet. NCCL's group is per thread, so
// while one communicator's group is open a call on another is refused (it
// would join the group). The caller does not hold the lock between the two
// calls, yet NCCL's group state points at the handle: the watchdog leaves an
// abort to group_end(), which applies it once the group is closed.
//
// Note [Host buffers]
// NCCL reads and writes device memory only, but scalars and control data
// (DDP::average's loss, the model check's hashes) live on the host. A host
// buffer is therefore staged through a device buffer of the communicator:
// copied in on its stream, operated on there, and copied back after the
// operation completed (that wait honours the timeout and the watchdog), so the
// call returns a completed Work. Host buffers are meant for small data; large
// ones belong on the device, where nothing is copied and nothing waits.
//
// Note [NCCL nonblocking]
// Communicators are created nonblocking (ncclConfig_t::blocking = 0): init,
// split, finalize and any later call may return ncclInProgress while NCCL goes
// on in the background, and nothing may be called on the communicator, or
// queued on its stream, until ncclCommGetAsyncError reports the state settled.
// settle() waits for that, bounded by the timeout, after every call: an init or
// split that a rank never joins, or a connection that is never made, ends in
// CommError and an aborted communicator instead of a call blocked in NCCL for
// good. Work events and follow-up copies are queued only after the call settled,
// or they could run ahead of the NCCL kernel. The price: NCCL launches each
// call (or group) from a thread of its own, some tens of microseconds per call.

#if defined(PTRAIN_NCCL)

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ptrain/core/device.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/nccl_call.hpp"
#include "ptrain/dist/nccl_id.hpp"
#include "ptrain/dist/nccl_work.hpp"
#include "ptrain/dist/store_interface.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"
#include "ptrain/kernels/cuda_unverified.hpp"

namespace ptrain::dist {
namespace detail {

// The communicator whose group_start() is open on this thread (NCCL's group state is per thread).
inline const void*& open_group() {
  thread_local const void* owner = nullptr;
  return owner;
}

}  // namespace detail

/// Communicator over an NCCL communicator on one CUDA device.
class NcclCommunicator : public Communicator {
 public:
  /// Collective over `size` ranks: rank 0 publishes the unique id in `store` under `key`.
  NcclCommunicator(Store& store, int rank, int size, int device,
                   std::chrono::milliseconds timeout = default_comm_timeout(), const std::string& key = "ptrain/nccl/id")
      : Communicator(timeout), rank_(rank), size_(size), device_(device) {
    init(detail::nccl_unique_id(store, rank, key, timeout));
  }

  /// Collective over `bootstrap`'s ranks: the unique id travels by its broadcast (MPI or Gloo).
  NcclCommunicator(Communicator& bootstrap, int device, std::chrono::milliseconds timeout = default_comm_timeout())
      : Communicator(timeout), rank_(bootstrap.rank()), size_(bootstrap.size()), device_(device) {
    init(detail::nccl_unique_id(bootstrap));
  }

  ~NcclCommunicator() override {
    if (detail::open_group() == this) detail::open_group() = nullptr;
    stop_ = true;
    if (watchdog_.joinable()) watchdog_.join();
    cudaSetDevice(device_);
    // After a watchdog abort the handle is already freed. ncclCommDestroy flushes
    // what is still queued, and an operation stuck on a dead peer would hang it (and
    // this destructor) forever: such a communicator is aborted instead.
    if (comm_ && !shared_->aborted) {
      if (quiesce() && finalize()) ncclCommDestroy(comm_);
      else
        abort_comm(detail::cat("the communicator on rank ", rank_,
                               " was destroyed while operations were still pending or had failed"));
    }
    if (scratch_) cudaFree(scratch_);
    if (stage_) cudaFree(stage_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  /// The CUDA device this communicator runs on.
  int device() const { return device_; }
  /// The communicator's stream; operations run there in call order.
  cudaStream_t stream() const { return stream_; }
  /// Makes every operation wait for the earlier work of stream `s`, instead of the
  /// calling thread's current stream on the device (kernels::cuda::current_stream,
  /// the stream ptrain's kernels use; the default). Null returns to the default.
  void set_user_stream(cudaStream_t s) { user_stream_ = s; }
  /// The raw NCCL handle.
  ncclComm_t native() const { return comm_; }
  /// Tensors on this communicator's GPU (host buffers are staged, for scalars only: Note [Host buffers]).
  bool serves(Device d) const override { return d.is_cuda() && d.index == device_; }
  bool graph_capturable() const override { return true; }

  /// Fuses the send/recv calls until group_end() (needed for rings: NCCL's p2p blocks until matched).
  /// Device buffers only; the Works of grouped calls complete only after group_end() (Note [NCCL groups]).
  void group_start() override {
    std::lock_guard lock(comm_m_);
    check_no_other_group("group_start()");
    PTRAIN_CHECK_NCCL(ncclGroupStart());
    ++group_depth_;
    detail::open_group() = this;
  }
  void group_end() override {
    std::lock_guard lock(comm_m_);
    PTRAIN_CHECK(group_depth_ > 0, CommError, "[ptrain.nccl.group] group_end() on rank ", rank_,
                 " without a matching group_start()");
    check_no_other_group("group_end()");
    --group_depth_;
    const ncclResult_t rc = ncclGroupEnd();
    const bool failed = !detail::nccl_ok(rc);
    if (group_depth_ > 0 && !failed) return;  // nested: NCCL launches at the outermost group_end()
    group_depth_ = 0;
    detail::open_group() = nullptr;
    auto works = std::move(group_works_);
    auto after = std::move(after_);
    group_works_.clear();
    after_.clear();
    // Every failure fails the group's Works (their waits throw it) and aborts the communicator.
    auto fail = [&](const std::string& why) {
      for (auto& w : works) w->set_failed(why);
      abort_locked(why);
    };
    if (failed) {
      const std::string why = detail::cat("ncclGroupEnd() failed on rank ", rank_, ": ", ncclGetErrorString(rc), " (",
                                          ncclGetLastError(comm_), "); the grouped operations' results are undefined");
      fail(why);
      PTRAIN_THROW(CommError, "[ptrain.nccl.group] ", why, "; create a new process group to continue");
    }
    try {
      settle("group_end()");
      if (deferred_abort_.empty()) {
        PTRAIN_CHECK_CUDA(cudaSetDevice(device_));
        for (auto& f : after) f();
        for (auto& w : works) record_launched(w);
        return;
      }
    } catch (const std::exception& e) {
      fail(e.what());
      throw;
    }
    const std::string why = std::exchange(deferred_abort_, std::string());
    fail(why);
    PTRAIN_THROW(CommError, "[ptrain.nccl.aborted] group_end() on rank ", rank_, ": ", why,
                 "; create a new process group to continue");
  }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    auto t = detail::nccl_type(dt);
    const std::size_t bytes = count * dtype_size(dt);
    return enqueue_buffers(detail::op_desc("all_reduce", count, dt, reduce_op_name(op)), -1, send, bytes, recv, bytes,
                           [&](const void* s, void* r) {
                             PTRAIN_CHECK_NCCL(ncclAllReduce(s, r, count, t, detail::nccl_op(op), comm_, stream_));
                           });
  }

  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    auto t = detail::nccl_type(dt);
    const std::size_t bytes = recv_count * dtype_size(dt);
    return enqueue_buffers(
        detail::op_desc("reduce_scatter", recv_count, dt, reduce_op_name(op)), -1, send,
        bytes * static_cast<std::size_t>(size_), recv, bytes, [&](const void* s, void* r) {
          if (s == r) {
            // ptrain's in-place form keeps the result at the front; NCCL's reads it in block rank().
            char* mine = static_cast<char*>(r) + static_cast<std::size_t>(rank_) * bytes;
            PTRAIN_CHECK_NCCL(ncclReduceScatter(s, mine, recv_count, t, detail::nccl_op(op), comm_, stream_));
            if (rank_ > 0 && bytes)
              after_launch([this, r, mine, bytes] {
                PTRAIN_CHECK_CUDA(cudaMemcpyAsync(r, mine, bytes, cudaMemcpyDeviceToDevice, stream_));
              });
          } else {
            PTRAIN_CHECK_NCCL(ncclReduceScatter(s, r, recv_count, t, detail::nccl_op(op), comm_, stream_));
          }
        });
  }

  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count,
                                         DType dt) override {
    auto t = detail::nccl_type(dt);
    const std::size_t bytes = send_count * dtype_size(dt);
    return enqueue_buffers(detail::op_desc("all_gather", send_count, dt), -1, send, bytes, recv,
                           bytes * static_cast<std::size_t>(size_), [&](const void* s, void* r) {
                             PTRAIN_CHECK_NCCL(ncclAllGather(s, r, send_count, t, comm_, stream_));
                           });
  }

  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    check_root(root, "broadcast");
    auto t = detail::nccl_type(dt);
    const std::size_t bytes = count * dtype_size(dt);
    return enqueue_buffers(detail::op_desc("broadcast", count, dt, detail::cat("root ", root).c_str()), -1, buf, bytes,
                           buf, bytes, [&](const void* s, void* r) {
                             PTRAIN_CHECK_NCCL(ncclBroadcast(s, r, count, t, root, comm_, stream_));
                           });
  }

  /// Grouped ncclSend/ncclRecv per peer (NCCL's all-to-all recipe); gated as "nccl_all_to_all".
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank,
                                         DType dt) override {
    return all_to_all_blocks(detail::all_to_all_desc(count_per_rank, dt), send, recv,
                             detail::AllToAllLayout::equal(count_per_rank, size_), dt);
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    const detail::AllToAllLayout l = all_to_all_layout(send_counts, recv_counts);
    return all_to_all_blocks(detail::all_to_all_v_desc(l, dt), send, recv, l, dt);
  }

  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    check_peer(peer, "send");
    check_tag(tag, "send");
    auto t = detail::nccl_type(dt);
    return enqueue_buffers(detail::op_desc("send", count, dt, detail::cat("to ", peer).c_str()), peer, buf,
                           count * dtype_size(dt), nullptr, 0, [&](const void* s, void*) {
                             PTRAIN_CHECK_NCCL(ncclSend(s, count, t, peer, comm_, stream_));
                           });
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    check_peer(peer, "recv");
    check_tag(tag, "recv");
    auto t = detail::nccl_type(dt);
    return enqueue_buffers(detail::op_desc("recv", count, dt, detail::cat("from ", peer).c_str()), peer, nullptr, 0,
                           buf, count * dtype_size(dt), [&](const void*, void* r) {
                             PTRAIN_CHECK_NCCL(ncclRecv(r, count, t, peer, comm_, stream_));
                           });
  }

  std::shared_ptr<Work> barrier_async() override {
    // NCCL has no barrier: a one-element all-reduce on a device scratch word.
    return enqueue("barrier()", -1, [&] {
      PTRAIN_CHECK_NCCL(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_));
    });
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    const std::string what = detail::cat("split(color ", color, ", key ", key, ")");
    check_alive(what);
    PTRAIN_CHECK(group_depth_ == 0, CommError, "[ptrain.nccl.group] ", what, " on rank ", rank_,
                 " inside group_start()/group_end(); call group_end() first");
    check_no_other_group(what);
    // ncclCommSplit may deadlock while operations are outstanding on the parent:
    // wait for the last one (same stream, so for all), bounded by the timeout.
    std::shared_ptr<detail::NcclWork> last;
    {
      std::lock_guard lock(comm_m_);
      last = last_.lock();
    }
    if (last) last->wait(timeout());
    PTRAIN_CHECK_CUDA(cudaSetDevice(device_));
    ncclComm_t out = nullptr;
    ncclResult_t rc = ncclSuccess;
    {
      std::lock_guard lock(comm_m_);
      check_alive(what);
      // Note [NCCL nonblocking]: the parent and the new communicator both settle.
      const auto deadline = std::chrono::steady_clock::now() + timeout();
      ncclConfig_t config = detail::nonblocking_config();
      rc = ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &out, &config);
      if (detail::nccl_ok(rc)) rc = detail::wait_settled(comm_, deadline);
      if (rc == ncclSuccess && out != nullptr) rc = detail::wait_settled(out, deadline);
    }
    if (rc != ncclSuccess) {
      const std::string why =
          rc == ncclInProgress
              ? detail::cat(what, " on rank ", rank_, " did not complete within ", timeout().count(),
                            " ms; every rank of the communicator must call split, in the same order as its "
                            "collectives")
              : detail::cat(what, " failed on rank ", rank_, ": ", ncclGetErrorString(rc), " (",
                            ncclGetLastError(comm_), ")");
      // Aborting the parent first joins NCCL's split job, which writes `out` even when it fails.
      abort_comm(why);
      if (out != nullptr) ncclCommAbort(out);
      PTRAIN_THROW(CommError, "[ptrain.nccl.split] ", why, "; the communicator was aborted: create a new process group");
    }
    if (out == nullptr) return nullptr;
    return std::unique_ptr<Communicator>(new NcclCommunicator(out, device_, timeout()));
  }

 private:
  NcclCommunicator(ncclComm_t comm, int device, std::chrono::milliseconds timeout)
      : Communicator(timeout), device_(device) {
    comm_ = comm;
    PTRAIN_CHECK_NCCL(ncclCommUserRank(comm_, &rank_));
    PTRAIN_CHECK_NCCL(ncclCommCount(comm_, &size_));
    start();
  }

  void init(const ncclUniqueId& id) {
    ::ptrain::detail::cuda_error_rank() = rank_;
    PTRAIN_CHECK_CUDA(cudaSetDevice(device_));
    // Note [NCCL nonblocking]: a rank that never joins ends the wait at the timeout.
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    ncclConfig_t config = detail::nonblocking_config();
    ncclResult_t rc = ncclCommInitRankConfig(&comm_, size_, id, rank_, &config);
    if (detail::nccl_ok(rc) && comm_ != nullptr) rc = detail::wait_settled(comm_, deadline);
    if (rc != ncclSuccess) {
      const std::string last = ncclGetLastError(comm_);
      if (comm_ != nullptr) ncclCommAbort(comm_);
      comm_ = nullptr;
      if (rc == ncclInProgress)
        PTRAIN_THROW(CommError, "[ptrain.nccl.init] rank ", rank_, " of ", size_,
                     ": the NCCL communicator was not complete within ", timeout().count(),
                     " ms: not every rank joined (one did not start, died, or got another unique id); start all ",
                     size_, " ranks with the same store and key, or raise PTRAIN_COMM_TIMEOUT_S");
      PTRAIN_THROW(CommError, "[ptrain.nccl.init] ncclCommInitRankConfig failed on rank ", rank_, " of ", size_,
                   " (device ", device_, "): ", ncclGetErrorString(rc), " (", last,
                   "); NCCL needs one GPU per rank: check CUDA_VISIBLE_DEVICES and LOCAL_RANK");
    }
    start();
  }

  void start() {
    try {
      PTRAIN_CHECK_CUDA(cudaSetDevice(device_));
      PTRAIN_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      PTRAIN_CHECK_CUDA(cudaMalloc(&scratch_, sizeof(int)));
      PTRAIN_CHECK_CUDA(cudaMemset(scratch_, 0, sizeof(int)));
      ready_ = std::make_unique<kernels::cuda::Event>();  // created on device_, like the stream
      watchdog_ = std::thread([this] { watch(); });
    } catch (...) {
      // A constructor that throws runs no destructor: release the handle (and NCCL's threads) here.
      ncclCommAbort(comm_);
      comm_ = nullptr;
      if (scratch_) cudaFree(scratch_);
      if (stream_) cudaStreamDestroy(stream_);
      throw;
    }
  }

  static void check_tag(int tag, const char* op) {
    // NCCL matches p2p by order per peer, not by tag; only tag 0 keeps the meaning honest.
    PTRAIN_CHECK(tag == 0, CommError, "[ptrain.nccl.tag] ", op, ": NCCL has no tags (got ", tag,
                 "); use tag 0 and post transfers to one peer in matching order");
  }

  // NCCL's group is per thread: a call on this communicator while another one's group
  // is open would join that group, which only the other one's group_end() launches;
  // a call from another thread while this one's group is open would run at once,
  // outside the group, while its Work waited for group_end(). Caller holds comm_m_.
  void check_no_other_group(const std::string& what) const {
    const void* owner = detail::open_group();
    PTRAIN_CHECK(owner == nullptr || owner == this, CommError, "[ptrain.nccl.group] ", what, " on rank ", rank_,
                 " while another NCCL communicator's group_start() is open on this thread; call its group_end() "
                 "first");
    PTRAIN_CHECK(group_depth_ == 0 || owner == this, CommError, "[ptrain.nccl.group] ", what, " on rank ", rank_,
                 " from a thread other than the one whose group_start() is open on this communicator (NCCL "
                 "groups are per thread); call it from that thread, or after its group_end()");
  }

  void check_alive(const std::string& what) {
    if (shared_->aborted) {
      std::lock_guard lock(shared_->m);
      PTRAIN_THROW(CommError, "[ptrain.comm.aborted] ", what, " on rank ", rank_,
                   ": the NCCL communicator was aborted: ", shared_->abort_reason);
    }
  }

  // Orders the comm stream after the user's stream, runs `call`, records the Work's
  // event (at group_end() inside a group, Note [NCCL groups]). comm_m_ keeps the
  // watchdog from freeing the handle under the NCCL call (Note [NCCL watchdog] in dist/nccl_work.hpp).
  template <class F>
  std::shared_ptr<Work> enqueue(std::string what, int peer, F&& call) {
    check_alive(what);
    PTRAIN_CHECK_CUDA(cudaSetDevice(device_));  // the Work's event belongs to the stream's device
    auto w = std::make_shared<detail::NcclWork>(std::move(what), rank_, peer, timeout(), shared_, device_);
    std::lock_guard lock(comm_m_);
    check_alive(w->what());
    check_no_other_group(w->what());
    const cudaStream_t user = user_stream_ ? user_stream_ : kernels::cuda::current_stream(device_);
    // Note [NCCL in a CUDA graph]: the user's stream is capturing.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    PTRAIN_CHECK_CUDA(cudaStreamIsCapturing(user, &capture));
    if (capture != cudaStreamCaptureStatusNone) w->set_captured(user);
    PTRAIN_CHECK_CUDA(cudaEventRecord(ready_->get(), user));
    PTRAIN_CHECK_CUDA(cudaStreamWaitEvent(stream_, ready_->get(), 0));
    call();
    if (group_depth_ > 0) {
      group_works_.push_back(w);
      return w;
    }
    auto after = std::move(after_);
    after_.clear();
    settle(w->what());
    for (auto& f : after) f();
    record_launched(w);
    return w;
  }

  // Stream work that must follow the current call's kernel: queued once the call
  // settled, or after ncclGroupEnd inside a group (Notes [NCCL groups], [NCCL nonblocking]).
  template <class F>
  void after_launch(F&& f) {
    after_.emplace_back(std::forward<F>(f));
  }

  // Note [NCCL nonblocking]: waits until NCCL finished the last call on comm_, at most
  // the timeout; aborts the communicator and throws when it failed or did not settle.
  // Caller holds comm_m_.
  void settle(const std::string& what) {
    const ncclResult_t rc = detail::wait_settled(comm_, std::chrono::steady_clock::now() + timeout());
    if (rc == ncclSuccess) return;
    const std::string why =
        rc == ncclInProgress
            ? detail::cat(what, " on rank ", rank_, " was not queued within ", timeout().count(),
                          " ms (NCCL could not connect to its peers); a peer may have died")
            : detail::cat(what, " failed on rank ", rank_, ": ", ncclGetErrorString(rc), " (", ncclGetLastError(comm_),
                          ")");
    abort_locked(why);
    PTRAIN_THROW(CommError, "[ptrain.nccl.aborted] ", why, "; create a new process group to continue");
  }

  // Records w's event behind everything queued so far and hands it to the watchdog. Caller holds comm_m_.
  void record_launched(const std::shared_ptr<detail::NcclWork>& w) {
    PTRAIN_CHECK_CUDA(cudaEventRecord(w->event.get(), stream_));
    w->set_launched();
    if (w->captured()) return;  // Note [NCCL in a CUDA graph]: nothing runs until a replay
    last_ = w;
    std::lock_guard lock(pending_m_);
    pending_.push_back(w);
  }

  // Whether NCCL can use p directly: device (or managed) memory of any device.
  static bool on_device(const void* p) {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // not a sticky error; clear it so later checks do not report it
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  // enqueue() of call(send, recv), with host buffers staged through stage_
  // (Note [Host buffers]): the send area first, the receive area behind it.
  template <class F>
  std::shared_ptr<Work> enqueue_buffers(std::string what, int peer, const void* send, std::size_t send_bytes,
                                        void* recv, std::size_t recv_bytes, F&& call) {
    const bool host_send = send_bytes > 0 && !on_device(send);
    const bool host_recv = recv_bytes > 0 && !on_device(recv);
    if (!host_send && !host_recv) return enqueue(std::move(what), peer, [&] { call(send, recv); });
    check_alive(what);
    PTRAIN_CHECK(group_depth_ == 0, CommError, "[ptrain.nccl.group] ", what, " on rank ", rank_,
                 ": host buffers cannot be used between group_start() and group_end() (NCCL runs the group only "
                 "at group_end(), and staging waits for the operation); pass device buffers");
    std::lock_guard stage_lock(stage_m_);  // one staged call at a time owns stage_
    PTRAIN_CHECK_CUDA(cudaSetDevice(device_));
    // In place stays in place (reduce_scatter keeps its result at the front).
    const bool same = host_send && host_recv && send == recv;
    constexpr std::size_t kAlign = 256;
    const std::size_t recv_at = host_send && !same ? (send_bytes + kAlign - 1) / kAlign * kAlign : 0;
    const std::size_t need = std::max(host_send ? send_bytes : 0, recv_at + (host_recv ? recv_bytes : 0));
    if (need > stage_bytes_) {
      // Staged calls complete before they return, so the old buffer is idle.
      if (stage_) PTRAIN_CHECK_CUDA(cudaFree(stage_));
      stage_ = nullptr;
      stage_bytes_ = 0;
      PTRAIN_CHECK_CUDA(cudaMalloc(&stage_, need));
      stage_bytes_ = need;
    }
    char* stage = static_cast<char*>(stage_);
    if (host_send) PTRAIN_CHECK_CUDA(cudaMemcpyAsync(stage, send, send_bytes, cudaMemcpyHostToDevice, stream_));
    const void* s = host_send ? stage : send;
    void* r = host_recv ? stage + recv_at : recv;
    auto w = enqueue(std::move(what), peer, [&] { call(s, r); });
    w->wait(timeout());
    if (host_recv) {
      PTRAIN_CHECK_CUDA(cudaMemcpyAsync(recv, stage + recv_at, recv_bytes, cudaMemcpyDeviceToHost, stream_));
      PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream_));
    }
    return w;
  }

  // all_to_all(_v): every block a ncclSend or ncclRecv with its peer, itself included,
  // inside one NCCL group (nested in the caller's group, if one is open: NCCL then
  // launches at the outer group_end()); empty blocks are skipped on both sides.
  std::shared_ptr<Work> all_to_all_blocks(std::string what, const void* send, void* recv,
                                          const detail::AllToAllLayout& l, DType dt) {
    kernels::check_cuda_verified("nccl_all_to_all");
    auto t = detail::nccl_type(dt);
    const std::size_t es = dtype_size(dt);
    check_no_overlap(send, l.send_total * es, recv, l.recv_total * es, what.c_str());
    return enqueue_buffers(std::move(what), -1, send, l.send_total * es, recv, l.recv_total * es,
                           [&](const void* s, void* r) {
                             PTRAIN_CHECK_NCCL(ncclGroupStart());
                             ncclResult_t rc = ncclSuccess;
                             for (int p = 0; p < size_ && detail::nccl_ok(rc); ++p) {
                               const auto up = static_cast<std::size_t>(p);
                               if (l.send_counts[up])
                                 rc = ncclSend(static_cast<const char*>(s) + l.send_offsets[up] * es,
                                               l.send_counts[up], t, p, comm_, stream_);
                               if (detail::nccl_ok(rc) && l.recv_counts[up])
                                 rc = ncclRecv(static_cast<char*>(r) + l.recv_offsets[up] * es, l.recv_counts[up],
                                               t, p, comm_, stream_);
                             }
                             const ncclResult_t end = ncclGroupEnd();  // closes the group even after a failure
                             PTRAIN_CHECK_NCCL(detail::nccl_ok(rc) ? end : rc);
                           });
  }

  // Note [NCCL watchdog] in dist/nccl_work.hpp.
  void watch() {
    cudaSetDevice(device_);
    while (!stop_) {
      std::this_thread::sleep_for(detail::kWatchdogPeriod);
      if (shared_->aborted) continue;
      std::string reason;
      {
        std::unique_lock lock(comm_m_, std::try_to_lock);
        ncclResult_t async = ncclSuccess;
        if (lock.owns_lock() && !shared_->aborted && ncclCommGetAsyncError(comm_, &async) == ncclSuccess &&
            !detail::nccl_ok(async))
          reason = detail::cat("asynchronous NCCL error on rank ", rank_, ": ", ncclGetErrorString(async), " (",
                               ncclGetLastError(comm_), "); a peer probably died");
      }
      {
        std::lock_guard lock(pending_m_);
        auto now = std::chrono::steady_clock::now();
        for (auto it = pending_.begin(); it != pending_.end();) {
          const auto& w = *it;
          int s = w->poll();
          if (s == 1) {
            w->set_done();  // completed before any abort below
            it = pending_.erase(it);
            continue;
          }
          if (reason.empty() && s < 0) {
            cudaError_t e = cudaEventQuery(w->event.get());
            reason = detail::cat(w->what(), " on rank ", rank_, " failed on device ", device_, ": ", cudaGetErrorName(e),
                                 ": ", cudaGetErrorString(e), "; a failed kernel leaves the CUDA context unusable: "
                                 "restart the process");
          }
          if (reason.empty() && now > w->deadline())
            reason = detail::cat(w->what(), " on rank ", rank_, " did not complete within ", w->timeout().count(),
                         " ms; a peer may have died or ranks called collectives in different orders");
          ++it;
        }
      }
      if (!reason.empty()) request_abort(reason);
    }
  }

  // Marks the communicator aborted with `reason`, then ncclCommAbort: kernels waiting
  // on dead peers return and the handle is freed (Note [NCCL watchdog] in dist/nccl_work.hpp). abort_locked:
  // the caller holds comm_m_.
  void abort_comm(const std::string& reason) {
    std::lock_guard lock(comm_m_);
    abort_locked(reason);
  }
  // The watchdog's abort. Inside a group the caller's thread holds NCCL's group
  // state, which points at the handle: group_end() aborts once the group is closed.
  void request_abort(const std::string& reason) {
    std::lock_guard lock(comm_m_);
    if (group_depth_ == 0) abort_locked(reason);
    else if (deferred_abort_.empty()) deferred_abort_ = reason;
  }
  void abort_locked(const std::string& reason) {
    if (shared_->aborted) return;
    {
      std::lock_guard g(shared_->m);
      shared_->abort_reason = reason;
    }
    shared_->aborted = true;
    ncclCommAbort(comm_);
  }

  // ncclCommFinalize for the destructor (a barrier with the ranks on this node); false
  // when it failed or did not settle within the timeout.
  bool finalize() {
    std::lock_guard lock(comm_m_);
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    return detail::nccl_ok(ncclCommFinalize(comm_)) && detail::wait_settled(comm_, deadline) == ncclSuccess;
  }

  // Waits (for the destructor) until the stream drained, at most until the latest
  // pending deadline; false on a timeout, an NCCL error or a CUDA error.
  bool quiesce() {
    auto until = std::chrono::steady_clock::now() + detail::kWatchdogPeriod;
    {
      std::lock_guard lock(pending_m_);
      for (const auto& w : pending_) until = std::max(until, w->deadline());
    }
    for (;;) {
      const cudaError_t e = stream_ ? cudaStreamQuery(stream_) : cudaSuccess;
      if (e == cudaSuccess) return true;
      if (e != cudaErrorNotReady) return false;
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess || !detail::nccl_ok(async)) return false;
      if (std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  int rank_ = 0, size_ = 1, device_ = 0;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t user_stream_ = nullptr;
  int* scratch_ = nullptr;
  void* stage_ = nullptr;  // Note [Host buffers]
  std::size_t stage_bytes_ = 0;
  std::unique_ptr<kernels::cuda::Event> ready_;
  std::shared_ptr<detail::NcclShared> shared_ = std::make_shared<detail::NcclShared>();
  std::mutex comm_m_;     // held around NCCL calls on comm_ (Note [NCCL watchdog] in dist/nccl_work.hpp)
  std::mutex stage_m_;    // Note [Host buffers]
  int group_depth_ = 0;   // Note [NCCL groups]
  std::vector<std::shared_ptr<detail::NcclWork>> group_works_;
  std::vector<std::function<void()>> after_;  // after_launch() work of the current call or group
  std::string deferred_abort_;                // the watchdog's reason while a group is open
  std::weak_ptr<detail::NcclWork> last_;  // the latest launched operation
  std::mutex pending_m_;
  std::vector<std::shared_ptr<detail::NcclWork>> pending_;  // until their event completes
  std::atomic<bool> stop_{false};
  std::thread watchdog_;
};

}  // namespace ptrain::dist

#endif  // PTRAIN_NCCL
