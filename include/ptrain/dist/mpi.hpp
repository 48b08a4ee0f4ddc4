#pragma once
// MPI backend (CPU buffers; launched by mpirun/srun). Built when PTRAIN_MPI is set.
//
// MPI is initialised with MPI_Init_thread(MPI_THREAD_MULTIPLE) on first use
// unless the application already did it, and finalised once at exit only when
// ptrain initialised it. Each MpiCommunicator owns a duplicate of its parent
// communicator, so ptrain's messages never match the application's. With
// MPI_THREAD_MULTIPLE every communicator's worker calls MPI freely; if the
// library grants only SERIALIZED, one process-wide mutex serialises calls, and
// ranks must then interleave operations on different communicators in the
// same order.
//
// Note [Inline blocking calls]
// The blocking all_to_all and all_to_all_v (and exchange_counts) run on the
// caller's thread when the communicator's worker has nothing queued or running
// (OpQueue::run_inline); otherwise they queue like the async forms. The worker
// starts nothing while an inline operation runs, so operations still run one at
// a time in call order (Note [Async execution]). Handing a 1 MiB all-to-all to
// the worker and waking the caller again cost 5-10 us of a 45 us operation at 2
// ranks (docs/communicators.md). Inline, the operation waits with MPI_Test until
// the communicator's timeout, then throws [ptrain.comm.timeout] and aborts the
// communicator (Note [Failure]); MPI cannot cancel a collective, so its request
// and the MPI communicator are leaked. The worker waits with MPI_Wait, its
// caller's wait() holding the timeout. Both paths use the nonblocking MPI calls,
// as do the checks before every collective: MPI never matches a blocking
// collective with a nonblocking one, and one rank may run a call inline while
// another runs it on its worker.

#ifdef PTRAIN_MPI

#include <cstdlib>
#include <mpi.h>

#include <climits>

#include "ptrain/dist/communicator.hpp"

/// Throws CommError with file:line, the call, MPI's message and the world rank when an MPI call fails.
#define PTRAIN_CHECK_MPI(call)                                                                           \
  do {                                                                                                   \
    int ptrain_mpi_rc_ = (call);                                                                         \
    if (ptrain_mpi_rc_ != MPI_SUCCESS)                                                                   \
      ::ptrain::detail::throw_at<::ptrain::CommError>(                                                   \
          __FILE__, __LINE__,                                                                            \
          ::ptrain::detail::cat("[ptrain.mpi] ", #call, " failed on world rank ",                       \
                                ::ptrain::dist::detail::mpi_world_rank(), ": ",                          \
                                ::ptrain::dist::detail::mpi_error_string(ptrain_mpi_rc_)));              \
  } while (0)

