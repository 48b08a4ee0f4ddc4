// The all_to_all_v split-size check of Note [Collective fingerprints] on one
// process: the checksums of n simulated ranks sum to zero exactly when every
// rank i's send_counts[j] equals rank j's recv_counts[i], and the message names
// the pairs that differ. tests/dist/comm/test_all_to_all.cpp runs it on real ranks.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "ptrain/dist/call_check.hpp"

namespace test_call_check {

using namespace ptrain;
using namespace ptrain::dist::detail;

namespace {

// Rank i sends m[i][j] elements to rank j; recv[j][i] is what rank j expects from rank i.
std::uint64_t total(const std::vector<std::vector<std::size_t>>& send, const std::vector<std::vector<std::size_t>>& recv) {
  std::uint64_t sum = 0;
  for (std::size_t r = 0; r < send.size(); ++r) sum += split_checksum(static_cast<int>(r), send[r], recv[r]);
  return sum;
}

std::vector<std::vector<std::size_t>> transpose(const std::vector<std::vector<std::size_t>>& m) {
  std::vector<std::vector<std::size_t>> t(m.size(), std::vector<std::size_t>(m.size()));
  for (std::size_t i = 0; i < m.size(); ++i)
    for (std::size_t j = 0; j < m.size(); ++j) t[j][i] = m[i][j];
  return t;
}

}  // namespace

TEST_CASE("split checksum: zero for matching sizes, not for any single wrong count", "[dist][call_check]") {
  for (std::size_t n : {1, 2, 3, 5}) {
    std::vector<std::vector<std::size_t>> send(n, std::vector<std::size_t>(n));
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) send[i][j] = (i * 7 + j * 3) % 5;  // zeros included
    const auto recv = transpose(send);
    INFO("n=" << n);
    CHECK(total(send, recv) == 0);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j)
        for (std::size_t delta : {1, 2, 1000}) {
          auto wrong = recv;
          wrong[j][i] += delta;
          CHECK(total(send, wrong) != 0);
        }
    // Two ranks' blocks swapped: the same totals, still caught.
    if (n >= 2 && send[0][1] != send[1][0]) {
      auto swapped = recv;
      std::swap(swapped[1][0], swapped[0][1]);
      CHECK(total(send, swapped) != 0);
    }
  }
}

TEST_CASE("split mismatch message names the pairs, and is empty when they match", "[dist][call_check]") {
  // 2 ranks: rank 0 sends {2, 3}, expects {2, 2}; rank 1 sends {2, 2}, expects {2, 2}.
  const std::vector<std::int64_t> all{2, 3, 2, 2, 2, 2, 2, 2};
  const std::string m = split_mismatch_message(7, 2, DType::BF16, all, "after");
  CHECK(m == "[ptrain.comm.mismatch] collective #7 all_to_all_v(BF16): the split sizes do not match across the 2 "
             "ranks: rank 0 sends 3 elements to rank 1, which expects 2. Rank i's send_counts[j] must equal rank j's "
             "recv_counts[i] (Note [All-to-all layout]; exchange_counts() computes recv_counts from the senders' "
             "counts); after");
  CHECK(split_mismatch_message(7, 2, DType::BF16, {2, 2, 2, 2, 2, 2, 2, 2}, "after").empty());
  CHECK(describe_call(call_row(kAllToAll, 8, DType::F32)) == "all_to_all(F32 x 8 per rank)");
  CHECK(describe_call(call_row(kAllToAllV, 0, DType::I64)) == "all_to_all_v(I64)");
}

}  // namespace test_call_check

