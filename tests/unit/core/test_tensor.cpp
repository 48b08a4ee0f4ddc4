#include <catch2/catch.hpp>
#include <cmath>
#include <ptrain/core/random.hpp>
#include <ptrain/core/tensor.hpp>

namespace test_tensor {

using namespace ptrain;

TEST_CASE("tensor views share storage and check bounds", "[core][tensor]") {
  auto t = Tensor<float>::zeros({4, 3});
  REQUIRE(t.numel() == 12);
  REQUIRE(t.dim() == 2);
  auto row = t[2];
  REQUIRE(row.shape() == Shape{3});
  row.at({1}) = 7.0f;
  REQUIRE(t.data()[2 * 3 + 1] == 7.0f);

  auto rows = t.narrow(1, 2);
  REQUIRE(rows.shape() == Shape{2, 3});
  REQUIRE(rows.data() == t.data() + 3);
  REQUIRE(rows.shares_storage(t));

  auto flat = t.reshape({-1});
  REQUIRE(flat.shape() == Shape{12});
  REQUIRE(flat.data()[7] == 7.0f);
  REQUIRE(t.reshape({2, -1}).shape() == Shape{2, 6});

  auto c = t.clone();
  c.data()[7] = 1.0f;
  REQUIRE(t.data()[7] == 7.0f);
  REQUIRE_FALSE(c.shares_storage(t));

  REQUIRE_THROWS_AS(t.reshape({5, 3}), ShapeError);
  REQUIRE_THROWS_AS(t.narrow(3, 2), ShapeError);
  REQUIRE_THROWS_AS(t[4], ShapeError);
  REQUIRE_THROWS_AS(t.view(10, {3}), ShapeError);
  REQUIRE_THROWS_AS(t.at({0, 3}), ShapeError);
  REQUIRE_THROWS_AS(Tensor<float>::from({1, 2, 3}, {2, 2}), ShapeError);
  REQUIRE_THROWS_WITH(t.reshape({5, 3}), Catch::Contains("[ptrain.tensor.reshape]") && Catch::Contains("[4, 3]"));
}

TEST_CASE("undefined tensors, oversized shapes and empty last dimensions give errors, not crashes",
          "[core][tensor]") {
  Tensor<float> u;  // also what Embedding's backward returns
  REQUIRE(u.numel() == 0);
  REQUIRE_THROWS_WITH(u.to_vector(), Catch::Contains("[ptrain.tensor.undefined]") && Catch::Contains("to_vector()"));
  REQUIRE_THROWS_WITH(u.clone(), Catch::Contains("[ptrain.tensor.undefined]"));
  REQUIRE_THROWS_WITH(u.zero_(), Catch::Contains("[ptrain.tensor.undefined]"));
  REQUIRE_THROWS_WITH(u.at({}), Catch::Contains("[ptrain.tensor.undefined]"));
  auto t = Tensor<float>::full({1}, 2);
  REQUIRE_THROWS_WITH(t.copy_(u), Catch::Contains("[ptrain.tensor.undefined]"));
  REQUIRE_THROWS_WITH(u.copy_(t), Catch::Contains("[ptrain.tensor.undefined]"));
  // 2^62 * 4 elements wraps to 0 in 64 bits; 2^32 * 2^32 to 0 as well.
  REQUIRE_THROWS_WITH(Tensor<float>::zeros({1ll << 62, 4}), Catch::Contains("[ptrain.tensor.shape]"));
  REQUIRE_THROWS_WITH(Tensor<float>::zeros({1ll << 32, 1ll << 32}), Catch::Contains("more elements"));
  REQUIRE_THROWS_WITH(t.view(INT64_MAX, {1}), Catch::Contains("[ptrain.tensor.view]"));
  REQUIRE(rows_of(Tensor<float>::zeros({0, 3}), "x") == 0);
  REQUIRE_THROWS_WITH(rows_of(Tensor<float>::zeros({3, 0}), "logits"),
                      Catch::Contains("logits has shape [3, 0]") && Catch::Contains("last dimension"));
}

TEST_CASE("allocator counts live and peak bytes exactly", "[core][allocator]") {
  const auto before = memory_stats();
  reset_peak_memory();
  {
    auto a = Tensor<double>::empty({100});
    auto b = Tensor<float>::empty({3, 5});
    auto view = a.narrow(10, 20);  // a view allocates nothing
    const auto during = memory_stats();
    REQUIRE(during.live_bytes - before.live_bytes == 100 * 8 + 15 * 4);
    REQUIRE(during.allocations - before.allocations == 2);
  }
  const auto after = memory_stats();
  REQUIRE(after.live_bytes == before.live_bytes);
  REQUIRE(after.peak_bytes == before.live_bytes + 100 * 8 + 15 * 4);
  reset_peak_memory();
  REQUIRE(memory_stats().peak_bytes == before.live_bytes);
}

TEST_CASE("cuda tensors without a CUDA build give a clear error", "[core][device]") {
  REQUIRE_THROWS_AS(Tensor<float>::empty({2}, Device::cuda(0)), CudaError);
  REQUIRE(Device::parse("cuda:3") == Device::cuda(3));
  REQUIRE(Device::parse("cpu").is_cpu());
  REQUIRE_THROWS_AS(Device::parse("gpu"), Error);
}

TEST_CASE("bf16 rounds to nearest even", "[core][dtype]") {
  // Reference: the nearest multiple of the bf16 spacing, computed in double.
  const float values[] = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, -7.77e10f, 1.00390625f, 1.01171875f};
  for (float f : values) {
    const int e = std::ilogb(f);
    const double ulp = std::ldexp(1.0, e - 7);  // 8 significant bits
    const double q = static_cast<double>(f) / ulp;
    double r = std::nearbyint(q);  // ties to even under the default rounding mode
    REQUIRE(static_cast<float>(bf16(f)) == static_cast<float>(r * ulp));
  }
  // Exact ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and rounds to the even 1.
  REQUIRE(static_cast<float>(bf16(1.00390625f)) == 1.0f);
  REQUIRE(static_cast<float>(bf16(1.01171875f)) == 1.015625f);
  REQUIRE(std::isnan(static_cast<float>(bf16(std::nanf("")))));
}

