// Activation modules of nn/activation.hpp against formulas written out here in
// double (naive loops), their gradients through ptrain::testing::check_gradients,
// float and bf16 against double; and the public gradient check itself, which
// must catch a wrong backward.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/ops/init.hpp>
#include <ptrain/testing/gradcheck.hpp>

#include "unit/gradcheck.hpp"

namespace test_activations {

using namespace ptrain;
using ptrain::testing::check_module_gradients;

namespace {

Tensor<double> random_input(const Shape& s, std::uint64_t seed, double scale = 3.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, -scale, scale, g);
  return x;
}

// forward(x) element by element against f.
void check_pointwise(nn::Module<double>& m, const std::function<double(double)>& f, const Tensor<double>& x) {
  nn::Cache<double> c;
  const auto y = m.forward(x, c);
  REQUIRE(y.shape() == x.shape());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    INFO(m.describe() << " at x = " << x.data()[i]);
    REQUIRE(y.data()[i] == Approx(f(x.data()[i])).epsilon(1e-14).margin(1e-300));
  }
}

// Row-wise reference of softmax (log = false) or log-softmax (log = true) over the last dimension.
std::vector<double> ref_softmax(const Tensor<double>& x, bool log) {
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  std::vector<double> out(static_cast<std::size_t>(x.numel()));
  for (std::int64_t r = 0; r < rows; ++r) {
    double denom = 0;
    for (std::int64_t c = 0; c < cols; ++c) denom += std::exp(x.data()[r * cols + c]);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double v = x.data()[r * cols + c];
      out[static_cast<std::size_t>(r * cols + c)] = log ? v - std::log(denom) : std::exp(v) / denom;
    }
  }
  return out;
}

}  // namespace

TEST_CASE("Tanh, Sigmoid, SiLU and LeakyReLU match their formulas and finite differences",
          "[nn][activation][gradcheck]") {
  const auto x = random_input({4, 9}, 1);
  nn::Tanh<double> tanh_m;
  nn::Sigmoid<double> sigmoid_m;
  nn::SiLU<double> silu_m;
  nn::LeakyReLU<double> leaky_default;
  nn::LeakyReLU<double> leaky(0.2);
  check_pointwise(tanh_m, [](double v) { return (std::exp(v) - std::exp(-v)) / (std::exp(v) + std::exp(-v)); }, x);
  check_pointwise(sigmoid_m, [](double v) { return 1 / (1 + std::exp(-v)); }, x);
  check_pointwise(silu_m, [](double v) { return v / (1 + std::exp(-v)); }, x);
  check_pointwise(leaky_default, [](double v) { return v > 0 ? v : 0.01 * v; }, x);
  check_pointwise(leaky, [](double v) { return v > 0 ? v : 0.2 * v; }, x);
  for (nn::Module<double>* m : std::initializer_list<nn::Module<double>*>{&tanh_m, &sigmoid_m, &silu_m, &leaky}) {
    INFO(m->describe());
    check_module_gradients(*m, random_input({3, 2, 5}, 2));
  }
  REQUIRE(leaky.describe() == "LeakyReLU(negative_slope=0.2)");
  // Sigmoid of large |x| saturates without overflow or NaN.
  nn::Cache<double> c;
  const auto big = sigmoid_m.forward(Tensor<double>::from({-800, 800}, {2}), c);
  REQUIRE(big.data()[0] == 0.0);
  REQUIRE(big.data()[1] == 1.0);
}

TEST_CASE("Softmax and LogSoftmax over the last dimension match their formulas and finite differences",
          "[nn][activation][gradcheck]") {
  const auto x = random_input({2, 3, 6}, 3);
  nn::Softmax<double> sm;
  nn::LogSoftmax<double> lsm;
  nn::Cache<double> c;
  const auto y = sm.forward(x, c), ly = lsm.forward(x, c);
  const auto want = ref_softmax(x, false), lwant = ref_softmax(x, true);
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    REQUIRE(y.data()[i] == Approx(want[static_cast<std::size_t>(i)]).epsilon(1e-13));
    REQUIRE(ly.data()[i] == Approx(lwant[static_cast<std::size_t>(i)]).epsilon(1e-13));
  }
  check_module_gradients(sm, x);
  check_module_gradients(lsm, x);
  // Large logits: the max is subtracted first, so nothing overflows.
  const auto huge = lsm.forward(Tensor<double>::from({1000, 0}, {1, 2}), c);
  REQUIRE(huge.data()[0] == Approx(0.0).margin(1e-300));
  REQUIRE(huge.data()[1] == Approx(-1000.0));
}

