#pragma once
// Communicator: the collective and point-to-point interface that DDP, FSDP and
// pipeline parallelism call, independent of the backend (MPI, Gloo, NCCL).
//
// Note [Collective order contract]
// Every rank of a communicator calls its collectives (all_reduce, reduce_scatter,
// all_gather, broadcast, all_to_all, all_to_all_v, barrier, split) in the same
// order, with the same count, dtype, op and root (all_to_all_v: matching split
// sizes, Note [All-to-all layout]). Backends match operations by their position
// in that order, so a rank that skips or reorders a call deadlocks or corrupts
// the group; the timeout below turns such a hang into a CommError.
//
// Note [Point-to-point order]
// MPI and Gloo pair a send with a recv by (peer, tag); NCCL has no tags and
// pairs them by order per peer and direction, and its send may wait until the
// peer has posted the matching recv. Code meant for every backend (pipelines)
// therefore uses tag 0, posts transfers to one peer in the same order on both
// sides, and brackets transfers that must progress together (a send to a
// neighbour and a recv from it) in group_start() / group_end(): NCCL starts a
// group's transfers together, MPI and Gloo start every call at once anyway.
//
// Note [Async execution]
// Each communicator owns one worker thread. *_async calls validate their
// arguments on the caller's thread, then queue the operation and return a Work
// at once; the worker runs queued operations strictly in submission order (like
// PyTorch's ProcessGroupMPI/Gloo). DDP starts a bucket's all-reduce while
// backward goes on and waits on the Work before the optimizer step. Buffers must
// stay alive and untouched until the Work completes. Send/recv are *started* in
// order on the worker and finish asynchronously, so a ring where every rank
// first sends and then receives does not deadlock. MPI's blocking all-to-alls
// skip the hand-off when the worker is idle and run on the caller's thread, still
// one operation at a time in call order (Note [Inline blocking calls], dist/mpi.hpp).
//
// Note [Failure]
// Every wait is bounded by a timeout (PTRAIN_COMM_TIMEOUT_S, default 300 s; the first
// rendezvous by PTRAIN_RDZV_TIMEOUT_S when set, see init_process_group).
// An operation that fails or times out raises CommError naming the operation,
// the rank, the peer when known, and the timeout. After a failure inside the
// backend the communicator is aborted: every later operation fails at once
// with [ptrain.comm.aborted] quoting the first error. Create a new process group
// to continue.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "ptrain/core/device.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/dist/call_check.hpp"
#if __has_include("ptrain/core/tensor.hpp")
#include "ptrain/core/tensor.hpp"
#define PTRAIN_COMM_HAVE_TENSOR 1
#endif

namespace ptrain::dist {

/// Reduction applied element-wise by all_reduce and reduce_scatter.
/// Avg is Sum followed by division by size(); for I32/I64 that division
/// truncates toward zero (as NCCL's ncclAvg does for integers).
enum class ReduceOp { Sum, Avg, Min, Max };

/// "sum", "avg", "min" or "max".
inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Min: return "min";
    case ReduceOp::Max: return "max";
  }
  return "?";
}

namespace detail {
// $name as a number of seconds from 0.001 to 1e7; nullopt when unset or empty.
inline std::optional<std::chrono::milliseconds> seconds_from_env(const char* name, const char* error_id) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  double s = std::strtod(v, &end);
  PTRAIN_CHECK(end != v && *end == '\0' && s >= 0.001 && s < 1e7, LaunchError, error_id, " ", name, "='", v,
               "' is not a number of seconds from 0.001 to 1e7; set it to e.g. 300 or unset it");
  return std::chrono::milliseconds(static_cast<std::int64_t>(s * 1000.0));
}
}  // namespace detail

