// The default check of Note [Collective fingerprints]: ranks that call
// different collectives (another count, dtype, operation, or the same calls in
// another order) all fail with [ptrain.comm.mismatch] naming what each side
// called, instead of crashing inside MPI (SIGSEGV) or Gloo (abort); nothing
// runs, and the communicator is aborted. Each case uses a fresh split of the
// plain (unwrapped) world, so it also runs under PTRAIN_DISTRIBUTED_DEBUG=DETAIL.

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "comm_util.hpp"

namespace test_mismatch {

using namespace comm_test;
using Catch::Contains;

namespace {

// A new group over the whole world, without the DETAIL wrapper.
std::unique_ptr<Communicator> fresh_group() {
  Communicator& w = world();
  auto* checked = dynamic_cast<CheckedCommunicator*>(&w);
  Communicator& base = checked ? checked->inner() : w;
  return base.split(0, base.rank());
}

// "rank 0: A; rank 1: B" (2 ranks) or "rank 0: A; ranks 1,2: B": the table of a rank-0-differs mismatch.
std::string table(int size, const std::string& rank0, const std::string& others) {
  std::string rest;
  for (int r = 1; r < size; ++r) rest += (r > 1 ? "," : "") + std::to_string(r);
  return "rank 0: " + rank0 + (size > 2 ? "; ranks " : "; rank ") + rest + ": " + others;
}

}  // namespace

TEST_CASE("comm: mismatched collectives fail on every rank with both calls named", "[dist][comm][mismatch]") {
  const int P = world().size(), r = world().rank();
  if (P == 1 || world().backend() == "nccl") return;  // a group of one cannot disagree; NCCL: DETAIL only
  const std::size_t n = 9;

  SECTION("another count: nothing runs, later calls fail fast") {
    auto g = fresh_group();
    std::vector<float> ones(n + 1, 1.0f);
    CHECK_THROWS_WITH(g->all_reduce(ones.data(), r == 0 ? n + 1 : n, DType::F32, ReduceOp::Sum),
                      Contains("[ptrain.comm.mismatch] collective #1") &&
                          Contains(table(P, "all_reduce(F32 x 10, sum)", "all_reduce(F32 x 9, sum)")) &&
                          Contains("communicator is aborted"));
    CHECK(std::count(ones.begin(), ones.end(), 1.0f) == static_cast<std::ptrdiff_t>(n + 1));
    CHECK_THROWS_WITH(g->barrier(), Contains("[ptrain.comm.aborted]") && Contains("[ptrain.comm.mismatch]"));
  }
  SECTION("another dtype") {
    auto g = fresh_group();
    std::vector<double> buf(n, 1.0);
    CHECK_THROWS_WITH(g->all_reduce(buf.data(), r == 0 ? n : 2 * n, r == 0 ? DType::F64 : DType::F32, ReduceOp::Sum),
                      Contains(table(P, "all_reduce(F64 x 9, sum)", "all_reduce(F32 x 18, sum)")));
  }
  SECTION("another operation: one rank left its loop for a barrier (issue 35's --batch case)") {
    auto g = fresh_group();
    std::vector<float> grads(1000, 1.0f);
    if (r == 0) {
      CHECK_THROWS_WITH(g->barrier(), Contains(table(P, "barrier()", "all_reduce(F32 x 1000, avg)")));
    } else {
      CHECK_THROWS_WITH(g->all_reduce(grads.data(), grads.size(), DType::F32, ReduceOp::Avg),
                        Contains(table(P, "barrier()", "all_reduce(F32 x 1000, avg)")));
    }
  }
  SECTION("the same calls in another order, asynchronously; a reduce op and a root") {
    auto g = fresh_group();
    std::vector<float> a(n, 1.0f), b(4, 2.0f);
    std::shared_ptr<Work> first, second;
    if (r == 0) {
      first = g->broadcast_async(b.data(), b.size(), DType::F32, 0);
      second = g->all_reduce_async(a.data(), a.data(), n, DType::F32, ReduceOp::Max);
    } else {
      first = g->all_reduce_async(a.data(), a.data(), n, DType::F32, ReduceOp::Max);
      second = g->broadcast_async(b.data(), b.size(), DType::F32, 0);
    }
    CHECK_THROWS_WITH(first->wait(), Contains(table(P, "broadcast(F32 x 4, root 0)", "all_reduce(F32 x 9, max)")));
    CHECK_THROWS_WITH(second->wait(), Contains("[ptrain.comm.aborted]"));
  }
  SECTION("another reduce op, another root") {
    auto g = fresh_group();
    std::vector<float> a(n, 1.0f);
    CHECK_THROWS_WITH(g->all_reduce(a.data(), n, DType::F32, r == 0 ? ReduceOp::Min : ReduceOp::Sum),
                      Contains(table(P, "all_reduce(F32 x 9, min)", "all_reduce(F32 x 9, sum)")));
    auto h = fresh_group();
    CHECK_THROWS_WITH(h->broadcast(a.data(), n, DType::F32, r == 0 ? 0 : P - 1),
                      Contains(table(P, "broadcast(F32 x 9, root 0)", "broadcast(F32 x 9, root " +
                                                                          std::to_string(P - 1) + ")")));
  }
  SECTION("calls that agree run as before, counted from 1 in each group") {
    auto g = fresh_group();
    std::vector<std::int64_t> v{r + 1};
    g->all_reduce(v.data(), 1, DType::I64, ReduceOp::Sum);
    CHECK(v[0] == static_cast<std::int64_t>(P) * (P + 1) / 2);
    std::vector<float> x(n, 0.0f);
    CHECK_THROWS_WITH(g->all_reduce(x.data(), r == 0 ? 1 : n, DType::F32, ReduceOp::Sum),
                      Contains("collective #2"));
  }
  world().barrier();
}

}  // namespace test_mismatch
