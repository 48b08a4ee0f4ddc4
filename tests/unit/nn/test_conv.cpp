// Conv2d, pooling and Flatten against nested-loop references written from
// PyTorch's definitions, and double-precision gradient checks.

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <ptrain/nn/conv.hpp>

#include "unit/gradcheck.hpp"

namespace test_conv {

using namespace ptrain;
using ptrain::testing::check_module_gradients;

namespace {
Tensor<double> random_input(const Shape& s, std::uint64_t seed) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, -1.0, 1.0, g);
  return x;
}

struct Geometry {
  std::int64_t kh, kw, sh, sw, ph, pw, dh = 1, dw = 1;
};

std::int64_t out_size(std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t p, std::int64_t d) {
  return (in + 2 * p - d * (k - 1) - 1) / s + 1;
}

// PyTorch's conv2d by its definition: cross-correlation over zero-padded input.
Tensor<double> naive_conv(const Tensor<double>& x, const Tensor<double>& w, const Tensor<double>* b, Geometry g,
                          std::int64_t groups) {
  const std::int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3), o = w.size(0);
  const std::int64_t ho = out_size(h, g.kh, g.sh, g.ph, g.dh), wo = out_size(wd, g.kw, g.sw, g.pw, g.dw);
  const std::int64_t cg = c / groups, og = o / groups;
  auto y = Tensor<double>::zeros({n, o, ho, wo});
  for (std::int64_t s = 0; s < n; ++s)
    for (std::int64_t oc = 0; oc < o; ++oc)
      for (std::int64_t oh = 0; oh < ho; ++oh)
        for (std::int64_t ow = 0; ow < wo; ++ow) {
          double acc = b ? b->at({oc}) : 0.0;
          const std::int64_t grp = oc / og;
          for (std::int64_t ci = 0; ci < cg; ++ci)
            for (std::int64_t i = 0; i < g.kh; ++i)
              for (std::int64_t j = 0; j < g.kw; ++j) {
                const std::int64_t ih = oh * g.sh - g.ph + i * g.dh, iw = ow * g.sw - g.pw + j * g.dw;
                if (ih < 0 || ih >= h || iw < 0 || iw >= wd) continue;
                acc += x.at({s, grp * cg + ci, ih, iw}) * w.at({oc, ci, i, j});
              }
          y.at({s, oc, oh, ow}) = acc;
        }
  return y;
}

Tensor<double> naive_pool(const Tensor<double>& x, Geometry g, bool max) {
  const std::int64_t n = x.size(0), c = x.size(1), h = x.size(2), wd = x.size(3);
  const std::int64_t ho = out_size(h, g.kh, g.sh, g.ph, 1), wo = out_size(wd, g.kw, g.sw, g.pw, 1);
  auto y = Tensor<double>::zeros({n, c, ho, wo});
  for (std::int64_t s = 0; s < n; ++s)
    for (std::int64_t ch = 0; ch < c; ++ch)
      for (std::int64_t oh = 0; oh < ho; ++oh)
        for (std::int64_t ow = 0; ow < wo; ++ow) {
          double acc = max ? -std::numeric_limits<double>::infinity() : 0.0;
          for (std::int64_t i = 0; i < g.kh; ++i)
            for (std::int64_t j = 0; j < g.kw; ++j) {
              const std::int64_t ih = oh * g.sh - g.ph + i, iw = ow * g.sw - g.pw + j;
              if (ih < 0 || ih >= h || iw < 0 || iw >= wd) continue;
              acc = max ? std::max(acc, x.at({s, ch, ih, iw})) : acc + x.at({s, ch, ih, iw});
            }
          y.at({s, ch, oh, ow}) = max ? acc : acc / static_cast<double>(g.kh * g.kw);
        }
  return y;
}

void require_close(const Tensor<double>& a, const Tensor<double>& b, double tol = 1e-12) {
  REQUIRE(a.shape() == b.shape());
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(a.data()[i] - b.data()[i]) <= tol);
  }
}
}  // namespace

TEST_CASE("Conv2d matches a nested-loop convolution", "[nn][conv]") {
  struct Case {
    std::int64_t c, o, h, w;
    Geometry g;
    std::int64_t groups;
    bool bias;
  };
  const Case cases[] = {
      {3, 4, 7, 6, {3, 3, 1, 1, 1, 1}, 1, true},        // same padding
      {4, 6, 9, 8, {3, 2, 2, 3, 1, 0, 2, 1}, 2, true},  // strides, dilation, groups, rectangular
      {4, 4, 5, 5, {3, 3, 1, 1, 1, 1}, 4, false},       // depthwise
      {5, 3, 4, 6, {1, 1, 1, 1, 0, 0}, 1, true},        // 1x1: the input is its own columns
      {2, 3, 5, 5, {1, 1, 2, 2, 0, 0}, 1, false},       // 1x1 strided: through im2col
  };
  std::uint64_t seed = 10;
  for (const Case& k : cases) {
    Generator gen(seed++);
    nn::Conv2d<double> conv(k.c, k.o, {k.g.kh, k.g.kw},
                            {.stride = {k.g.sh, k.g.sw}, .padding = {k.g.ph, k.g.pw}, .dilation = {k.g.dh, k.g.dw},
                             .groups = k.groups, .bias = k.bias},
                            gen);
    auto x = random_input({2, k.c, k.h, k.w}, seed++);
    nn::Cache<double> cache;
    auto y = conv.forward(x, cache);
    require_close(y, naive_conv(x, conv.weight().value, conv.bias() ? &conv.bias()->value : nullptr, k.g, k.groups));
    check_module_gradients(conv, x);
  }
}

