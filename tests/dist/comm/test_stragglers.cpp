// straggler_report (train/stragglers.hpp) on every rank of the job: rank r
// reports a step of (r + 1) * 10 ms; the expected fields are computed here.
#include <algorithm>

#include "comm_util.hpp"
#include "ptrain/train/stragglers.hpp"

namespace test_stragglers {

using namespace comm_test;

TEST_CASE("straggler report names the slowest rank and its ratio to the median", "[comm][stragglers]") {
  Communicator& c = world();
  const int n = c.size(), r = c.rank();
  ptrain::train::StepTimes mine;
  for (int i = 0; i < 4; ++i) mine.add(0.01 * (r + 1), 0.001 * r, 0.002);  // means: step (r+1)/100, data r/1000
  const auto rep = ptrain::train::straggler_report(c, mine);
  REQUIRE(rep["step_time_per_rank"].size() == static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) {
    CHECK(rep["step_time_per_rank"][q].get<double>() == Approx(0.01 * (q + 1)));
    CHECK(rep["data_wait_per_rank"][q].get<double>() == Approx(0.001 * q).margin(1e-12));
    CHECK(rep["comm_wait_per_rank"][q].get<double>() == Approx(0.002));
  }
  CHECK(rep["slowest_rank"] == n - 1);
  // step times 1..n (x 10 ms): the median is (n + 1) / 2
  CHECK(rep["slowest_vs_median"].get<double>() == Approx(n / ((n + 1) / 2.0)));
  CHECK(rep["step_time_s"].get<double>() == Approx(0.01));
}

}  // namespace test_stragglers
