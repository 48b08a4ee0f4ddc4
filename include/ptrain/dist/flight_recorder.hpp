#pragma once
// The collective flight recorder: every communicator of a process keeps its last
// N operations, and the process writes them as JSON when something goes wrong,
// so that tools/flight_recorder.py can say which rank is stuck and where.
//
// Note [Flight recorder]
// RecordingCommunicator wraps a communicator (init_process_group applies it when
// $PTRAIN_FLIGHT_RECORDER_DIR is set, outside CheckedCommunicator, so the check's
// own exchanges are not recorded; split() children are wrapped too). Each call
// appends one entry to a ring of the last N (default 2000,
// $PTRAIN_FLIGHT_RECORDER_SIZE): a per-communicator collective sequence number
// (1, 2, ... in the order of Note [Collective order contract], so entry #k of
// every rank describes the same collective), or a p2p sequence number for
// send/recv, the op, count, dtype, reduce op, root or peer (all_to_all_v: its
// send and recv counts per rank; count is what it sends), the group size, the
// label of the innermost CollectiveLabel scope on the calling thread, and the
// state: "started" when issued, "completed" once a wait or is_completed() on its
// Work has seen it finish, "failed" with the error. "completed" is what the
// caller observed, not the moment the backend finished: an async all-reduce
// nobody waited for yet stays "started".
//
// The process writes every live recorder to $PTRAIN_FLIGHT_RECORDER_DIR/rank<R>.json
// (R: the world rank, the first recorder's rank) when a wait on a recorded
// operation throws CommError (a timeout, an aborted communicator, a failed peer,
// a mismatch), and when it receives SIGUSR2 ($PTRAIN_FLIGHT_RECORDER_SIGNAL may
// name another: USR1, USR2 or a number). A rank that is stuck cannot run a
// handler's work on its own thread, and a signal handler may not take locks or
// allocate, so the handler only writes one byte to a pipe; a watcher thread,
// blocked in read() on the other end, wakes and writes the dump under the
// recorders' locks, which no caller holds while it waits (the handler replaces
// any earlier handler of that signal). A later dump replaces an earlier one
// (written to a temporary name, then renamed), so the file always holds the
// newest complete picture; it also quotes the reason of the process's first
// dump, since the errors after a failure mostly repeat it ([ptrain.comm.aborted]).

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ptrain/core/writable_dir.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/forwarding_communicator.hpp"
#include "ptrain/obs/trace.hpp"

namespace ptrain::dist {

namespace detail {
inline thread_local const char* collective_label = nullptr;
inline std::atomic<std::int64_t> collective_wait_ns{0};
}  // namespace detail

/// Seconds this process's callers spent blocked in waits on recorded operations
/// (Work::wait of a RecordingCommunicator's Work); 0 while no recorder is on.
inline double collective_wait_seconds() { return 1e-9 * static_cast<double>(detail::collective_wait_ns.load()); }

/// Names the collectives issued on this thread inside its scope in the flight
/// recorder ("ddp.bucket", "fsdp.gather"); the string must outlive the scope.
class CollectiveLabel {
 public:
  explicit CollectiveLabel(const char* label) : prev_(detail::collective_label) { detail::collective_label = label; }
  ~CollectiveLabel() { detail::collective_label = prev_; }
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;

