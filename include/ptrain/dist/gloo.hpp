#pragma once
// Gloo backend (CPU buffers; torchrun/ptrun/Kubernetes launches). Built when
// PTRAIN_GLOO is set. Ranks meet through ptrain's TCP store (dist/store.hpp):
// every rank publishes its TCP pair addresses under a per-communicator key
// prefix and Gloo connects a full mesh.
//
// all_reduce, all_gather, broadcast, all_to_all(_v) and barrier are Gloo's algorithms;
// reduce_scatter is a ring over Gloo's unbound buffers (each rank sends
// (n-1)/n of the data, the bandwidth optimum) and send/recv are unbound
// buffer transfers. bf16 reductions run in float and round once per step.
//
// Note [Gloo failure]
// A dead peer shows up in Gloo as a reset or closed TCP pair, but its message
// names a socket address, not a rank. On the first failure a rank (1) sets
// <prefix>/failed/any and marks itself alive under <prefix>/failed/alive/<rank>
// in the store, (2) closes all its pairs so that ranks waiting on it fail at
// once instead of at the timeout, and (3) waits up to kFailureGrace for the
// other ranks' marks. Ranks without a mark are named as the failed peers. When
// the store itself is unreachable, rank 0 (which serves it) is named.
//
// Gloo does not wake every wait of a broken pair: an unbound-buffer send that
// sits half written in the pair's transmit queue (the peer stopped reading)
// fails only at Gloo's timeout. So a user thread waiting on a Work also looks
// for <prefix>/failed/any every kGlooProbeInterval and, once some rank has set
// it, runs the same diagnosis and throws. The worker may then still be inside
// Gloo; the communicator's destructor waits for it only kFailureGrace and then
// detaches it. Everything the worker touches lives in GlooState, which its
// queued task co-owns, so it can finish (at Gloo's timeout) after the
// communicator is gone. Buffers of the failed operation may still be written
// until then.

#ifdef PTRAIN_GLOO

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <vector>

#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/store.hpp"

namespace ptrain::dist {
namespace detail {

// How long a rank that saw a failure waits for the others' alive marks.
inline constexpr std::chrono::milliseconds kFailureGrace{2000};
// How often a waiting user thread looks for failure marks in the store.
inline constexpr std::chrono::milliseconds kGlooProbeInterval{500};
// Slot prefixes for ptrain's own unbound-buffer traffic; Gloo uses 0x01..0x08.
inline constexpr std::uint8_t kGlooReduceScatterSlot = 0x40;
inline constexpr std::uint8_t kGlooP2PSlot = 0x41;

// ptrain's Store shared by a communicator and the groups split from it; the
// mutex keeps one request at a time on the store's connection.
struct SharedStore {
  explicit SharedStore(std::shared_ptr<Store> s) : store(std::move(s)) {}
  std::shared_ptr<Store> store;
  std::mutex m;
};

// Gloo's rendezvous::Store on top of ptrain's Store.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<SharedStore> s, std::string prefix, std::chrono::milliseconds timeout)
      : s_(std::move(s)), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    std::lock_guard lock(s_->m);
    s_->store->set(prefix_ + key, std::string(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    std::lock_guard lock(s_->m);
    s_->store->wait({prefix_ + key}, timeout_);
    std::string v = s_->store->get(prefix_ + key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    std::lock_guard lock(s_->m);
    s_->store->wait(full, timeout);
  }

 private:
  std::shared_ptr<SharedStore> s_;
  std::string prefix_;
  std::chrono::milliseconds timeout_;
};

// Gloo reduction callback: out[i] = op(a[i], b[i]); Avg reduces as Sum.
inline gloo::AllreduceOptions::Func gloo_reduce_fn(DType dt, ReduceOp op) {
  return visit_dtype(dt, [op](auto t) -> gloo::AllreduceOptions::Func {
    using T = decltype(t);
    return [op](void* out, const void* a, const void* b, std::size_t n) {
      reduce_into(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, op);
    };
  });
}

// The TCP device: GLOO_SOCKET_IFNAME names an interface; otherwise the
// hostname given (the launch's master address when it is loopback, so
// single-node runs never leave the machine), otherwise gethostname().
inline std::shared_ptr<gloo::transport::Device> gloo_device(const std::string& hostname) {
  gloo::transport::tcp::attr attr;
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    attr.iface = ifname;
  } else if (!hostname.empty()) {
    attr.hostname = hostname;
  } else {
    char buf[256] = {};
    ::gethostname(buf, sizeof(buf) - 1);
    attr.hostname = buf;
  }
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    PTRAIN_THROW(CommError, "[ptrain.gloo.device] cannot create Gloo's TCP device on '",
                 attr.iface.empty() ? attr.hostname : attr.iface, "': ", e.what(),
                 "; set GLOO_SOCKET_IFNAME to the network interface to use (e.g. eth0)");
  }
}

// Send/recv: the worker posts the unbound-buffer transfer in order; the
// communicator's completion thread waits for it (Gloo's own wait with a
// timeout would close every pair when it expires, so a user's shorter
// Work::wait(timeout) must not call it) and reports here.
class GlooP2PWork : public Work {
 public:
  using Work::Work;
  using Work::set_probe;
  std::shared_ptr<gloo::Context> context;  // keeps the pair alive until the transfer ends
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  bool is_send = false;

