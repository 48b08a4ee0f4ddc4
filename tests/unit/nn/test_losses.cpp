// Losses of nn/loss.hpp against formulas written out here in double (the
// definitions of torch.nn's losses, evaluated element by element with naive
// loops), and their gradients against central differences of forward.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/parallel/local.hpp>
#include <ptrain/ops/init.hpp>

namespace test_losses {

using namespace ptrain;
using nn::Reduction;

namespace {

Tensor<double> random_tensor(const Shape& s, std::uint64_t seed, double lo = -2.0, double hi = 2.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, lo, hi, g);
  return x;
}

// Reference per-element formulas (torch.nn documentation), independent of kernels/pointwise_math.hpp.
double ref_mse(double x, double y) { return (x - y) * (x - y); }
double ref_l1(double x, double y) { return std::fabs(x - y); }
double ref_smooth_l1(double x, double y, double beta) {
  const double z = std::fabs(x - y);
  if (beta == 0) return z;
  return z < beta ? 0.5 * z * z / beta : z - 0.5 * beta;
}
double ref_huber(double x, double y, double delta) {
  const double z = std::fabs(x - y);
  return z < delta ? 0.5 * z * z : delta * (z - 0.5 * delta);
}
// The textbook form -[pw y log(s) + (1 - y) log(1 - s)], s = 1 / (1 + e^-x): fine for moderate x.
double ref_bce(double x, double y, double pw) {
  const double s = 1.0 / (1.0 + std::exp(-x));
  return -(pw * y * std::log(s) + (1 - y) * std::log(1 - s));
}

double reduce(const std::vector<double>& v, Reduction r) {
  double s = 0;
  for (double e : v) s += e;
  return r == Reduction::Mean ? s / static_cast<double>(v.size()) : s;
}

// d loss / d input by central differences of `f` (which reads `x`), element by element.
std::vector<double> numeric_grad(Tensor<double>& x, const std::function<double()>& f, double h = 1e-6) {
  std::vector<double> g(static_cast<std::size_t>(x.numel()));
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double orig = x.data()[i];
    x.data()[i] = orig + h;
    const double lp = f();
    x.data()[i] = orig - h;
    const double lm = f();
    x.data()[i] = orig;
    g[static_cast<std::size_t>(i)] = (lp - lm) / (2 * h);
  }
  return g;
}

void require_close(const Tensor<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.numel() == static_cast<std::int64_t>(want.size()));
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    INFO("element " << i);
    REQUIRE(got.data()[i] == Approx(want[static_cast<std::size_t>(i)]).margin(tol));
  }
}

// Values against `ref` for every reduction, and gradients against finite differences:
// of the reduced loss (times dloss) and of sum(w * elements) for reduction none.
template <class Loss>
void check_pointwise(const std::function<Loss(Reduction)>& make,
                     const std::function<double(double, double, std::int64_t)>& ref, Tensor<double> x,
                     const Tensor<double>& y) {
  std::vector<double> want;
  for (std::int64_t i = 0; i < x.numel(); ++i) want.push_back(ref(x.data()[i], y.data()[i], i));
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    INFO("reduction " << ops::reduction_name(r));
    Loss loss = make(r);
    nn::Cache<double> c;
    REQUIRE(loss.forward(x, y, c) == Approx(reduce(want, r)).epsilon(1e-12));
    const Tensor<double> d = loss.backward(c, 1.7);
    require_close(d, numeric_grad(x, [&] {
                    nn::Cache<double> c2;
                    return 1.7 * loss.forward(x, y, c2);
                  }), 1e-7);
  }
  Loss none = make(Reduction::None);
  nn::Cache<double> c;
  require_close(none.forward_elements(x, y, c), want, 1e-12);
  const auto w = random_tensor(x.shape(), 77);
  const Tensor<double> d = none.backward_elements(w, c);
  require_close(d, numeric_grad(x, [&] {
                  nn::Cache<double> c2;
                  const auto e = none.forward_elements(x, y, c2);
                  double s = 0;
                  for (std::int64_t i = 0; i < e.numel(); ++i) s += w.data()[i] * e.data()[i];
                  return s;
                }), 1e-7);
  REQUIRE_THROWS_WITH(none.forward(x, y, c), Catch::Contains("[ptrain.loss.reduction]"));
}

}  // namespace