namespace ptrain::dist {
namespace detail {

inline std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return detail::cat("MPI error ", rc);
  return std::string(buf, static_cast<std::size_t>(len));
}

inline int mpi_world_rank() {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// bf16 has no MPI type: it travels as a 2-byte contiguous type with user reductions.
template <ReduceOp Op>
void mpi_bf16_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* a = static_cast<bf16*>(inout);
  reduce_into(a, a, static_cast<const bf16*>(in), static_cast<std::size_t>(*len), Op);
}

// The reduction of the collective check's exchange (CallCheck::check).
inline void mpi_check_reduce(void* in, void* inout, int* len, MPI_Datatype*) {
  auto* b = static_cast<std::int64_t*>(inout);
  reduce_check_triples(b, static_cast<const std::int64_t*>(in), b, static_cast<std::size_t>(*len));
}

// Process-wide MPI state. Construction initialises MPI if needed; the
// destructor (at exit) finalises it only if ptrain initialised it.
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime rt;
    return rt;
  }
  // Serialises MPI calls when the library is not MPI_THREAD_MULTIPLE.
  std::unique_lock<std::mutex> guard() {
    return multiple_ ? std::unique_lock<std::mutex>() : std::unique_lock<std::mutex>(m_);
  }
  int thread_level() const { return level_; }
  MPI_Datatype bf16_type() const { return bf16_type_; }
  // Three I64 reduced by mpi_check_reduce: the collective check's exchange.
  MPI_Datatype check_type() const { return check_type_; }
  MPI_Op check_op() const { return check_op_; }
  MPI_Op bf16_op(ReduceOp op) const {
    return op == ReduceOp::Min ? bf16_min_ : op == ReduceOp::Max ? bf16_max_ : bf16_sum_;
  }

  ~MpiRuntime() {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    MPI_Op_free(&bf16_sum_);
    MPI_Op_free(&bf16_min_);
    MPI_Op_free(&bf16_max_);
    MPI_Op_free(&check_op_);
    MPI_Type_free(&bf16_type_);
    MPI_Type_free(&check_type_);
    if (owned_) MPI_Finalize();
  }

 private:
  MpiRuntime() {
    int init = 0;
    PTRAIN_CHECK_MPI(MPI_Initialized(&init));
    if (!init) {
      // Collectives run on the communicator's worker thread while the main
      // thread computes (DDP overlap). Open MPI busy-polls inside a blocking
      // collective by default, which takes the compute thread's core; yielding
      // made a 2-rank DDP step 1.6x faster on 2 cores. A user's setting wins.
      ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 0);
      PTRAIN_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &level_));
      owned_ = true;
    } else {
      PTRAIN_CHECK_MPI(MPI_Query_thread(&level_));
    }
    PTRAIN_CHECK(level_ >= MPI_THREAD_SERIALIZED, CommError,
                 "[ptrain.mpi.thread] MPI was initialised with thread level ", level_,
                 " but ptrain's worker thread needs MPI_THREAD_SERIALIZED or higher; call "
                 "MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or let ptrain initialise MPI");
    multiple_ = level_ >= MPI_THREAD_MULTIPLE;
    PTRAIN_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &bf16_type_));
    PTRAIN_CHECK_MPI(MPI_Type_commit(&bf16_type_));
    PTRAIN_CHECK_MPI(MPI_Op_create(&mpi_bf16_reduce<ReduceOp::Sum>, 1, &bf16_sum_));
    PTRAIN_CHECK_MPI(MPI_Op_create(&mpi_bf16_reduce<ReduceOp::Min>, 1, &bf16_min_));
    PTRAIN_CHECK_MPI(MPI_Op_create(&mpi_bf16_reduce<ReduceOp::Max>, 1, &bf16_max_));
    PTRAIN_CHECK_MPI(MPI_Type_contiguous(3, MPI_INT64_T, &check_type_));
    PTRAIN_CHECK_MPI(MPI_Type_commit(&check_type_));
    PTRAIN_CHECK_MPI(MPI_Op_create(&mpi_check_reduce, 1, &check_op_));
  }

  int level_ = 0;
  bool owned_ = false, multiple_ = false;
  std::mutex m_;
  MPI_Datatype bf16_type_ = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL, bf16_min_ = MPI_OP_NULL, bf16_max_ = MPI_OP_NULL;
  MPI_Datatype check_type_ = MPI_DATATYPE_NULL;
  MPI_Op check_op_ = MPI_OP_NULL;
};

inline MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::BF16: return MpiRuntime::get().bf16_type();
    default: break;
  }
  PTRAIN_THROW(CommError, "[ptrain.comm.dtype] the MPI backend has no ", dtype_name(dt),
               "; use F32, F64, BF16, I32 or I64");
}

inline MPI_Op mpi_op(ReduceOp op, DType dt) {
  if (dt == DType::BF16) return MpiRuntime::get().bf16_op(op);
  return op == ReduceOp::Min ? MPI_MIN : op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
}

