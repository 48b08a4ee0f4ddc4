#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <numeric>
#include <vector>

#include "ptrain/data/batches.hpp"

namespace test_batches {

using ptrain::Shape;
using ptrain::Tensor;

TEST_CASE("shuffled_indices is a permutation", "[data][batches]") {
  for (std::int64_t n : {0, 1, 2, 7, 1000, 60000}) {
    auto idx = ptrain::shuffled_indices(n, 1234, 3);
    REQUIRE(static_cast<std::int64_t>(idx.size()) == n);
    std::sort(idx.begin(), idx.end());
    std::vector<std::int64_t> iota(static_cast<std::size_t>(n));
    std::iota(iota.begin(), iota.end(), std::int64_t{0});
    CHECK(idx == iota);
  }
  CHECK_THROWS_AS(ptrain::shuffled_indices(-1, 0, 0), ptrain::Error);
}

TEST_CASE("shuffled_indices depends only on (n, seed, epoch)", "[data][batches]") {
  const auto a = ptrain::shuffled_indices(1000, 42, 0);
  CHECK(a == ptrain::shuffled_indices(1000, 42, 0));
  CHECK(a != ptrain::shuffled_indices(1000, 42, 1));
  CHECK(a != ptrain::shuffled_indices(1000, 43, 0));
  std::vector<std::int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), std::int64_t{0});
  CHECK(a != identity);

  // Fixed values: the order must not change between machines, compilers or releases,
  // or resumed runs and other ranks would see a different data order. Values from a
  // separate Python implementation of SplitMix64 + Philox4x32-10 + Fisher-Yates.
  CHECK(ptrain::shuffled_indices(10, 42, 0) == std::vector<std::int64_t>{4, 5, 6, 3, 1, 0, 8, 9, 2, 7});
  CHECK(ptrain::shuffled_indices(10, 42, 1) == std::vector<std::int64_t>{9, 6, 0, 5, 4, 1, 3, 8, 7, 2});
}

TEST_CASE("shuffled_indices is uniform", "[data][batches]") {
  // Over 4800 epochs of n = 4 every one of the 24 permutations should appear
  // ~200 times and every value in every position ~1200 times; a biased shuffle
  // (e.g. j drawn from [0, n) instead of [0, i]) fails these bounds by far.
  const int trials = 4800;
  std::map<std::vector<std::int64_t>, int> perms;
  int position[4][4] = {};
  for (int e = 0; e < trials; ++e) {
    const auto p = ptrain::shuffled_indices(4, 7, static_cast<std::uint64_t>(e));
    ++perms[p];
    for (int i = 0; i < 4; ++i) ++position[i][p[static_cast<std::size_t>(i)]];
  }
  CHECK(perms.size() == 24);
  for (const auto& [perm, count] : perms) {
    CHECK(count > 120);  // mean 200, sd ~14
    CHECK(count < 280);
  }
  for (auto& row : position)
    for (int count : row) {
      CHECK(count > 1080);  // mean 1200, sd 30
      CHECK(count < 1320);
    }
}

TEST_CASE("num_batches counts partial batches unless dropped", "[data][batches]") {
  CHECK(ptrain::num_batches(60000, 128, false) == 469);
  CHECK(ptrain::num_batches(60000, 128, true) == 468);
  CHECK(ptrain::num_batches(256, 128, false) == 2);
  CHECK(ptrain::num_batches(0, 128, false) == 0);
  CHECK_THROWS_AS(ptrain::num_batches(10, 0, false), ptrain::Error);
}

TEST_CASE("gather_rows matches a naive element copy", "[data][batches]") {
  const std::int64_t n = 50, h = 3, w = 4;
  auto src = Tensor<float>::empty({n, h, w});
  for (std::int64_t i = 0; i < src.numel(); ++i) src.data()[i] = static_cast<float>(i) * 0.5f - 7.0f;
  const auto order = ptrain::shuffled_indices(n, 9, 0);

  // dst larger than the batch: rows past `count` must stay untouched.
  const std::int64_t count = 13;
  auto dst = Tensor<float>::full({16, h, w}, -1.0f);
  ptrain::gather_rows(src, order.data() + 20, count, dst);
  for (std::int64_t i = 0; i < 16; ++i)
    for (std::int64_t r = 0; r < h; ++r)
      for (std::int64_t c = 0; c < w; ++c) {
        const float want = i < count ? src.at({order[static_cast<std::size_t>(20 + i)], r, c}) : -1.0f;
        CHECK(dst.at({i, r, c}) == want);
      }

  auto labels = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n; ++i) labels.data()[i] = static_cast<std::int32_t>(100 + i);
  auto y = Tensor<std::int32_t>::zeros({count});
  ptrain::gather_rows(labels, order.data(), count, y);
  for (std::int64_t i = 0; i < count; ++i) CHECK(y.data()[i] == 100 + order[static_cast<std::size_t>(i)]);
}

TEST_CASE("gather_rows rejects bad indices and shapes", "[data][batches]") {
  auto src = Tensor<float>::zeros({5, 2});
  auto dst = Tensor<float>::zeros({3, 2});
  const std::vector<std::int64_t> bad = {0, 5};
  CHECK_THROWS_AS(ptrain::gather_rows(src, bad.data(), 2, dst), ptrain::Error);
  const std::vector<std::int64_t> neg = {-1};
  CHECK_THROWS_AS(ptrain::gather_rows(src, neg.data(), 1, dst), ptrain::Error);
  const std::vector<std::int64_t> ok = {0, 1, 2, 3};
  CHECK_THROWS_AS(ptrain::gather_rows(src, ok.data(), 4, dst), ptrain::ShapeError);
  auto wide = Tensor<float>::zeros({3, 3});
  CHECK_THROWS_AS(ptrain::gather_rows(src, ok.data(), 2, wide), ptrain::ShapeError);
  auto flat = Tensor<float>::zeros({6});
  CHECK_THROWS_AS(ptrain::gather_rows(src, ok.data(), 2, flat), ptrain::ShapeError);
}

}  // namespace test_batches