namespace test_call_check {

TEST_CASE("check exchange reduction: max, max and a wrapping sum per triple", "[dist][call_check]") {
  const std::int64_t big = static_cast<std::int64_t>(0x7fffffffffffffffull);
  std::vector<std::int64_t> a{5, -3, big, 1, 2, 3}, b{7, -9, 2, 0, 2, -5};
  reduce_check_triples(b.data(), a.data(), b.data(), 2);  // out aliases b, as MPI's in/inout
  const std::int64_t wrapped = static_cast<std::int64_t>(0x7fffffffffffffffull + 2ull);  // big + 2 wraps around
  CHECK(b == std::vector<std::int64_t>{7, -3, wrapped, 1, 2, -2});
}

namespace {

// CallCheck::check on `n` simulated ranks: ranks[r] calls `rows[r]` with split sizes
// send[r] / recv[r] (empty: not an all_to_all_v). The exchange is played on one process:
// a first pass records what each rank contributes, the second hands every rank the
// element-wise (max, max, sum) over them and the rows or counts it gathers. Returns each
// rank's error message, "" where the call would have run.
std::vector<std::string> run_checks(const std::vector<CallRow>& rows, const std::vector<std::vector<std::size_t>>& send,
                                    const std::vector<std::vector<std::size_t>>& recv) {
  const int n = static_cast<int>(rows.size());
  auto counts = [&](int r, const std::vector<std::vector<std::size_t>>& c) {
    return c[static_cast<std::size_t>(r)].empty() ? nullptr : &c[static_cast<std::size_t>(r)];
  };
  struct Recorded {};
  std::vector<std::int64_t> contributed;
  for (int r = 0; r < n; ++r) {
    CallCheck check(true);
    try {
      check.check(rows[static_cast<std::size_t>(r)], r, n, counts(r, send), counts(r, recv), [&](std::int64_t* v) {
        contributed.insert(contributed.end(), v, v + 3);
        throw Recorded{};
      }, [](const std::int64_t*, std::size_t, std::int64_t*) {});
    } catch (const Recorded&) {
    }
  }
  // The reference reduction, written out.
  std::int64_t max0 = contributed[0], max1 = contributed[1];
  std::uint64_t sum = 0;
  for (int r = 0; r < n; ++r) {
    max0 = std::max(max0, contributed[3 * static_cast<std::size_t>(r)]);
    max1 = std::max(max1, contributed[3 * static_cast<std::size_t>(r) + 1]);
    sum += static_cast<std::uint64_t>(contributed[3 * static_cast<std::size_t>(r) + 2]);
  }
  std::vector<std::string> errors;
  for (int r = 0; r < n; ++r) {
    CallCheck check(true);
    try {
      check.check(
          rows[static_cast<std::size_t>(r)], r, n, counts(r, send), counts(r, recv),
          [&](std::int64_t* v) {
            v[0] = max0;
            v[1] = max1;
            v[2] = static_cast<std::int64_t>(sum);
          },
          [&](const std::int64_t*, std::size_t k, std::int64_t* all) {
            for (int q = 0; q < n; ++q) {
              std::vector<std::int64_t> theirs(rows[static_cast<std::size_t>(q)].begin(),
                                               rows[static_cast<std::size_t>(q)].end());
              if (k != theirs.size()) {  // the split sizes: send counts, then recv counts
                theirs.assign(send[static_cast<std::size_t>(q)].begin(), send[static_cast<std::size_t>(q)].end());
                theirs.insert(theirs.end(), recv[static_cast<std::size_t>(q)].begin(),
                              recv[static_cast<std::size_t>(q)].end());
              }
              std::copy(theirs.begin(), theirs.end(), all + k * static_cast<std::size_t>(q));
            }
          });
      errors.emplace_back();
    } catch (const CommError& e) {
      errors.emplace_back(e.what());
    }
  }
  return errors;
}

}  // namespace

TEST_CASE("collective check: every rank runs or every rank fails, from one exchange", "[dist][call_check]") {
  const CallRow a2a = call_row(kAllToAll, 8, DType::F32), reduce = call_row(kAllReduce, 8, DType::F32);
  const CallRow a2av = call_row(kAllToAllV, 0, DType::F32);
  const std::vector<std::vector<std::size_t>> none(3);
  SECTION("the same call everywhere runs") {
    for (const auto& e : run_checks({a2a, a2a, a2a}, none, none)) CHECK(e.empty());
  }
  SECTION("another count on one rank fails on every rank, naming both calls") {
    const CallRow other = call_row(kAllToAll, 9, DType::F32);
    for (const auto& e : run_checks({a2a, other, a2a}, none, none)) {
      CHECK(e.find("[ptrain.comm.mismatch] collective #1 differs across the 3 ranks") != std::string::npos);
      CHECK(e.find("ranks 0,2: all_to_all(F32 x 8 per rank); rank 1: all_to_all(F32 x 9 per rank)") !=
            std::string::npos);
    }
  }
  // Rank r sends (r + j) % 3 elements to rank j.
  std::vector<std::vector<std::size_t>> send(3, std::vector<std::size_t>(3)), recv = send;
  for (std::size_t r = 0; r < 3; ++r)
    for (std::size_t j = 0; j < 3; ++j) send[r][j] = recv[j][r] = (r + j) % 3;
  SECTION("all_to_all_v with matching split sizes runs") {
    for (const auto& e : run_checks({a2av, a2av, a2av}, send, recv)) CHECK(e.empty());
  }
  SECTION("all_to_all_v with one count off fails on every rank, naming the pair") {
    recv[2][1] += 1;
    for (const auto& e : run_checks({a2av, a2av, a2av}, send, recv))
      CHECK(e.find("rank 1 sends 0 elements to rank 2, which expects 1") != std::string::npos);
  }
  SECTION("all_to_all_v against another collective: the calls are named, not the sizes") {
    std::vector<std::vector<std::size_t>> s = send, v = recv;
    s[1].clear();
    v[1].clear();
    for (const auto& e : run_checks({a2av, reduce, a2av}, s, v))
      CHECK(e.find("ranks 0,2: all_to_all_v(F32); rank 1: all_reduce(F32 x 8, sum)") != std::string::npos);
  }
}

}  // namespace test_call_check
