// Optimizer steps against values worked out by hand.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/clip.hpp>
#include <ptrain/optim/schedule.hpp>
#include <ptrain/optim/sgd.hpp>

namespace test_optim {

using namespace ptrain;

namespace {
// A one-parameter "model": values and grads of a few elements, no padding.
struct Tiny {
  Tensor<double> values, grads;
  std::vector<nn::FlatEntry<double>> entries;
  Tiny(std::vector<double> v, std::vector<double> g) {
    const auto n = static_cast<std::int64_t>(v.size());
    values = Tensor<double>::from(v, {n});
    grads = Tensor<double>::from(g, {n});
    entries = {{"w", 0, Shape{n}, nullptr}};
  }
};
}  // namespace

TEST_CASE("SGD with momentum follows torch.optim.SGD", "[optim][sgd]") {
  // p = 1, g = 0.5, lr 0.1, momentum 0.9:
  // step 1: buf = 0.5,                p = 1 - 0.05 = 0.95
  // step 2: buf = 0.9*0.5 + 0.5 = 0.95, p = 0.95 - 0.095 = 0.855
  Tiny t({1.0}, {0.5});
  optim::SGD<double> sgd(t.values, t.grads, t.entries, {.lr = 0.1, .momentum = 0.9});
  sgd.step();
  REQUIRE(t.values.data()[0] == Approx(0.95).epsilon(1e-15));
  sgd.step();
  REQUIRE(t.values.data()[0] == Approx(0.855).epsilon(1e-15));

  // Nesterov with weight decay 0.1: d = 0.5 + 0.1*1 = 0.6; buf = 0.6; d = 0.6 + 0.9*0.6 = 1.14; p = 1 - 0.114
  Tiny n({1.0}, {0.5});
  optim::SGD<double> nes(n.values, n.grads, n.entries,
                         {.lr = 0.1, .momentum = 0.9, .nesterov = true, .weight_decay = 0.1});
  nes.step();
  REQUIRE(n.values.data()[0] == Approx(0.886).epsilon(1e-15));
  REQUIRE_THROWS_AS(optim::SGD<double>(n.values, n.grads, n.entries, {.nesterov = true}), Error);
}

TEST_CASE("AdamW follows torch.optim.AdamW", "[optim][adamw]") {
  // p = 1, g = 0.5, lr 0.1, wd 0.01, betas (0.9, 0.999), eps 1e-8.
  // step 1: p = 1*(1 - 0.001) = 0.999; m = 0.05, v = 0.00025; m_hat = 0.5, v_hat = 0.25
  //         p -= 0.1 * 0.5 / (0.5 + 1e-8)  ->  0.899 (+2e-9)
  Tiny t({1.0, -2.0}, {0.5, 0.0});
  optim::AdamW<double> opt(t.values, t.grads, t.entries, {.lr = 0.1, .weight_decay = 0.01});
  opt.step();
  REQUIRE(t.values.data()[0] == Approx(0.999 - 0.1 * 0.5 / (0.5 + 1e-8)).epsilon(1e-15));
  REQUIRE(t.values.data()[1] == Approx(-2.0 * 0.999).epsilon(1e-15));  // zero gradient: only decay
  // step 2 with g = 0.5 again: m = 0.095, v = 0.00049975; bc1 = 0.19, bc2 = 0.001999
  //   m_hat = 0.5, v_hat = 0.25 -> the step is again lr * 0.5 / (0.5 + eps) after decay
  const double p1 = t.values.data()[0];
  opt.step();
  REQUIRE(t.values.data()[0] == Approx(p1 * 0.999 - 0.1 * 0.5 / (0.5 + 1e-8)).epsilon(1e-13));
  REQUIRE(opt.steps() == 2);
  auto state = opt.state_tensors();
  REQUIRE(state.size() == 2);
  REQUIRE(state[0].first == "w.exp_avg");
  REQUIRE(state[0].second.data()[0] == Approx(0.095).epsilon(1e-15));
  REQUIRE(state[1].first == "w.exp_avg_sq");
  REQUIRE(state[1].second.data()[0] == Approx(0.00049975).epsilon(1e-12));
}

TEST_CASE("a decay filter exempts parameters from weight decay", "[optim][adamw]") {
  Generator gen(3);
  nn::Linear<double> lin(3, 2, true, gen);
  nn::FlatParameters<double> flat(lin);
  const auto w0 = lin.weight().value.to_vector();
  const auto b0 = lin.bias()->value.to_vector();
  // Zero gradients: AdamW moves a parameter only through its decay.
  optim::AdamW<double> opt(flat, {.lr = 0.5, .weight_decay = 0.1},
                           [](const std::string& name) { return name != "bias"; });
  opt.step();
  const auto w1 = lin.weight().value.to_vector();
  const auto b1 = lin.bias()->value.to_vector();
  for (std::size_t i = 0; i < w0.size(); ++i) REQUIRE(w1[i] == Approx(w0[i] * 0.95).epsilon(1e-15));
  for (std::size_t i = 0; i < b0.size(); ++i) REQUIRE(b1[i] == b0[i]);
}

TEST_CASE("optimizers on FlatParameters refuse parameters rebound after packing", "[optim]") {
  Generator gen(4);
  nn::Linear<double> lin(3, 2, true, gen);
  nn::FlatParameters<double> flat(lin);
  optim::SGD<double> sgd(flat, {.lr = 0.1});
  optim::AdamW<double> adamw(flat, {.lr = 0.1});
  sgd.step();
  adamw.step();
  lin.weight().value.copy_(lin.weight().value.clone());  // in place: still bound
  sgd.step();
  lin.bias()->value = lin.bias()->value.clone();  // what module.to() to another device does
  const double before = lin.bias()->value.to_vector()[0];
  const auto unbound = Catch::Contains("[ptrain.flat.unbound] parameter bias is no longer a view");
  CHECK_THROWS_WITH(sgd.step(), unbound);
  CHECK_THROWS_WITH(adamw.step(), unbound);
  CHECK(lin.bias()->value.to_vector()[0] == before);
}

TEST_CASE("optimizers refuse options that would silently ruin training", "[optim]") {
  Tiny t({1.0, 2.0}, {0.1, 0.2});
  auto adamw = [&](optim::AdamWOptions o) { optim::AdamW<double> opt(t.values, t.grads, t.entries, o); };
  auto sgd = [&](optim::SGDOptions o) { optim::SGD<double> opt(t.values, t.grads, t.entries, o); };
  CHECK_THROWS_WITH(adamw({.lr = -1}), Catch::Contains("[ptrain.optim.lr]"));
  CHECK_THROWS_WITH(adamw({.lr = std::nan("")}), Catch::Contains("[ptrain.optim.lr]"));
  CHECK_THROWS_WITH(adamw({.beta1 = 1.0}), Catch::Contains("AdamW beta1 1"));
  CHECK_THROWS_WITH(adamw({.beta2 = -0.1}), Catch::Contains("AdamW beta2"));
  CHECK_THROWS_WITH(adamw({.eps = -1e-8}), Catch::Contains("AdamW eps"));
  CHECK_THROWS_WITH(adamw({.weight_decay = -5}), Catch::Contains("AdamW weight_decay"));
  CHECK_THROWS_WITH(sgd({.lr = 0.1, .momentum = -0.9}), Catch::Contains("SGD momentum"));
  CHECK_THROWS_WITH(sgd({.lr = 0.1, .dampening = 2}), Catch::Contains("SGD dampening"));
  CHECK_THROWS_WITH(sgd({.lr = 0.1, .weight_decay = -1}), Catch::Contains("SGD weight_decay"));
  CHECK_NOTHROW(adamw({.lr = 0, .beta1 = 0, .beta2 = 0, .eps = 0, .weight_decay = 0}));
  optim::SGD<double> ok(t.values, t.grads, t.entries, {.lr = 0.1});
  CHECK_THROWS_WITH(ok.set_lr(INFINITY), Catch::Contains("[ptrain.optim.lr]"));
  CHECK(ok.lr() == 0.1);
}

namespace {
/// A Linear's flat parameters with gradients filled from random values in [-scale, scale).
template <class T>
struct Model {
  Generator gen{21};
  nn::Linear<T> lin{5, 3, true, gen};
  nn::FlatParameters<T> flat{lin};
  explicit Model(double scale) {
    auto& g = flat.grads();
    std::vector<T> v(static_cast<std::size_t>(g.numel()));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = T(static_cast<float>(scale * (2 * random_uniform(5, i) - 1)));
    g.copy_(Tensor<T>::from(v, g.shape()));
  }
};
bool no_bias_decay(const std::string& name) { return name != "bias"; }

/// One AdamW step in double from p, g (weight decay wd where decay[i]), clipped to max_norm (0: off).
std::vector<double> naive_adamw(std::vector<double> p, std::vector<double> g, const std::vector<bool>& decay,
                                double lr, double wd, double max_norm) {
  double sq = 0;
  for (double x : g) sq += x * x;
  const double coef = max_norm > 0 ? std::min(1.0, max_norm / (std::sqrt(sq) + 1e-6)) : 1.0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double gi = g[i] * coef, m = 0.1 * gi, v = 0.001 * gi * gi;
    const double mhat = m / 0.1, vhat = v / 0.001;
    p[i] = p[i] * (1 - lr * (decay[i] ? wd : 0.0)) - lr * mhat / (std::sqrt(vhat) + 1e-8);
  }
  return p;
}
}  // namespace