  // Called by the completion thread: waits up to `timeout` for the transfer.
  void complete(std::chrono::milliseconds timeout) {
    std::exception_ptr err;
    try {
      if (is_send) buffer->waitSend(timeout);
      else buffer->waitRecv(timeout);
    } catch (const std::exception& e) {
      err = std::make_exception_ptr(CommError(detail::cat(
          "[ptrain.gloo.p2p] ", what(), " failed: ", e.what(), "; peer ", peer(),
          " may have died, or it never posted the matching ", is_send ? "recv" : "send", " (timeout ",
          timeout.count(), " ms)")));
    }
    {
      std::lock_guard lock(m_);
      done_ = true;
      error_ = err;
    }
    cv_.notify_all();
  }
  void complete_empty() {
    std::lock_guard lock(m_);
    done_ = true;
  }

 protected:
  void finish(std::chrono::milliseconds timeout) override {
    std::unique_lock lock(m_);
    if (!wait_probing(cv_, lock, std::chrono::steady_clock::now() + timeout, [&] { return done_; })) throw_timeout();
    if (error_) std::rethrow_exception(error_);
  }
  bool try_finish() override {
    std::lock_guard lock(m_);
    if (error_) std::rethrow_exception(error_);
    return done_;
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};

// Gloo's TCP transport writes to its sockets without MSG_NOSIGNAL. When a peer
// dies, such a write raises SIGPIPE, whose default action kills this process
// before Gloo can report the broken connection, so a dead peer would take its
// neighbours with it instead of giving them a CommError. SIGPIPE is therefore
// ignored (writes then fail with EPIPE, which Gloo reports) unless the program
// installed a handler of its own.
inline void ignore_default_sigpipe() {
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

// What a Gloo communicator's queued operations and Works use, owned jointly so
// that a worker left inside a stuck Gloo call outlives its communicator safely
// (Note [Gloo failure]).
struct GlooState {
  GlooState(std::shared_ptr<SharedStore> s, int r, int n, std::string h, std::string p, std::chrono::milliseconds t)
      : store(std::move(s)), rank(r), size(n), hostname(std::move(h)), prefix(std::move(p)),
        grace(std::min(kFailureGrace, t)) {}

  std::shared_ptr<SharedStore> store;
  int rank, size;
  std::string hostname, prefix;
  std::chrono::milliseconds grace;  // how long a rank that saw a failure waits for the others' marks
  std::shared_ptr<gloo::Context> ctx;
  std::uint32_t tag = 0;  // Gloo tags must match across ranks; all ranks run the same sequence
  OpQueue p2p_done;       // waits for posted send/recv transfers, in posting order
  CallCheck check;        // Note [Collective fingerprints]; used on the worker only

  // On the worker, before each collective: the exchange of Note [Collective fingerprints];
  // `split`: an all_to_all_v's layout, whose sizes the same exchange checks.
  void verify(const std::string& what, std::chrono::milliseconds timeout, const CallRow& row,
              const AllToAllLayout* split = nullptr) {
    struct Triple {  // one Gloo element, so that no algorithm splits it
      std::int64_t v[3];
    };
    check.check(
        row, rank, size, split ? &split->send_counts : nullptr, split ? &split->recv_counts : nullptr,
        [&](std::int64_t* v) {
          guarded(what, timeout, [&] {
            gloo::AllreduceOptions o(ctx);
            o.setOutput<Triple>(reinterpret_cast<Triple*>(v), 1);
            o.setReduceFunction([](void* out, const void* a, const void* b, std::size_t n) {
              reduce_check_triples(static_cast<std::int64_t*>(out), static_cast<const std::int64_t*>(a),
                                   static_cast<const std::int64_t*>(b), n);
            });
            o.setTag(tag++);
            o.setTimeout(timeout);
            gloo::allreduce(o);
          });
        },
        [&](const std::int64_t* mine, std::size_t n, std::int64_t* all) {
          std::copy(mine, mine + n, all + n * static_cast<std::size_t>(rank));
          guarded(what, timeout, [&] {
            gloo::AllgatherOptions o(ctx);
            o.setOutput(reinterpret_cast<char*>(all), n * sizeof(std::int64_t) * static_cast<std::size_t>(size));
            o.setTag(tag++);
            o.setTimeout(timeout);
            gloo::allgather(o);
          });
        });
  }

  std::string failed() {
    std::lock_guard lock(failure_m_);
    return failure_;
  }

  // Runs a Gloo call on the worker; turns its failure into a CommError naming
  // the operation and the failed peers.
  template <class F>
  void guarded(const std::string& what, std::chrono::milliseconds timeout, F&& f) {
    std::string earlier = failed();
    PTRAIN_CHECK(ctx && earlier.empty(), CommError, "[ptrain.comm.aborted] ", what, " on rank ", rank,
                 ": the Gloo communicator failed earlier: ", earlier.empty() ? "context closed" : earlier);
    try {
      f();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string gloo_msg = e.what();
      mark_failed();
      // Closing the pairs turns the peers' waits on this rank into errors now.
      for (int r = 0; r < size; ++r)
        if (r != rank) {
          try {
            ctx->getPair(r)->close();
          } catch (...) {
          }
        }
      ctx.reset();
      fail(what, detail::cat("Gloo: ", gloo_msg, " (timeout ", timeout.count(), " ms)"));
    }
  }

  // Called by a waiting user thread every kGlooProbeInterval: throws once any
  // rank of the group has marked a failure, even while this rank's worker is
  // still inside a Gloo call that only Gloo's timeout would end.
  void probe(const std::string& what) {
    if (failed().empty()) {
      try {
        std::lock_guard lock(store->m);
        if (!store->store->check({prefix + "/failed/any"})) return;
      } catch (const std::exception&) {
        // The store is gone: fall through, mark_failed() names rank 0.
      }
    }
    mark_failed();
    fail(what, "seen through the store while this rank waited");
  }

 private:
  [[noreturn]] void fail(const std::string& what, const std::string& detail) {
    PTRAIN_THROW(CommError, "[ptrain.gloo.failed] ", what, " failed on rank ", rank, " of ", size, " (", prefix,
                 "): ", failed(), "; ", detail,
                 ". The communicator is aborted; restart the job or create a new process group");
  }

  // Marks the failure and this rank alive in the store, waits up to the
  // grace for the other ranks' marks and records the verdict naming
  // the ranks without one (once; later calls keep the first verdict).
  void mark_failed() {
    std::lock_guard once(diagnose_m_);
    if (!failed().empty()) return;
    std::string verdict = diagnose();
    std::lock_guard lock(failure_m_);
    failure_ = verdict;
  }

  std::string diagnose() {
    auto key = [&](int r) { return detail::cat(prefix, "/failed/alive/", r); };
    try {
      std::lock_guard lock(store->m);
      store->store->set(prefix + "/failed/any", "1");
      store->store->set(key(rank), "1");
    } catch (const std::exception& e) {
      return detail::cat("peer rank 0 (it serves the store) is probably dead: the store is unreachable (", e.what(),
                         ")");
    }
    auto deadline = std::chrono::steady_clock::now() + grace;
    std::vector<int> missing;
    for (;;) {
      missing.clear();
      try {
        std::lock_guard lock(store->m);
        for (int r = 0; r < size; ++r)
          if (r != rank && !store->store->check({key(r)})) missing.push_back(r);
      } catch (const std::exception& e) {
        return detail::cat("peer rank 0 (it serves the store) is probably dead: the store became unreachable (",
                           e.what(), ")");
      }
      if (missing.empty() || std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (missing.empty()) return "every peer is still alive (a peer reported a transport error)";
    std::string list;
    for (std::size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + std::to_string(missing[i]);
    return detail::cat("peer rank", missing.size() > 1 ? "s " : " ", list,
                       " failed (died, or is stuck outside this collective)");
  }

  std::mutex diagnose_m_, failure_m_;
  std::string failure_;
};

}  // namespace detail

/// Communicator over a Gloo TCP full mesh; rendezvous through a ptrain Store.
class GlooCommunicator : public Communicator {
 public:
  /// Collective over `size` ranks sharing `store`: connects the mesh under key `prefix`.
  /// `hostname` is the address peers reach this rank at (see detail::gloo_device).
  GlooCommunicator(std::shared_ptr<Store> store, int rank, int size,
                   std::chrono::milliseconds timeout = default_comm_timeout(), std::string hostname = "",
                   std::string prefix = "ptrain/gloo/world")
      : GlooCommunicator(std::make_shared<detail::SharedStore>(std::move(store)), rank,
                         size, timeout, std::move(hostname), std::move(prefix)) {}

  ~GlooCommunicator() override {
    // Posting first, then completion: the worker may still hand transfers to the completion thread.
    // After a failure a worker may sit in a Gloo wait that only Gloo's own timeout ends
    // (Note [Gloo failure]); it is detached then and keeps the shared state alive until it returns.
    auto limit = s_->failed().empty() ? std::chrono::milliseconds(std::chrono::hours(24 * 365)) : s_->grace;
    if (queue_.shutdown(limit)) s_->p2p_done.shutdown(limit);
  }

  int rank() const override { return s_->rank; }
  int size() const override { return s_->size; }
  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    auto w = make_work(detail::op_desc("all_reduce", count, dt, reduce_op_name(op)));
    auto fn = detail::gloo_reduce_fn(dt, op);
    const auto row = detail::call_row(detail::kAllReduce, count, dt, static_cast<std::int64_t>(op));
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row);
      std::size_t bytes = count * dtype_size(dt);
      if (send != recv && bytes) std::memcpy(recv, send, bytes);
      // The copy above makes every all-reduce in place, which Gloo handles best.
      if (s->size > 1 && count > 0) {
        s->guarded(what, t, [&] {
          gloo::AllreduceOptions o(s->ctx);
          set_output(o, recv, count, dt);
          o.setReduceFunction(fn);
          o.setTag(s->tag++);
          o.setTimeout(t);
          gloo::allreduce(o);
        });
      }
      if (op == ReduceOp::Avg) detail::divide_by(recv, count, dt, s->size);
    });
    return w;
  }

  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    auto w = make_work(detail::op_desc("reduce_scatter", recv_count, dt, reduce_op_name(op)));
    const auto row = detail::call_row(detail::kReduceScatter, recv_count, dt, static_cast<std::int64_t>(op));
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row);
      ring_reduce_scatter(*s, what, t, send, recv, recv_count, dt, op);
      if (op == ReduceOp::Avg) detail::divide_by(recv, recv_count, dt, s->size);
    });
    return w;
  }

  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count,
                                         DType dt) override {
    detail::check_dtype(dt);
    auto w = make_work(detail::op_desc("all_gather", send_count, dt));
    const auto row = detail::call_row(detail::kAllGather, send_count, dt);
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row);
      std::size_t bytes = send_count * dtype_size(dt);
      char* mine = static_cast<char*>(recv) + static_cast<std::size_t>(s->rank) * bytes;
      if (send != mine && bytes) std::memcpy(mine, send, bytes);
      if (s->size == 1 || bytes == 0) return;
      s->guarded(what, t, [&] {
        // Input unset: Gloo takes this rank's block from the output (in place).
        gloo::AllgatherOptions o(s->ctx);
        o.setOutput(static_cast<char*>(recv), bytes * static_cast<std::size_t>(s->size));
        o.setTag(s->tag++);
        o.setTimeout(t);
        gloo::allgather(o);
      });
    });
    return w;
  }

  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    check_root(root, "broadcast");
    detail::check_dtype(dt);
    auto w = make_work(detail::op_desc("broadcast", count, dt, detail::cat("root ", root).c_str()));
    const auto row = detail::call_row(detail::kBroadcast, count, dt, 0, root);
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row);
      std::size_t bytes = count * dtype_size(dt);
      if (s->size == 1 || bytes == 0) return;
      s->guarded(what, t, [&] {
        gloo::BroadcastOptions o(s->ctx);
        o.setOutput(static_cast<char*>(buf), bytes);
        o.setRoot(root);
        o.setTag(s->tag++);
        o.setTimeout(t);
        gloo::broadcast(o);
      });
    });
    return w;
  }

  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank,
                                         DType dt) override {
    detail::check_dtype(dt);
    const std::size_t bytes = count_per_rank * dtype_size(dt) * static_cast<std::size_t>(s_->size);
    check_no_overlap(send, bytes, recv, bytes, "all_to_all");
    auto w = make_work(detail::all_to_all_desc(count_per_rank, dt));
    const auto row = detail::call_row(detail::kAllToAll, count_per_rank, dt);
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row);
      if (s->size == 1 || bytes == 0) {
        if (bytes) std::memcpy(recv, send, bytes);
        return;
      }
      s->guarded(what, t, [&] {
        gloo::AlltoallOptions o(s->ctx);
        o.setInput(static_cast<char*>(const_cast<void*>(send)), bytes);
        o.setOutput(static_cast<char*>(recv), bytes);
        o.setTag(s->tag++);
        o.setTimeout(t);
        gloo::alltoall(o);
      });
    });
    return w;
  }

  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    detail::check_dtype(dt);
    const detail::AllToAllLayout l = all_to_all_layout(send_counts, recv_counts);  // and verify()
    const std::size_t es = dtype_size(dt);
    check_no_overlap(send, l.send_total * es, recv, l.recv_total * es, "all_to_all_v");
    // Gloo's alltoallv takes bytes per rank.
    std::vector<std::int64_t> send_bytes, recv_bytes;
    for (int r = 0; r < s_->size; ++r) {
      send_bytes.push_back(static_cast<std::int64_t>(l.send_counts[r] * es));
      recv_bytes.push_back(static_cast<std::int64_t>(l.recv_counts[r] * es));
    }
    auto w = make_work(detail::all_to_all_v_desc(l, dt));
    const auto row = detail::call_row(detail::kAllToAllV, 0, dt);
    queue_.submit(w, [=, s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, row, &l);
      if (s->size == 1) {
        if (send_bytes[0]) std::memcpy(recv, send, static_cast<std::size_t>(send_bytes[0]));
        return;
      }
      s->guarded(what, t, [&] {
        gloo::AlltoallvOptions o(s->ctx);
        o.setInput(static_cast<char*>(const_cast<void*>(send)), send_bytes);
        o.setOutput(static_cast<char*>(recv), recv_bytes);
        o.setTag(s->tag++);
        o.setTimeout(t);
        gloo::alltoallv(o);
      });
    });
    return w;
  }

  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return p2p(true, const_cast<void*>(buf), count, dt, peer, tag);
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return p2p(false, buf, count, dt, peer, tag);
  }

  std::shared_ptr<Work> barrier_async() override {
    auto w = make_work("barrier()");
    queue_.submit(w, [s = s_, t = timeout(), what = w->what()] {
      s->verify(what, t, detail::call_row(detail::kBarrier));
      if (s->size == 1) return;
      s->guarded(what, t, [&] {
        gloo::BarrierOptions o(s->ctx);
        o.setTag(s->tag++);
        o.setTimeout(t);
        gloo::barrier(o);
      });
    });
    return w;
  }

  std::unique_ptr<Communicator> split(int color, int key) override {
    // Every rank learns every (color, key) through an all-gather on this
    // group, then the members of each color build a fresh mesh under a prefix
    // unique to this split (the split counter is the same on every rank).
    int n = s_->size;
    std::int64_t mine[2] = {color, key};
    std::vector<std::int64_t> all(2 * static_cast<std::size_t>(n));
    all_gather(mine, all.data(), 2, DType::I64);
    int split_id = splits_++;
    std::unique_ptr<Communicator> group;
    if (color >= 0) {
      std::vector<std::pair<std::int64_t, int>> members;  // (key, old rank)
      for (int r = 0; r < n; ++r)
        if (all[2 * r] == color) members.emplace_back(all[2 * r + 1], r);
      std::sort(members.begin(), members.end());
      int new_rank = 0;
      for (std::size_t i = 0; i < members.size(); ++i)
        if (members[i].second == s_->rank) new_rank = static_cast<int>(i);
      group.reset(new GlooCommunicator(s_->store, new_rank, static_cast<int>(members.size()), timeout(),
                                       s_->hostname, detail::cat(s_->prefix, "/split", split_id, "/color", color)));
    }
    // No rank returns while another still connects to the new group: a group destroyed
    // at once (a short-lived mesh) would otherwise close sockets a slower peer is still
    // handshaking on, and that peer's connect would fail.
    barrier();
    return group;
  }

 private:
  GlooCommunicator(std::shared_ptr<detail::SharedStore> store, int rank, int size, std::chrono::milliseconds timeout,
                   std::string hostname, std::string prefix)
      : Communicator(timeout) {
    PTRAIN_CHECK(size >= 1 && rank >= 0 && rank < size, CommError, "[ptrain.gloo.rank] rank ", rank,
                 " and size ", size, " do not describe a group; need 0 <= rank < size");
    s_ = std::make_shared<detail::GlooState>(std::move(store), rank, size, std::move(hostname), std::move(prefix),
                                             timeout);
    if (size == 1) return;  // a group of one never talks to anyone
    detail::ignore_default_sigpipe();
    auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, size);
    ctx->setTimeout(timeout);
    detail::GlooStoreAdapter adapter(s_->store, s_->prefix + "/", timeout);
    auto device = detail::gloo_device(s_->hostname);
    try {
      ctx->connectFullMesh(adapter, device);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      PTRAIN_THROW(CommError, "[ptrain.gloo.connect] rank ", rank, " of ", size,
                   " could not connect to its peers under store prefix '", s_->prefix, "' within ", timeout.count(),
                   " ms: ", e.what(), "; check that every rank started and that peers can reach this host (",
                   device->str(), "); set GLOO_SOCKET_IFNAME to pick the interface");
    }
    s_->ctx = std::move(ctx);
  }

  // Works of a group of 2+ probe the store while they wait (Note [Gloo failure]).
  template <class W>
  std::shared_ptr<W> probing(std::shared_ptr<W> w) {
    if (s_->size > 1)
      w->set_probe([s = std::weak_ptr(s_), what = w->what()] {
        if (auto state = s.lock()) state->probe(what);
      }, detail::kGlooProbeInterval);
    return w;
  }

  struct SingleStageWork : detail::QueuedWork {
    SingleStageWork(std::string what, int rank, std::chrono::milliseconds t)
        : QueuedWork(std::move(what), rank, -1, t) {}
    using Work::set_probe;
  };
  std::shared_ptr<Work> make_work(std::string what) {
    return probing(std::make_shared<SingleStageWork>(std::move(what), s_->rank, timeout()));
  }

  template <class Opts>
  static void set_output(Opts& o, void* buf, std::size_t count, DType dt) {
    detail::visit_dtype(dt, [&](auto t) {
      using T = decltype(t);
      o.template setOutput<T>(static_cast<T*>(buf), count);
      return 0;
    });
  }

  // Ring reduce-scatter: at step k rank r sends block (r-k-1) to r+1 and
  // reduces block (r-k-2) received from r-1; after n-1 steps block r is
  // complete. A scratch copy keeps `send` untouched when out of place.
  static void ring_reduce_scatter(detail::GlooState& s, const std::string& what, std::chrono::milliseconds t,
                                  const void* send, void* recv, std::size_t rc, DType dt, ReduceOp op) {
    std::size_t es = dtype_size(dt), block = rc * es;
    if (s.size == 1 || block == 0) {
      if (send != recv && block) std::memcpy(recv, send, block);
      return;
    }
    std::vector<char> work(static_cast<const char*>(send), static_cast<const char*>(send) + block * s.size);
    std::vector<char> incoming(block);
    int n = s.size, rank = s.rank, right = (rank + 1) % n, left = (rank - 1 + n) % n;
    std::uint32_t tag = s.tag++;
    s.guarded(what, t, [&] {
      auto out = s.ctx->createUnboundBuffer(work.data(), work.size());
      auto in = s.ctx->createUnboundBuffer(incoming.data(), incoming.size());
      auto slot = gloo::Slot::build(detail::kGlooReduceScatterSlot, tag);
      auto fn = detail::gloo_reduce_fn(dt, op);
      for (int k = 0; k < n - 1; ++k) {
        std::size_t send_idx = static_cast<std::size_t>((rank - k - 1 + 2 * n) % n);
        std::size_t recv_idx = static_cast<std::size_t>((rank - k - 2 + 2 * n) % n);
        in->recv(left, slot, 0, block);
        out->send(right, slot, send_idx * block, block);
        in->waitRecv(t);
        char* dst = work.data() + recv_idx * block;
        fn(dst, dst, incoming.data(), rc);
        out->waitSend(t);
      }
    });
    std::memcpy(recv, work.data() + static_cast<std::size_t>(rank) * block, block);
  }

  std::shared_ptr<Work> p2p(bool is_send, void* buf, std::size_t count, DType dt, int peer, int tag) {
    check_p2p(is_send ? "send" : "recv", peer, tag);
    detail::check_dtype(dt);
    auto w = probing(std::make_shared<detail::GlooP2PWork>(detail::p2p_desc(is_send, count, dt, peer, tag), s_->rank,
                                                           peer, timeout()));
    w->is_send = is_send;
    std::size_t bytes = count * dtype_size(dt);
    queue_.submit(w, [=, s = s_, t = timeout()] {
      if (bytes == 0) {
        w->complete_empty();  // both sides skip: nothing to match
        return;
      }
      s->guarded(w->what(), t, [&] {
        w->context = s->ctx;
        w->buffer = s->ctx->createUnboundBuffer(buf, bytes);
        auto slot = gloo::Slot::build(detail::kGlooP2PSlot, static_cast<std::uint32_t>(tag));
        if (is_send) w->buffer->send(peer, slot);
        else w->buffer->recv(peer, slot);
      });
      auto ticket = std::make_shared<SingleStageWork>("p2p completion", s->rank, t);
      s->p2p_done.submit(ticket, [w, t] { w->complete(t); });
    });
    return w;
  }

  std::shared_ptr<detail::GlooState> s_;
  int splits_ = 0;
  detail::OpQueue queue_;  // runs operations in order (Note [Async execution]); destroyed first
};

}  // namespace ptrain::dist

#endif  // PTRAIN_GLOO
