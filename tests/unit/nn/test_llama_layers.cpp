// Llama-family layers on the CPU: RMSNorm, the SwiGLU MLP, rotary position
// embedding (with Llama 3's frequency scaling) and grouped-query attention.
// References are plain loops written here from the published formulas (Hugging
// Face's LlamaRMSNorm, LlamaMLP, rotate_half / apply_rotary_pos_emb,
// _compute_llama3_parameters, LlamaAttention with repeat_kv); gradients are
// checked by finite differences in double.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <ptrain/nn/gqa_attention.hpp>
#include <ptrain/nn/rms_norm.hpp>
#include <ptrain/nn/swiglu.hpp>
#include <vector>

#include "unit/gradcheck.hpp"

namespace test_llama_layers {

using namespace ptrain;
using Catch::Matchers::Contains;
using ptrain::testing::random_tensor;
using ptrain::testing::check_module_gradients;

namespace {

void randomize(nn::Module<double>& m, std::uint64_t seed) {
  Generator g(seed);
  for (auto& p : m.named_parameters()) ops::uniform_(p.param->value, -0.5, 0.5, g);
}

double max_abs_diff(const Tensor<double>& a, const std::vector<double>& b) {
  REQUIRE(static_cast<std::size_t>(a.numel()) == b.size());
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.data()[i] - b[static_cast<std::size_t>(i)]));
  return m;
}

// y[r, o] = b[o] + sum_i x[r, i] W[o, i] for rows r of x's last dimension.
std::vector<double> naive_linear(const std::vector<double>& x, std::int64_t rows, std::int64_t in,
                                 nn::Linear<double>& lin) {
  const auto& w = lin.weight().value;
  const std::int64_t out = w.size(0);
  std::vector<double> y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = lin.bias() ? lin.bias()->value.data()[o] : 0.0;
      for (std::int64_t i = 0; i < in; ++i) s += x[static_cast<std::size_t>(r * in + i)] * w.data()[o * in + i];
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  return y;
}

// Hugging Face's _compute_llama3_parameters, step by step as written there.
std::vector<double> reference_inv_freq(std::int64_t dim, double base, const ops::Llama3RopeScaling* sc) {
  std::vector<double> inv;
  for (std::int64_t i = 0; i < dim; i += 2) inv.push_back(1.0 / std::pow(base, double(i) / double(dim)));
  if (!sc) return inv;
  const double pi = 3.14159265358979323846, old_ctx = double(sc->original_max_position_embeddings);
  const double low_freq_wavelen = old_ctx / sc->low_freq_factor, high_freq_wavelen = old_ctx / sc->high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2 * pi / f;
    double llama = wavelen > low_freq_wavelen ? f / sc->factor : f;
    const double smooth = (old_ctx / wavelen - sc->low_freq_factor) / (sc->high_freq_factor - sc->low_freq_factor);
    const double smoothed = (1 - smooth) * llama / sc->factor + smooth * llama;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    f = medium ? smoothed : llama;
  }
  return inv;
}

// apply_rotary_pos_emb on one head vector: x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),
// rotate_half(x) = cat(-x2, x1).
void reference_rope(double* x, std::int64_t D, double pos, const std::vector<double>& inv) {
  std::vector<double> rot(static_cast<std::size_t>(D)), out(static_cast<std::size_t>(D));
  const std::int64_t half = D / 2;
  for (std::int64_t i = 0; i < half; ++i) {
    rot[static_cast<std::size_t>(i)] = -x[i + half];
    rot[static_cast<std::size_t>(i + half)] = x[i];
  }
  for (std::int64_t i = 0; i < D; ++i) {
    const double freq = pos * inv[static_cast<std::size_t>(i % half)];
    out[static_cast<std::size_t>(i)] = x[i] * std::cos(freq) + rot[static_cast<std::size_t>(i)] * std::sin(freq);
  }
  for (std::int64_t i = 0; i < D; ++i) x[i] = out[static_cast<std::size_t>(i)];
}