TEST_CASE("Identity passes values and gradients through", "[nn][activation]") {
  nn::Identity<double> id;
  nn::Cache<double> c;
  const auto x = random_input({3, 4}, 4);
  REQUIRE(id.forward(x, c).to_vector() == x.to_vector());
  REQUIRE(id.backward(x, c).to_vector() == x.to_vector());
  check_module_gradients(id, x);
}

TEST_CASE("Float and bf16 activations agree with double", "[nn][activation][bf16]") {
  const auto xd = random_input({5, 7}, 5);
  auto xf = Tensor<float>::empty(xd.shape());
  auto xb = Tensor<bf16>::empty(xd.shape());
  for (std::int64_t i = 0; i < xd.numel(); ++i) {
    xb.data()[i] = bf16(static_cast<float>(xd.data()[i]));
    xf.data()[i] = static_cast<float>(xb.data()[i]);  // the same inputs for all three
  }
  auto xdb = Tensor<double>::empty(xd.shape());
  for (std::int64_t i = 0; i < xd.numel(); ++i) xdb.data()[i] = static_cast<float>(xb.data()[i]);
  auto run = [&](auto make) {
    auto md = make(0.0);
    auto mf = make(0.0f);
    auto mb = make(bf16{});
    nn::Cache<double> cd;
    nn::Cache<float> cf;
    nn::Cache<bf16> cb;
    const auto yd = md.forward(xdb, cd);
    const auto yf = mf.forward(xf, cf);
    const auto yb = mb.forward(xb, cb);
    const auto gd = md.backward(xdb, cd);  // any upstream gradient: the inputs again
    const auto gf = mf.backward(xf, cf);
    const auto gb = mb.backward(xb, cb);
    for (std::int64_t i = 0; i < xd.numel(); ++i) {
      INFO(md.describe() << " element " << i);
      REQUIRE(yf.data()[i] == Approx(yd.data()[i]).epsilon(1e-6).margin(1e-6));
      REQUIRE(static_cast<float>(yb.data()[i]) == Approx(yd.data()[i]).epsilon(1e-2).margin(1e-2));
      REQUIRE(gf.data()[i] == Approx(gd.data()[i]).epsilon(1e-5).margin(1e-5));
      REQUIRE(static_cast<float>(gb.data()[i]) == Approx(gd.data()[i]).epsilon(2e-2).margin(2e-2));
    }
  };
  run([](auto tag) { return nn::Tanh<decltype(tag)>(); });
  run([](auto tag) { return nn::Sigmoid<decltype(tag)>(); });
  run([](auto tag) { return nn::SiLU<decltype(tag)>(); });
  run([](auto tag) { return nn::LeakyReLU<decltype(tag)>(0.1); });
  run([](auto tag) { return nn::LogSoftmax<decltype(tag)>(); });
}

namespace {
// A user-written module with a deliberate mistake in backward: the gradient of
// x^2 written as x instead of 2x, for the last element only when `wrong`.
class Square : public nn::Module<double> {
 public:
  explicit Square(bool wrong) : wrong_(wrong) {}
  Tensor<double> forward(const Tensor<double>& x, nn::Cache<double>& cache) override {
    cache.tensors = {x};
    auto y = x.clone();
    for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] *= x.data()[i];
    return y;
  }
  Tensor<double> backward(const Tensor<double>& dy, nn::Cache<double>& cache) override {
    const auto& x = cache.tensors.at(0);
    auto dx = dy.clone();
    for (std::int64_t i = 0; i < dx.numel(); ++i)
      dx.data()[i] *= (wrong_ && i == dx.numel() - 1 ? 1.0 : 2.0) * x.data()[i];
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "Square()"; }

 private:
  bool wrong_;
};
}  // namespace

TEST_CASE("The public gradient check passes a right backward and names the worst element of a wrong one",
          "[testing][gradcheck]") {
  const auto x = random_input({2, 3}, 6);
  Square right(false), wrong(true);
  const auto good = ptrain::testing::check_gradients(right, x);
  INFO(good.report());
  REQUIRE(good.ok);
  REQUIRE(good.checked == 6);
  const auto bad = ptrain::testing::check_gradients(wrong, x);
  REQUIRE_FALSE(bad.ok);
  REQUIRE(bad.failed == 1);
  REQUIRE(bad.worst_tensor == "input");
  REQUIRE(bad.worst_index == 5);
  REQUIRE(bad.report().find("GRADIENT MISMATCH: 1 of 6") != std::string::npos);
  // Parameter gradients: a Linear layer is checked through its weight and bias too.
  Generator g(7);
  nn::Linear<double> lin(3, 2, true, g);
  const auto r = ptrain::testing::check_gradients(lin, x, {.max_points = 4});
  INFO(r.report());
  REQUIRE(r.ok);
  REQUIRE(r.checked == 6 + 6 + 2);  // input (every element), weight (every element), bias
}

}  // namespace test_activations
