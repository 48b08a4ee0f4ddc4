#pragma once
// StagedCommunicator: tensors on a GPU moved by a host communicator (MPI or
// Gloo) through host buffers, so that several ranks can share one GPU, which
// NCCL refuses. init_process_group() wraps an MPI or Gloo communicator in one
// when the device is cuda:N and that backend was chosen (docs/communicators.md).
//
// Note [Staged device buffers]
// Like PyTorch's Gloo backend for CUDA tensors, each call that is given device
// memory (a pointer the device backend does not call host memory) runs as:
//   1. copy the device input into a host buffer, on the calling thread, through
//      DeviceBackend::copy: it queues on the caller's current stream and waits for
//      it, so the kernels that produced the input have finished;
//   2. start the same call on the wrapped communicator with the host buffers;
//   3. when the Work is waited for (or found complete by is_completed()), wait for
//      the host call, then copy the result back to the device through
//      DeviceBackend::copy, which waits for the copy. So the result is in device
//      memory before wait() returns, ahead of any kernel the caller queues next, on
//      any stream.
// Host buffers come from a pool: page-locked memory when the device backend has
// it (DeviceBackend::allocate_pinned_host), pageable otherwise, in power-of-two
// sizes, reused by later calls of the same size class. A call holds its buffer
// until its result has been copied back (until the host call is done, for a send),
// whether or not its Work is still referenced: a Work dropped without waiting is
// completed (result copied back) by the next wait on another Work of the same
// communicator that finds it done, by the next staged call, or at the latest by
// the communicator's destructor. Buffers that overlap (in place: all_reduce with
// send == recv, all_gather with send inside recv, reduce_scatter with recv inside
// send) share one host region at the same offsets, so the wrapped communicator
// sees the same in-place call. A broadcast copies in on the root and back on the others; a send
// copies in only, a recv back only. Host pointers pass through unchanged.
// Cost: every staged call waits for the caller's stream before it starts, and
// each byte crosses PCIe twice, so communication no longer overlaps the GPU's
// work; NCCL, one GPU per rank, stays the fast path.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/device.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/forwarding_communicator.hpp"
#include "ptrain/kernels/cuda_unverified.hpp"

namespace ptrain::dist {

/// Counters of a staging pool (shared by a StagedCommunicator and its splits).
struct StagingStats {
  std::int64_t blocks = 0;         ///< host buffers allocated so far
  std::int64_t pinned_blocks = 0;  ///< of which page-locked
  std::int64_t bytes = 0;          ///< bytes of those buffers
  std::int64_t staged_calls = 0;   ///< calls that moved device memory through them
};

namespace detail {

// A host buffer of the staging pool.
struct StageBlock {
  void* p = nullptr;
  std::size_t bytes = 0;  // a power of two
  bool pinned = false;
};

// Host buffers by power-of-two size class; a taken block returns to its class
// when the last holder drops it (Note [Staged device buffers]).
class StagePool : public std::enable_shared_from_this<StagePool> {
 public:
  static constexpr std::size_t kMinBlock = 4096;

  explicit StagePool(::ptrain::detail::DeviceBackend& backend) : backend_(backend) {}
  ~StagePool() {
    for (auto& list : free_)
      for (auto& b : list) release(b);
  }
  StagePool(const StagePool&) = delete;
  StagePool& operator=(const StagePool&) = delete;

  std::shared_ptr<StageBlock> take(std::size_t bytes) {
    std::size_t cls = 0;
    while ((kMinBlock << cls) < bytes) ++cls;
    StageBlock b;
    {
      std::lock_guard lock(m_);
      if (cls >= free_.size()) free_.resize(cls + 1);
      if (!free_[cls].empty()) {
        b = free_[cls].back();
        free_[cls].pop_back();
      }
      ++stats_.staged_calls;
    }
    if (!b.p) b = allocate(kMinBlock << cls);
    auto self = shared_from_this();
    return std::shared_ptr<StageBlock>(new StageBlock(b), [self, cls](StageBlock* blk) {
      self->give_back(cls, *blk);
      delete blk;
    });
  }