double pos_of(const Tensor<std::int32_t>& positions, std::int64_t b, std::int64_t s) {
  if (!positions.defined()) return double(s);
  return positions.dim() == 1 ? positions.data()[s] : positions.data()[b * positions.size(1) + s];
}

// LlamaAttention with repeat_kv: projections, rotary on q and k, causal softmax per
// query head over the keys of head h / (H / Hkv), o_proj; all in plain loops.
std::vector<double> naive_gqa(nn::GroupedQueryAttention<double>& attn, const Tensor<double>& x,
                              const Tensor<std::int32_t>& positions, const ops::Llama3RopeScaling* sc, double theta) {
  const std::int64_t B = x.size(0), S = x.size(1), C = x.size(2), H = attn.n_head(), Hkv = attn.n_kv_head();
  const std::int64_t D = C / H, rows = B * S;
  const std::vector<double> xv = x.to_vector();
  auto q = naive_linear(xv, rows, C, attn.q_proj());
  auto k = naive_linear(xv, rows, C, attn.k_proj());
  auto v = naive_linear(xv, rows, C, attn.v_proj());
  const auto inv = reference_inv_freq(D, theta, sc);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s) {
      for (std::int64_t h = 0; h < H; ++h)
        reference_rope(&q[static_cast<std::size_t>(((b * S + s) * H + h) * D)], D, pos_of(positions, b, s), inv);
      for (std::int64_t h = 0; h < Hkv; ++h)
        reference_rope(&k[static_cast<std::size_t>(((b * S + s) * Hkv + h) * D)], D, pos_of(positions, b, s), inv);
    }
  std::vector<double> y(static_cast<std::size_t>(rows * H * D), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t g = h / (H / Hkv);
      for (std::int64_t i = 0; i < S; ++i) {
        std::vector<double> score(static_cast<std::size_t>(i + 1));
        double mx = -1e300;
        for (std::int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += q[static_cast<std::size_t>(((b * S + i) * H + h) * D + d)] *
                   k[static_cast<std::size_t>(((b * S + j) * Hkv + g) * D + d)];
          score[static_cast<std::size_t>(j)] = dot / std::sqrt(double(D));
          mx = std::max(mx, score[static_cast<std::size_t>(j)]);
        }
        double z = 0;
        for (auto& e : score) z += (e = std::exp(e - mx));
        for (std::int64_t j = 0; j <= i; ++j)
          for (std::int64_t d = 0; d < D; ++d)
            y[static_cast<std::size_t>(((b * S + i) * H + h) * D + d)] +=
                score[static_cast<std::size_t>(j)] / z * v[static_cast<std::size_t>(((b * S + j) * Hkv + g) * D + d)];
      }
    }
  return naive_linear(y, rows, H * D, attn.o_proj());
}

// Runs a GroupedQueryAttention with fixed position ids through the one-tensor Module interface.
class PositionedAttention : public nn::Module<double> {
 public:
  PositionedAttention(std::shared_ptr<nn::GroupedQueryAttention<double>> attn, Tensor<std::int32_t> positions)
      : attn_(register_module("attn", attn)), positions_(positions) {}
  Tensor<double> forward(const Tensor<double>& x, nn::Cache<double>& cache) override {
    return attn_->forward(x, positions_, cache.child(0));
  }
  Tensor<double> backward(const Tensor<double>& dy, nn::Cache<double>& cache) override {
    return attn_->backward(dy, cache.child(0));
  }
  std::string describe() const override { return "PositionedAttention"; }

 private:
  std::shared_ptr<nn::GroupedQueryAttention<double>> attn_;
  Tensor<std::int32_t> positions_;
};

}  // namespace

