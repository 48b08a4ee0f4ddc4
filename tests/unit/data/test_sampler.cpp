#include <catch2/catch.hpp>
#include <algorithm>
#include <ptrain/data/sampler.hpp>
#include <set>

namespace test_sampler {

using namespace ptrain;

TEST_CASE("DistributedSampler shards cover the data set disjointly", "[data][sampler]") {
  for (int world : {1, 2, 3, 4}) {
    const std::int64_t n = 10;  // not divisible by 3 or 4: padding repeats the first indices
    std::vector<std::int64_t> all;
    for (int r = 0; r < world; ++r) {
      DistributedSampler s(n, r, world, 7);
      s.set_epoch(2);
      REQUIRE(s.num_samples() == (n + world - 1) / world);
      all.insert(all.end(), s.indices().begin(), s.indices().end());
    }
    // Reference: the epoch order, padded by wrapping, dealt round-robin.
    const auto order = shuffled_indices(n, 7, 2);
    std::multiset<std::int64_t> got(all.begin(), all.end()), want;
    const std::int64_t total = (n + world - 1) / world * world;
    for (std::int64_t i = 0; i < total; ++i) want.insert(order[static_cast<std::size_t>(i % n)]);
    REQUIRE(got == want);
    REQUIRE(std::set<std::int64_t>(all.begin(), all.end()).size() == static_cast<std::size_t>(n));
  }
}

TEST_CASE("DistributedSampler with drop_last drops the tail", "[data][sampler]") {
  std::set<std::int64_t> seen;
  for (int r = 0; r < 3; ++r) {
    DistributedSampler s(10, r, 3, 1, true, true);
    REQUIRE(s.num_samples() == 3);
    for (auto i : s.indices()) REQUIRE(seen.insert(i).second);  // disjoint
  }
  REQUIRE(seen.size() == 9);
}

TEST_CASE("DistributedSampler reshuffles per epoch and resumes mid-epoch", "[data][sampler]") {
  DistributedSampler a(100, 1, 2, 3);
  a.set_epoch(0);
  const auto e0 = a.indices();
  a.set_epoch(1);
  REQUIRE(a.indices() != e0);
  a.set_epoch(0);
  REQUIRE(a.indices() == e0);

  auto first = a.next(16);
  auto second = a.next(16);
  REQUIRE(a.position() == 32);
  DistributedSampler b(100, 1, 2, 3);
  b.set_epoch(0, 16);  // resume where `first` ended
  REQUIRE(b.next(16) == second);
  while (!a.epoch_done()) a.next(16);
  REQUIRE(a.position() == 50);
  REQUIRE(a.next(16).empty());

  DistributedSampler plain(5, 0, 1, 0, /*shuffle=*/false);
  REQUIRE(plain.indices() == std::vector<std::int64_t>{0, 1, 2, 3, 4});
  REQUIRE_THROWS_AS(DistributedSampler(10, 2, 2, 0), Error);
  REQUIRE_THROWS_AS(b.set_epoch(0, 51), Error);
}

}  // namespace test_sampler