 private:
  const char* prev_;
};

/// $PTRAIN_FLIGHT_RECORDER_DIR, or "" when the recorder is off.
inline std::string flight_recorder_dir() {
  const char* v = std::getenv("PTRAIN_FLIGHT_RECORDER_DIR");
  return v ? v : "";
}

/// Entries each recorder keeps: $PTRAIN_FLIGHT_RECORDER_SIZE, or 2000.
inline std::size_t flight_recorder_size() {
  const char* v = std::getenv("PTRAIN_FLIGHT_RECORDER_SIZE");
  if (v == nullptr || *v == '\0') return 2000;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  PTRAIN_CHECK(end != v && *end == '\0' && n >= 1 && n <= 10'000'000, LaunchError,
               "[ptrain.flight.size_env] PTRAIN_FLIGHT_RECORDER_SIZE='", v,
               "' is not a number of entries from 1 to 10000000; set it to e.g. 2000 or unset it");
  return static_cast<std::size_t>(n);
}

/// The signal that makes every rank dump: $PTRAIN_FLIGHT_RECORDER_SIGNAL (USR1, USR2 or a number), default SIGUSR2.
inline int flight_recorder_signal() {
  const char* v = std::getenv("PTRAIN_FLIGHT_RECORDER_SIGNAL");
  if (v == nullptr || *v == '\0') return SIGUSR2;
  std::string s(v);
  if (s == "USR1" || s == "SIGUSR1") return SIGUSR1;
  if (s == "USR2" || s == "SIGUSR2") return SIGUSR2;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  PTRAIN_CHECK(end != v && *end == '\0' && n > 0 && n < NSIG && n != SIGKILL && n != SIGSTOP, LaunchError,
               "[ptrain.flight.signal_env] PTRAIN_FLIGHT_RECORDER_SIGNAL='", v,
               "' is not USR1, USR2 or a signal number that can be caught; unset it for SIGUSR2");
  return static_cast<int>(n);
}

/// One recorded operation (Note [Flight recorder]).
struct FlightEntry {
  std::int64_t seq = 0;      // collective sequence number, 0 for send/recv
  std::int64_t p2p_seq = 0;  // send/recv sequence number, 0 for collectives
  std::string op;            // "all_reduce", "send", ...
  std::size_t count = 0;     // all_to_all: per rank; all_to_all_v: elements sent
  std::vector<std::size_t> send_counts, recv_counts;  // all_to_all_v's split sizes, else empty
  DType dtype = DType::F32;
  std::string reduce_op;     // "sum" ... for all_reduce / reduce_scatter, else ""
  int root = -1;             // broadcast
  int peer = -1;             // send / recv
  std::string label;
  const char* trace_name = nullptr;  // the span name in traces ("comm.all_reduce")
  std::string state = "started";
  std::string error;
  double start_us = 0, end_us = 0;  // microseconds since the Unix epoch; end 0 until observed
};

/// The ring of one communicator's last operations; thread-safe.
class FlightRecorder {
 public:
  FlightRecorder(std::string group, int rank, int size, std::string backend, std::size_t capacity)
      : group_(std::move(group)), rank_(rank), size_(size), backend_(std::move(backend)), capacity_(capacity) {
    PTRAIN_CHECK(capacity_ > 0, LaunchError, "[ptrain.flight.size] a flight recorder needs room for one entry");
  }

  static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  /// Records a new operation as started; returns its id for finish().
  std::int64_t start(FlightEntry e) {
    std::lock_guard lock(m_);
    if (e.peer < 0) e.seq = ++seq_;
    else e.p2p_seq = ++p2p_seq_;
    e.start_us = now_us();
    const std::int64_t id = next_id_++;
    if (ring_.size() < capacity_) ring_.push_back(std::move(e));
    else ring_[static_cast<std::size_t>(id) % capacity_] = std::move(e);
    return id;
  }

  /// Marks operation `id` completed (error empty) or failed, unless it left the ring.
  void finish(std::int64_t id, const std::string& error = {}) {
    std::lock_guard lock(m_);
    if (id < next_id_ - static_cast<std::int64_t>(ring_.size())) return;
    FlightEntry& e = ring_[static_cast<std::size_t>(id) % capacity_];
    if (e.state != "started") return;
    e.state = error.empty() ? "completed" : "failed";
    e.error = error;
    e.end_us = now_us();
  }

  /// The entries, oldest first.
  std::vector<FlightEntry> entries() const {
    std::lock_guard lock(m_);
    std::vector<FlightEntry> out;
    const auto n = static_cast<std::int64_t>(ring_.size());
    for (std::int64_t id = next_id_ - n; id < next_id_; ++id) out.push_back(ring_[static_cast<std::size_t>(id) % capacity_]);
    return out;
  }