TEST_CASE("AdamW in one call over the ranges gives the bits of the range-by-range update",
          "[optim][adamw][fused]") {
  // max_grad_norm far above the norm takes the one-call path (Note [AdamW in one launch]) and clips nothing.
  Model<float> a(1.0), b(1.0);
  optim::AdamW<float> per_range(a.flat, {.lr = 0.05, .weight_decay = 0.1}, no_bias_decay);
  optim::AdamW<float> one_call(b.flat, {.lr = 0.05, .weight_decay = 0.1, .max_grad_norm = 1e30}, no_bias_decay);
  for (int s = 0; s < 3; ++s) {
    per_range.step();
    one_call.step();
  }
  const auto va = a.flat.values().to_vector(), vb = b.flat.values().to_vector();
  CHECK(std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)) == 0);
  CHECK(one_call.grad_sumsq().to_vector()[0] == Approx(optim::clip_grad_norm_(a.flat.grads(), 1e30) *
                                                       optim::clip_grad_norm_(a.flat.grads(), 1e30)));
  CHECK(b.flat.grads().to_vector() == a.flat.grads().to_vector());  // clipping in the update leaves the gradients
}

TEST_CASE("AdamW clips inside the update as clip_grad_norm_ before it", "[optim][adamw][fused]") {
  Model<float> a(3.0), b(3.0);
  const auto p0 = a.flat.values().to_vector();
  const auto g0 = a.flat.grads().to_vector();
  optim::AdamW<float> before(a.flat, {.lr = 0.05, .weight_decay = 0.1}, no_bias_decay);
  optim::AdamW<float> inside(b.flat, {.lr = 0.05, .weight_decay = 0.1, .max_grad_norm = 0.5}, no_bias_decay);
  const double norm = optim::clip_grad_norm_(a.flat.grads(), 0.5);
  REQUIRE(norm > 1.0);  // the clipping matters
  before.step();
  inside.step();
  const auto va = a.flat.values().to_vector(), vb = b.flat.values().to_vector();
  CHECK(std::memcmp(va.data(), vb.data(), va.size() * sizeof(float)) == 0);
  CHECK(std::sqrt(inside.grad_sumsq().to_vector()[0]) == Approx(norm).epsilon(1e-12));
  // Against the definition in double: weights decay, the bias does not.
  std::vector<bool> decay(p0.size(), true);
  const auto& e = b.flat.entries();
  for (const auto& en : e)
    if (en.name == "bias")
      for (std::int64_t i = 0; i < en.shape.numel(); ++i) decay[static_cast<std::size_t>(en.offset + i)] = false;
  const auto want = naive_adamw({p0.begin(), p0.end()}, {g0.begin(), g0.end()}, decay, 0.05, 0.1, 0.5);
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(vb[i] == Approx(want[i]).margin(1e-6));
}