/// Default timeout for every communicator wait: $PTRAIN_COMM_TIMEOUT_S seconds, or 300 s.
inline std::chrono::milliseconds default_comm_timeout() {
  constexpr std::chrono::milliseconds kDefault{300'000};
  return detail::seconds_from_env("PTRAIN_COMM_TIMEOUT_S", "[ptrain.comm.timeout_env]").value_or(kDefault);
}

/// Timeout of the first rendezvous alone (reaching the store and every rank joining it):
/// $PTRAIN_RDZV_TIMEOUT_S seconds; nullopt when unset, and then the communicator timeout bounds it.
/// Lets a job wait long for its last pod to be scheduled and pull its image while a lost
/// peer is still noticed within PTRAIN_COMM_TIMEOUT_S once training runs.
inline std::optional<std::chrono::milliseconds> rdzv_timeout_from_env() {
  return detail::seconds_from_env("PTRAIN_RDZV_TIMEOUT_S", "[ptrain.comm.rdzv_timeout_env]");
}

namespace detail {
using ::ptrain::detail::cat;
class OpQueue;
}  // namespace detail

/// Handle of an operation started by a *_async call.
/// wait() throws CommError on failure or timeout; destroying a Work without
/// waiting is allowed (the operation still runs to completion).
class Work {
 public:
  /// Made by backends; `what` names the operation, `peer` is -1 when not a single peer.
  Work(std::string what, int rank, int peer, std::chrono::milliseconds default_timeout)
      : what_(std::move(what)), rank_(rank), peer_(peer), default_timeout_(default_timeout) {}
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  /// Waits up to the communicator's timeout.
  void wait() { wait(default_timeout_); }

  /// Waits up to `timeout`; rethrows the operation's CommError, or throws one on timeout.
  void wait(std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    {
      std::unique_lock lock(m_);
      wait_timeout_ = timeout;
      if (!wait_probing(cv_, lock, deadline, [&] { return queued_done_; })) throw_timeout();
      if (error_) std::rethrow_exception(error_);
      if (finished_) return;
    }
    // Second stage (p2p): the transfer was started in order and finishes here.
    std::lock_guard finish_lock(finish_m_);
    if (finished_.load()) return;
    // Rounded up: a wrapper's Work (RecordingCommunicator) passes this on, and its
    // timeout message must quote the timeout the caller asked for.
    auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    finish(std::max(left, std::chrono::milliseconds(0)));
    finished_ = true;
  }

  /// True once the operation finished (successfully or not); never blocks.
  bool is_completed() {
    {
      std::lock_guard lock(m_);
      if (!queued_done_) return false;
      if (error_ || finished_) return true;
    }
    std::unique_lock finish_lock(finish_m_, std::try_to_lock);
    if (!finish_lock.owns_lock()) return false;
    try {
      if (!finished_ && try_finish()) finished_ = true;
    } catch (...) {
      std::lock_guard lock(m_);
      error_ = std::current_exception();
      return true;
    }
    return finished_;
  }

  /// The operation, e.g. "all_reduce(F32 x 1000, sum)".
  const std::string& what() const { return what_; }
  /// The peer rank of a send/recv, or -1.
  int peer() const { return peer_; }

 protected:
  /// Second stage for operations whose queued part only starts a transfer.
  /// Blocks up to `timeout`; throws CommError on failure or timeout.
  virtual void finish(std::chrono::milliseconds /*timeout*/) {}
  /// Non-blocking form of finish(): true when done.
  virtual bool try_finish() { return true; }
  /// Backends without a second stage mark the operation finished when queued work ends.
  void set_single_stage() { finished_ = true; }
  /// Backends without a worker queue (NCCL: the operation is on a CUDA stream
  /// already) mark the first stage done at once; finish() then waits for the device.
  void mark_enqueued() {
    std::lock_guard lock(m_);
    queued_done_ = true;
  }

  /// Backends that can learn of a failure elsewhere while their own call is
  /// stuck (Gloo) set a probe: waits call it every `interval`, and the
  /// CommError it throws ends the wait unless the operation completed meanwhile.
  void set_probe(std::function<void()> probe, std::chrono::milliseconds interval) {
    probe_ = std::move(probe);
    probe_interval_ = interval;
  }

  /// cv.wait_until(lock, deadline, done), calling the probe between slices; false on timeout.
  template <class Done>
  bool wait_probing(std::condition_variable& cv, std::unique_lock<std::mutex>& lock,
                    std::chrono::steady_clock::time_point deadline, Done done) {
    for (;;) {
      auto now = std::chrono::steady_clock::now();
      auto next = probe_ ? std::min(deadline, now + probe_interval_) : deadline;
      if (cv.wait_until(lock, next, done)) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      lock.unlock();
      std::exception_ptr probed;
      try {
        probe_();
      } catch (...) {
        probed = std::current_exception();
      }
      lock.lock();
      if (probed && !done()) std::rethrow_exception(probed);
    }
  }

  /// Throws the timeout CommError for the wait() in progress.
  [[noreturn]] void throw_timeout() const { throw_timeout(what_, rank_, peer_, wait_timeout_.load()); }

 public:
  /// The [ptrain.comm.timeout] CommError of operation `what` on `rank` (peer -1: none);
  /// also thrown by a backend that waits on the caller's thread (Note [Inline blocking calls]).
  [[noreturn]] static void throw_timeout(const std::string& what, int rank, int peer,
                                         std::chrono::milliseconds timeout) {
    PTRAIN_THROW(CommError, "[ptrain.comm.timeout] ", what, " on rank ", rank,
                 peer >= 0 ? detail::cat(" with peer ", peer) : std::string(), " did not complete within ",
                 timeout.count(), " ms; a peer may have died or ranks called collectives in different "
                 "orders (see Note [Collective order contract]; PTRAIN_DISTRIBUTED_DEBUG=DETAIL names the call that differs); "
                 "raise PTRAIN_COMM_TIMEOUT_S if the work is just slow");
  }

 private:
  friend class detail::OpQueue;

  void complete_queued(std::exception_ptr e) {
    {
      std::lock_guard lock(m_);
      error_ = std::move(e);
      queued_done_ = true;
    }
    cv_.notify_all();
  }

  std::string what_;
  int rank_;
  int peer_;
  std::chrono::milliseconds default_timeout_;
  std::function<void()> probe_;
  std::chrono::milliseconds probe_interval_{0};
  std::atomic<std::chrono::milliseconds> wait_timeout_{std::chrono::milliseconds(0)};
  std::mutex m_;
  std::condition_variable cv_;
  bool queued_done_ = false;
  std::exception_ptr error_;
  std::mutex finish_m_;
  std::atomic<bool> finished_{false};
};

namespace detail {

// One worker thread running queued operations in order (Note [Async execution]).
// After an operation throws, the queue is aborted and fails the rest fast.
class OpQueue {
 public:
  OpQueue() : state_(std::make_shared<State>()) {
    thread_ = std::thread([s = state_] { run(*s); });
  }
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Runs what is queued, then stops. Waits at most `limit` for the worker: one
  // stuck in a backend call that cannot be interrupted (MPI) is detached rather
  // than hanging the process; returns false in that case, and the owner must
  // then leak the backend handles the worker may still use.
  bool shutdown(std::chrono::milliseconds limit) {
    if (!thread_.joinable()) return true;
    std::unique_lock lock(state_->m);
    state_->stop = true;
    state_->cv.notify_all();
    bool idle = state_->cv_idle.wait_for(lock, limit, [&] { return state_->exited; });
    lock.unlock();
    if (idle) thread_.join();
    else thread_.detach();
    return idle;
  }
  ~OpQueue() { shutdown(std::chrono::hours(24 * 365)); }

  // Runs fn on the calling thread when nothing is queued or running (Note [Inline blocking
  // calls]) and completes `work` as the worker would; the worker starts nothing meanwhile.
  // False (fn not run) when the queue is busy or shutting down: submit() it instead.
  bool run_inline(Work& work, const std::function<void()>& fn) {
    {
      std::lock_guard lock(state_->m);
      if (state_->stop || state_->busy || !state_->tasks.empty()) return false;
      state_->busy = true;
    }
    execute(*state_, work, fn);
    bool queued = false;
    {
      std::lock_guard lock(state_->m);
      state_->busy = false;
      queued = !state_->tasks.empty();
    }
    // Another thread queued work meanwhile. Only then: waking the idle worker for nothing
    // costs a context switch (about 5 us on a 2-core VM, as much as the hand-off saved).
    if (queued) state_->cv.notify_one();
    return true;
  }

  // Queues fn; its exception (or success) completes `work`.
  void submit(std::shared_ptr<Work> work, std::function<void()> fn) {
    {
      std::lock_guard lock(state_->m);
      PTRAIN_CHECK(!state_->stop, CommError, "[ptrain.comm.closed] ", work->what(),
                   " submitted to a communicator that is shutting down");
      state_->tasks.push_back({std::move(work), std::move(fn)});
    }
    state_->cv.notify_one();
  }

  // Marks the queue aborted from outside (watchdog); later operations fail fast.
  void abort(const std::string& reason) {
    std::lock_guard lock(state_->m);
    if (state_->aborted.empty()) state_->aborted = reason;
  }
  std::string aborted_reason() const {
    std::lock_guard lock(state_->m);
    return state_->aborted;
  }

 private:
  struct Task {
    std::shared_ptr<Work> work;
    std::function<void()> fn;
  };
  struct State {
    mutable std::mutex m;
    std::condition_variable cv, cv_idle;
    std::deque<Task> tasks;
    bool stop = false, exited = false;
    bool busy = false;  // a task runs, on the worker or inline
    std::string aborted;
  };

  // Runs one task (or fails it fast when the queue is aborted) and completes its Work.
  static void execute(State& s, Work& work, const std::function<void()>& fn) {
    std::string aborted;
    {
      std::lock_guard lock(s.m);
      aborted = s.aborted;
    }
    std::exception_ptr err;
    if (!aborted.empty()) {
      err = std::make_exception_ptr(CommError(detail::cat("[ptrain.comm.aborted] ", work.what(),
                                                          " not run: the communicator failed earlier: ", aborted,
                                                          "; create a new process group to continue")));
    } else {
      try {
        fn();
      } catch (const std::exception& e) {
        err = std::current_exception();
        std::lock_guard lock(s.m);
        if (s.aborted.empty()) s.aborted = e.what();
      } catch (...) {
        err = std::current_exception();
        std::lock_guard lock(s.m);
        if (s.aborted.empty()) s.aborted = "unknown exception";
      }
    }
    work.complete_queued(std::move(err));
  }

  static void run(State& s) {
    for (;;) {
      Task t;
      {
        std::unique_lock lock(s.m);
        s.cv.wait(lock, [&] { return !s.busy && (s.stop || !s.tasks.empty()); });
        if (s.tasks.empty()) break;
        t = std::move(s.tasks.front());
        s.tasks.pop_front();
        s.busy = true;
      }
      execute(s, *t.work, t.fn);
      std::lock_guard lock(s.m);
      s.busy = false;
    }
    std::lock_guard lock(s.m);
    s.exited = true;
    s.cv_idle.notify_all();
  }

  std::shared_ptr<State> state_;
  std::thread thread_;
};

// A Work that is complete once its task on an OpQueue has run.
class QueuedWork : public Work {
 public:
  QueuedWork(std::string what, int rank, int peer, std::chrono::milliseconds timeout)
      : Work(std::move(what), rank, peer, timeout) {
    set_single_stage();
  }
};

// dst[i] = op(dst[i], src[i]) on the host; used by backends without a native
// reduction for a dtype (bf16) and by Gloo's reduction callbacks.
template <class T>
void reduce_into(T* dst, const T* a, const T* b, std::size_t n, ReduceOp op) {
  if constexpr (std::is_same_v<T, bf16>) {
    for (std::size_t i = 0; i < n; ++i) {
      float x = static_cast<float>(a[i]), y = static_cast<float>(b[i]);
      float r = op == ReduceOp::Min ? std::min(x, y) : op == ReduceOp::Max ? std::max(x, y) : x + y;
      dst[i] = bf16(r);
    }
  } else {
    switch (op) {
      case ReduceOp::Min: for (std::size_t i = 0; i < n; ++i) dst[i] = std::min(a[i], b[i]); break;
      case ReduceOp::Max: for (std::size_t i = 0; i < n; ++i) dst[i] = std::max(a[i], b[i]); break;
      default: for (std::size_t i = 0; i < n; ++i) dst[i] = a[i] + b[i]; break;
    }
  }
}

// Calls f(T{}) with T the C++ type of dt (F32, F64, BF16, I32, I64).
template <class F>
decltype(auto) visit_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    case DType::BF16: return f(bf16{});
    case DType::I32: return f(std::int32_t{});
    case DType::I64: return f(std::int64_t{});
    default: break;
  }
  PTRAIN_THROW(CommError, "[ptrain.comm.dtype] dtype ", dtype_name(dt),
               " is not supported by communicators; use F32, F64, BF16, I32 or I64");
}