  const std::string& group() const { return group_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::size_t capacity() const { return capacity_; }

  /// This recorder as a JSON object (the "groups" items of a dump).
  nlohmann::json to_json() const {
    nlohmann::json ops = nlohmann::json::array();
    for (const FlightEntry& e : entries()) {
      nlohmann::json j = {{"seq", e.seq},       {"p2p_seq", e.p2p_seq}, {"op", e.op},
                          {"count", e.count},   {"dtype", dtype_name(e.dtype)},
                          {"reduce_op", e.reduce_op}, {"root", e.root}, {"peer", e.peer},
                          {"label", e.label},   {"state", e.state},     {"start_us", e.start_us},
                          {"end_us", e.end_us}};
      if (!e.error.empty()) j["error"] = e.error;
      if (e.op == "all_to_all_v") {
        j["send_counts"] = e.send_counts;
        j["recv_counts"] = e.recv_counts;
      }
      ops.push_back(std::move(j));
    }
    return {{"group", group_}, {"rank", rank_}, {"size", size_}, {"backend", backend_},
            {"capacity", capacity_}, {"ops", std::move(ops)}};
  }

 private:
  std::string group_;
  int rank_, size_;
  std::string backend_;
  std::size_t capacity_;
  mutable std::mutex m_;
  std::vector<FlightEntry> ring_;
  std::int64_t next_id_ = 0, seq_ = 0, p2p_seq_ = 0;
};

namespace detail {

// The process's live recorders, the dump, and the signal watcher (Note [Flight recorder]).
class FlightRegistry {
 public:
  static FlightRegistry& get() {
    static FlightRegistry* r = new FlightRegistry();  // never destroyed: the watcher thread may outlive main()
    return *r;
  }

  void add(const std::shared_ptr<FlightRecorder>& rec) {
    std::lock_guard lock(m_);
    std::erase_if(recorders_, [](const std::weak_ptr<FlightRecorder>& w) { return w.expired(); });
    if (recorders_.empty() && world_rank_ < 0) world_rank_ = rec->rank();
    if (recorders_.empty()) prepare_dir(rec->rank());
    recorders_.push_back(rec);
    start_watcher();
  }

  /// Makes $PTRAIN_FLIGHT_RECORDER_DIR and proves that a file can be written there, when
  /// the first recorder starts: a folder that cannot take the dump is found when the job
  /// starts, not when it is stuck and the dump is needed.
  static void prepare_dir(int rank) {
    const std::string dir = flight_recorder_dir();
    if (dir.empty()) return;
    const std::string err = make_writable_dir(dir, rank);
    PTRAIN_CHECK(err.empty(), CommError, "[ptrain.flight.dir] rank ", rank, " cannot write to the flight recorder's "
                 "folder PTRAIN_FLIGHT_RECORDER_DIR=", dir, " (", err, "); set it (or "
                 "--flight-recorder-dir) to a writable folder on every node");
  }

  /// Writes every live recorder to <dir>/rank<R>.json; `reason` says why. Returns the path, "" when off.
  std::string dump(const std::string& reason) {
    std::lock_guard dump_lock(dump_m_);
    const std::string dir = flight_recorder_dir();
    if (dir.empty()) return {};
    nlohmann::json groups = nlohmann::json::array();
    int world_rank = 0;
    if (first_reason_.empty()) first_reason_ = reason;
    ++dumps_;
    {
      std::lock_guard lock(m_);
      world_rank = world_rank_;
      std::vector<std::weak_ptr<FlightRecorder>> live;
      for (auto& w : recorders_)
        if (auto r = w.lock()) {
          groups.push_back(r->to_json());
          live.push_back(w);
        }
      recorders_ = std::move(live);
    }
    nlohmann::json doc = {{"version", 1},
                          {"rank", world_rank},
                          {"pid", static_cast<long>(::getpid())},
                          {"reason", reason},
                          {"first_reason", first_reason_},  // later errors often only echo the first
                          {"dump", dumps_},
                          {"dumped_us", FlightRecorder::now_us()},
                          {"groups", std::move(groups)}};
    const std::string path = cat(dir, "/rank", world_rank, ".json");
    const std::string tmp = cat(path, ".tmp", ::getpid());
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "[ptrain.flight.write] cannot write the flight recorder dump %s: %s; check that "
                   "PTRAIN_FLIGHT_RECORDER_DIR exists and is writable\n", tmp.c_str(), std::strerror(errno));
      return {};
    }
    const std::string text = doc.dump(1);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::fprintf(stderr, "[ptrain.flight.write] writing the flight recorder dump %s failed: %s\n", path.c_str(),
                   std::strerror(errno));
      std::remove(tmp.c_str());
      return {};
    }
    std::fprintf(stderr, "[ptrain.flight] rank %d wrote %s (%s)\n", world_rank, path.c_str(), reason.c_str());
    return path;
  }

 private:
  FlightRegistry() = default;

