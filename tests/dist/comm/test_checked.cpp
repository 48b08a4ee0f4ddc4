// CheckedCommunicator (PTRAIN_DISTRIBUTED_DEBUG=DETAIL): calls that agree give
// the plain communicator's results; a call that differs on one rank throws the
// same [ptrain.comm.mismatch] on every rank, runs nothing, and leaves the group
// usable. CTest also runs the whole suite with PTRAIN_DISTRIBUTED_DEBUG=DETAIL.

#include <algorithm>
#include <cstdlib>
#include <string>

#include "comm_util.hpp"

namespace test_checked {

using namespace comm_test;
using Catch::Contains;

TEST_CASE("comm: PTRAIN_DISTRIBUTED_DEBUG wraps the world when DETAIL, and is refused when unknown", "[dist][comm]") {
  const char* v = std::getenv("PTRAIN_DISTRIBUTED_DEBUG");
  const bool detail = v != nullptr && std::string(v) == "DETAIL";
  CHECK((dynamic_cast<CheckedCommunicator*>(&world()) != nullptr) == detail);
  const std::string saved = v ? v : "";
  ::setenv("PTRAIN_DISTRIBUTED_DEBUG", "detail", 1);
  CHECK_THROWS_WITH(collective_checks_from_env(), Contains("[ptrain.comm.debug_env]") && Contains("OFF or DETAIL"));
  ::setenv("PTRAIN_DISTRIBUTED_DEBUG", "OFF", 1);
  CHECK_FALSE(collective_checks_from_env());
  if (v) ::setenv("PTRAIN_DISTRIBUTED_DEBUG", saved.c_str(), 1);
  else ::unsetenv("PTRAIN_DISTRIBUTED_DEBUG");
}

TEST_CASE("comm: checked collectives give the plain results and name the rank whose call differs", "[dist][comm]") {
  Communicator& w = world();
  const int P = w.size(), r = w.rank();
  CheckedCommunicator c(w.split(0, r));
  CHECK(c.backend() == w.backend());
  CHECK(c.rank() == r);
  CHECK(c.size() == P);

  const std::size_t n = 9;
  auto fresh = [&] {
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(input(r, i));
    return x;
  };
  auto summed = [&](const std::vector<float>& x) {
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (x[i] != reference(DType::F32, ReduceOp::Sum, column(P, i))) ++wrong;
    return wrong;
  };
  std::vector<float> x = fresh();
  c.all_reduce(x.data(), n, DType::F32, ReduceOp::Sum);
  CHECK(summed(x) == 0);
  std::vector<float> gathered(n * P, -1.0f);
  x = fresh();
  c.all_gather_async(x.data(), gathered.data(), n, DType::F32)->wait();
  std::size_t wrong = 0;
  for (int q = 0; q < P; ++q)
    for (std::size_t i = 0; i < n; ++i)
      if (gathered[q * n + i] != static_cast<float>(input(q, i))) ++wrong;
  CHECK(wrong == 0);
  x = fresh();
  c.broadcast(x.data(), n, DType::F32, P - 1);
  wrong = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (x[i] != static_cast<float>(input(P - 1, i))) ++wrong;
  CHECK(wrong == 0);
  c.barrier();
  CHECK(c.checked() == 4);

  if (P > 1) {
    // The last rank passes one element more.
    std::vector<float> ones(n + 1, 1.0f);
    const std::size_t count = r == P - 1 ? n + 1 : n;
    CHECK_THROWS_WITH(c.all_reduce(ones.data(), count, DType::F32, ReduceOp::Sum),
                      Contains("[ptrain.comm.mismatch] collective #5") && Contains("all_reduce(F32 x 9, sum)") &&
                          Contains("rank " + std::to_string(P - 1) + ": all_reduce(F32 x 10, sum)") &&
                          Contains("still usable"));
    CHECK(std::count(ones.begin(), ones.end(), 1.0f) == static_cast<std::ptrdiff_t>(n + 1));  // nothing ran
    // Rank 0 calls another collective; then another root.
    const auto other = Contains("rank 0: broadcast(F32 x 9, root 0)");
    if (r == 0) CHECK_THROWS_WITH(c.broadcast(ones.data(), n, DType::F32, 0), other);
    else CHECK_THROWS_WITH(c.all_reduce(ones.data(), n, DType::F32, ReduceOp::Sum), other);
    CHECK_THROWS_WITH(c.broadcast(ones.data(), n, DType::F32, r == 0 ? 1 : 0),
                      Contains("rank 0: broadcast(F32 x 9, root 1)"));
    // The group still works.
    x = fresh();
    c.all_reduce(x.data(), n, DType::F32, ReduceOp::Sum);
    CHECK(summed(x) == 0);
  }

  // A split's children are checked too; a rank outside every group gets nullptr.
  auto child = c.split(r == 0 && P > 2 ? -1 : r % 2, r);
  if (r == 0 && P > 2) {
    CHECK(child == nullptr);
  } else {
    REQUIRE(child != nullptr);
    CHECK(dynamic_cast<CheckedCommunicator*>(child.get()) != nullptr);
    child->barrier();
  }
}

}  // namespace test_checked