TEST_CASE("AdamW on bf16 parameters rounds the master copy stochastically", "[optim][adamw][fused]") {
  Model<bf16> a(1.0), b(1.0);
  optim::AdamW<bf16> nearest(a.flat, {.lr = 1e-3, .weight_decay = 0.1});
  optim::AdamW<bf16> stochastic(b.flat, {.lr = 1e-3, .weight_decay = 0.1, .stochastic_rounding = true, .seed = 9});
  nearest.step();
  stochastic.step();
  // The fp32 master copies agree bit for bit; the bf16 parameters are a neighbour of the master
  // value (nearest rounding: the nearer one), and stochastic rounding moves some of them.
  const auto& ma = nearest.flat_state()[2].second;
  const auto& mb = stochastic.flat_state()[2].second;
  REQUIRE(nearest.flat_state()[2].first == "master");
  CHECK(ma.to_vector() == mb.to_vector());
  const auto pa = a.flat.values().to_vector(), pb = b.flat.values().to_vector();
  const auto master = mb.to_vector();
  int moved = 0;
  for (std::size_t i = 0; i < master.size(); ++i) {
    const float m = master[i], na = static_cast<float>(pa[i]), sb = static_cast<float>(pb[i]);
    CHECK(na == static_cast<float>(bf16(m)));
    const float ulp = std::ldexp(1.0f, std::ilogb(m) - 7);  // bf16's gap at m
    CHECK(std::abs(sb - m) <= ulp);
    CHECK((sb == na || (sb - m) * (na - m) <= 0));  // nearest, or the neighbour on m's other side
    moved += sb != na;
  }
  CHECK(moved > 0);
  Model<float> c(1.0);
  CHECK_THROWS_WITH(optim::AdamW<float>(c.flat, {.stochastic_rounding = true}),
                    Catch::Contains("stochastic_rounding rounds bf16"));
}