TEST_CASE("MSELoss and L1Loss follow torch's definitions and reductions", "[nn][loss][gradcheck]") {
  const auto x = random_tensor({3, 4}, 1), y = random_tensor({3, 4}, 2);
  check_pointwise<nn::MSELoss<double>>([](Reduction r) { return nn::MSELoss<double>(r); },
                                       [](double a, double b, std::int64_t) { return ref_mse(a, b); }, x, y);
  check_pointwise<nn::L1Loss<double>>([](Reduction r) { return nn::L1Loss<double>(r); },
                                      [](double a, double b, std::int64_t) { return ref_l1(a, b); }, x, y);
}

TEST_CASE("SmoothL1Loss and HuberLoss follow torch's definitions on both sides of the kink",
          "[nn][loss][gradcheck]") {
  // Differences spread over [-4, 4]: with beta = delta = 1.3 both branches occur.
  const auto x = random_tensor({5, 4}, 3, -2, 2), y = random_tensor({5, 4}, 4, -2, 2);
  for (double beta : {1.3, 0.4}) {
    INFO("beta/delta " << beta);
    check_pointwise<nn::SmoothL1Loss<double>>(
        [=](Reduction r) { return nn::SmoothL1Loss<double>(r, beta); },
        [=](double a, double b, std::int64_t) { return ref_smooth_l1(a, b, beta); }, x, y);
    check_pointwise<nn::HuberLoss<double>>([=](Reduction r) { return nn::HuberLoss<double>(r, beta); },
                                           [=](double a, double b, std::int64_t) { return ref_huber(a, b, beta); },
                                           x, y);
  }
  nn::SmoothL1Loss<double> l1_like(Reduction::Sum, 0.0);  // torch: beta 0 is L1Loss
  nn::Cache<double> c;
  double want = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) want += ref_l1(x.data()[i], y.data()[i]);
  REQUIRE(l1_like.forward(x, y, c) == Approx(want).epsilon(1e-12));
  REQUIRE_THROWS_WITH(nn::HuberLoss<double>(Reduction::Mean, 0.0), Catch::Contains("[ptrain.loss.delta]"));
}

TEST_CASE("BCEWithLogitsLoss with weight and pos_weight follows torch, and is stable for large logits",
          "[nn][loss][gradcheck]") {
  const std::int64_t rows = 4, classes = 3;
  const auto x = random_tensor({rows, classes}, 5, -3, 3);
  const auto y = random_tensor({rows, classes}, 6, 0, 1);  // soft targets in [0, 1]
  check_pointwise<nn::BCEWithLogitsLoss<double>>([](Reduction r) { return nn::BCEWithLogitsLoss<double>(r); },
                                                 [](double a, double b, std::int64_t) { return ref_bce(a, b, 1.0); },
                                                 x, y);
  const auto pos_weight = Tensor<double>::from({0.5, 2.0, 3.0}, {classes});
  const auto weight = Tensor<double>::from({1.5, 0.25, 1.0}, {classes});
  check_pointwise<nn::BCEWithLogitsLoss<double>>(
      [&](Reduction r) { return nn::BCEWithLogitsLoss<double>(r, weight, pos_weight); },
      [&](double a, double b, std::int64_t i) {
        return weight.data()[i % classes] * ref_bce(a, b, pos_weight.data()[i % classes]);
      },
      x, y);
  // A weight of the input's shape.
  const auto full = random_tensor({rows, classes}, 8, 0, 2);
  check_pointwise<nn::BCEWithLogitsLoss<double>>(
      [&](Reduction r) { return nn::BCEWithLogitsLoss<double>(r, full); },
      [&](double a, double b, std::int64_t i) { return full.data()[i] * ref_bce(a, b, 1.0); }, x, y);

  // |x| = 100: log(1 - sigmoid(100)) underflows in the textbook form; the loss is
  // softplus: 100 + log1p(e^-100) for (x = 100, y = 0) and pw (100 + ...) for (x = -100, y = 1).
  nn::BCEWithLogitsLoss<double> bce(Reduction::None, {}, Tensor<double>::from({2.0}, {1}));
  nn::Cache<double> c;
  const auto e = bce.forward_elements(Tensor<double>::from({100, -100, 100}, {3}),
                                      Tensor<double>::from({0, 1, 1}, {3}), c);
  REQUIRE(e.data()[0] == Approx(100.0).epsilon(1e-15));
  REQUIRE(e.data()[1] == Approx(200.0).epsilon(1e-15));
  REQUIRE(e.data()[2] == Approx(2 * std::exp(-100.0)).epsilon(1e-12));
  REQUIRE_THROWS_WITH(nn::BCEWithLogitsLoss<double>(Reduction::Mean, Tensor<double>::from({1, 2}, {2}))
                          .forward(x, y, c),
                      Catch::Contains("does not broadcast"));
}

