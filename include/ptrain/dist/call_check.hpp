#pragma once
// What a rank says about the collective it is about to run (detail::CallRow),
// how a disagreement is reported ([ptrain.comm.mismatch]), and the default
// check that MPI and Gloo communicators run before every collective
// (detail::CallCheck, Note [Collective fingerprints]). CheckedCommunicator
// (dist/checked.hpp) is the full check of PTRAIN_DISTRIBUTED_DEBUG=DETAIL.
//
// Note [Collective fingerprints]
// Ranks that break the collective order contract (Note [Collective order
// contract]: another operation, count, dtype, op or root, or the calls in
// another order) would hand MPI or Gloo buffers of different sizes: Open MPI
// then reads past a buffer and dies of SIGSEGV, Gloo aborts the process from its
// I/O thread. So, by default, each MPI or Gloo collective is preceded on the
// thread that runs it (the communicator's worker, Note [Async execution], or for
// MPI's blocking all-to-alls the caller's, Note [Inline blocking calls]) by one
// 24-byte all-reduce of three 64-bit integers: a hash h of the call and its
// complement ~h, both reduced by max (one max yields both the largest and the
// smallest h), and a split checksum reduced by wrapping sum, all in one
// user-defined reduction (reduce_check_triples). When the largest and smallest
// h equal this rank's, every rank called the same thing. Otherwise every rank
// learns it from the same exchange, all-gathers the calls themselves (five
// integers per rank; this exchange has the same size everywhere, so it cannot
// mismatch), and fails the operation with [ptrain.comm.mismatch] naming what
// each rank called; the mismatched collective never starts and the communicator
// is aborted (Note [Failure]). The exchange runs with the collective, so *_async
// calls still overlap with the caller's work; its cost is one small-message
// latency per collective (docs/communicators.md has the measurements). A rank
// that never reaches a collective (it left its loop, it waits in a point-to-point
// call) still surfaces as the timeout of Note [Failure]. An all_to_all_v's row
// holds its dtype only, since its split sizes differ by rank; its third integer is
// this rank's split_checksum(), whose sum over the ranks is zero when each rank
// i's send_counts[j] equals rank j's recv_counts[i] (every other collective puts
// 0 there). When the rows agree and that sum is not zero (Open MPI would fail
// the receiver alone with MPI_ERR_TRUNCATE or silently leave a block short, Gloo
// aborts the process), every rank all-gathers the counts and fails with
// [ptrain.comm.mismatch] naming the pairs that differ. (Until 2026-11-29 the
// checksum took a second exchange, one more small-message latency per
// all_to_all_v: a Gloo round trip, about 1.3 us on MPI here.)
// NCCL is not covered (its collectives are enqueued on a GPU stream; use
// DETAIL), nor are send and recv.
// PTRAIN_DISTRIBUTED_DEBUG=OFF turns the check off.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"