  StagingStats stats() const {
    std::lock_guard lock(m_);
    return stats_;
  }

 private:
  StageBlock allocate(std::size_t bytes) {
    StageBlock b{backend_.allocate_pinned_host(bytes), bytes, false};
    b.pinned = b.p != nullptr;
    if (!b.p) b.p = std::aligned_alloc(64, bytes);
    PTRAIN_CHECK(b.p != nullptr, CommError, "[ptrain.comm.staging] out of host memory allocating a ", bytes,
                 "-byte staging buffer for device tensors; use smaller buckets (DDPOptions::bucket_cap_bytes) "
                 "or one GPU per rank with NCCL");
    std::lock_guard lock(m_);
    ++stats_.blocks;
    stats_.pinned_blocks += b.pinned ? 1 : 0;
    stats_.bytes += static_cast<std::int64_t>(bytes);
    return b;
  }
  void give_back(std::size_t cls, const StageBlock& b) {
    std::lock_guard lock(m_);
    free_[cls].push_back(b);
  }
  void release(StageBlock& b) noexcept {
    try {
      if (b.pinned) backend_.free_pinned_host(b.p);
      else std::free(b.p);
    } catch (...) {
      // A failing device at exit: the memory goes with the process.
    }
  }

  ::ptrain::detail::DeviceBackend& backend_;
  mutable std::mutex m_;
  std::vector<std::vector<StageBlock>> free_;  // by size class
  StagingStats stats_;
};

// One staged call in flight: the host call, its buffer, and where its result goes.
struct StagedOp {
  std::mutex m;
  std::shared_ptr<Work> inner;
  std::shared_ptr<StageBlock> block;
  ::ptrain::detail::DeviceBackend* backend = nullptr;
  Device device;
  void* dst = nullptr;        // device memory the result is copied back to (null: nothing to copy)
  const void* src = nullptr;  // its place in block
  std::size_t bytes = 0;
  bool done = false;

  // Waits up to `timeout` for the host call (rethrowing its error), then copies back.
  void complete(std::chrono::milliseconds timeout) {
    std::lock_guard lock(m);
    if (done) return;
    inner->wait(timeout);
    copy_back();
  }
  // Copies back if the host call has finished (rethrowing its error); never waits for it.
  bool try_complete() {
    std::unique_lock lock(m, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    if (done) return true;
    if (!inner->is_completed()) return false;
    inner->wait(std::chrono::milliseconds(0));
    copy_back();
    return true;
  }

 private:
  void copy_back() {
    if (bytes) backend->copy(dst, device, src, Device::cpu(), bytes);
    block.reset();  // the buffer returns to the pool
    done = true;
  }
};

// The staged calls of one communicator in flight, in submission order.
class StagedOps {
 public:
  void add(std::shared_ptr<StagedOp> op) {
    std::lock_guard lock(m_);
    ops_.push_back(std::move(op));
  }
  // Completes every call whose host part has finished and forgets the completed ones.
  void reap() {
    std::vector<std::shared_ptr<StagedOp>> ops;
    {
      std::lock_guard lock(m_);
      ops.assign(ops_.begin(), ops_.end());
    }
    for (auto& op : ops) {
      try {
        op->try_complete();
      } catch (...) {
        // A failed call: its Work's owner meets the error when it waits.
      }
    }
    std::lock_guard lock(m_);
    ops_.erase(std::remove_if(ops_.begin(), ops_.end(),
                              [](const std::shared_ptr<StagedOp>& op) {
                                std::unique_lock l(op->m, std::try_to_lock);
                                return l.owns_lock() && op->done;
                              }),
               ops_.end());
  }
  // Completes every call, waiting up to `timeout` for each; errors are dropped (the
  // owner of a Work meets them when it waits).
  void drain(std::chrono::milliseconds timeout) noexcept {
    std::deque<std::shared_ptr<StagedOp>> ops;
    {
      std::lock_guard lock(m_);
      ops.swap(ops_);
    }
    for (auto& op : ops) {
      try {
        op->complete(timeout);
      } catch (...) {
      }
    }
  }