// Throws [ptrain.comm.dtype] unless communicators move dt (the types of visit_dtype).
inline void check_dtype(DType dt) {
  visit_dtype(dt, [](auto) {});
}

// What a send or recv Work says it is, e.g. "send(F32 x 8, to 1, tag 0)".
inline std::string p2p_desc(bool is_send, std::size_t count, DType dt, int peer, int tag) {
  return op_desc(is_send ? "send" : "recv", count, dt, cat(is_send ? "to " : "from ", peer, ", tag ", tag).c_str());
}

// The division that turns a Sum into an Avg (Note on ReduceOp::Avg).
inline void divide_by(void* buf, std::size_t n, DType dt, int size) {
  visit_dtype(dt, [&](auto t) {
    using T = decltype(t);
    T* p = static_cast<T*>(buf);
    if constexpr (std::is_same_v<T, bf16>) {
      for (std::size_t i = 0; i < n; ++i) p[i] = bf16(static_cast<float>(p[i]) / static_cast<float>(size));
    } else {
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(size));
    }
  });
}

// Note [All-to-all layout]
// all_to_all moves size() blocks of count_per_rank elements: block i of rank r's
// send goes to rank i and lands in block r of rank i's recv. all_to_all_v does the
// same with blocks of per-peer sizes: send_counts[i] elements go to rank i and
// recv_counts[j] elements come from rank j. Blocks lie back to back in rank order,
// so a block's offset is the sum of the counts before it (there are no separate
// displacements). Rank i's send_counts[j] must equal rank j's recv_counts[i]; when
// a receiver does not know its counts, Communicator::exchange_counts() computes
// them from every rank's send_counts. The count arrays are read before the call
// returns; the buffers must stay untouched until the Work completes, and send
// and recv must not overlap (there is no in-place form).
struct AllToAllLayout {
  std::vector<std::size_t> send_counts, recv_counts, send_offsets, recv_offsets;  // elements
  std::size_t send_total = 0, recv_total = 0;