TEST_CASE("RMSNorm matches x / sqrt(mean(x^2) + eps) * w and its gradients", "[nn][llama]") {
  nn::RMSNorm<double> norm(6, 1e-5);
  norm.weight().value.copy_(random_tensor({6}, 3, 0.5, 1.5));
  auto x = random_tensor({2, 3, 6}, 4, -2.0, 2.0);
  nn::Cache<double> cache;
  auto y = norm.forward(x, cache);
  std::vector<double> ref(static_cast<std::size_t>(x.numel()));
  for (std::int64_t r = 0; r < 6; ++r) {
    double ms = 0;
    for (std::int64_t i = 0; i < 6; ++i) ms += x.data()[r * 6 + i] * x.data()[r * 6 + i] / 6.0;
    for (std::int64_t i = 0; i < 6; ++i)
      ref[static_cast<std::size_t>(r * 6 + i)] =
          x.data()[r * 6 + i] / std::sqrt(ms + 1e-5) * norm.weight().value.data()[i];
  }
  REQUIRE(max_abs_diff(y, ref) < 1e-14);
  check_module_gradients(norm, x);
  REQUIRE_THROWS_WITH(norm.forward(random_tensor({2, 5}, 1), cache), Contains("[ptrain.rms_norm]") && Contains("6"));
  Tensor<double> rstd;
  REQUIRE_THROWS_WITH(ops::rms_norm(x, random_tensor({5}, 1), 1e-5, rstd), Contains("rms_norm weight"));
  REQUIRE_THROWS_WITH(nn::RMSNorm<double>(0), Contains("[ptrain.rms_norm]"));
}

TEST_CASE("RMSNorm in float stays close to the double result", "[nn][llama]") {
  nn::RMSNorm<float> nf(16);
  nn::RMSNorm<double> nd(16);
  auto xd = random_tensor({4, 16}, 9, -3.0, 3.0);
  auto xf = Tensor<float>::empty({4, 16});
  for (std::int64_t i = 0; i < xd.numel(); ++i) xf.data()[i] = static_cast<float>(xd.data()[i]);
  nn::Cache<float> cf;
  nn::Cache<double> cd;
  auto yf = nf.forward(xf, cf);
  auto yd = nd.forward(xd, cd);
  for (std::int64_t i = 0; i < yd.numel(); ++i) REQUIRE(std::abs(yf.data()[i] - yd.data()[i]) < 1e-5);
}

TEST_CASE("SwiGLU is down(silu(gate(x)) * up(x)), with and without biases", "[nn][llama]") {
  for (bool bias : {false, true}) {
    nn::SwiGLU<double> mlp(5, 7, bias);
    randomize(mlp, 11);
    REQUIRE((mlp.gate_proj().bias() != nullptr) == bias);
    std::vector<std::string> names;
    for (auto& p : mlp.named_parameters()) names.push_back(p.name);
    REQUIRE(names.front() == "gate_proj.weight");
    REQUIRE(names.size() == (bias ? 6u : 3u));
    auto x = random_tensor({2, 3, 5}, 12, -2.0, 2.0);
    nn::Cache<double> cache;
    auto y = mlp.forward(x, cache);
    REQUIRE(y.shape() == Shape{2, 3, 5});
    const auto xv = x.to_vector();
    auto g = naive_linear(xv, 6, 5, mlp.gate_proj());
    auto u = naive_linear(xv, 6, 5, mlp.up_proj());
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
    REQUIRE(max_abs_diff(y, naive_linear(g, 6, 7, mlp.down_proj())) < 1e-13);
    check_module_gradients(mlp, x);
    REQUIRE_THROWS_WITH(mlp.forward(random_tensor({2, 4}, 1), cache), Contains("[ptrain.swiglu]"));
  }
  REQUIRE_THROWS_WITH(ops::swiglu(random_tensor({3}, 1), random_tensor({4}, 2)), Contains("swiglu up projection"));
}