namespace ptrain::dist {

/// What $PTRAIN_DISTRIBUTED_DEBUG asks for: Off ("OFF"), Fingerprint (unset or
/// empty: Note [Collective fingerprints]) or Detail ("DETAIL": CheckedCommunicator as well).
enum class CollectiveChecks { Off, Fingerprint, Detail };

inline CollectiveChecks collective_checks_mode() {
  const char* v = std::getenv("PTRAIN_DISTRIBUTED_DEBUG");
  if (v == nullptr || *v == '\0') return CollectiveChecks::Fingerprint;
  const std::string s(v);
  if (s == "OFF") return CollectiveChecks::Off;
  PTRAIN_CHECK(s == "DETAIL", LaunchError, "[ptrain.comm.debug_env] PTRAIN_DISTRIBUTED_DEBUG='", v,
               "' is not OFF or DETAIL; set DETAIL to check every collective across ranks, OFF to skip even the "
               "default fingerprint check, or unset it");
  return CollectiveChecks::Detail;
}

namespace detail {

using ::ptrain::detail::cat;

enum CallKind : std::int64_t {
  kAllReduce = 1, kReduceScatter, kAllGather, kBroadcast, kBarrier, kSplit, kAllToAll, kAllToAllV
};
/// kind, count, dtype, reduce op, root: the same on every rank for a correct program.
/// all_to_all's count is per rank; all_to_all_v's is 0 (its split sizes differ by rank and
/// are checked pairwise after the row: CallCheck::check_split, CheckedCommunicator).
using CallRow = std::array<std::int64_t, 5>;

inline CallRow call_row(CallKind kind, std::size_t count = 0, DType dt = DType::I64, std::int64_t op = 0,
                        std::int64_t root = 0) {
  return {kind, static_cast<std::int64_t>(count), static_cast<std::int64_t>(dt), op, root};
}

// "all_reduce(F32 x 1000, sum)": how operations are named in errors.
inline std::string op_desc(const char* op, std::size_t count, DType dt, const char* extra = nullptr) {
  return cat(op, "(", dtype_name(dt), " x ", count, extra ? ", " : "", extra ? extra : "", ")");
}

// "all_to_all(F32 x 8 per rank)".
// Built without a stream: an ostringstream took 0.5 us of a blocking call's 0.7 us of
// overhead (Note [Inline blocking calls]).
inline std::string all_to_all_desc(std::size_t count_per_rank, DType dt) {
  return std::string("all_to_all(") + dtype_name(dt) + " x " + std::to_string(count_per_rank) + " per rank)";
}

inline std::string describe_call(const CallRow& r) {
  static const char* const kOps[] = {"sum", "avg", "min", "max"};  // ReduceOp's order
  const auto dt = static_cast<DType>(r[2]);
  const auto n = static_cast<std::size_t>(r[1]);
  const char* op = r[3] >= 0 && r[3] < 4 ? kOps[r[3]] : "?";
  switch (r[0]) {
    case kAllReduce: return op_desc("all_reduce", n, dt, op);
    case kReduceScatter: return op_desc("reduce_scatter", n, dt, op);
    case kAllGather: return op_desc("all_gather", n, dt);
    case kBroadcast: return op_desc("broadcast", n, dt, cat("root ", r[4]).c_str());
    case kBarrier: return "barrier()";
    case kSplit: return "split()";
    case kAllToAll: return all_to_all_desc(n, dt);
    case kAllToAllV: return cat("all_to_all_v(", dtype_name(dt), ")");
  }
  return "?";
}

/// The [ptrain.comm.mismatch] message for collective #seq, from every rank's row
/// (size() rows of 5 in `all`): ranks grouped by the call they made. `after` says
/// what became of the call and the communicator.
inline std::string mismatch_message(std::int64_t seq, int rank, int size, const std::vector<std::int64_t>& all,
                                    const char* after) {
  auto row_of = [&](int r) {
    CallRow out;
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = all[out.size() * static_cast<std::size_t>(r) + i];
    return out;
  };
  std::vector<CallRow> calls;
  std::vector<std::string> ranks;
  for (int r = 0; r < size; ++r) {
    const CallRow row = row_of(r);
    std::size_t i = 0;
    while (i < calls.size() && calls[i] != row) ++i;
    if (i == calls.size()) {
      calls.push_back(row);
      ranks.emplace_back();
    }
    ranks[i] += ranks[i].empty() ? cat(r) : cat(",", r);
  }
  std::string table;
  for (std::size_t i = 0; i < calls.size(); ++i)
    table += cat(i ? "; " : "", ranks[i].find(',') == std::string::npos ? "rank " : "ranks ", ranks[i], ": ",
                 describe_call(calls[i]));
  return cat("[ptrain.comm.mismatch] collective #", seq, " differs across the ", size, " ranks (seen on rank ", rank,
             "): ", table,
             ". Every rank must call the same collectives in the same order with the same count, dtype, op and "
             "root (Note [Collective order contract]); ",
             after);
}

/// The split-size checksum of an all_to_all_v on `rank` (Note [Collective fingerprints]):
/// summed over the ranks (wrapping), zero when every rank i's send_counts[j] equals rank
/// j's recv_counts[i], and almost surely not otherwise.
inline std::uint64_t split_checksum(int rank, const std::vector<std::size_t>& send_counts,
                                    const std::vector<std::size_t>& recv_counts) {
  auto mix = [](std::uint64_t x) {  // splitmix64's finaliser
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  auto term = [&](std::size_t from, std::size_t to, std::size_t count) { return mix(mix(mix(from) ^ to) ^ count); };
  std::uint64_t sum = 0;
  const auto me = static_cast<std::size_t>(rank);
  for (std::size_t j = 0; j < send_counts.size(); ++j) sum += term(me, j, send_counts[j]) - term(j, me, recv_counts[j]);
  return sum;
}

/// The [ptrain.comm.mismatch] message of all_to_all_v #seq whose split sizes differ, from
/// every rank's send and then recv counts (2 n I64 per rank in `all`); "" when they match.
inline std::string split_mismatch_message(std::int64_t seq, std::size_t n, DType dt,
                                          const std::vector<std::int64_t>& all, const char* after) {
  std::string pairs;
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t sent = all[2 * n * i + j], expected = all[2 * n * j + n + i];
      if (sent != expected && ++wrong <= 4)
        pairs += cat(wrong > 1 ? "; " : "", "rank ", i, " sends ", sent, " elements to rank ", j, ", which expects ",
                     expected);
    }
  if (wrong == 0) return {};
  return cat("[ptrain.comm.mismatch] collective #", seq, " all_to_all_v(", dtype_name(dt),
             "): the split sizes do not match across the ", n, " ranks: ", pairs,
             wrong > 4 ? cat(" (and ", wrong - 4, " more pairs)") : std::string(),
             ". Rank i's send_counts[j] must equal rank j's recv_counts[i] (Note [All-to-all layout]; "
             "exchange_counts() computes recv_counts from the senders' counts); ", after);
}

/// CallCheck::check's reduction over `n` triples of I64: out = (max, max, wrapping sum)
/// of a and b, element by element (out may alias a or b).
inline void reduce_check_triples(std::int64_t* out, const std::int64_t* a, const std::int64_t* b, std::size_t n) {
  for (std::size_t i = 0; i < 3 * n; i += 3) {
    out[i] = std::max(a[i], b[i]);
    out[i + 1] = std::max(a[i + 1], b[i + 1]);
    out[i + 2] = static_cast<std::int64_t>(static_cast<std::uint64_t>(a[i + 2]) + static_cast<std::uint64_t>(b[i + 2]));
  }
}

/// The default check of Note [Collective fingerprints], one per communicator;
/// check() runs before each collective, on the thread that runs it.
class CallCheck {
  static constexpr const char* kAborted =
      "the call was not run, and the communicator is aborted (Note [Failure]). Find the branch that differs between "
      "ranks (a batch size, an epoch length, a condition on the rank)";