  // Equal blocks (all_to_all) of `count` elements for `n` ranks.
  static AllToAllLayout equal(std::size_t count, int n) {
    const std::vector<std::size_t> c(static_cast<std::size_t>(n), count);
    return AllToAllLayout(c.data(), c.data(), n);
  }
  // Blocks of the given sizes (all_to_all_v); `sc` and `rc` hold n entries each.
  AllToAllLayout(const std::size_t* sc, const std::size_t* rc, int n) {
    const auto un = static_cast<std::size_t>(n);
    PTRAIN_CHECK(un == 0 || (sc != nullptr && rc != nullptr), CommError,
                 "[ptrain.comm.all_to_all] all_to_all_v needs send_counts and recv_counts, one entry per rank (", n,
                 ")");
    send_counts.assign(sc, sc + un);
    recv_counts.assign(rc, rc + un);
    for (std::size_t i = 0; i < un; ++i) {
      send_offsets.push_back(send_total);
      recv_offsets.push_back(recv_total);
      send_total += send_counts[i];
      recv_total += recv_counts[i];
    }
  }
};

// "all_to_all_v(F32, send 10, recv 12)": how an all_to_all_v is named in errors.
inline std::string all_to_all_v_desc(const AllToAllLayout& l, DType dt) {
  return std::string("all_to_all_v(") + dtype_name(dt) + ", send " + std::to_string(l.send_total) + ", recv " +
         std::to_string(l.recv_total) + ")";  // no stream: all_to_all_desc
}

}  // namespace detail

