// BatchNorm1d / BatchNorm2d against statistics computed by a plain loop from
// PyTorch's definitions (biased variance to normalise, unbiased for
// running_var), train/eval behaviour, buffers, and gradient checks.

#include <catch2/catch.hpp>
#include <cmath>
#include <ptrain/nn/batch_norm.hpp>
#include <ptrain/nn/sequential.hpp>

#include "unit/gradcheck.hpp"

namespace test_batch_norm {

using namespace ptrain;
using ptrain::testing::check_module_gradients;

namespace {
Tensor<double> random_input(const Shape& s, std::uint64_t seed, double shift = 0.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, shift - 1.0, shift + 1.0, g);
  return x;
}

struct ChannelStats {
  std::vector<double> mean, var;  // biased variance
  double count = 0;
};
ChannelStats naive_stats(const Tensor<double>& x) {
  const std::int64_t n = x.size(0), c = x.size(1), hw = x.numel() / (n * c);
  ChannelStats s{std::vector<double>(c, 0.0), std::vector<double>(c, 0.0), static_cast<double>(n * hw)};
  for (std::int64_t ch = 0; ch < c; ++ch) {
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t k = 0; k < hw; ++k) s.mean[ch] += x.data()[(i * c + ch) * hw + k];
    s.mean[ch] /= s.count;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t k = 0; k < hw; ++k) {
        const double d = x.data()[(i * c + ch) * hw + k] - s.mean[ch];
        s.var[ch] += d * d;
      }
    s.var[ch] /= s.count;
  }
  return s;
}
}  // namespace

TEST_CASE("BatchNorm2d normalises with batch statistics in training and running ones in eval", "[nn][batch_norm]") {
  nn::BatchNorm2d<double> bn(3, {.eps = 1e-3, .momentum = 0.2});
  ops::uniform_(bn.weight()->value, 0.5, 1.5, default_generator());
  ops::uniform_(bn.bias()->value, -0.5, 0.5, default_generator());
  auto x = random_input({4, 3, 3, 2}, 1, 2.0);
  const ChannelStats s = naive_stats(x);
  nn::Cache<double> c;
  auto y = bn.forward(x, c);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const std::int64_t ch = (i / 6) % 3;
    const double want = (x.data()[i] - s.mean[ch]) / std::sqrt(s.var[ch] + 1e-3) * bn.weight()->value.data()[ch] +
                        bn.bias()->value.data()[ch];
    REQUIRE(y.data()[i] == Approx(want).epsilon(1e-12));
  }
  for (std::int64_t ch = 0; ch < 3; ++ch) {
    REQUIRE(bn.running_mean()->data()[ch] == Approx(0.2 * s.mean[ch]).epsilon(1e-12));
    REQUIRE(bn.running_var()->data()[ch] == Approx(0.8 + 0.2 * s.var[ch] * 24.0 / 23.0).epsilon(1e-12));
  }
  REQUIRE(bn.num_batches_tracked()->data()[0] == 1);

  bn.train(false);
  const double rm = bn.running_mean()->data()[1], rv = bn.running_var()->data()[1];
  nn::Cache<double> ce;
  auto ye = bn.forward(x, ce);
  const double want = (x.at({2, 1, 1, 0}) - rm) / std::sqrt(rv + 1e-3) * bn.weight()->value.data()[1] +
                      bn.bias()->value.data()[1];
  REQUIRE(ye.at({2, 1, 1, 0}) == Approx(want).epsilon(1e-12));
  REQUIRE(bn.running_mean()->data()[1] == rm);  // eval leaves the running statistics alone
  REQUIRE(bn.num_batches_tracked()->data()[0] == 1);
}

TEST_CASE("BatchNorm keeps its running statistics as named buffers, not parameters", "[nn][batch_norm]") {
  nn::Sequential<double> net;
  net.add(std::make_shared<nn::BatchNorm1d<double>>(5));
  auto params = net.named_parameters();
  REQUIRE(params.size() == 2);
  REQUIRE(params[0].name == "0.weight");
  auto buffers = net.named_buffers();
  REQUIRE(buffers.size() == 3);
  REQUIRE(buffers[0].name == "0.running_mean");
  REQUIRE(buffers[1].name == "0.running_var");
  REQUIRE(buffers[2].name == "0.num_batches_tracked");
  REQUIRE(buffers[2].buffer->shape() == Shape{});
  nn::BatchNorm1d<double> plain(5, {.affine = false, .track_running_stats = false});
  REQUIRE(plain.named_parameters().empty());
  REQUIRE(plain.named_buffers().empty());
}

TEST_CASE("BatchNorm gradients match finite differences", "[nn][batch_norm][gradcheck]") {
  SECTION("BatchNorm2d, training") {
    nn::BatchNorm2d<double> bn(3);
    ops::uniform_(bn.weight()->value, 0.5, 1.5, default_generator());
    check_module_gradients(bn, random_input({3, 3, 2, 3}, 5, 0.5), true, 1e-6);
  }
  SECTION("BatchNorm1d on [N, C] and [N, C, L], training") {
    nn::BatchNorm1d<double> bn(4);
    check_module_gradients(bn, random_input({6, 4}, 6), true, 1e-6);
    check_module_gradients(bn, random_input({3, 4, 5}, 7), true, 1e-6);
  }
  SECTION("without affine parameters or running statistics (batch statistics in eval too)") {
    nn::BatchNorm2d<double> bn(2, {.affine = false, .track_running_stats = false});
    bn.train(false);
    check_module_gradients(bn, random_input({2, 2, 3, 3}, 8), true, 1e-6);
  }
  SECTION("evaluation: an affine map of the input") {
    nn::BatchNorm2d<double> bn(3);
    nn::Cache<double> c;
    bn.forward(random_input({4, 3, 2, 2}, 9, 1.0), c);  // moves the running statistics off 0 and 1
    bn.train(false);
    check_module_gradients(bn, random_input({2, 3, 2, 2}, 10), true, 1e-6);
  }
}

TEST_CASE("BatchNorm refuses inputs of the wrong shape", "[nn][batch_norm]") {
  nn::BatchNorm2d<double> bn2(3);
  nn::BatchNorm1d<double> bn1(3);
  nn::Cache<double> c;
  REQUIRE_THROWS_WITH(bn2.forward(random_input({4, 3}, 1), c), Catch::Contains("use BatchNorm1d"));
  REQUIRE_THROWS_WITH(bn1.forward(random_input({4, 3, 2, 2}, 1), c), Catch::Contains("use BatchNorm2d"));
  REQUIRE_THROWS_WITH(bn2.forward(random_input({4, 2, 2, 2}, 1), c), Catch::Contains("expects 3"));
  REQUIRE_THROWS_AS(nn::BatchNorm2d<double>(3, {.momentum = 1.5}), ShapeError);
  REQUIRE_THROWS_WITH(bn2.backward(random_input({4, 3, 2, 2}, 1), c), Catch::Contains("[ptrain.backward]"));
}

}  // namespace test_batch_norm