namespace {
// Two linears, the first frozen; gradients of the second from random_uniform.
template <class T>
struct HalfFrozen {
  Generator gen{22};
  nn::Sequential<T> model;
  std::unique_ptr<nn::FlatParameters<T>> flat;
  HalfFrozen() {
    model.add(std::make_shared<nn::Linear<T>>(6, 5, true, gen))->requires_grad_(false);
    model.add(std::make_shared<nn::Linear<T>>(5, 3, true, gen));
    flat = std::make_unique<nn::FlatParameters<T>>(model);
    auto& g = flat->grads();
    std::vector<T> v(static_cast<std::size_t>(g.numel()), T(0.0f));  // the padding stays zero, as in training
    for (const auto& e : flat->entries())
      for (std::int64_t i = e.offset; i < e.offset + e.numel(); ++i) {
        const double u = random_uniform(6, static_cast<std::uint64_t>(i));
        v[static_cast<std::size_t>(i)] = T(static_cast<float>(3 * (2 * u - 1)));
      }
    g.copy_(Tensor<T>::from(v, g.shape()));
  }
};

template <class T>
void check_adamw_skips_frozen(double tol) {
  HalfFrozen<T> m;
  const auto p0 = m.flat->values().to_vector(), g0 = m.flat->grads().to_vector();
  const auto as_float = [](const Tensor<T>& t) {
    std::vector<float> v;
    for (auto x : t.to_vector()) v.push_back(static_cast<float>(x));
    return v;
  };
  const auto frozen0 = as_float(m.flat->frozen_values());
  std::vector<std::string> asked;
  optim::AdamW<T> opt(*m.flat, {.lr = 0.05, .weight_decay = 0.1, .max_grad_norm = 0.5}, [&](const std::string& n) {
    asked.push_back(n);
    return n.find("bias") == std::string::npos;
  });
  CHECK(asked == std::vector<std::string>{"1.weight", "1.bias"});  // the decay filter sees trainable names only
  // State (and for bf16 the fp32 master copy) covers values(): 15 + 3 elements padded to 32, not the frozen 36.
  CHECK(m.flat->values().numel() == 32);
  CHECK(opt.flat_state().size() == (std::is_same_v<T, bf16> ? 3u : 2u));
  for (const auto& [kind, t] : opt.flat_state()) CHECK(t.numel() == 32);
  for (const auto& [name, t] : opt.state_tensors()) CHECK(name.rfind("1.", 0) == 0);
  opt.step();
  std::vector<bool> decay(p0.size(), true);
  for (const auto& e : m.flat->entries())
    if (e.name == "1.bias")
      for (std::int64_t i = 0; i < e.numel(); ++i) decay[static_cast<std::size_t>(e.offset + i)] = false;
  std::vector<double> pd, gd;
  for (auto x : p0) pd.push_back(static_cast<double>(static_cast<float>(x)));
  for (auto x : g0) gd.push_back(static_cast<double>(static_cast<float>(x)));
  const auto want = naive_adamw(pd, gd, decay, 0.05, 0.1, 0.5);  // the clip's norm is the trainable gradients'
  const auto got = m.flat->values().to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(static_cast<float>(got[i]) == Approx(want[i]).margin(tol));
  CHECK(as_float(m.flat->frozen_values()) == frozen0);
}
}  // namespace