TEST_CASE("Conv2d initialises and describes like torch.nn.Conv2d, and refuses bad shapes", "[nn][conv]") {
  Generator gen(3);
  nn::Conv2d<double> conv(4, 8, 3, {.padding = {1, 1}, .groups = 2}, gen);
  REQUIRE(conv.weight().value.shape() == Shape{8, 2, 3, 3});
  const double bound = 1.0 / std::sqrt(2.0 * 9.0);
  for (std::int64_t i = 0; i < conv.weight().value.numel(); ++i)
    REQUIRE(std::abs(conv.weight().value.data()[i]) <= bound);
  REQUIRE(conv.describe() == "Conv2d(4, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), groups=2)");
  nn::Cache<double> c;
  REQUIRE_THROWS_WITH(conv.forward(random_input({2, 3, 5, 5}, 1), c), Catch::Contains("[ptrain.conv2d.channels]"));
  REQUIRE_THROWS_WITH(conv.forward(random_input({4, 5, 5}, 1), c), Catch::Contains("[ptrain.conv2d.shape]"));
  nn::Conv2d<double> big(1, 1, 5, {}, gen);
  REQUIRE_THROWS_WITH(big.forward(random_input({1, 1, 4, 4}, 1), c), Catch::Contains("does not fit"));
  REQUIRE_THROWS_AS(nn::Conv2d<double>(3, 4, 3, {.groups = 2}), ShapeError);
  REQUIRE_THROWS_AS(nn::Conv2d<double>(3, 4, 3, {.stride = {0, 1}}), ShapeError);
  nn::Cache<double> fresh;
  REQUIRE_THROWS_WITH(conv.backward(random_input({2, 8, 5, 5}, 1), fresh), Catch::Contains("[ptrain.backward]"));
}

TEST_CASE("MaxPool2d and AvgPool2d match nested-loop pooling", "[nn][conv]") {
  const Geometry geos[] = {{2, 2, 2, 2, 0, 0}, {3, 3, 2, 2, 1, 1}, {3, 2, 1, 2, 1, 0}};
  std::uint64_t seed = 40;
  for (const Geometry& g : geos) {
    auto x = random_input({2, 3, 7, 6}, seed++);
    nn::Pool2dOptions o{.stride = {g.sh, g.sw}, .padding = {g.ph, g.pw}};
    nn::MaxPool2d<double> mp({g.kh, g.kw}, o);
    nn::AvgPool2d<double> ap({g.kh, g.kw}, o);
    nn::Cache<double> c1, c2;
    require_close(mp.forward(x, c1), naive_pool(x, g, true));
    require_close(ap.forward(x, c2), naive_pool(x, g, false));
    check_module_gradients(mp, x);
    check_module_gradients(ap, x);
  }
  // The stride defaults to the kernel size.
  nn::MaxPool2d<double> two(2);
  nn::Cache<double> c;
  REQUIRE(two.forward(random_input({1, 1, 6, 4}, 1), c).shape() == Shape{1, 1, 3, 2});
  REQUIRE(two.describe() == "MaxPool2d(kernel_size=(2, 2), stride=(2, 2), padding=(0, 0))");
  nn::MaxPool2d<double> wide(2, {.padding = {2, 2}});
  REQUIRE_THROWS_WITH(wide.forward(random_input({1, 1, 6, 4}, 1), c), Catch::Contains("at most half"));
}

TEST_CASE("MaxPool2d sends each gradient to the window's maximum", "[nn][conv]") {
  // One plane [[1, 5], [3, 2]] with a 2x2 window: only the 5 gets the gradient.
  auto x = Tensor<double>::from({1, 5, 3, 2}, {1, 1, 2, 2});
  nn::MaxPool2d<double> mp(2);
  nn::Cache<double> c;
  REQUIRE(mp.forward(x, c).data()[0] == 5);
  auto dx = mp.backward(Tensor<double>::full({1, 1, 1, 1}, 7.0), c);
  REQUIRE(dx.data()[0] == 0);
  REQUIRE(dx.data()[1] == 7);
  REQUIRE(dx.data()[2] == 0);
  REQUIRE(dx.data()[3] == 0);
}

TEST_CASE("AdaptiveAvgPool2d(1) averages each plane and Flatten keeps the batch dimension", "[nn][conv]") {
  auto x = random_input({2, 3, 4, 5}, 77);
  nn::AdaptiveAvgPool2d<double> gap;
  nn::Cache<double> c;
  auto y = gap.forward(x, c);
  REQUIRE(y.shape() == Shape{2, 3, 1, 1});
  for (std::int64_t s = 0; s < 2; ++s)
    for (std::int64_t ch = 0; ch < 3; ++ch) {
      double sum = 0;
      for (std::int64_t i = 0; i < 20; ++i) sum += x.data()[(s * 3 + ch) * 20 + i];
      REQUIRE(y.at({s, ch, 0, 0}) == Approx(sum / 20).epsilon(1e-14));
    }
  check_module_gradients(gap, x);
  REQUIRE_THROWS_AS(nn::AdaptiveAvgPool2d<double>(2), ShapeError);

  nn::Flatten<double> flat;
  nn::Cache<double> fc;
  auto f = flat.forward(x, fc);
  REQUIRE(f.shape() == Shape{2, 60});
  REQUIRE(f.data()[59] == x.data()[59]);
  REQUIRE(flat.backward(f, fc).shape() == x.shape());
  check_module_gradients(flat, x);
}

}  // namespace test_conv