TEST_CASE("NLLLoss on log-probabilities respects ignore_index and every reduction", "[nn][loss][gradcheck]") {
  auto logp = random_tensor({5, 4}, 9, -3, 0);
  const auto t = Tensor<std::int32_t>::from({2, -100, 0, 3, 3}, {5});
  std::vector<double> rows = {-logp.at({0, 2}), 0.0, -logp.at({2, 0}), -logp.at({3, 3}), -logp.at({4, 3})};
  const double total = rows[0] + rows[2] + rows[3] + rows[4];
  for (Reduction r : {Reduction::Mean, Reduction::Sum}) {
    INFO("reduction " << ops::reduction_name(r));
    nn::NLLLoss<double> nll(r);
    nn::Cache<double> c;
    REQUIRE(nll.forward(logp, t, c) == Approx(r == Reduction::Mean ? total / 4 : total).epsilon(1e-12));
    const auto d = nll.backward(c, 0.6);
    require_close(d, numeric_grad(logp, [&] {
                    nn::Cache<double> c2;
                    return 0.6 * nll.forward(logp, t, c2);
                  }), 1e-8);
  }
  nn::NLLLoss<double> none(Reduction::None);
  nn::Cache<double> c;
  require_close(none.forward_elements(logp, t, c), rows, 1e-15);
  const auto w = Tensor<double>::from({1, 2, 3, 4, 5}, {5});
  const auto d = none.backward_elements(w, c);
  for (std::int64_t i = 0; i < d.numel(); ++i) {
    const std::int64_t r = i / 4, col = i % 4;
    const double want = (t.data()[r] == col) ? -w.data()[r] : 0.0;
    REQUIRE(d.data()[i] == want);
  }
  nn::NLLLoss<double> custom(Reduction::Mean, 3);  // rows with target 3 are ignored
  REQUIRE(custom.forward(logp, Tensor<std::int32_t>::from({2, 1, 0, 3, 3}, {5}), c) ==
          Approx((-logp.at({0, 2}) - logp.at({1, 1}) - logp.at({2, 0})) / 3).epsilon(1e-12));
  REQUIRE_THROWS_WITH(none.forward_elements(logp, Tensor<std::int32_t>::from({0, 4, 1, 1, 1}, {5}), c),
                      Catch::Contains("[ptrain.loss.nll] a target lies outside [0, 4)"));
}