TEST_CASE("rotary frequencies: plain and with Llama 3 scaling", "[nn][llama]") {
  const auto plain = ops::rotary_inv_freq(8, {.theta = 10000.0});
  REQUIRE(plain.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) REQUIRE(plain[i] == Approx(std::pow(10000.0, -2.0 * double(i) / 8.0)));
  // Llama 3.1 8B: head 128, theta 500000, factor 8, low 1, high 4, original context 8192.
  ops::Llama3RopeScaling sc;
  const auto scaled = ops::rotary_inv_freq(128, {.theta = 500000.0, .llama3_scaling = sc});
  const auto ref = reference_inv_freq(128, 500000.0, &sc);
  const auto unscaled = reference_inv_freq(128, 500000.0, nullptr);
  int high = 0, low = 0, medium = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    REQUIRE(scaled[i] == Approx(ref[i]).epsilon(1e-14));
    const double wavelen = 2 * 3.14159265358979323846 / unscaled[i];
    if (wavelen < 8192.0 / 4) {
      ++high;
      REQUIRE(scaled[i] == Approx(unscaled[i]).epsilon(1e-14));  // high frequencies kept
    } else if (wavelen > 8192.0) {
      ++low;
      REQUIRE(scaled[i] == Approx(unscaled[i] / 8).epsilon(1e-14));  // low frequencies divided by factor
    } else {
      ++medium;  // in between: strictly between the two
      REQUIRE(scaled[i] < unscaled[i]);
      REQUIRE(scaled[i] > unscaled[i] / 8);
    }
  }
  REQUIRE(high > 0);
  REQUIRE(low > 0);
  REQUIRE(medium > 0);
  REQUIRE_THROWS_WITH(ops::rotary_inv_freq(7, {}), Contains("even"));
  ops::Llama3RopeScaling bad;
  bad.high_freq_factor = 0.5;
  REQUIRE_THROWS_WITH(ops::rotary_inv_freq(8, {.llama3_scaling = bad}), Contains("[ptrain.rotary.llama3]"));
}

TEST_CASE("rotary_ rotates by rotate_half; positions; its backward is the transpose", "[nn][llama]") {
  const std::int64_t B = 2, S = 5, H = 3, D = 8;
  ops::RotaryConfig rope{.theta = 100.0, .llama3_scaling = ops::Llama3RopeScaling{2.0, 1.0, 4.0, 16}};
  const auto inv = reference_inv_freq(D, rope.theta, &*rope.llama3_scaling);
  auto pos = Tensor<std::int32_t>::from({3, 0, 7, 7, 1, 2, 9, 4, 0, 11}, {B, S});
  for (const Tensor<std::int32_t>& p :
       {Tensor<std::int32_t>(), pos, Tensor<std::int32_t>::from({4, 5, 6, 7, 8}, {S})}) {
    auto x = random_tensor({B, S, H, D}, 21);
    auto ref = x.to_vector();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t h = 0; h < H; ++h)
          reference_rope(&ref[static_cast<std::size_t>(((b * S + s) * H + h) * D)], D, pos_of(p, b, s), inv);
    auto y = x.clone();
    ops::rotary_(y, rope, p);
    REQUIRE(max_abs_diff(y, ref) < 1e-14);
    // <R x, g> == <x, R^T g>: rotary_backward_ is the transpose (adjoint) of rotary_.
    auto g = random_tensor({B, S, H, D}, 22);
    auto rt_g = g.clone();
    ops::rotary_backward_(rt_g, rope, p);
    REQUIRE(ptrain::testing::dot(y, g) == Approx(ptrain::testing::dot(x, rt_g)).epsilon(1e-13));
  }
  auto x = random_tensor({B, S, H, D}, 23);
  REQUIRE_THROWS_WITH(ops::rotary_(x, rope, Tensor<std::int32_t>::from({1, 2}, {2})), Contains("position ids"));
  REQUIRE_THROWS_WITH(ops::rotary_(x, rope, Tensor<std::int32_t>::from({0, 1, -2, 3, 4}, {S})), Contains("negative"));
  auto flat = random_tensor({B, S, H * D}, 24);
  REQUIRE_THROWS_WITH(ops::rotary_(flat, rope), Contains("[B, S, H, D]"));
}