// MPI counts are int; operations other than all_reduce refuse larger ones.
inline int mpi_count(std::size_t n, const char* op) {
  PTRAIN_CHECK(n <= static_cast<std::size_t>(INT_MAX), CommError, "[ptrain.mpi.count] ", op, ": ", n,
               " elements exceed MPI's int count; split the buffer into pieces of at most ", INT_MAX);
  return static_cast<int>(n);
}

// Send/recv: the worker posts MPI_Isend/Irecv in order; waiting tests the request.
class MpiP2PWork : public Work {
 public:
  using Work::Work;
  MPI_Request request = MPI_REQUEST_NULL;

  ~MpiP2PWork() override {
    // Un-waited transfer: let MPI finish it in the background.
    if (request != MPI_REQUEST_NULL) {
      auto g = MpiRuntime::get().guard();
      MPI_Request_free(&request);
    }
  }

 protected:
  void finish(std::chrono::milliseconds timeout) override {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(1);
    while (!try_finish()) {
      if (std::chrono::steady_clock::now() >= deadline) throw_timeout();
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(1000));
    }
  }
  bool try_finish() override {
    int done = 0;
    auto g = MpiRuntime::get().guard();
    PTRAIN_CHECK_MPI(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    return done != 0;
  }
};

// Where an MpiCommunicator's operation waits for its MPI requests (Note [Inline blocking
// calls]): on the worker (work == nullptr) as long as they take, since the caller's wait()
// times out instead; on the caller's thread until `deadline`, then [ptrain.comm.timeout].
struct MpiWaiting {
  const Work* work = nullptr;
  std::chrono::steady_clock::time_point deadline{};
  std::chrono::milliseconds timeout{0};
};

}  // namespace detail