 public:
  explicit CallCheck(bool on = collective_checks_mode() != CollectiveChecks::Off) : on_(on) {}
  bool on() const { return on_; }

  /// The check before a collective, `mine` its row: for an all_to_all_v (`send_counts` and
  /// `recv_counts` non-null) its split sizes as well. reduce3(v): all-reduce three I64 in place
  /// across the group by reduce_check_triples; gather(mine, n, all): all-gather n I64 per rank.
  /// Throws [ptrain.comm.mismatch] on every rank when the calls or the split sizes differ.
  template <class Reduce3, class Gather>
  void check(const CallRow& mine, int rank, int size, const std::vector<std::size_t>* send_counts,
             const std::vector<std::size_t>* recv_counts, Reduce3&& reduce3, Gather&& gather) {
    const std::int64_t seq = ++seq_;
    if (!on_ || size == 1) return;
    const std::int64_t h = fingerprint(mine);
    const std::uint64_t split = send_counts ? split_checksum(rank, *send_counts, *recv_counts) : 0;
    std::int64_t v[3] = {h, ~h, static_cast<std::int64_t>(split)};
    reduce3(v);
    if (v[0] != h || v[1] != ~h) calls_differ(seq, mine, rank, size, gather);
    if (send_counts && v[2] != 0) splits_differ(size, *send_counts, *recv_counts, static_cast<DType>(mine[2]), gather);
  }

 private:
  // FNV-1a over the row's bytes.
  static std::int64_t fingerprint(const CallRow& row) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (std::int64_t f : row)
      for (int b = 0; b < 8; ++b) h = (h ^ ((static_cast<std::uint64_t>(f) >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    return static_cast<std::int64_t>(h);
  }

  // The exchange disagreed: every rank gathers the calls (five I64 each) and throws.
  template <class Gather>
  [[noreturn]] void calls_differ(std::int64_t seq, const CallRow& mine, int rank, int size, Gather& gather) {
    std::vector<std::int64_t> all(mine.size() * static_cast<std::size_t>(size));
    gather(mine.data(), mine.size(), all.data());
    PTRAIN_THROW(CommError, mismatch_message(seq, rank, size, all, kAborted));
  }
  template <class Gather>
  [[noreturn]] void splits_differ(int size, const std::vector<std::size_t>& send_counts,
                                  const std::vector<std::size_t>& recv_counts, DType dt, Gather& gather) {
    const auto n = static_cast<std::size_t>(size);
    std::vector<std::int64_t> mine(send_counts.begin(), send_counts.end()), all(2 * n * n);
    mine.insert(mine.end(), recv_counts.begin(), recv_counts.end());
    gather(mine.data(), mine.size(), all.data());
    PTRAIN_THROW(CommError, split_mismatch_message(seq_, n, dt, all, kAborted));
  }

  bool on_;
  std::int64_t seq_ = 0;  // collectives seen (by the thread running them, one at a time)
};

}  // namespace detail

}  // namespace ptrain::dist