TEST_CASE("Philox4x32-10 matches the published known-answer vectors", "[core][random]") {
  // Random123 kat_vectors: philox4x32 10 rounds.
  auto z = detail::philox(0, 0, 0);
  REQUIRE(z.x[0] == 0x6627e8d5u);
  REQUIRE(z.x[1] == 0xe169c58du);
  REQUIRE(z.x[2] == 0xbc57ac4cu);
  REQUIRE(z.x[3] == 0x9b00dbd8u);
  auto f = detail::philox(0xffffffffffffffffull, 0xffffffffffffffffull, 0xffffffffffffffffull);
  REQUIRE(f.x[0] == 0x408f276du);
  REQUIRE(f.x[1] == 0x41c83b0eu);
  REQUIRE(f.x[2] == 0xa20bc7c6u);
  REQUIRE(f.x[3] == 0x6d5451fdu);
  // counter = 243f6a88 85a308d3 13198a2e 03707344, key = a4093822 299f31d0 (digits of pi)
  auto p = detail::philox(0x299f31d0a4093822ull, 0x85a308d3243f6a88ull, 0x0370734413198a2eull);
  REQUIRE(p.x[0] == 0xd16cfe09u);
  REQUIRE(p.x[1] == 0x94fdccebu);
  REQUIRE(p.x[2] == 0x5001e420u);
  REQUIRE(p.x[3] == 0x24126ea1u);
}

TEST_CASE("generator streams are reproducible and well distributed", "[core][random]") {
  Generator a(42), b(42);
  for (int i = 0; i < 5; ++i) REQUIRE(a.uniform() == b.uniform());
  REQUIRE(a.offset() == 5);
  Generator c(42, 3);
  Generator d(42);
  d.reserve(3);
  REQUIRE(c.normal() == d.normal());

  const int n = 200000;
  double sum = 0, sum2 = 0;
  int counts[10] = {};
  Generator g(7);
  for (int i = 0; i < n; ++i) {
    const double z = g.normal();
    sum += z;
    sum2 += z * z;
    ++counts[g.below(10)];
  }
  REQUIRE(std::abs(sum / n) < 0.01);           // 4.5 sigma for the mean of n normals
  REQUIRE(std::abs(sum2 / n - 1.0) < 0.015);   // ~5 sigma for the variance
  for (int k = 0; k < 10; ++k) REQUIRE(std::abs(counts[k] - n / 10) < 700);  // ~5 sigma
}

}  // namespace test_tensor
