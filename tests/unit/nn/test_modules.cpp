#include <catch2/catch.hpp>
#include <cstring>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/embedding.hpp>
#include <ptrain/nn/flat_parameters.hpp>
#include <ptrain/nn/layer_norm.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/nn/sequential.hpp>

#include "unit/gradcheck.hpp"

namespace test_modules {

using namespace ptrain;
using ptrain::testing::check_module_gradients;

namespace {
Tensor<double> random_input(const Shape& s, std::uint64_t seed, double scale = 1.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, -scale, scale, g);
  return x;
}
}  // namespace

TEST_CASE("Linear gradients match finite differences", "[nn][gradcheck]") {
  Generator gen(1);
  nn::Linear<double> lin(5, 4, true, gen);
  check_module_gradients(lin, random_input({3, 5}, 2));
  nn::Linear<double> nobias(5, 4, false, gen);
  check_module_gradients(nobias, random_input({2, 3, 5}, 3));  // leading dims flatten
}

TEST_CASE("Linear matches an explicit x W^T + b", "[nn][linear]") {
  Generator gen(4);
  nn::Linear<double> lin(3, 2, true, gen);
  auto x = random_input({4, 3}, 5);
  nn::Cache<double> c;
  auto y = lin.forward(x, c);
  auto& w = lin.weight().value;
  auto& b = lin.bias()->value;
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t o = 0; o < 2; ++o) {
      double s = b.at({o});
      for (std::int64_t k = 0; k < 3; ++k) s += x.at({i, k}) * w.at({o, k});
      REQUIRE(y.at({i, o}) == Approx(s).epsilon(1e-14));
    }
  for (std::int64_t i = 0; i < w.numel(); ++i) REQUIRE(std::abs(w.data()[i]) <= 1.0 / std::sqrt(3.0));
  REQUIRE_THROWS_AS(lin.forward(random_input({4, 5}, 1), c), ShapeError);
  // The backward checks the gradients' layout, not only their sizes.
  auto dw = Tensor<double>::zeros({2, 3}), db = Tensor<double>::zeros({1});
  REQUIRE_THROWS_WITH(ops::linear_backward(x, w, random_input({2, 4}, 7), dw, static_cast<Tensor<double>*>(nullptr)),
                      Catch::Contains("[ptrain.linear.backward]"));
  REQUIRE_THROWS_WITH(ops::linear_backward(x, w, random_input({4, 2}, 7), dw, &db),
                      Catch::Contains("linear bias gradient"));
  REQUIRE_THROWS_AS(nn::LayerNorm<double>(0), ShapeError);
}

TEST_CASE("Backward ops refuse saved tensors and gradients of the wrong shape", "[nn][ops]") {
  // Each backward writes through raw pointers sized by its first argument: a
  // mismatched saved tensor or gradient must be a ShapeError, not a stray write.
  const auto x = random_input({4, 3}, 8), dy = random_input({4, 3}, 9);
  auto gamma = Tensor<double>::full({3}, 1.0), beta = Tensor<double>::zeros({3});
  Tensor<double> mean, rstd;
  ops::layer_norm(x, gamma, beta, 1e-5, mean, rstd);
  auto dgamma = Tensor<double>::zeros({3}), dbeta = Tensor<double>::zeros({3}), short_grad = Tensor<double>::zeros({2});
  REQUIRE_NOTHROW(ops::layer_norm_backward(x, mean, rstd, gamma, dy, dgamma, dbeta));
  const auto wrong_rows = Tensor<double>::zeros({3});
  REQUIRE_THROWS_WITH(ops::layer_norm_backward(x, wrong_rows, rstd, gamma, dy, dgamma, dbeta),
                      Catch::Contains("layer_norm mean"));
  REQUIRE_THROWS_WITH(ops::layer_norm_backward(x, mean, wrong_rows, gamma, dy, dgamma, dbeta),
                      Catch::Contains("layer_norm rstd"));
  REQUIRE_THROWS_WITH(ops::layer_norm_backward(x, mean, rstd, gamma, dy, short_grad, dbeta),
                      Catch::Contains("layer_norm weight gradient"));
  REQUIRE_THROWS_WITH(ops::layer_norm_backward(x, mean, rstd, gamma, dy, dgamma, short_grad),
                      Catch::Contains("layer_norm bias gradient"));

  const std::vector<std::int32_t> t{0, 2, 1, 2};
  const auto targets = Tensor<std::int32_t>::from(t, {4});
  Tensor<double> lse;
  std::int64_t valid = 0;
  ops::cross_entropy(x, targets, lse, valid);
  REQUIRE_NOTHROW(ops::cross_entropy_backward(x, lse, targets, valid, 1.0));
  REQUIRE_THROWS_WITH(ops::cross_entropy_backward(x, wrong_rows, targets, valid, 1.0),
                      Catch::Contains("cross_entropy log-sum-exp"));
  REQUIRE_THROWS_WITH(ops::cross_entropy_backward(x, lse, Tensor<std::int32_t>::from({0, 1}, {2}), valid, 1.0),
                      Catch::Contains("but 2 targets"));
}