 private:
  std::mutex m_;
  std::deque<std::shared_ptr<StagedOp>> ops_;
};

// The Work of a staged call: done once its result is back in device memory.
class StagedWork final : public Work {
 public:
  StagedWork(std::shared_ptr<StagedOp> op, std::shared_ptr<StagedOps> all, int rank,
             std::chrono::milliseconds timeout)
      : Work(op->inner->what(), rank, op->inner->peer(), timeout), op_(std::move(op)), all_(std::move(all)) {
    mark_enqueued();
  }

 protected:
  void finish(std::chrono::milliseconds timeout) override {
    op_->complete(timeout);
    all_->reap();  // earlier calls whose Work was dropped: their results land now too
  }
  bool try_finish() override { return op_->try_complete(); }

 private:
  std::shared_ptr<StagedOp> op_;
  std::shared_ptr<StagedOps> all_;
};

}  // namespace detail

/// Wraps a host communicator (MPI or Gloo) so that it also takes buffers on
/// `device` (cuda:N), staged through host buffers (Note [Staged device buffers]).
/// split() returns staged children sharing the host buffers.
class StagedCommunicator final : public ForwardingCommunicator {
 public:
  /// Throws unless `device` is a CUDA device, `inner` moves host memory, and the
  /// verification gate lets "staged_communicator" run (Note [The verification gate]).
  StagedCommunicator(std::unique_ptr<Communicator> inner, Device device)
      : StagedCommunicator(std::move(inner), device, nullptr) {}
  ~StagedCommunicator() override { ops_->drain(timeout()); }