  // Write end of the self-pipe, for the signal handler (which may only call write()).
  static std::atomic<int>& pipe_write_fd() {
    static std::atomic<int> fd{-1};
    return fd;
  }
  static void on_signal(int) {
    const int saved = errno;
    const int fd = pipe_write_fd().load();
    const char byte = 1;
    if (fd >= 0) [[maybe_unused]] auto n = ::write(fd, &byte, 1);
    errno = saved;
  }

  // Installs the handler and starts the watcher thread, once per process (under m_).
  void start_watcher() {
    if (watcher_started_) return;
    watcher_started_ = true;
    const int sig = flight_recorder_signal();
    int fds[2];
    if (::pipe(fds) != 0) {
      std::fprintf(stderr, "[ptrain.flight.signal] no pipe for the flight recorder's signal watcher (%s); dumps "
                   "happen only on communicator errors\n", std::strerror(errno));
      return;
    }
    ::fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    ::fcntl(fds[1], F_SETFD, FD_CLOEXEC);
    ::fcntl(fds[1], F_SETFL, O_NONBLOCK);  // a burst of signals must never block the handler
    pipe_write_fd() = fds[1];
    std::thread([this, fd = fds[0], sig] {
      char buf[64];
      for (;;) {
        ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        dump(cat("signal ", sig));
      }
    }).detach();
    struct sigaction sa {};
    sa.sa_handler = &FlightRegistry::on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(sig, &sa, nullptr);
  }

  std::mutex m_, dump_m_;
  std::vector<std::weak_ptr<FlightRecorder>> recorders_;
  int world_rank_ = -1;
  bool watcher_started_ = false;
  std::string first_reason_;  // under dump_m_
  int dumps_ = 0;
};

// The Work a RecordingCommunicator returns: waits on the backend's Work and
// records how it ended (completed, or failed with a dump).
class RecordedWork final : public Work {
 public:
  // `trace` names the operation's span when it was issued inside the trace window (else nullptr).
  RecordedWork(std::shared_ptr<Work> inner, std::shared_ptr<FlightRecorder> rec, std::int64_t id, int rank,
               std::chrono::milliseconds timeout, const char* trace, double trace_start_us, std::string label)
      : Work(inner->what(), rank, inner->peer(), timeout),
        inner_(std::move(inner)),
        rec_(std::move(rec)),
        id_(id),
        trace_(trace),
        trace_start_us_(trace_start_us),
        label_(std::move(label)) {
    mark_enqueued();
  }

 protected:
  void finish(std::chrono::milliseconds timeout) override {
    const auto t0 = std::chrono::steady_clock::now();
    struct AddWait {  // counted on success and on error alike
      std::chrono::steady_clock::time_point t0;
      ~AddWait() {
        collective_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - t0).count();
      }
    } add{t0};
    observe([&] { inner_->wait(timeout); });
  }
  bool try_finish() override {
    if (!inner_->is_completed()) return false;
    observe([&] { inner_->wait(std::chrono::milliseconds(0)); });  // completed: returns or rethrows at once
    return true;
  }

 private:
  template <class F>
  void observe(F&& f) {
    try {
      f();
    } catch (const CommError& e) {
      rec_->finish(id_, e.what());
      trace_end();
      FlightRegistry::get().dump(cat("error on rank ", rec_->rank(), " of group ", rec_->group(), ": ", e.what()));
      throw;
    }
    rec_->finish(id_);
    trace_end();
  }

  // The operation's span, from its issue to the end its caller observed.
  void trace_end() {
    if (trace_ != nullptr) obs::Tracer::get().complete(trace_, "comm", trace_start_us_, obs::trace_now_us(), -1, label_);
  }

  std::shared_ptr<Work> inner_;
  std::shared_ptr<FlightRecorder> rec_;
  std::int64_t id_;
  const char* trace_;
  double trace_start_us_;
  std::string label_;
};

}  // namespace detail

/// Wraps a communicator so that its operations go into a flight recorder (Note [Flight recorder]).
class RecordingCommunicator final : public ForwardingCommunicator {
 public:
  /// `group` names the communicator in dumps ("world"; split children get "world/split<n>.<color>").
  explicit RecordingCommunicator(std::unique_ptr<Communicator> inner, std::string group = "world",
                                 std::size_t capacity = flight_recorder_size())
      : ForwardingCommunicator(std::move(inner)) {
    PTRAIN_CHECK(inner_ != nullptr, CommError, "[ptrain.flight.inner] RecordingCommunicator needs a communicator");
    rec_ = std::make_shared<FlightRecorder>(std::move(group), inner_->rank(), inner_->size(), inner_->backend(),
                                            capacity);
    detail::FlightRegistry::get().add(rec_);
  }