TEST_CASE("Sequential takes token ids through its first layer", "[nn][sequential]") {
  Generator gen(6);
  nn::Sequential<double> seq;
  auto emb = seq.add(std::make_shared<nn::Embedding<double>>(7, 3, gen));
  auto lin = seq.add(std::make_shared<nn::Linear<double>>(3, 2, true, gen));
  const std::vector<std::int32_t> ids{4, 0, 6, 4};
  nn::Cache<double> c;
  auto y = seq.forward_tokens(Tensor<std::int32_t>::from(ids, {2, 2}), c);
  REQUIRE(y.shape() == Shape{2, 2, 2});
  auto& table = emb->weight().value;
  auto& w = lin->weight().value;
  for (std::size_t r = 0; r < ids.size(); ++r)
    for (std::int64_t o = 0; o < 2; ++o) {
      double s = lin->bias()->value.at({o});
      for (std::int64_t k = 0; k < 3; ++k) s += table.at({ids[r], k}) * w.at({o, k});
      REQUIRE(y.data()[r * 2 + static_cast<std::size_t>(o)] == Approx(s).epsilon(1e-14));
    }
  // Backward adds dy W into the looked-up rows: row 4 twice, rows 1..3 and 5 never.
  seq.zero_grad();
  auto dy = Tensor<double>::full({2, 2, 2}, 1.0);
  REQUIRE_FALSE(seq.backward(dy, c).defined());
  auto& grad = emb->weight().grad;
  for (std::int64_t k = 0; k < 3; ++k) {
    const double col = w.at({0, k}) + w.at({1, k});
    REQUIRE(grad.at({4, k}) == Approx(2 * col).epsilon(1e-14));
    REQUIRE(grad.at({0, k}) == Approx(col).epsilon(1e-14));
    REQUIRE(grad.at({2, k}) == 0.0);
  }
  nn::Sequential<double> dense;
  dense.add(std::make_shared<nn::Linear<double>>(3, 2, true, gen));
  REQUIRE_THROWS_AS(dense.forward_tokens(Tensor<std::int32_t>::from(ids, {4}), c), ShapeError);
  REQUIRE_THROWS_AS(nn::Sequential<double>().forward_tokens(Tensor<std::int32_t>::from(ids, {4}), c), ShapeError);
}

TEST_CASE("activation gradients match finite differences", "[nn][gradcheck]") {
  nn::ReLU<double> relu;
  check_module_gradients(relu, random_input({4, 7}, 6));
  nn::GELU<double> gelu;
  check_module_gradients(gelu, random_input({4, 7}, 7, 3.0));
}

TEST_CASE("GELU forward matches the tanh formula", "[nn][gelu]") {
  nn::GELU<double> gelu;
  nn::Cache<double> c;
  auto x = random_input({50}, 8, 4.0);
  auto y = gelu.forward(x, c);
  for (std::int64_t i = 0; i < 50; ++i) {
    const double v = x.data()[i];
    REQUIRE(y.data()[i] ==
            Approx(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)))).epsilon(1e-12));
  }
}

TEST_CASE("LayerNorm gradients match finite differences", "[nn][gradcheck]") {
  nn::LayerNorm<double> ln(6);
  Generator g(9);
  for (auto& p : ln.named_parameters()) ops::uniform_(p.param->value, 0.5, 1.5, g);
  check_module_gradients(ln, random_input({5, 6}, 10));
}