/// A group of ranks that run collectives together (MPI communicator, Gloo
/// context, NCCL communicator). Move-only in spirit: not copyable, owned by
/// unique_ptr. See Note [Collective order contract] and Note [Failure].
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This process's rank in the group, 0 <= rank() < size().
  virtual int rank() const = 0;
  /// Number of ranks in the group.
  virtual int size() const = 0;
  /// "mpi", "gloo" or "nccl".
  virtual std::string backend() const = 0;

  /// Timeout of every blocking form and of Work::wait().
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Changes the timeout for operations started afterwards.
  virtual void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  /// recv[i] = op over ranks of send[i], count elements; in place when send == recv.
  virtual std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                                 ReduceOp op) = 0;
  /// send holds size()*recv_count elements; recv gets block rank() of their reduction.
  /// In place when send == recv (result in the first recv_count elements).
  virtual std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count,
                                                     DType dt, ReduceOp op) = 0;
  /// recv (size()*send_count) gets every rank's send block in rank order.
  /// In place when send == recv + rank()*send_count.
  virtual std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count,
                                                 DType dt) = 0;
  /// Copies root's buf to every rank's buf.
  virtual std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) = 0;
  /// Sends count elements to peer (!= rank()); matched by a recv with the same tag.
  virtual std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer,
                                           int tag = 0) = 0;
  /// Receives count elements from peer (!= rank()).
  virtual std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag = 0) = 0;
  /// send and recv hold size()*count_per_rank elements; send's block i goes to rank i,
  /// recv's block j comes from rank j (Note [All-to-all layout]). No in-place form.
  virtual std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank,
                                                 DType dt) = 0;
  /// send_counts[i] elements of send go to rank i, recv_counts[j] elements of recv come
  /// from rank j; blocks back to back in rank order, size() counts each, read during the
  /// call (Note [All-to-all layout]). No in-place form.
  virtual std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                                   const std::size_t* recv_counts, DType dt) = 0;
  /// Completes when every rank has entered it.
  virtual std::shared_ptr<Work> barrier_async() = 0;
  /// Collective: ranks with equal color form a new group ordered by (key, rank),
  /// like MPI_Comm_split. A negative color returns nullptr (not in any group).
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;

  /// Brackets send/recv calls that must progress together (Note [Point-to-point order]).
  /// NCCL starts them at group_end(); MPI and Gloo start each call at once, so here they do nothing.
  virtual void group_start() {}
  virtual void group_end() {}

  /// True when tensors on `d` can be passed directly: host memory for MPI and
  /// Gloo (Debian's builds are not CUDA-aware), the communicator's own GPU for NCCL.
  virtual bool serves(Device d) const { return d.is_cpu(); }
  /// Whether operations on device memory can be captured in a CUDA graph (Note [CUDA
  /// graphs of the step] in train/step_graph.hpp): NCCL's; not MPI's or Gloo's, which go
  /// through host memory and wait on the host.
  virtual bool graph_capturable() const { return false; }
  /// Throws CommError unless serves(d); `who` names the caller ("DDP", "FSDP", "Pipeline").
  void check_serves(Device d, const char* who) const {
    PTRAIN_CHECK(serves(d), CommError, "[ptrain.comm.device] ", who, " holds its tensors on ", d.str(), " but the ",
                 backend(), " communicator of rank ", rank(), " cannot move them: ",
                 d.is_cpu() ? "NCCL moves GPU memory only; train a CPU model over MPI or Gloo"
                            : "use the NCCL backend for CUDA tensors (init_process_group picks it for a cuda "
                              "device), created on the tensors' GPU; or MPI or Gloo staged through host memory "
                              "(init_process_group with that device and backend mpi or gloo); or move the model "
                              "to the CPU");
  }

  /// Blocking forms: the async form, then wait(timeout()).
  void all_reduce(const void* send, void* recv, std::size_t count, DType dt, ReduceOp op) {
    all_reduce_async(send, recv, count, dt, op)->wait(timeout_);
  }
  /// In-place all-reduce.
  void all_reduce(void* buf, std::size_t count, DType dt, ReduceOp op) { all_reduce(buf, buf, count, dt, op); }
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DType dt, ReduceOp op) {
    reduce_scatter_async(send, recv, recv_count, dt, op)->wait(timeout_);
  }
  void all_gather(const void* send, void* recv, std::size_t send_count, DType dt) {
    all_gather_async(send, recv, send_count, dt)->wait(timeout_);
  }
  void broadcast(void* buf, std::size_t count, DType dt, int root) {
    broadcast_async(buf, count, dt, root)->wait(timeout_);
  }
  void send(const void* buf, std::size_t count, DType dt, int peer, int tag = 0) {
    send_async(buf, count, dt, peer, tag)->wait(timeout_);
  }
  void recv(void* buf, std::size_t count, DType dt, int peer, int tag = 0) {
    recv_async(buf, count, dt, peer, tag)->wait(timeout_);
  }
  void barrier() { barrier_async()->wait(timeout_); }
  void all_to_all(const void* send, void* recv, std::size_t count_per_rank, DType dt) {
    all_to_all_blocking(send, recv, count_per_rank, dt);
  }
  void all_to_all_v(const void* send, const std::size_t* send_counts, void* recv, const std::size_t* recv_counts,
                    DType dt) {
    all_to_all_v_blocking(send, send_counts, recv, recv_counts, dt);
  }
  /// Collective: the recv_counts of an all_to_all_v from every rank's send_counts
  /// (size() entries): result[j] = rank j's send_counts[rank()]. One all_to_all of
  /// one I64 per rank; for receivers that do not know their split sizes.
  std::vector<std::size_t> exchange_counts(const std::vector<std::size_t>& send_counts) {
    PTRAIN_CHECK(send_counts.size() == static_cast<std::size_t>(size()), CommError,
                 "[ptrain.comm.all_to_all] exchange_counts on rank ", rank(), ": ", send_counts.size(),
                 " send counts for a group of ", size(), " ranks; pass one count per rank");
    std::vector<std::int64_t> out(send_counts.begin(), send_counts.end()), in(send_counts.size());
    all_to_all(out.data(), in.data(), 1, DType::I64);
    return std::vector<std::size_t>(in.begin(), in.end());
  }