TEST_CASE("rotary: q.k after rotation depends on the position difference only", "[nn][llama]") {
  ops::RotaryConfig rope{.theta = 10000.0};
  auto q = random_tensor({1, 1, 1, 16}, 31), k = random_tensor({1, 1, 1, 16}, 32);
  auto rotated_dot = [&](std::int32_t pq, std::int32_t pk) {
    auto a = q.clone(), b = k.clone();
    ops::rotary_(a, rope, Tensor<std::int32_t>::from({pq}, {1}));
    ops::rotary_(b, rope, Tensor<std::int32_t>::from({pk}, {1}));
    return ptrain::testing::dot(a, b);
  };
  REQUIRE(rotated_dot(5, 2) == Approx(rotated_dot(103, 100)).epsilon(1e-12));
  REQUIRE(rotated_dot(0, 0) == Approx(ptrain::testing::dot(q, k)).epsilon(1e-14));
  REQUIRE(std::abs(rotated_dot(5, 2) - rotated_dot(5, 3)) > 1e-6);
}

TEST_CASE("grouped-query attention matches a naive loop (GQA, MQA, MHA)", "[nn][llama]") {
  const ops::Llama3RopeScaling sc{4.0, 1.0, 4.0, 32};
  struct Case {
    std::int64_t n_kv;
    bool scaled, positions, bias;
  };
  for (const Case c : {Case{2, false, false, false}, Case{1, true, true, true}, Case{4, true, false, false},
                       Case{2, true, true, false}}) {
    CAPTURE(c.n_kv, c.scaled, c.positions, c.bias);
    ops::RotaryConfig rope{.theta = 50.0};
    if (c.scaled) rope.llama3_scaling = sc;
    auto attn = std::make_shared<nn::GroupedQueryAttention<double>>(16, 4, c.n_kv, rope, c.bias, c.bias);
    randomize(*attn, 41);
    auto x = random_tensor({2, 70, 16}, 42);  // S = 70 crosses the 64-row tile
    auto pos = Tensor<std::int32_t>::empty({2, 70});
    for (std::int64_t i = 0; i < pos.numel(); ++i) pos.data()[i] = static_cast<std::int32_t>((i * 7) % 90);
    if (!c.positions) pos = Tensor<std::int32_t>();
    nn::Cache<double> cache;
    auto y = attn->forward(x, pos, cache);
    REQUIRE(y.shape() == Shape{2, 70, 16});
    REQUIRE(max_abs_diff(y, naive_gqa(*attn, x, pos, c.scaled ? &sc : nullptr, 50.0)) < 1e-12);
  }
}

TEST_CASE("grouped-query attention gradients (finite differences)", "[nn][llama]") {
  const ops::RotaryConfig rope{.theta = 20.0, .llama3_scaling = ops::Llama3RopeScaling{4.0, 1.0, 4.0, 8}};
  for (std::int64_t n_kv : {1, 2, 4}) {
    CAPTURE(n_kv);
    nn::GroupedQueryAttention<double> attn(8, 4, n_kv, rope, true, true);
    randomize(attn, 51);
    check_module_gradients(attn, random_tensor({2, 5, 8}, 52));
  }
  // 70 positions: the backward's row and column tiles of 64, key/value heads summed across tiles.
  nn::GroupedQueryAttention<double> long_attn(8, 4, 2, rope);
  randomize(long_attn, 55);
  check_module_gradients(long_attn, random_tensor({1, 70, 8}, 56));
  auto attn = std::make_shared<nn::GroupedQueryAttention<double>>(8, 4, 2, rope);
  randomize(*attn, 53);
  PositionedAttention positioned(attn, Tensor<std::int32_t>::from({4, 9, 1, 2, 3, 0, 5, 6, 7, 12}, {2, 5}));
  check_module_gradients(positioned, random_tensor({2, 5, 8}, 54));
}