TEST_CASE("Dropout is identity in eval mode and its backward reuses the mask", "[nn][dropout]") {
  nn::Dropout<double> drop(0.5, 3);
  auto x = random_input({200}, 11);
  nn::Cache<double> c;
  auto y = drop.forward(x, c);
  auto dy = Tensor<double>::full({200}, 1.0);
  auto dx = drop.backward(dy, c);
  int zeros = 0;
  for (std::int64_t i = 0; i < 200; ++i) {
    // d(y_i)/d(x_i) is the mask value: y = x * m, so dx = m = y / x.
    REQUIRE(dx.data()[i] == Approx(y.data()[i] / x.data()[i]));
    zeros += y.data()[i] == 0.0;
  }
  REQUIRE(zeros > 60);
  REQUIRE(zeros < 140);
  drop.train(false);
  auto ye = drop.forward(x, c);
  for (std::int64_t i = 0; i < 200; ++i) REQUIRE(ye.data()[i] == x.data()[i]);
}

TEST_CASE("MLP gradients match finite differences", "[nn][gradcheck]") {
  Generator gen(12);
  nn::MLP<double> mlp(6, {5, 4}, 3, nn::Activation::GELU, gen);
  check_module_gradients(mlp, random_input({4, 6}, 13));
  nn::MLP<double> relu_mlp(6, {8}, 3, nn::Activation::ReLU, gen);
  check_module_gradients(relu_mlp, random_input({4, 6}, 14));
  auto names = relu_mlp.named_parameters();
  REQUIRE(names.size() == 4);
  REQUIRE(names[0].name == "0.weight");
  REQUIRE(names[3].name == "2.bias");
}

TEST_CASE("CrossEntropyLoss gradient matches finite differences", "[nn][gradcheck]") {
  auto logits = random_input({5, 4}, 15, 3.0);
  auto targets = Tensor<std::int32_t>::from({0, 3, -100, 1, 2}, {5});
  nn::CrossEntropyLoss<double> ce;
  nn::Cache<double> c;
  ce.forward(logits, targets, c);
  auto d = ce.backward(c, 2.0);
  for (std::int64_t i = 0; i < logits.numel(); ++i) {
    const double h = 1e-6, orig = logits.data()[i];
    nn::Cache<double> c2;
    logits.data()[i] = orig + h;
    const double lp = ce.forward(logits, targets, c2);
    logits.data()[i] = orig - h;
    const double lm = ce.forward(logits, targets, c2);
    logits.data()[i] = orig;
    REQUIRE(d.data()[i] == Approx(2.0 * (lp - lm) / (2 * h)).margin(1e-8));
  }
  auto bad = Tensor<std::int32_t>::from({0, 4, 1, 1, 1}, {5});
  REQUIRE_THROWS_WITH(ce.forward(logits, bad, c), Catch::Contains("target 4 at row 1"));
}

TEST_CASE("gradient-ready hooks fire in reverse order of use", "[nn][hooks]") {
  Generator gen(16);
  nn::MLP<double> mlp(3, {4}, 2, nn::Activation::ReLU, gen);
  std::vector<std::string> order;
  for (auto& p : mlp.named_parameters()) {
    const std::string name = p.name;
    p.param->on_grad_ready = [&order, name](nn::Parameter<double>&) { order.push_back(name); };
  }
  nn::Cache<double> c;
  auto y = mlp.forward(random_input({2, 3}, 17), c);
  mlp.backward(Tensor<double>::full(y.shape(), 1.0), c);
  REQUIRE(order == std::vector<std::string>{"2.weight", "2.bias", "0.weight", "0.bias"});
  REQUIRE(c.empty());
}