#ifdef PTRAIN_COMM_HAVE_TENSOR
  /// Tensor forms: in place on the tensor's storage (contiguous by design).
  template <class T>
  void all_reduce(Tensor<T>& t, ReduceOp op) {
    all_reduce(t.data(), t.data(), static_cast<std::size_t>(t.numel()), dtype_of<T>(), op);
  }
  template <class T>
  std::shared_ptr<Work> all_reduce_async(Tensor<T>& t, ReduceOp op) {
    return all_reduce_async(t.data(), t.data(), static_cast<std::size_t>(t.numel()), dtype_of<T>(), op);
  }
  /// out.numel() * size() == in.numel().
  template <class T>
  void reduce_scatter(const Tensor<T>& in, Tensor<T>& out, ReduceOp op) {
    check_numel(static_cast<std::size_t>(in.numel()), static_cast<std::size_t>(out.numel()) * size(), "reduce_scatter");
    reduce_scatter(in.data(), out.data(), static_cast<std::size_t>(out.numel()), dtype_of<T>(), op);
  }
  /// out.numel() == in.numel() * size().
  template <class T>
  void all_gather(const Tensor<T>& in, Tensor<T>& out) {
    check_numel(static_cast<std::size_t>(out.numel()), static_cast<std::size_t>(in.numel()) * size(), "all_gather");
    all_gather(in.data(), out.data(), static_cast<std::size_t>(in.numel()), dtype_of<T>());
  }
  template <class T>
  void broadcast(Tensor<T>& t, int root) {
    broadcast(t.data(), static_cast<std::size_t>(t.numel()), dtype_of<T>(), root);
  }
  /// in.numel() == out.numel(), a multiple of size() (Note [All-to-all layout]).
  template <class T>
  void all_to_all(const Tensor<T>& in, Tensor<T>& out) {
    const auto n = static_cast<std::size_t>(in.numel()), p = static_cast<std::size_t>(size());
    check_numel(static_cast<std::size_t>(out.numel()), n, "all_to_all");
    PTRAIN_CHECK(n % p == 0, ShapeError, "[ptrain.comm.numel] all_to_all: ", n,
                 " elements do not split into ", p, " equal blocks; use all_to_all_v for unequal ones");
    all_to_all(in.data(), out.data(), n / p, dtype_of<T>());
  }
  /// in.numel() == sum of send_counts, out.numel() == sum of recv_counts, size() counts each.
  template <class T>
  void all_to_all_v(const Tensor<T>& in, const std::vector<std::size_t>& send_counts, Tensor<T>& out,
                    const std::vector<std::size_t>& recv_counts) {
    const auto p = static_cast<std::size_t>(size());
    PTRAIN_CHECK(send_counts.size() == p && recv_counts.size() == p, ShapeError,
                 "[ptrain.comm.numel] all_to_all_v: ", send_counts.size(), " send and ", recv_counts.size(),
                 " recv counts for a group of ", p, " ranks; pass one count per rank");
    detail::AllToAllLayout l(send_counts.data(), recv_counts.data(), size());
    check_numel(static_cast<std::size_t>(in.numel()), l.send_total, "all_to_all_v (input, the sum of send_counts)");
    check_numel(static_cast<std::size_t>(out.numel()), l.recv_total, "all_to_all_v (output, the sum of recv_counts)");
    all_to_all_v(in.data(), send_counts.data(), out.data(), recv_counts.data(), dtype_of<T>());
  }
  template <class T>
  void send(const Tensor<T>& t, int peer, int tag = 0) {
    send(t.data(), static_cast<std::size_t>(t.numel()), dtype_of<T>(), peer, tag);
  }
  template <class T>
  void recv(Tensor<T>& t, int peer, int tag = 0) {
    recv(t.data(), static_cast<std::size_t>(t.numel()), dtype_of<T>(), peer, tag);
  }