TEST_CASE("grouped-query attention: shape errors", "[nn][llama]") {
  REQUIRE_THROWS_WITH(nn::GroupedQueryAttention<double>(16, 4, 3), Contains("n_kv_head 3 must divide n_head 4"));
  REQUIRE_THROWS_WITH(nn::GroupedQueryAttention<double>(15, 4, 2), Contains("not divisible"));
  REQUIRE_THROWS_WITH(nn::GroupedQueryAttention<double>(12, 4, 2), Contains("even"));  // head width 3
  nn::GroupedQueryAttention<double> attn(16, 4, 2);
  nn::Cache<double> cache;
  REQUIRE_THROWS_WITH(attn.forward(random_tensor({2, 3, 8}, 1), cache), Contains("[B, S, 16]"));
  REQUIRE_THROWS_WITH(attn.backward(random_tensor({2, 3, 16}, 1), cache), Contains("without a forward"));
  ops::GqaSaved<double> saved;
  REQUIRE_THROWS_WITH(ops::gqa_attention(random_tensor({1, 3, 4, 2}, 1), random_tensor({1, 3, 3, 2}, 2),
                                         random_tensor({1, 3, 3, 2}, 3), saved),
                      Contains("3 key/value heads do not divide 4"));
  REQUIRE_THROWS_WITH(ops::gqa_attention(random_tensor({1, 3, 4, 2}, 1), random_tensor({1, 3, 2, 2}, 2),
                                         random_tensor({1, 3, 1, 2}, 3), saved),
                      Contains("v"));
}

TEST_CASE("the Llama-family ops on CUDA tensors reach the kernel table", "[nn][llama]") {
  // Host memory labelled cuda:0: no op may read it. Every Llama-family op goes to the
  // CUDA kernel table, which this program does not link.
  auto host = std::make_shared<std::vector<double>>(2 * 3 * 2 * 4, 0.5);
  auto on_cuda = [&](const Shape& s) { return Tensor<double>::wrap(host->data(), s, Device::cuda(0), host); };
  const auto x = on_cuda({2, 3, 2, 4});
  const auto unavailable = Contains("[ptrain.cuda.unavailable]");
  Tensor<double> rstd;
  REQUIRE_THROWS_AS(ops::rms_norm(x, on_cuda({4}), 1e-6, rstd), CudaError);
  REQUIRE_THROWS_WITH(ops::rms_norm(x, on_cuda({4}), 1e-6, rstd), unavailable);
  REQUIRE_THROWS_WITH(ops::swiglu(x, x), unavailable);
  auto rotated = x;
  REQUIRE_THROWS_WITH(ops::rotary_(rotated, {}), unavailable);
  // Position ids on another device than x.
  REQUIRE_THROWS_WITH(ops::rotary_(rotated, {}, Tensor<std::int32_t>::from({0, 1, 2}, {3})),
                      Contains("[ptrain.device.mismatch]"));
  ops::GqaSaved<double> saved;
  REQUIRE_THROWS_WITH(ops::gqa_attention(x, x, x, saved), unavailable);
}