TEST_CASE("flat parameters alias the module's parameters", "[nn][flat]") {
  Generator gen(18);
  nn::MLP<float> mlp(5, {3}, 2, nn::Activation::ReLU, gen);
  std::vector<std::vector<float>> before;
  for (auto& p : mlp.named_parameters()) before.push_back(p.param->value.to_vector());
  nn::FlatParameters<float> flat(mlp, 16);
  const auto& e = flat.entries();
  REQUIRE(e.size() == 4);
  // 15 weights padded to 16, 3 biases to 16, 6 weights to 16, 2 biases to 16.
  REQUIRE(e[1].offset == 16);
  REQUIRE(e[3].offset == 48);
  REQUIRE(flat.numel() == 64);
  auto params = mlp.named_parameters();
  for (std::size_t i = 0; i < params.size(); ++i) {
    REQUIRE(params[i].param->value.to_vector() == before[i]);
    REQUIRE(params[i].param->value.data() == flat.values().data() + e[i].offset);
    REQUIRE(params[i].param->grad.data() == flat.grads().data() + e[i].offset);
  }
  for (std::int64_t i = 15; i < 16; ++i) REQUIRE(flat.values().data()[i] == 0.0f);  // padding
}

namespace {
template <class T>
bool same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}
}  // namespace

TEMPLATE_TEST_CASE("residual_layer_norm is the residual add then layer_norm, bit for bit", "[nn][layer_norm]", float,
                   double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  // 37 columns: no multiple of a vector width, so a vectorised tail is covered too.
  const Shape shape{3, 5, 37};
  auto cast = [](const Tensor<double>& d) {
    auto t = Tensor<T>::empty(d.shape());
    for (std::int64_t i = 0; i < d.numel(); ++i) t.data()[i] = static_cast<T>(d.data()[i]);
    return t;
  };
  const auto x = cast(random_input(shape, 81, 2.0)), res = cast(random_input(shape, 82, 2.0));
  const auto gamma = cast(random_input({37}, 83)), beta = cast(random_input({37}, 84));
  const A eps = A(1e-5);

  // Forward: h = x + residual written out, and the norm of that h (GPT's block adds
  // the attention output into a copy of its input with axpy_).
  auto h_ref = res.clone();
  ops::axpy_(A(1), x, h_ref);
  Tensor<A> mean_ref, rstd_ref, mean, rstd;
  const auto y_ref = ops::layer_norm(h_ref, gamma, beta, eps, mean_ref, rstd_ref);
  Tensor<T> h;
  const auto y = ops::residual_layer_norm(x, res, gamma, beta, eps, h, mean, rstd);
  CHECK(same_bits(h, h_ref));
  CHECK(same_bits(y, y_ref));
  CHECK(same_bits(mean, mean_ref));
  CHECK(same_bits(rstd, rstd_ref));

  // Backward: dh = the norm's dx + the residual stream's gradient; dgamma and dbeta
  // accumulate onto what they held.
  const auto dy = cast(random_input(shape, 85)), dres = cast(random_input(shape, 86));
  const auto dg0 = cast(random_input({37}, 87)), db0 = cast(random_input({37}, 88));
  auto dg_ref = dg0.clone(), db_ref = db0.clone(), dg = dg0.clone(), db = db0.clone();
  auto dh_ref = ops::layer_norm_backward(h_ref, mean_ref, rstd_ref, gamma, dy, dg_ref, db_ref);
  ops::axpy_(A(1), dres, dh_ref);
  const auto dh = ops::residual_layer_norm_backward(h, mean, rstd, gamma, dy, dres, dg, db);
  CHECK(same_bits(dh, dh_ref));
  CHECK(same_bits(dg, dg_ref));
  CHECK(same_bits(db, db_ref));
  // dres moved the result: the fused form is not the plain backward by accident.
  auto dg_plain = dg0.clone(), db_plain = db0.clone();
  CHECK_FALSE(same_bits(dh, ops::layer_norm_backward(h_ref, mean_ref, rstd_ref, gamma, dy, dg_plain, db_plain)));
  CHECK(ops::residual_layer_norm_usable<T>(Device::cpu()));

  REQUIRE_THROWS_WITH(ops::residual_layer_norm(x, cast(random_input({3, 5, 36}, 89)), gamma, beta, eps, h, mean, rstd),
                      Catch::Contains("residual_layer_norm residual"));
  REQUIRE_THROWS_WITH(ops::residual_layer_norm_backward(h, mean, rstd, gamma, dy, cast(random_input({3, 5, 36}, 90)),
                                                        dg, db),
                      Catch::Contains("residual-stream gradient"));
}

}  // namespace test_modules