TEST_CASE("AdamW on FlatParameters with frozen parameters: state, decay, clipping and bf16 masters for the "
          "trainable ones only", "[optim][adamw][frozen]") {
  check_adamw_skips_frozen<float>(1e-6);
  check_adamw_skips_frozen<bf16>(1e-2);  // the bf16 value of the fp32 master
  // clip_grad_norm_ over grads() is the norm of the trainable gradients.
  HalfFrozen<double> m;
  double sq = 0;
  for (auto& p : m.model.named_trainable_parameters())
    for (double x : p.param->grad.to_vector()) sq += x * x;
  CHECK(optim::clip_grad_norm_(m.flat->grads(), 1e9) == Approx(std::sqrt(sq)).epsilon(1e-14));
}

TEST_CASE("warmup + cosine schedule", "[optim][schedule]") {
  optim::WarmupCosine s{.base_lr = 1.0, .warmup = 10, .total = 110, .min_lr = 0.1};
  REQUIRE(s(0) == Approx(0.1));
  REQUIRE(s(9) == Approx(1.0));
  REQUIRE(s(10) == Approx(1.0));
  REQUIRE(s(60) == Approx(0.55));  // half way: min + (base - min) / 2
  REQUIRE(s(110) == Approx(0.1));
  REQUIRE(s(500) == Approx(0.1));
}

TEST_CASE("global-norm clipping", "[optim][clip]") {
  auto g = Tensor<double>::from({3.0, 4.0}, {2});
  REQUIRE(optim::clip_grad_norm_(g, 10.0) == Approx(5.0));
  REQUIRE(g.data()[0] == 3.0);  // below the limit: unchanged
  REQUIRE(optim::clip_grad_norm_(g, 1.0) == Approx(5.0));
  REQUIRE(g.data()[0] == Approx(0.6).epsilon(1e-6));
  REQUIRE(g.data()[1] == Approx(0.8).epsilon(1e-6));
  // A reduce function sees the local sum of squares (here: pretend 3 ranks hold equal parts).
  auto h = Tensor<double>::from({1.0, 1.0}, {2});
  REQUIRE(optim::clip_grad_norm_(h, 100.0, [](double s) { return 3 * s; }) == Approx(std::sqrt(6.0)));
}

}  // namespace test_optim
