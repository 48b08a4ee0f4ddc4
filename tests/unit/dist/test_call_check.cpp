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