#endif

 protected:
  explicit Communicator(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  /// What the blocking all_to_all and all_to_all_v run: the async form, then wait(timeout()).
  /// MPI overrides them to run on the caller's thread when its queue is idle (Note [Inline
  /// blocking calls] in dist/mpi.hpp); wrappers keep these, so their async overrides still apply.
  virtual void all_to_all_blocking(const void* send, void* recv, std::size_t count_per_rank, DType dt) {
    all_to_all_async(send, recv, count_per_rank, dt)->wait(timeout_);
  }
  virtual void all_to_all_v_blocking(const void* send, const std::size_t* send_counts, void* recv,
                                     const std::size_t* recv_counts, DType dt) {
    all_to_all_v_async(send, send_counts, recv, recv_counts, dt)->wait(timeout_);
  }

  // Argument checks shared by backends; they run on the caller's thread so a
  // bad call throws at once instead of aborting the communicator.
  void check_peer(int peer, const char* op) const {
    PTRAIN_CHECK(peer >= 0 && peer < size() && peer != rank(), CommError, "[ptrain.comm.peer] ", op, " on rank ",
                 rank(), ": peer ", peer, " is not another rank of this group of ", size(),
                 " (0..", size() - 1, ", excluding self)");
  }
  // send/recv on a backend that pairs transfers by (peer, tag) (MPI, Gloo): another
  // rank of the group and a tag >= 0. `op` is "send" or "recv".
  void check_p2p(const char* op, int peer, int tag) const {
    check_peer(peer, op);
    PTRAIN_CHECK(tag >= 0, CommError, "[ptrain.comm.tag] ", op, ": tag ", tag, " must be >= 0");
  }
  void check_root(int root, const char* op) const {
    PTRAIN_CHECK(root >= 0 && root < size(), CommError, "[ptrain.comm.root] ", op, ": root ", root,
                 " is outside this group of ", size(), " ranks");
  }
  // The layout of an all_to_all_v call. A group of one checks its sizes here; larger
  // groups check them across ranks (Note [Collective fingerprints], CheckedCommunicator).
  detail::AllToAllLayout all_to_all_layout(const std::size_t* send_counts, const std::size_t* recv_counts) const {
    detail::AllToAllLayout l(send_counts, recv_counts, size());
    PTRAIN_CHECK(size() != 1 || l.send_counts[0] == l.recv_counts[0], CommError,
                 "[ptrain.comm.all_to_all] all_to_all_v in a group of one: send_counts[0] = ", l.send_counts[0],
                 " but recv_counts[0] = ", l.recv_counts[0], "; rank i's send_counts[j] must equal rank j's "
                 "recv_counts[i] (exchange_counts() computes recv_counts)");
    return l;
  }
  // send and recv of an all-to-all must be different memory (Note [All-to-all layout]).
  static void check_no_overlap(const void* send, std::size_t send_bytes, const void* recv, std::size_t recv_bytes,
                               const char* op) {
    const auto s = reinterpret_cast<std::uintptr_t>(send), r = reinterpret_cast<std::uintptr_t>(recv);
    PTRAIN_CHECK(send_bytes == 0 || recv_bytes == 0 || s + send_bytes <= r || r + recv_bytes <= s, CommError,
                 "[ptrain.comm.all_to_all] ", op, ": send and recv overlap; all-to-all has no in-place form, "
                 "pass a separate output buffer");
  }
  static void check_numel(std::size_t got, std::size_t want, const char* op) {
    PTRAIN_CHECK(got == want, ShapeError, "[ptrain.comm.numel] ", op, ": tensor has ", got,
                 " elements, expected ", want);
  }

 private:
  std::chrono::milliseconds timeout_;
};

}  // namespace ptrain::dist