  /// Host memory (through the wrapped communicator) and this communicator's device.
  bool serves(Device d) const override { return d == device_ || (d.is_cpu() && inner_->serves(d)); }
  /// The device whose buffers are staged.
  Device device() const { return device_; }
  /// The staging pool's counters (shared with splits).
  StagingStats staging_stats() const { return pool_->stats(); }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    const std::size_t b = count * dtype_size(dt);
    return staged(send, b, true, recv, b, true,
                  [&](const void* s, void* r) { return inner_->all_reduce_async(s, r, count, dt, op); });
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    const std::size_t b = recv_count * dtype_size(dt);
    return staged(send, b * static_cast<std::size_t>(size()), true, recv, b, true, [&](const void* s, void* r) {
      return inner_->reduce_scatter_async(s, r, recv_count, dt, op);
    });
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    const std::size_t b = send_count * dtype_size(dt);
    return staged(send, b, true, recv, b * static_cast<std::size_t>(size()), true,
                  [&](const void* s, void* r) { return inner_->all_gather_async(s, r, send_count, dt); });
  }
  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    const std::size_t b = count * dtype_size(dt);
    const bool is_root = root == rank();
    return staged(buf, b, is_root, buf, b, !is_root, [&](const void*, void* r) {
      return inner_->broadcast_async(r, count, dt, root);
    });
  }
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    const std::size_t b = count_per_rank * dtype_size(dt) * static_cast<std::size_t>(size());
    return staged(send, b, true, recv, b, true,
                  [&](const void* s, void* r) { return inner_->all_to_all_async(s, r, count_per_rank, dt); });
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    const detail::AllToAllLayout l(send_counts, recv_counts, size());
    return staged(send, l.send_total * dtype_size(dt), true, recv, l.recv_total * dtype_size(dt), true,
                  [&](const void* s, void* r) {
                    return inner_->all_to_all_v_async(s, send_counts, r, recv_counts, dt);
                  });
  }
  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return staged(buf, count * dtype_size(dt), true, nullptr, 0, false,
                  [&](const void* s, void*) { return inner_->send_async(s, count, dt, peer, tag); });
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return staged(nullptr, 0, false, buf, count * dtype_size(dt), true,
                  [&](const void*, void* r) { return inner_->recv_async(r, count, dt, peer, tag); });
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    auto child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::unique_ptr<Communicator>(new StagedCommunicator(std::move(child), device_, pool_));
  }

 private:
  StagedCommunicator(std::unique_ptr<Communicator> inner, Device device, std::shared_ptr<detail::StagePool> pool)
      : ForwardingCommunicator(std::move(inner)), device_(device) {
    PTRAIN_CHECK(inner_ != nullptr, CommError, "[ptrain.comm.staged] StagedCommunicator needs a communicator");
    PTRAIN_CHECK(device.is_cuda(), CommError, "[ptrain.comm.staged] a staged communicator moves device buffers, "
                 "but was given ", device.str(), "; use the ", inner_->backend(), " communicator itself for host memory");
    PTRAIN_CHECK(inner_->serves(Device::cpu()), CommError, "[ptrain.comm.staged] the ", inner_->backend(),
                 " communicator does not move host memory, so it cannot carry staged device buffers; wrap an MPI "
                 "or Gloo communicator");
    backend_ = &::ptrain::detail::cuda_backend();  // [ptrain.cuda.unavailable] without ptrain::cuda
    kernels::check_cuda_verified("staged_communicator");
    pool_ = pool ? std::move(pool) : std::make_shared<detail::StagePool>(*backend_);
  }

  // Runs start(host send, host recv) with the device buffers among send and recv
  // staged (Note [Staged device buffers]): copy_in copies send's device bytes in
  // first, copy_out copies recv's bytes back when the Work completes.
  template <class Start>
  std::shared_ptr<Work> staged(const void* send, std::size_t send_bytes, bool copy_in, void* recv,
                               std::size_t recv_bytes, bool copy_out, Start start) {
    const bool dev_send = send_bytes > 0 && !backend_->is_host_pointer(send);
    const bool dev_recv = recv_bytes > 0 && !backend_->is_host_pointer(recv);
    if (!dev_send && !dev_recv) return start(send, recv);
    ops_->reap();
    const char* s = static_cast<const char*>(send);
    char* r = static_cast<char*>(recv);
    std::size_t send_at = 0, recv_at = 0, total = 0;
    if (dev_send && dev_recv && s < r + recv_bytes && r < s + send_bytes) {
      // One region at the same offsets: the wrapped communicator sees the same in-place call.
      const char* lo = std::min<const char*>(s, r);
      send_at = static_cast<std::size_t>(s - lo);
      recv_at = static_cast<std::size_t>(r - lo);
      total = std::max(send_at + send_bytes, recv_at + recv_bytes);
    } else {
      recv_at = dev_send ? (send_bytes + 63) / 64 * 64 : 0;
      total = recv_at + (dev_recv ? recv_bytes : 0);
    }
    auto block = pool_->take(total);
    char* base = static_cast<char*>(block->p);
    if (dev_send && copy_in) backend_->copy(base + send_at, Device::cpu(), send, device_, send_bytes);
    auto op = std::make_shared<detail::StagedOp>();
    op->inner = start(dev_send ? base + send_at : send, dev_recv ? base + recv_at : recv);
    op->block = std::move(block);
    op->backend = backend_;
    op->device = device_;
    if (dev_recv && copy_out) {
      op->dst = recv;
      op->src = base + recv_at;
      op->bytes = recv_bytes;
    }
    ops_->add(op);
    return std::make_shared<detail::StagedWork>(std::move(op), ops_, rank(), timeout());
  }

  Device device_;
  ::ptrain::detail::DeviceBackend* backend_ = nullptr;
  std::shared_ptr<detail::StagePool> pool_;
  std::shared_ptr<detail::StagedOps> ops_ = std::make_shared<detail::StagedOps>();
};

}  // namespace ptrain::dist
