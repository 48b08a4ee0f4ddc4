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
// unchecked (they pair per peer, not in one order across the group). Without
// DETAIL, MPI and Gloo communicators still run the cheaper check of Note
// [Collective fingerprints] (dist/call_check.hpp), which aborts the
// communicator on a mismatch; this wrapper also covers NCCL and leaves the
// communicator usable. For all_to_all_v, whose split sizes differ by rank, the
// rows hold the dtype only, and a second all-gather of every rank's send and
// recv counts checks them pairwise (rank i's send_counts[j] against rank j's
// recv_counts[i]).

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ptrain/dist/call_check.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/forwarding_communicator.hpp"

namespace ptrain::dist {

/// True when $PTRAIN_DISTRIBUTED_DEBUG is DETAIL (collective_checks_mode()).
inline bool collective_checks_from_env() { return collective_checks_mode() == CollectiveChecks::Detail; }

/// Wraps a communicator so that every collective is first checked across ranks (Note [Collective checks]).
class CheckedCommunicator final : public ForwardingCommunicator {
 public:
  explicit CheckedCommunicator(std::unique_ptr<Communicator> inner) : ForwardingCommunicator(std::move(inner)) {
    PTRAIN_CHECK(inner_ != nullptr, CommError, "[ptrain.comm.checked] CheckedCommunicator needs a communicator");
  }

  /// Collectives checked so far.
  std::int64_t checked() const { return seq_; }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    check(detail::call_row(detail::kAllReduce, count, dt, static_cast<std::int64_t>(op)));
    return inner_->all_reduce_async(send, recv, count, dt, op);
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    check(detail::call_row(detail::kReduceScatter, recv_count, dt, static_cast<std::int64_t>(op)));
    return inner_->reduce_scatter_async(send, recv, recv_count, dt, op);
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    check(detail::call_row(detail::kAllGather, send_count, dt));
    return inner_->all_gather_async(send, recv, send_count, dt);
  }
  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    check(detail::call_row(detail::kBroadcast, count, dt, 0, root));
    return inner_->broadcast_async(buf, count, dt, root);
  }
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    check(detail::call_row(detail::kAllToAll, count_per_rank, dt));
    return inner_->all_to_all_async(send, recv, count_per_rank, dt);
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    check(detail::call_row(detail::kAllToAllV, 0, dt));
    check_split_sizes(detail::AllToAllLayout(send_counts, recv_counts, size()), dt);
    return inner_->all_to_all_v_async(send, send_counts, recv, recv_counts, dt);
  }
  std::shared_ptr<Work> barrier_async() override {
    check(detail::call_row(detail::kBarrier));
    return inner_->barrier_async();
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    check(detail::call_row(detail::kSplit));
    auto child = inner_->split(color, key);
    if (!child) return nullptr;
    return std::make_unique<CheckedCommunicator>(std::move(child));
  }

 private:
  // Exchanges this call's row with every rank; throws [ptrain.comm.mismatch] on all of them when the rows differ.
  void check(const detail::CallRow& mine) {
    const std::int64_t seq = ++seq_;
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size()));
    try {
      inner_->all_gather_async(mine.data(), all.data(), mine.size(), DType::I64)->wait(timeout());
    } catch (const CommError& e) {
      PTRAIN_THROW(CommError, e.what(), " (while checking collective #", seq, ", ", detail::describe_call(mine),
                   ", across ranks)");
    }
    for (int r = 0; r < size(); ++r)
      if (!std::equal(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()) * r))
        PTRAIN_THROW(CommError, detail::mismatch_message(seq, rank(), size(), all,
                                                         "the call was not run and the communicator is still usable"));
  }

  // all_to_all_v, once check() passed: every rank's send and recv counts (2 size() I64
  // per rank, so the exchange has one size everywhere) all-gathered and compared pairwise.
  void check_split_sizes(const detail::AllToAllLayout& l, DType dt) {
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::int64_t> mine(l.send_counts.begin(), l.send_counts.end()), all(2 * n * n);
    mine.insert(mine.end(), l.recv_counts.begin(), l.recv_counts.end());
    inner_->all_gather_async(mine.data(), all.data(), 2 * n, DType::I64)->wait(timeout());
    const std::string message = detail::split_mismatch_message(
        seq_, n, dt, all, "the call was not run and the communicator is still usable");
    if (!message.empty()) PTRAIN_THROW(CommError, message);
  }

  std::int64_t seq_ = 0;
};

}  // namespace ptrain::dist