TEST_CASE("RMSNorm, swiglu and rotary in bf16 match double on the same inputs", "[nn][llama][bf16]") {
  // Inputs exactly representable in bf16; a bf16 result is rounded once (2^-8 relative at most,
  // plus float arithmetic: 1e-5 absolute for values of order 1).
  auto xd = random_tensor({3, 4, 2, 8}, 61, -2.0, 2.0), ud = random_tensor({3, 4, 2, 8}, 62, -2.0, 2.0);
  auto wd = random_tensor({8}, 63, 0.5, 1.5);
  auto xb = Tensor<bf16>::empty(xd.shape()), ub = Tensor<bf16>::empty(ud.shape()), wb = Tensor<bf16>::empty({8});
  ops::cast_into(xd, xb);
  ops::cast_into(ud, ub);
  ops::cast_into(wd, wb);
  ops::cast_into(xb, xd);
  ops::cast_into(ub, ud);
  ops::cast_into(wb, wd);
  auto near = [](const Tensor<bf16>& b, const Tensor<double>& d) {
    auto bd = Tensor<double>::empty(b.shape());
    ops::cast_into(b, bd);
    for (std::int64_t i = 0; i < d.numel(); ++i)
      REQUIRE(std::abs(bd.data()[i] - d.data()[i]) <= std::ldexp(std::abs(d.data()[i]), -8) + 1e-5);
  };
  Tensor<float> rstd_b;
  Tensor<double> rstd_d;
  near(ops::rms_norm(xb, wb, 1e-6f, rstd_b), ops::rms_norm(xd, wd, 1e-6, rstd_d));
  for (std::int64_t r = 0; r < rstd_d.numel(); ++r) REQUIRE(rstd_b.data()[r] == Approx(rstd_d.data()[r]).epsilon(1e-5));
  // Backward with dy = u: dx rounded once, dw summed over the 24 rows in float and rounded once.
  auto dwb = Tensor<bf16>::zeros({8});
  auto dwd = Tensor<double>::zeros({8});
  near(ops::rms_norm_backward(xb, rstd_b, wb, ub, dwb), ops::rms_norm_backward(xd, rstd_d, wd, ud, dwd));
  near(dwb, dwd);
  near(ops::swiglu(xb, ub), ops::swiglu(xd, ud));
  const ops::RotaryConfig rope{.theta = 10000.0};
  ops::rotary_(xb, rope);
  ops::rotary_(xd, rope);
  near(xb, xd);
}

namespace {
// Same shape and the same bytes.
template <class T>
bool same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  return a.shape() == b.shape() &&
         std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
}
}  // namespace

TEMPLATE_TEST_CASE("residual_rms_norm is the residual add then rms_norm, bit for bit", "[nn][llama]", float,
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
  const auto x = cast(random_tensor(shape, 71, -2.0, 2.0)), res = cast(random_tensor(shape, 72, -2.0, 2.0));
  const auto w = cast(random_tensor({37}, 73, 0.5, 1.5));
  const A eps = A(1e-5);

  // Forward: h = x + residual written out, and the norm of that h.
  auto h_ref = res.clone();
  ops::axpy_(A(1), x, h_ref);
  Tensor<A> rstd_ref, rstd;
  const auto y_ref = ops::rms_norm(h_ref, w, eps, rstd_ref);
  Tensor<T> h;
  const auto y = ops::residual_rms_norm(x, res, w, eps, h, rstd);
  CHECK(same_bits(h, h_ref));
  CHECK(same_bits(y, y_ref));
  CHECK(same_bits(rstd, rstd_ref));

  // Backward: dh = the norm's dx + the residual stream's gradient; dw accumulates onto dw0.
  const auto dy = cast(random_tensor(shape, 74)), dres = cast(random_tensor(shape, 75));
  const auto dw0 = cast(random_tensor({37}, 76));
  auto dw_ref = dw0.clone(), dw = dw0.clone();
  auto dh_ref = ops::rms_norm_backward(h_ref, rstd_ref, w, dy, dw_ref);
  ops::axpy_(A(1), dres, dh_ref);
  const auto dh = ops::residual_rms_norm_backward(h, rstd, w, dy, dres, dw);
  CHECK(same_bits(dh, dh_ref));
  CHECK(same_bits(dw, dw_ref));
  // The fused result is not the unfused one by accident of equal inputs: dres moved it.
  CHECK_FALSE(same_bits(dh, ops::rms_norm_backward(h_ref, rstd_ref, w, dy, dw_ref)));

  REQUIRE_THROWS_WITH(ops::residual_rms_norm(x, cast(random_tensor({3, 5, 36}, 77)), w, eps, h, rstd),
                      Contains("residual"));
}

}  // namespace test_llama_layers