/// Communicator over an MPI communicator (default: a duplicate of MPI_COMM_WORLD).
/// Constructing one is collective over the parent communicator.
class MpiCommunicator : public Communicator {
 public:
  /// Duplicates `parent` (MPI_COMM_WORLD by default); initialises MPI if needed.
  explicit MpiCommunicator(std::chrono::milliseconds timeout = default_comm_timeout())
      : MpiCommunicator(MPI_COMM_WORLD, timeout) {}
  MpiCommunicator(MPI_Comm parent, std::chrono::milliseconds timeout) : Communicator(timeout) {
    detail::MpiRuntime::get();
    MPI_Comm dup = MPI_COMM_NULL;
    PTRAIN_CHECK_MPI(MPI_Comm_dup(parent, &dup));
    adopt(dup);
  }
  ~MpiCommunicator() override {
    // A worker stuck in a blocking MPI call past the timeout is detached and
    // the handle leaked rather than freed under it (Note [Failure]).
    if (queue_.shutdown(timeout()) && !stuck_ && comm_ != MPI_COMM_NULL) {
      auto g = detail::MpiRuntime::get().guard();
      int fin = 0;
      MPI_Finalized(&fin);
      if (!fin) MPI_Comm_free(&comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  /// The underlying MPI communicator (owned by this object).
  MPI_Comm native() const { return comm_; }
  /// MPI's granted thread level (MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE).
  static int thread_level() { return detail::MpiRuntime::get().thread_level(); }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    auto type = detail::mpi_type(dt);
    auto w = make_work(detail::op_desc("all_reduce", count, dt, reduce_op_name(op)));
    const auto row = detail::call_row(detail::kAllReduce, count, dt, static_cast<std::int64_t>(op));
    queue_.submit(w, [=, this] {
      verify(row);
      std::size_t es = dtype_size(dt);
      // Chunks keep each MPI count within int range.
      constexpr std::size_t kChunk = std::size_t{1} << 30;
      for (std::size_t off = 0; off < count || (count == 0 && off == 0); off += kChunk) {
        int n = static_cast<int>(std::min(kChunk, count - off));
        const void* s = send == recv ? MPI_IN_PLACE : static_cast<const char*>(send) + off * es;
        auto g = detail::MpiRuntime::get().guard();
        PTRAIN_CHECK_MPI(MPI_Allreduce(s, static_cast<char*>(recv) + off * es, n, type, detail::mpi_op(op, dt), comm_));
        if (count == 0) break;
      }
      if (op == ReduceOp::Avg) detail::divide_by(recv, count, dt, size_);
    });
    return w;
  }

  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    auto type = detail::mpi_type(dt);
    int n = detail::mpi_count(recv_count, "reduce_scatter");
    auto w = make_work(detail::op_desc("reduce_scatter", recv_count, dt, reduce_op_name(op)));
    const auto row = detail::call_row(detail::kReduceScatter, recv_count, dt, static_cast<std::int64_t>(op));
    queue_.submit(w, [=, this] {
      verify(row);
      const void* s = send == recv ? MPI_IN_PLACE : send;
      {
        auto g = detail::MpiRuntime::get().guard();
        PTRAIN_CHECK_MPI(MPI_Reduce_scatter_block(s, recv, n, type, detail::mpi_op(op, dt), comm_));
      }
      if (op == ReduceOp::Avg) detail::divide_by(recv, recv_count, dt, size_);
    });
    return w;
  }

  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count,
                                         DType dt) override {
    auto type = detail::mpi_type(dt);
    int n = detail::mpi_count(send_count, "all_gather");
    detail::mpi_count(send_count * static_cast<std::size_t>(size_), "all_gather");
    auto w = make_work(detail::op_desc("all_gather", send_count, dt));
    const void* s = send == static_cast<const char*>(recv) + rank_ * send_count * dtype_size(dt) ? MPI_IN_PLACE : send;
    const auto row = detail::call_row(detail::kAllGather, send_count, dt);
    queue_.submit(w, [=, this] {
      verify(row);
      auto g = detail::MpiRuntime::get().guard();
      PTRAIN_CHECK_MPI(MPI_Allgather(s, n, type, recv, n, type, comm_));
    });
    return w;
  }

  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    check_root(root, "broadcast");
    auto type = detail::mpi_type(dt);
    int n = detail::mpi_count(count, "broadcast");
    auto w = make_work(detail::op_desc("broadcast", count, dt, detail::cat("root ", root).c_str()));
    const auto row = detail::call_row(detail::kBroadcast, count, dt, 0, root);
    queue_.submit(w, [=, this] {
      verify(row);
      auto g = detail::MpiRuntime::get().guard();
      PTRAIN_CHECK_MPI(MPI_Bcast(buf, n, type, root, comm_));
    });
    return w;
  }

  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank,
                                         DType dt) override {
    return all_to_all_op(send, recv, count_per_rank, dt, false);
  }

  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    return all_to_all_v_op(send, send_counts, recv, recv_counts, dt, false);
  }

  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return p2p(true, const_cast<void*>(buf), count, dt, peer, tag);
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return p2p(false, buf, count, dt, peer, tag);
  }

  std::shared_ptr<Work> barrier_async() override {
    auto w = make_work("barrier()");
    queue_.submit(w, [this] {
      verify(detail::call_row(detail::kBarrier));
      auto g = detail::MpiRuntime::get().guard();
      PTRAIN_CHECK_MPI(MPI_Barrier(comm_));
    });
    return w;
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm out = MPI_COMM_NULL;
    // Runs on the worker so that it stays in order with queued collectives.
    auto w = make_work(detail::cat("split(color ", color, ", key ", key, ")"));
    queue_.submit(w, [&, this] {
      verify(detail::call_row(detail::kSplit));
      auto g = detail::MpiRuntime::get().guard();
      PTRAIN_CHECK_MPI(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out));
    });
    w->wait(timeout());
    if (out == MPI_COMM_NULL) return nullptr;
    return std::unique_ptr<Communicator>(new MpiCommunicator(AdoptTag{}, out, timeout()));
  }

 protected:
  // Note [Inline blocking calls]: run on this thread when the worker is idle.
  void all_to_all_blocking(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    all_to_all_op(send, recv, count_per_rank, dt, true)->wait(timeout());
  }
  void all_to_all_v_blocking(const void* send, const std::size_t* send_counts, void* recv,
                             const std::size_t* recv_counts, DType dt) override {
    all_to_all_v_op(send, send_counts, recv, recv_counts, dt, true)->wait(timeout());
  }

 private:
  struct AdoptTag {};

  // Runs `op` on the worker in submission order, or, when `blocking` and nothing is queued
  // or running, on this thread (Note [Inline blocking calls]).
  void run(const std::shared_ptr<Work>& w, bool blocking, std::function<void(const detail::MpiWaiting&)> op) {
    if (blocking) {
      const detail::MpiWaiting here{w.get(), std::chrono::steady_clock::now() + timeout(), timeout()};
      if (queue_.run_inline(*w, [&] { op(here); })) return;
    }
    queue_.submit(w, [op = std::move(op)] { op(detail::MpiWaiting{}); });
  }

  // Completes the nonblocking MPI operation that `post` starts (an MPI_I* call on its request).
  template <class Post>
  void complete(const detail::MpiWaiting& how, Post&& post) {
    MPI_Request q = MPI_REQUEST_NULL;
    if (how.work == nullptr) {
      auto g = detail::MpiRuntime::get().guard();
      post(&q);
      PTRAIN_CHECK_MPI(MPI_Wait(&q, MPI_STATUS_IGNORE));
      return;
    }
    {
      auto g = detail::MpiRuntime::get().guard();
      post(&q);
    }
    for (;;) {
      int done = 0;
      {
        auto g = detail::MpiRuntime::get().guard();
        PTRAIN_CHECK_MPI(MPI_Test(&q, &done, MPI_STATUS_IGNORE));
      }
      if (done) return;
      if (std::chrono::steady_clock::now() >= how.deadline) {
        // MPI cannot cancel a collective: the request stays pending, so the handle is leaked.
        stuck_ = true;
        Work::throw_timeout(how.work->what(), rank_, -1, how.timeout);
      }
    }
  }

  std::shared_ptr<Work> all_to_all_op(const void* send, void* recv, std::size_t count_per_rank, DType dt,
                                      bool blocking) {
    auto type = detail::mpi_type(dt);
    int n = detail::mpi_count(count_per_rank, "all_to_all");
    const std::size_t total = count_per_rank * static_cast<std::size_t>(size_);
    detail::mpi_count(total, "all_to_all");
    check_no_overlap(send, total * dtype_size(dt), recv, total * dtype_size(dt), "all_to_all");
    auto w = make_work(detail::all_to_all_desc(count_per_rank, dt));
    const auto row = detail::call_row(detail::kAllToAll, count_per_rank, dt);
    run(w, blocking, [=, this](const detail::MpiWaiting& how) {
      verify(row, nullptr, how);
      complete(how, [&](MPI_Request* q) { PTRAIN_CHECK_MPI(MPI_Ialltoall(send, n, type, recv, n, type, comm_, q)); });
    });
    return w;
  }

  std::shared_ptr<Work> all_to_all_v_op(const void* send, const std::size_t* send_counts, void* recv,
                                        const std::size_t* recv_counts, DType dt, bool blocking) {
    auto type = detail::mpi_type(dt);
    auto l = std::make_shared<const detail::AllToAllLayout>(all_to_all_layout(send_counts, recv_counts));
    // MPI_Alltoallv's counts and displacements are int: the totals bound both.
    detail::mpi_count(l->send_total, "all_to_all_v (elements sent)");
    detail::mpi_count(l->recv_total, "all_to_all_v (elements received)");
    check_no_overlap(send, l->send_total * dtype_size(dt), recv, l->recv_total * dtype_size(dt), "all_to_all_v");
    auto ints = std::make_shared<std::vector<int>>();  // send counts, send displacements, recv counts, recv displacements
    for (const auto* v : {&l->send_counts, &l->send_offsets, &l->recv_counts, &l->recv_offsets})
      ints->insert(ints->end(), v->begin(), v->end());
    auto w = make_work(detail::all_to_all_v_desc(*l, dt));
    const auto row = detail::call_row(detail::kAllToAllV, 0, dt);
    run(w, blocking, [=, this](const detail::MpiWaiting& how) {
      verify(row, l.get(), how);
      const int* c = ints->data();
      complete(how, [&](MPI_Request* q) {
        PTRAIN_CHECK_MPI(MPI_Ialltoallv(send, c, c + size_, type, recv, c + 2 * size_, c + 3 * size_, type, comm_, q));
      });
    });
    return w;
  }

  MpiCommunicator(AdoptTag, MPI_Comm comm, std::chrono::milliseconds timeout) : Communicator(timeout) { adopt(comm); }

  void adopt(MPI_Comm comm) {
    comm_ = comm;
    // Errors come back as codes (turned into CommError) instead of aborting the job.
    PTRAIN_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    PTRAIN_CHECK_MPI(MPI_Comm_rank(comm_, &rank_));
    PTRAIN_CHECK_MPI(MPI_Comm_size(comm_, &size_));
  }

  std::shared_ptr<Work> make_work(std::string what) {
    return std::make_shared<detail::QueuedWork>(std::move(what), rank_, -1, timeout());
  }

  // Note [Collective fingerprints]: before each collective, one exchange (CallCheck::check);
  // `split`: an all_to_all_v's layout, whose sizes that exchange checks as well. `how`: where
  // it waits (Note [Inline blocking calls]); nonblocking calls everywhere, since MPI does not
  // match a blocking collective with a nonblocking one.
  void verify(const detail::CallRow& row, const detail::AllToAllLayout* split = nullptr,
              const detail::MpiWaiting& how = {}) {
    const MPI_Datatype i64 = detail::mpi_type(DType::I64);
    const auto& rt = detail::MpiRuntime::get();
    check_.check(
        row, rank_, size_, split ? &split->send_counts : nullptr, split ? &split->recv_counts : nullptr,
        [&](std::int64_t* v) {
          complete(how, [&](MPI_Request* q) {
            PTRAIN_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, v, 1, rt.check_type(), rt.check_op(), comm_, q));
          });
        },
        [&](const std::int64_t* mine, std::size_t count, std::int64_t* all) {
          const int n = static_cast<int>(count);
          complete(how, [&](MPI_Request* q) { PTRAIN_CHECK_MPI(MPI_Iallgather(mine, n, i64, all, n, i64, comm_, q)); });
        });
  }

  std::shared_ptr<Work> p2p(bool is_send, void* buf, std::size_t count, DType dt, int peer, int tag) {
    const char* op = is_send ? "send" : "recv";
    check_p2p(op, peer, tag);
    auto type = detail::mpi_type(dt);
    int n = detail::mpi_count(count, op);
    auto w = std::make_shared<detail::MpiP2PWork>(detail::p2p_desc(is_send, count, dt, peer, tag), rank_, peer,
                                                  timeout());
    queue_.submit(w, [=, this, raw = w.get()] {
      auto g = detail::MpiRuntime::get().guard();
      if (is_send) PTRAIN_CHECK_MPI(MPI_Isend(buf, n, type, peer, tag, comm_, &raw->request));
      else PTRAIN_CHECK_MPI(MPI_Irecv(buf, n, type, peer, tag, comm_, &raw->request));
    });
    return w;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  detail::CallCheck check_;  // used by the running operation only (worker or inline)
  std::atomic<bool> stuck_{false};  // an inline operation timed out with its request pending
  detail::OpQueue queue_;
};

}  // namespace ptrain::dist

#endif  // PTRAIN_MPI