  /// The recorder (inner() is the wrapped communicator).
  const FlightRecorder& recorder() const { return *rec_; }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    return record(entry("all_reduce", "comm.all_reduce", count, dt, reduce_op_name(op)),
                  [&] { return inner_->all_reduce_async(send, recv, count, dt, op); });
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    return record(entry("reduce_scatter", "comm.reduce_scatter", recv_count, dt, reduce_op_name(op)),
                  [&] { return inner_->reduce_scatter_async(send, recv, recv_count, dt, op); });
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    return record(entry("all_gather", "comm.all_gather", send_count, dt),
                  [&] { return inner_->all_gather_async(send, recv, send_count, dt); });
  }
  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    FlightEntry e = entry("broadcast", "comm.broadcast", count, dt);
    e.root = root;
    return record(std::move(e), [&] { return inner_->broadcast_async(buf, count, dt, root); });
  }
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    return record(entry("all_to_all", "comm.all_to_all", count_per_rank, dt),
                  [&] { return inner_->all_to_all_async(send, recv, count_per_rank, dt); });
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    const detail::AllToAllLayout l(send_counts, recv_counts, size());
    FlightEntry e = entry("all_to_all_v", "comm.all_to_all_v", l.send_total, dt);
    e.send_counts = l.send_counts;
    e.recv_counts = l.recv_counts;
    return record(std::move(e), [&] { return inner_->all_to_all_v_async(send, send_counts, recv, recv_counts, dt); });
  }
  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    FlightEntry e = entry("send", "comm.send", count, dt);
    e.peer = peer;
    return record(std::move(e), [&] { return inner_->send_async(buf, count, dt, peer, tag); });
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    FlightEntry e = entry("recv", "comm.recv", count, dt);
    e.peer = peer;
    return record(std::move(e), [&] { return inner_->recv_async(buf, count, dt, peer, tag); });
  }
  std::shared_ptr<Work> barrier_async() override {
    return record(entry("barrier", "comm.barrier", 0, DType::F32), [&] { return inner_->barrier_async(); });
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    const std::int64_t id = rec_->start(entry("split", "comm.split", 0, DType::I32));
    std::unique_ptr<Communicator> child;
    try {
      child = inner_->split(color, key);
    } catch (const CommError& e) {
      fail(id, e);
      throw;
    }
    rec_->finish(id);
    if (!child) return nullptr;
    return std::make_unique<RecordingCommunicator>(std::move(child),
                                                   detail::cat(rec_->group(), "/split", ++splits_, ".", color),
                                                   rec_->capacity());
  }

 private:
  // `trace` is the op's span name in traces (a literal: Note [Tracing cost]).
  FlightEntry entry(const char* op, const char* trace, std::size_t count, DType dt, const char* reduce = "") const {
    FlightEntry e;
    e.op = op;
    e.trace_name = trace;
    e.count = count;
    e.dtype = dt;
    e.reduce_op = reduce;
    if (detail::collective_label != nullptr) e.label = detail::collective_label;
    return e;
  }

  void fail(std::int64_t id, const CommError& e) {
    rec_->finish(id, e.what());
    detail::FlightRegistry::get().dump(detail::cat("error on rank ", rank(), " of group ", rec_->group(), ": ",
                                                   e.what()));
  }

  template <class Call>
  std::shared_ptr<Work> record(FlightEntry e, Call&& call) {
    const char* trace = obs::tracing() ? e.trace_name : nullptr;
    const double trace_start = trace ? obs::trace_now_us() : 0;
    std::string label = trace ? e.label : std::string();
    const std::int64_t id = rec_->start(std::move(e));
    std::shared_ptr<Work> w;
    try {
      w = call();
    } catch (const CommError& err) {  // a mismatch found on the calling thread, a closed communicator
      fail(id, err);
      throw;
    }
    return std::make_shared<detail::RecordedWork>(std::move(w), rec_, id, rank(), timeout(), trace, trace_start,
                                                  std::move(label));
  }

  std::shared_ptr<FlightRecorder> rec_;
  int splits_ = 0;
};

}  // namespace ptrain::dist
