#pragma once
// CheckedCommunicator: checks that every rank calls the same collective before
// running it (PTRAIN_DISTRIBUTED_DEBUG=DETAIL, like PyTorch's
// TORCH_DISTRIBUTED_DEBUG=DETAIL).
//
// Note [Collective checks]
// A rank that breaks the collective order contract (another count, dtype, op,
// root, or another collective altogether) otherwise hangs until the timeout,
// corrupts the result, or, with Gloo, aborts the process. The wrapper first
// all-gathers a fixed-size description of the call through the wrapped
// communicator itself (a few bytes, the same size on every rank, so it cannot
// itself mismatch), compares the rows on the calling thread, and throws the
// same CommError [ptrain.comm.mismatch] on every rank when they differ, naming
// which ranks called what. The wrapped communicator stays usable. The exchange
// waits for the operations queued before it, so *_async calls stop overlapping:
// a debugging aid, not for production runs. Point-to-point calls pass through
// unchecked (they pair per peer, not in one order across the group).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ptrain/dist/communicator.hpp"

namespace ptrain::dist {

/// True when $PTRAIN_DISTRIBUTED_DEBUG asks for collective checks ("DETAIL"); false when unset, empty or "OFF".
inline bool collective_checks_from_env() {
  const char* v = std::getenv("PTRAIN_DISTRIBUTED_DEBUG");
  if (v == nullptr || *v == '\0' || std::string(v) == "OFF") return false;
  PTRAIN_CHECK(std::string(v) == "DETAIL", LaunchError, "[ptrain.comm.debug_env] PTRAIN_DISTRIBUTED_DEBUG='", v,
               "' is not OFF or DETAIL; set DETAIL to check every collective across ranks, or unset it");
  return true;
}

/// Wraps a communicator so that every collective is first checked across ranks (Note [Collective checks]).
class CheckedCommunicator final : public Communicator {
 public:
  explicit CheckedCommunicator(std::unique_ptr<Communicator> inner)
      : Communicator(inner ? inner->timeout() : std::chrono::milliseconds(0)), inner_(std::move(inner)) {
    PTRAIN_CHECK(inner_ != nullptr, CommError, "[ptrain.comm.checked] CheckedCommunicator needs a communicator");
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  void set_timeout(std::chrono::milliseconds t) override {
    Communicator::set_timeout(t);
    inner_->set_timeout(t);
  }
  /// The wrapped communicator.
  Communicator& inner() { return *inner_; }
  /// Collectives checked so far.
  std::int64_t checked() const { return seq_; }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    check(kAllReduce, count, dt, static_cast<std::int64_t>(op));
    return inner_->all_reduce_async(send, recv, count, dt, op);
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    check(kReduceScatter, recv_count, dt, static_cast<std::int64_t>(op));
    return inner_->reduce_scatter_async(send, recv, recv_count, dt, op);
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    check(kAllGather, send_count, dt);
    return inner_->all_gather_async(send, recv, send_count, dt);
  }
  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    check(kBroadcast, count, dt, 0, root);
    return inner_->broadcast_async(buf, count, dt, root);
  }
  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return inner_->send_async(buf, count, dt, peer, tag);
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return inner_->recv_async(buf, count, dt, peer, tag);
  }
  void group_start() override { inner_->group_start(); }
  void group_end() override { inner_->group_end(); }
  bool serves(Device d) const override { return inner_->serves(d); }
  std::shared_ptr<Work> barrier_async() override {
    check(kBarrier);
    return inner_->barrier_async();
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    check(kSplit);
    auto child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::make_unique<CheckedCommunicator>(std::move(child));
  }

 private:
  enum Kind : std::int64_t { kAllReduce = 1, kReduceScatter, kAllGather, kBroadcast, kBarrier, kSplit };
  static constexpr std::size_t kFields = 5;  // kind, count, dtype, reduce op, root
  using Row = std::array<std::int64_t, kFields>;

  static std::string describe(const Row& r) {
    const auto dt = static_cast<DType>(r[2]);
    const auto n = static_cast<std::size_t>(r[1]);
    const char* op = reduce_op_name(static_cast<ReduceOp>(r[3]));
    switch (r[0]) {
      case kAllReduce: return detail::op_desc("all_reduce", n, dt, op);
      case kReduceScatter: return detail::op_desc("reduce_scatter", n, dt, op);
      case kAllGather: return detail::op_desc("all_gather", n, dt);
      case kBroadcast: return detail::op_desc("broadcast", n, dt, detail::cat("root ", r[4]).c_str());
      case kBarrier: return "barrier()";
      case kSplit: return "split()";
    }
    return "?";
  }

  // Exchanges this call's row with every rank; throws [ptrain.comm.mismatch] on all of them when the rows differ.
  void check(Kind kind, std::size_t count = 0, DType dt = DType::I64, std::int64_t op = 0, std::int64_t root = 0) {
    const std::int64_t seq = ++seq_;
    const Row mine{kind, static_cast<std::int64_t>(count), static_cast<std::int64_t>(dt), op, root};
    std::vector<std::int64_t> all(kFields * static_cast<std::size_t>(size()));
    try {
      inner_->all_gather_async(mine.data(), all.data(), kFields, DType::I64)->wait(timeout());
    } catch (const CommError& e) {
      PTRAIN_THROW(CommError, e.what(), " (while checking collective #", seq, ", ", describe(mine),
                   ", across ranks)");
    }
    auto row_of = [&](int r) {
      Row out;
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(kFields) * r, kFields, out.begin());
      return out;
    };
    bool same = true;
    for (int r = 0; r < size(); ++r) same = same && row_of(r) == mine;
    if (same) return;
    // Ranks grouped by the call they made, in order of their first rank.
    std::vector<Row> calls;
    std::vector<std::string> ranks;
    for (int r = 0; r < size(); ++r) {
      const Row row = row_of(r);
      const auto it = std::find(calls.begin(), calls.end(), row);
      const std::size_t i = static_cast<std::size_t>(it - calls.begin());
      if (it == calls.end()) {
        calls.push_back(row);
        ranks.emplace_back();
      }
      ranks[i] += ranks[i].empty() ? detail::cat(r) : detail::cat(",", r);
    }
    std::string table;
    for (std::size_t i = 0; i < calls.size(); ++i)
      table += detail::cat(i ? "; " : "", ranks[i].find(',') == std::string::npos ? "rank " : "ranks ", ranks[i],
                           ": ", describe(calls[i]));
    PTRAIN_THROW(CommError, "[ptrain.comm.mismatch] collective #", seq, " differs across the ", size(),
                 " ranks (seen on rank ", rank(), "): ", table,
                 ". Every rank must call the same collectives in the same order with the same count, dtype, op "
                 "and root (Note [Collective order contract]); the call was not run and the communicator is "
                 "still usable");
  }

  std::unique_ptr<Communicator> inner_;
  std::int64_t seq_ = 0;
};

}  // namespace ptrain::dist