TEST_CASE("CrossEntropyLoss label smoothing follows torch's definition", "[nn][loss][gradcheck]") {
  auto logits = random_tensor({6, 5}, 10, -3, 3);
  const auto t = Tensor<std::int32_t>::from({4, 0, -100, 2, 2, 1}, {6});
  for (double eps : {0.0, 0.1, 0.35}) {
    INFO("label_smoothing " << eps);
    // Reference: (1 - eps) * -logp[t] + eps * mean_c(-logp[c]) per counted row, averaged over them.
    double total = 0;
    int counted = 0;
    for (std::int64_t r = 0; r < 6; ++r) {
      if (t.data()[r] == -100) continue;
      double mx = -1e300, s = 0, mean_logp = 0;
      for (std::int64_t c = 0; c < 5; ++c) mx = std::max(mx, logits.at({r, c}));
      for (std::int64_t c = 0; c < 5; ++c) s += std::exp(logits.at({r, c}) - mx);
      const double lse = mx + std::log(s);
      for (std::int64_t c = 0; c < 5; ++c) mean_logp += (logits.at({r, c}) - lse) / 5;
      total += (1 - eps) * (lse - logits.at({r, t.data()[r]})) - eps * mean_logp;
      ++counted;
    }
    nn::CrossEntropyLoss<double> ce(-100, eps);
    nn::Cache<double> c;
    REQUIRE(ce.forward(logits, t, c) == Approx(total / counted).epsilon(1e-12));
    const auto d = ce.backward(c, 1.3);
    require_close(d, numeric_grad(logits, [&] {
                    nn::Cache<double> c2;
                    return 1.3 * ce.forward(logits, t, c2);
                  }), 1e-8);
  }
  REQUIRE_THROWS_WITH(nn::CrossEntropyLoss<double>(-100, 1.5), Catch::Contains("[ptrain.loss.label_smoothing]"));
}

TEST_CASE("CrossEntropyLoss equals NLLLoss of LogSoftmax", "[nn][loss]") {
  const auto logits = random_tensor({4, 7}, 11, -4, 4);
  const auto t = Tensor<std::int32_t>::from({6, 0, 3, 3}, {4});
  nn::CrossEntropyLoss<double> ce;
  nn::LogSoftmax<double> lsm;
  nn::NLLLoss<double> nll;
  nn::Cache<double> c1, c2, c3;
  REQUIRE(ce.forward(logits, t, c1) == Approx(nll.forward(lsm.forward(logits, c2), t, c3)).epsilon(1e-13));
  const auto a = ce.backward(c1), b = lsm.backward(nll.backward(c3), c2);
  for (std::int64_t i = 0; i < a.numel(); ++i) REQUIRE(a.data()[i] == Approx(b.data()[i]).margin(1e-14));
}

TEST_CASE("CrossEntropyLoss::forward_backward writes forward and backward's gradient over the logits and keeps the "
          "loss in a DeviceLoss", "[nn][loss][fused]") {
  const auto logits = random_tensor({6, 5}, 17, -3, 3);
  const auto t = Tensor<std::int32_t>::from({4, 0, -100, 2, 2, 1}, {6});
  nn::CrossEntropyLoss<double> ce(-100, 0.1);
  nn::Cache<double> c;
  const double want = ce.forward(logits, t, c);
  const auto d = ce.backward(c, 1.3);
  ops::DeviceLoss window;
  auto work = logits.clone();
  const auto g = ce.forward_backward(work, t, window, 1.3, 0.5);
  CHECK(g.data() == work.data());  // in place
  CHECK(g.to_vector() == d.to_vector());
  CHECK(window.device() == Device::cpu());
  CHECK(window.sum() == 0.5 * want);
  CHECK(window.weight() == 0.5);
  CHECK(window.mean() == want);
  auto again = logits.clone();
  ce.forward_backward(again, t, window, 1.3, 0.5);
  CHECK(window.mean() == Approx(want).epsilon(1e-15));
  window.reset();
  CHECK(window.sum() == 0.0);
  CHECK(window.mean() == 0.0);
  auto bad = logits.clone();
  REQUIRE_THROWS_WITH(ce.forward_backward(bad, Tensor<std::int32_t>::from({4, 0, 5, 2, 2, 1}, {6}), window),
                      Catch::Contains("[ptrain.cross_entropy] target 5 at row 2"));
}

TEST_CASE("device_cross_entropy: an engine's step with the loss kept in a DeviceLoss", "[nn][loss][fused]") {
  // The same model twice; the default cross-entropy against the fused one.
  auto run = [](bool fused, ops::DeviceLoss& window, std::vector<double>& grads) {
    Generator gen(31);
    nn::Linear<double> head(4, 7, true, gen);
    parallel::Local<double> engine(head);
    if (fused) engine.set_loss(parallel::device_cross_entropy<double>(window, -100, 0.05));
    else engine.set_loss(parallel::loss_fn<double>(nn::CrossEntropyLoss<double>(-100, 0.05)));
    const auto x = random_tensor({5, 4}, 32);
    const auto t = Tensor<std::int32_t>::from({6, 0, -100, 3, 3}, {5});
    engine.zero_grad();
    double loss = engine.forward_backward(x, t, 0.25);
    loss += engine.forward_backward(x, t, 0.75);  // accumulates, as micro-batches do
    grads = engine.parameters().grads().to_vector();
    const double eval = engine.eval_loss(x, t);
    return std::pair{loss, eval};
  };
  ops::DeviceLoss unused, window;
  std::vector<double> g_ref, g;
  const auto [loss_ref, eval_ref] = run(false, unused, g_ref);
  const auto [loss, eval] = run(true, window, g);
  CHECK(std::isnan(loss));  // training calls leave the loss in the window
  CHECK(window.weight() == 1.0);
  CHECK(window.mean() == Approx(loss_ref / 2).epsilon(1e-15));  // both batches are the same: the mean is one loss
  CHECK(eval == eval_ref);
  CHECK(g == g_ref);
}

TEST_CASE("A loss given the wrong kind of targets says which it needs", "[nn][loss]") {
  const auto x = random_tensor({3, 2}, 12);
  const auto ids = Tensor<std::int32_t>::from({0, 1, 1}, {3});
  nn::Cache<double> c;
  nn::MSELoss<double> mse;
  REQUIRE_THROWS_WITH(mse.forward(x, ids, c),
                      Catch::Contains("[ptrain.loss.targets] MSELoss takes floating-point target values (F64)"));
  nn::CrossEntropyLoss<double> ce;
  REQUIRE_THROWS_WITH(ce.forward(x, random_tensor({3, 2}, 13), c),
                      Catch::Contains("[ptrain.loss.targets] CrossEntropyLoss takes int32 class ids"));
  REQUIRE_THROWS_WITH(mse.forward(x, random_tensor({2, 3}, 14), c), Catch::Contains("[ptrain.loss.shape] MSELoss"));
  REQUIRE_THROWS_WITH(mse.backward(c), Catch::Contains("without a forward"));
}

TEST_CASE("Float and bf16 losses agree with double", "[nn][loss][bf16]") {
  const auto xd = random_tensor({8, 3}, 15), yd = random_tensor({8, 3}, 16, 0, 1);
  auto to = [](const Tensor<double>& d, auto tag) {
    using E = decltype(tag);
    auto out = Tensor<E>::empty(d.shape());
    for (std::int64_t i = 0; i < d.numel(); ++i) out.data()[i] = E(static_cast<float>(d.data()[i]));
    return out;
  };
  nn::Cache<double> cd;
  nn::BCEWithLogitsLoss<double> bd;
  const double want = bd.forward(xd, yd, cd);
  const auto gd = bd.backward(cd);
  nn::Cache<float> cf;
  nn::BCEWithLogitsLoss<float> bf;
  REQUIRE(bf.forward(to(xd, 0.0f), to(yd, 0.0f), cf) == Approx(want).epsilon(1e-6));
  const auto gf = bf.backward(cf);
  nn::Cache<bf16> cb;
  nn::BCEWithLogitsLoss<bf16> bb;
  const auto xb = to(xd, bf16{}), yb = to(yd, bf16{});
  REQUIRE(bb.forward(xb, yb, cb) == Approx(want).epsilon(2e-2));
  const auto gb = bb.backward(cb);
  for (std::int64_t i = 0; i < gd.numel(); ++i) {
    REQUIRE(gf.data()[i] == Approx(gd.data()[i]).margin(1e-7));
    REQUIRE(static_cast<float>(gb.data()[i]) == Approx(gd.data()[i]).margin(2e-3));
  }
}

}  // namespace test_losses
