// Embedding, causal attention, transformer block and GPT: finite-difference
// gradients in double, a naive-loop reference for attention, the causal mask,
// weight tying and its gradient announcement, sampling.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <map>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/gpt.hpp>

#include "unit/gradcheck.hpp"

namespace test_transformer {

using namespace ptrain;
using ptrain::testing::check_module_gradients;

namespace {

Tensor<double> random_tensor(const Shape& s, std::uint64_t seed, double scale = 1.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, -scale, scale, g);
  return x;
}

template <class T>
Tensor<T> random_ids(std::int64_t b, std::int64_t s, std::int64_t vocab, std::uint64_t seed) {
  auto x = Tensor<T>::empty({b, s});
  Generator g(seed);
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<T>(g.below(static_cast<std::uint64_t>(vocab)));
  return x;
}

// Parameters well away from GPT-2's tiny init, so every gradient is large enough to check.
void randomize(nn::Module<double>& m, std::uint64_t seed) {
  Generator g(seed);
  for (auto& p : m.named_parameters()) {
    if (p.name.find("ln_") != std::string::npos && p.name.find("weight") != std::string::npos)
      ops::uniform_(p.param->value, 0.5, 1.5, g);
    else
      ops::uniform_(p.param->value, -0.5, 0.5, g);
  }
}

// softmax(q k^T / sqrt(D) + causal mask) v with plain loops, from the layer's own weights.
Tensor<double> naive_attention(nn::CausalSelfAttention<double>& attn, const Tensor<double>& x, std::int64_t H) {
  const std::int64_t B = x.size(0), S = x.size(1), C = x.size(2), D = C / H;
  auto& wa = attn.c_attn().weight().value;
  auto& ba = attn.c_attn().bias()->value;
  auto& wp = attn.c_proj().weight().value;
  auto& bp = attn.c_proj().bias()->value;
  std::vector<double> qkv(static_cast<std::size_t>(B * S * 3 * C));
  for (std::int64_t r = 0; r < B * S; ++r)
    for (std::int64_t o = 0; o < 3 * C; ++o) {
      double s = ba.data()[o];
      for (std::int64_t k = 0; k < C; ++k) s += x.data()[r * C + k] * wa.data()[o * C + k];
      qkv[static_cast<std::size_t>(r * 3 * C + o)] = s;
    }
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t col) {
    return qkv[static_cast<std::size_t>((b * S + t) * 3 * C + col)];
  };
  std::vector<double> y(static_cast<std::size_t>(B * S * C), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        std::vector<double> w(static_cast<std::size_t>(i + 1));
        double mx = -1e300, z = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < D; ++d) s += at(b, i, h * D + d) * at(b, j, C + h * D + d);
          w[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, w[static_cast<std::size_t>(j)]);
        }
        for (auto& v : w) z += (v = std::exp(v - mx));
        for (std::int64_t d = 0; d < D; ++d) {
          double s = 0;
          for (std::int64_t j = 0; j <= i; ++j) s += w[static_cast<std::size_t>(j)] / z * at(b, j, 2 * C + h * D + d);
          y[static_cast<std::size_t>((b * S + i) * C + h * D + d)] = s;
        }
      }
  auto out = Tensor<double>::empty(x.shape());
  for (std::int64_t r = 0; r < B * S; ++r)
    for (std::int64_t o = 0; o < C; ++o) {
      double s = bp.data()[o];
      for (std::int64_t k = 0; k < C; ++k) s += y[static_cast<std::size_t>(r * C + k)] * wp.data()[o * C + k];
      out.data()[r * C + o] = s;
    }
  return out;
}

// Runs the wrapped module with every dropout stream rewound first, so that
// repeated forwards (finite differences) draw the same masks. It registers
// no parameters: the check walks the inner module's.
class FixedMasks : public nn::Module<double> {
 public:
  FixedMasks(nn::Module<double>& inner, std::vector<Generator*> gens) : inner_(inner), gens_(std::move(gens)) {}
  Tensor<double> forward(const Tensor<double>& x, nn::Cache<double>& c) override {
    for (auto* g : gens_) g->set_offset(0);
    return inner_.forward(x, c);
  }
  Tensor<double> backward(const Tensor<double>& dy, nn::Cache<double>& c) override { return inner_.backward(dy, c); }
  std::string describe() const override { return "FixedMasks"; }

 private:
  nn::Module<double>& inner_;
  std::vector<Generator*> gens_;
};

nn::GPTConfig tiny_config(bool tie) {
  return {.vocab_size = 7, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.0, .tie_weights = tie};
}

}  // namespace

TEST_CASE("Embedding looks up rows and its gradients match finite differences", "[nn][embedding][gradcheck]") {
  Generator gen(1);
  nn::Embedding<double> emb(5, 3, gen);
  auto ids = Tensor<double>::from({4, 0, 4, 2}, {2, 2});
  nn::Cache<double> c;
  auto y = emb.forward(ids, c);
  REQUIRE(y.shape() == Shape{2, 2, 3});
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t k = 0; k < 3; ++k)
      REQUIRE(y.data()[r * 3 + k] == emb.weight().value.at({static_cast<std::int64_t>(ids.data()[r]), k}));
  check_module_gradients(emb, ids, false);  // id 4 repeats: its gradient rows must add up

  nn::TokenPositionEmbedding<double> tpe(5, 4, 3, 0.0, 0, gen);
  check_module_gradients(tpe, Tensor<double>::from({1, 3, 1, 0, 4, 4}, {2, 3}), false);
}

TEST_CASE("Embedding rejects ids that are not integers in range", "[nn][embedding]") {
  nn::TokenPositionEmbedding<float> tpe(5, 4, 3);
  nn::Cache<float> c;
  REQUIRE_THROWS_WITH(tpe.forward(Tensor<float>::from({1, 2, 3, 0, 1.5f, 2}, {2, 3}), c),
                      Catch::Contains("[ptrain.embedding.id]") && Catch::Contains("1.5") &&
                          Catch::Contains("position [1, 1]"));
  REQUIRE_THROWS_AS(tpe.forward(Tensor<float>::from({1, 5}, {1, 2}), c), ShapeError);
  REQUIRE_THROWS_AS(tpe.forward(Tensor<float>::from({-1, 2}, {1, 2}), c), ShapeError);
  REQUIRE_THROWS_WITH(tpe.forward(Tensor<float>::zeros({1, 5}), c), Catch::Contains("block_size 4"));
}

TEST_CASE("Causal attention matches a naive loop, across row tiles", "[nn][attention]") {
  for (std::int64_t S : {5, 70, 130}) {  // 70 and 130 cross the 64-row tiles of the kernel
    Generator gen(2);
    nn::CausalSelfAttention<double> attn(8, 2, 0.0, 0, gen);
    auto x = random_tensor({2, S, 8}, 3);
    nn::Cache<double> c;
    auto y = attn.forward(x, c);
    auto ref = naive_attention(attn, x, 2);
    INFO("S = " << S);
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(y.data()[i] == Approx(ref.data()[i]).margin(1e-12));
  }
}

TEST_CASE("Causal attention gradients match finite differences", "[nn][attention][gradcheck]") {
  Generator gen(4);
  nn::CausalSelfAttention<double> attn(8, 2, 0.0, 0, gen);
  randomize(attn, 5);
  check_module_gradients(attn, random_tensor({2, 5, 8}, 6));
  nn::CausalSelfAttention<double> wide(4, 2, 0.0, 0, gen);  // S = 70: two row tiles, a partial one
  randomize(wide, 7);
  check_module_gradients(wide, random_tensor({1, 70, 4}, 8), true, 1e-7, 48);
}

TEST_CASE("Attention dropout: masks differ from eval mode and gradients use the same masks", "[nn][attention]") {
  Generator gen(9);
  nn::CausalSelfAttention<double> attn(8, 2, 0.3, 11, gen);
  randomize(attn, 10);
  auto x = random_tensor({2, 6, 8}, 12);
  nn::Cache<double> c;
  auto train_y = attn.forward(x, c);
  attn.train(false);
  auto eval_y = attn.forward(x, c);
  attn.train(true);
  double diff = 0;
  for (std::int64_t i = 0; i < x.numel(); ++i) diff += std::abs(train_y.data()[i] - eval_y.data()[i]);
  REQUIRE(diff > 1e-3);

  FixedMasks fixed(attn, {&attn.attn_dropout_generator(), &attn.resid_dropout().generator()});
  nn::Cache<double> cache;
  auto y = fixed.forward(x, cache);
  auto r = random_tensor(y.shape(), 13);
  attn.zero_grad();
  auto dx = fixed.backward(r, cache);
  auto loss = [&] {
    nn::Cache<double> cc;
    return ptrain::testing::dot(fixed.forward(x, cc), r);
  };
  auto check = [&](Tensor<double> v, const Tensor<double>& analytic) {
    for (std::int64_t i = 0; i < v.numel(); i += std::max<std::int64_t>(1, v.numel() / 40)) {
      const double h = 1e-5, orig = v.data()[i];
      v.data()[i] = orig + h;
      const double lp = loss();
      v.data()[i] = orig - h;
      const double lm = loss();
      v.data()[i] = orig;
      REQUIRE(analytic.data()[i] == Approx((lp - lm) / (2 * h)).margin(1e-7));
    }
  };
  check(x, dx);
  for (auto& p : attn.named_parameters()) check(p.param->value, p.param->grad);
}

TEST_CASE("Transformer block gradients match finite differences", "[nn][block][gradcheck]") {
  Generator gen(14);
  nn::TransformerBlock<double> block(8, 2, 0.0, 0, gen);
  randomize(block, 15);
  check_module_gradients(block, random_tensor({2, 4, 8}, 16));
  const auto names = block.named_parameters();
  REQUIRE(names.size() == 12);
  REQUIRE(names[0].name == "ln_1.weight");
  REQUIRE(names[2].name == "attn.c_attn.weight");
  REQUIRE(names[11].name == "mlp.c_proj.bias");
}

TEST_CASE("Whole tiny GPT gradients match finite differences, tied and untied", "[nn][gpt][gradcheck]") {
  for (bool tie : {true, false}) {
    INFO("tie_weights = " << tie);
    Generator gen(17);
    nn::GPT<double> model(tiny_config(tie), gen);
    randomize(model, 18);
    check_module_gradients(model, random_ids<double>(2, 5, 7, 19), false, 1e-7, 40);
  }
}

TEST_CASE("GPT loss gradient matches finite differences of the cross-entropy", "[nn][gpt][gradcheck]") {
  Generator gen(20);
  nn::GPT<double> model(tiny_config(true), gen);
  randomize(model, 21);
  auto x = random_ids<double>(2, 6, 7, 22);
  auto targets = Tensor<std::int32_t>::empty({12});
  Generator tg(23);
  for (std::int64_t i = 0; i < 12; ++i) targets.data()[i] = static_cast<std::int32_t>(tg.below(7));
  nn::CrossEntropyLoss<double> ce;
  auto loss = [&] {
    nn::Cache<double> c, lc;
    return ce.forward(model.forward(x, c), targets, lc);
  };
  nn::Cache<double> c, lc;
  ce.forward(model.forward(x, c), targets, lc);
  model.zero_grad();
  model.backward(ce.backward(lc), c);
  for (auto& p : model.named_parameters()) {
    Tensor<double> v = p.param->value;
    for (std::int64_t i = 0; i < v.numel(); i += std::max<std::int64_t>(1, v.numel() / 16)) {
      const double orig = v.data()[i], h = 1e-5;
      v.data()[i] = orig + h;
      const double lp = loss();
      v.data()[i] = orig - h;
      const double lm = loss();
      v.data()[i] = orig;
      INFO(p.name << "[" << i << "]");
      REQUIRE(p.param->grad.data()[i] == Approx((lp - lm) / (2 * h)).margin(1e-8));
    }
  }
}

TEST_CASE("Causal mask: a later token never changes earlier outputs", "[nn][gpt][causal]") {
  Generator gen(24);
  nn::GPTConfig cfg{.vocab_size = 11, .block_size = 80, .n_layer = 2, .n_head = 2, .n_embd = 8};
  nn::GPT<double> model(cfg, gen);
  randomize(model, 25);
  const std::int64_t S = 75;  // two attention row tiles
  auto x = random_ids<double>(1, S, 11, 26);
  nn::Cache<double> c;
  auto base = model.forward(x, c);
  for (std::int64_t t : {0, 10, 63, 64, 73}) {
    auto x2 = x.clone();
    x2.data()[t + 1] = std::fmod(x2.data()[t + 1] + 3, 11.0);
    auto y = model.forward(x2, c);
    INFO("changed token " << t + 1);
    for (std::int64_t i = 0; i <= t; ++i)
      for (std::int64_t v = 0; v < 11; ++v) REQUIRE(y.at({0, i, v}) == base.at({0, i, v}));
    double later = 0;
    for (std::int64_t v = 0; v < 11; ++v) later += std::abs(y.at({0, t + 1, v}) - base.at({0, t + 1, v}));
    REQUIRE(later > 1e-6);  // the changed position itself does see it
  }
}

TEST_CASE("GPT is a list of units whose composition is the model", "[nn][gpt]") {
  for (bool tie : {true, false}) {
    Generator gen(27);
    auto cfg = tiny_config(tie);
    nn::GPT<float> model(cfg, gen);
    REQUIRE(model.units().size() == 4);
    REQUIRE(model.unit_names() == std::vector<std::string>{"embed", "h.0", "h.1", "head"});
    REQUIRE(model.num_parameters() == cfg.num_parameters());
    std::map<std::string, int> names;
    for (auto& p : model.named_parameters()) ++names[p.name];
    REQUIRE(names.count("embed.wte.weight") == 1);
    REQUIRE(names.count("head.lm_head.weight") == (tie ? 0u : 1u));
    for (auto& [n, count] : names) REQUIRE(count == 1);

    auto x = random_ids<float>(2, 6, 7, 28);
    nn::Cache<float> c, cu;
    auto y = model.forward(x, c);
    Tensor<float> h = x;
    for (auto& u : model.units()) {
      nn::Cache<float> uc;
      h = u->forward(h, uc);
    }
    REQUIRE(h.shape() == Shape{2, 6, 7});
    for (std::int64_t i = 0; i < y.numel(); ++i) REQUIRE(h.data()[i] == y.data()[i]);
    if (tie) REQUIRE(model.head().weight().value.data() == model.embedding().wte().weight().value.data());
    const auto borrowed = model.head().borrowed_parameters();
    if (tie) REQUIRE(borrowed == std::vector<nn::Parameter<float>*>{&model.embedding().wte().weight()});
    else REQUIRE(borrowed.empty());
    for (std::size_t u = 0; u + 1 < model.units().size(); ++u) REQUIRE(model.units()[u]->borrowed_parameters().empty());
  }
}

TEST_CASE("Every gradient is announced exactly once, the tied one after both uses", "[nn][gpt][hooks]") {
  for (bool tie : {true, false}) {
    INFO("tie_weights = " << tie);
    Generator gen(29);
    nn::GPT<double> model(tiny_config(tie), gen);
    randomize(model, 30);
    std::map<std::string, int> count;
    std::map<std::string, std::vector<double>> at_announce;
    for (auto& p : model.named_parameters()) {
      const std::string name = p.name;
      p.param->on_grad_ready = [&, name](nn::Parameter<double>& param) {
        ++count[name];
        at_announce[name] = param.grad.to_vector();
      };
    }
    nn::Cache<double> c;
    auto y = model.forward(random_ids<double>(2, 5, 7, 31), c);
    model.zero_grad();
    model.backward(random_tensor(y.shape(), 32), c);
    for (auto& p : model.named_parameters()) {
      INFO(p.name);
      REQUIRE(count[p.name] == 1);
      REQUIRE(at_announce[p.name] == p.param->grad.to_vector());  // final when announced
    }
    // The wte gradient holds the head's part: rows of ids that never occur are non-zero only when tied.
    auto& g = model.embedding().wte().weight().grad;
    double unused_rows = 0;
    auto ids = random_ids<double>(2, 5, 7, 31);
    for (std::int64_t v = 0; v < 7; ++v) {
      bool used = false;
      for (std::int64_t i = 0; i < ids.numel(); ++i) used |= ids.data()[i] == v;
      if (!used)
        for (std::int64_t k = 0; k < 8; ++k) unused_rows += std::abs(g.at({v, k}));
    }
    if (tie) REQUIRE(unused_rows > 0);
    else REQUIRE(unused_rows == 0);
  }
}

TEST_CASE("GPT-2 initialisation and the decay filter", "[nn][gpt][init]") {
  nn::GPTConfig cfg{.vocab_size = 50, .block_size = 32, .n_layer = 4, .n_head = 4, .n_embd = 64};
  Generator gen(33);
  nn::GPT<double> model(cfg, gen);
  auto stddev = [](const Tensor<double>& t) {
    double s = 0, s2 = 0;
    for (std::int64_t i = 0; i < t.numel(); ++i) s += t.data()[i], s2 += t.data()[i] * t.data()[i];
    const double n = static_cast<double>(t.numel());
    return std::sqrt(s2 / n - (s / n) * (s / n));
  };
  auto decay = nn::gpt_decay_filter();
  for (auto& p : model.named_parameters()) {
    INFO(p.name);
    const auto& v = p.param->value;
    const bool bias = p.name.size() > 5 && p.name.substr(p.name.size() - 5) == ".bias";
    if (p.name.find("ln_") != std::string::npos) {
      REQUIRE(v.data()[0] == (bias ? 0.0 : 1.0));
      REQUIRE_FALSE(decay(p.name));
    } else if (bias) {
      REQUIRE(stddev(v) == 0.0);
      REQUIRE(v.data()[0] == 0.0);
      REQUIRE_FALSE(decay(p.name));
    } else if (p.name.find("c_proj.weight") != std::string::npos) {
      REQUIRE(stddev(v) == Approx(0.02 / std::sqrt(8.0)).epsilon(0.05));
      REQUIRE(decay(p.name));
    } else {
      REQUIRE(stddev(v) == Approx(0.02).epsilon(0.05));
      REQUIRE(decay(p.name) == (p.name.find("wte") == std::string::npos && p.name.find("wpe") == std::string::npos));
    }
  }
  // Same generator state, same model.
  Generator g1(5), g2(5);
  nn::GPT<float> a(cfg, g1), b(cfg, g2);
  REQUIRE(a.named_parameters()[3].param->value.to_vector() == b.named_parameters()[3].param->value.to_vector());
}

// Reference: the whole model built from the same generator; each unit built alone
// must hold the same bits, and its dropout streams the same seeds.
template <class T>
void check_units_alone(nn::GPTConfig cfg) {
  const Generator start(33, 7);  // not at the start of its stream
  Generator whole_gen = start;
  nn::GPT<T> whole(cfg, whole_gen);
  const auto units = whole.units().size();
  for (std::size_t u = 0; u < units; ++u) {
    INFO("unit " << u << " (" << whole.unit_names()[u] << "), tied " << cfg.tie_weights);
    if (cfg.tie_weights && u + 1 == units) {
      REQUIRE_THROWS_WITH(nn::gpt_unit<T>(cfg, u, start), Catch::Contains("[ptrain.gpt.unit]") &&
                                                             Catch::Contains("tie_weights = false"));
      continue;
    }
    auto alone = nn::gpt_unit<T>(cfg, u, start);
    auto want = whole.units()[u]->named_parameters();
    auto got = alone->named_parameters();
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      INFO(want[i].name);
      REQUIRE(got[i].name == want[i].name);
      const auto& a = got[i].param->value;
      const auto& b = want[i].param->value;
      REQUIRE(a.shape() == b.shape());
      REQUIRE(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0);
    }
  }
  // Streams: the block's dropout draws as the whole model's does.
  if (cfg.n_layer > 0) {
    auto block = std::dynamic_pointer_cast<nn::TransformerBlock<T>>(nn::gpt_unit<T>(cfg, 1, start));
    REQUIRE(block);
    REQUIRE(block->mlp().dropout().generator().seed() == whole.block(0).mlp().dropout().generator().seed());
  }
}

TEST_CASE("gpt_unit builds each unit alone with the whole model's values", "[nn][gpt][init]") {
  nn::GPTConfig cfg{.vocab_size = 50, .block_size = 32, .n_layer = 3, .n_head = 4, .n_embd = 64, .dropout = 0.1,
                    .dropout_seed = 9};
  for (bool tie : {false, true}) {
    cfg.tie_weights = tie;
    check_units_alone<float>(cfg);
    check_units_alone<bf16>(cfg);
  }
  REQUIRE_THROWS_WITH(nn::gpt_unit<float>(cfg, 5), Catch::Contains("[ptrain.gpt.unit] unit 5 of a GPT with 5 units"));
  const Generator g(3, 11);
  (void)nn::gpt_unit<float>(cfg, 2, g);
  REQUIRE(g.offset() == 11);  // the caller's generator is not advanced
}

namespace {
// One training step's forward and backward (cross-entropy); returns the bytes the step
// held at its peak beyond what was live before it.
template <class T>
std::int64_t step_peak(nn::GPT<T>& model, const Tensor<std::int32_t>& ids, const Tensor<std::int32_t>& targets,
                       Tensor<T>& logits) {
  auto& alloc = allocator_for(Device::cpu());
  const std::int64_t before = alloc.stats().live_bytes;
  alloc.reset_peak();
  nn::CrossEntropyLoss<T> ce;
  nn::Cache<T> c, lc;
  logits = model.forward_tokens(ids, c);
  ce.forward(logits, targets, lc);
  model.backward(ce.backward(lc), c);
  return alloc.stats().peak_bytes - before;
}
}  // namespace

TEST_CASE("Recompute: a GPT with recomputed blocks trains bitwise like the plain one, in less memory",
          "[nn][gpt][recompute]") {
  // Dropout everywhere: the second forward must draw the masks of the first.
  nn::GPTConfig cfg{.vocab_size = 11, .block_size = 32, .n_layer = 4, .n_head = 2, .n_embd = 16, .dropout = 0.2,
                    .dropout_seed = 5};
  for (bool tie : {true, false}) {
    INFO("tie_weights = " << tie);
    cfg.tie_weights = tie;
    auto wrapped = cfg;
    wrapped.recompute = true;
    Generator ga(3), gb(3);
    nn::GPT<double> plain(cfg, ga), rec(wrapped, gb);
    REQUIRE(rec.units()[1]->describe().rfind("Recompute(", 0) == 0);
    auto pn = plain.named_parameters(), rn = rec.named_parameters();
    REQUIRE(pn.size() == rn.size());
    for (std::size_t i = 0; i < pn.size(); ++i) REQUIRE(pn[i].name == rn[i].name);
    std::int64_t peak_plain = 0, peak_rec = 0;
    for (int step = 0; step < 2; ++step) {
      INFO("step " << step);
      Generator gd(40 + static_cast<std::uint64_t>(step));
      std::vector<std::int32_t> ids(8 * 32), targets(8 * 32);
      for (auto& v : ids) v = static_cast<std::int32_t>(gd.below(11));
      for (auto& v : targets) v = static_cast<std::int32_t>(gd.below(11));
      const auto x = Tensor<std::int32_t>::from(ids, {8, 32}), y = Tensor<std::int32_t>::from(targets, {8 * 32});
      plain.zero_grad();
      rec.zero_grad();
      Tensor<double> lp, lr;
      peak_plain = step_peak(plain, x, y, lp);
      peak_rec = step_peak(rec, x, y, lr);
      REQUIRE(lp.to_vector() == lr.to_vector());
      for (std::size_t i = 0; i < pn.size(); ++i) {
        INFO(pn[i].name);
        REQUIRE(pn[i].param->grad.to_vector() == rn[i].param->grad.to_vector());
      }
      // The streams end where the plain model's do, so the next step draws the same masks.
      auto sp = plain.generators(), sr = rec.generators();
      for (std::size_t i = 0; i < sp.size(); ++i) REQUIRE(sp[i].second->offset() == sr[i].second->offset());
    }
    // Four blocks' activations at once against one block's plus the blocks' inputs.
    INFO("peak bytes of a step: plain " << peak_plain << ", recompute " << peak_rec);
    CHECK(peak_rec < peak_plain / 2);
  }
  nn::Recompute<double> lone(std::make_shared<nn::Linear<double>>(3, 2));
  nn::Cache<double> empty;
  REQUIRE_THROWS_WITH(lone.backward(Tensor<double>::zeros({1, 2}), empty),
                      Catch::Contains("[ptrain.backward] Recompute::backward without a forward"));
}

TEST_CASE("sample_logits: greedy, top-k support and frequencies", "[nn][sample]") {
  const std::vector<double> logits = {0.1, 2.0, -1.0, 1.5, 2.0, 0.3};
  REQUIRE(nn::sample_logits(logits.data(), 6, 0.0, 0, 0.7) == 1);  // first of the tied maxima
  REQUIRE(nn::sample_logits(logits.data(), 6, 1.0, 1, 0.99) == 1);
  // top_k = 3 keeps ids 1, 4, 3; frequencies follow their softmax at temperature 0.5.
  Generator g(34);
  std::map<int, int> hits;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++hits[nn::sample_logits(logits.data(), 6, 0.5, 3, g.uniform())];
  REQUIRE(hits.size() == 3);
  const double z = 2 * std::exp(4.0) + std::exp(3.0);
  REQUIRE(hits[1] / double(n) == Approx(std::exp(4.0) / z).margin(0.015));
  REQUIRE(hits[4] / double(n) == Approx(std::exp(4.0) / z).margin(0.015));
  REQUIRE(hits[3] / double(n) == Approx(std::exp(3.0) / z).margin(0.015));
  REQUIRE_THROWS_AS(nn::sample_logits(logits.data(), 6, -1.0, 0, 0.5), Error);
}

TEST_CASE("generate: greedy continuation follows the model's argmax; crops the context", "[nn][sample]") {
  Generator gen(35);
  nn::GPT<double> model(tiny_config(true), gen);
  randomize(model, 36);
  Generator sg(0);
  auto out = nn::generate(model, {1, 2}, 8, 0.0, 0, sg);
  REQUIRE(out.size() == 10);
  REQUIRE(model.training());
  for (std::size_t n = 2; n < out.size(); ++n) {
    const std::int64_t len = std::min<std::int64_t>(6, static_cast<std::int64_t>(n));
    auto x = Tensor<double>::empty({1, len});
    for (std::int64_t i = 0; i < len; ++i) x.data()[i] = out[n - static_cast<std::size_t>(len - i)];
    nn::Cache<double> c;
    auto logits = model.forward(x, c);
    std::int32_t best = 0;
    for (std::int32_t v = 1; v < 7; ++v)
      if (logits.at({0, len - 1, v}) > logits.at({0, len - 1, best})) best = v;
    REQUIRE(out[n] == best);
  }
  Generator s1(7), s2(7);
  REQUIRE(nn::generate(model, {3}, 12, 1.0, 4, s1) == nn::generate(model, {3}, 12, 1.0, 4, s2));
  // A vocabulary limit below the greedy choices: only ids under it, and the largest logit among them.
  const std::int32_t limit = *std::min_element(out.begin() + 2, out.end());
  REQUIRE(limit > 0);
  auto limited = nn::generate(model, {1, 2}, 8, 0.0, 0, sg, limit);
  for (std::size_t n = 2; n < limited.size(); ++n) {
    nn::Cache<double> c;
    const std::int64_t len = std::min<std::int64_t>(6, static_cast<std::int64_t>(n));
    auto x = Tensor<double>::empty({1, len});
    for (std::int64_t i = 0; i < len; ++i) x.data()[i] = limited[n - static_cast<std::size_t>(len - i)];
    auto logits = model.forward(x, c);
    std::int32_t best = 0;
    for (std::int32_t v = 1; v < limit; ++v)
      if (logits.at({0, len - 1, v}) > logits.at({0, len - 1, best})) best = v;
    REQUIRE(limited[n] == best);
  }
}

TEMPLATE_TEST_CASE("TransformerBlock with ln_2 fused with the residual add is PreNormBlock's wiring, bit for bit",
                   "[nn][block][layer_norm]", float, double, bf16) {
  // TransformerBlock fuses h = x + attn(ln_1(x)) into ln_2 (ops::residual_layer_norm);
  // PreNormBlock over parts made from the same seed adds with axpy_ and runs ln_2 alone.
  using T = TestType;
  const std::int64_t C = 12, H = 3;
  Generator g1(31), g2(31);
  nn::TransformerBlock<T> block(C, H, 0.0, 0, g1);
  nn::PreNormBlock<T> plain({"ln_1", std::make_shared<nn::LayerNorm<T>>(C)},
                            {"attn", std::make_shared<nn::CausalSelfAttention<T>>(C, H, 0.0, 0, g2)},
                            {"ln_2", std::make_shared<nn::LayerNorm<T>>(C)},
                            {"mlp", std::make_shared<nn::FeedForward<T>>(C, 0.0, 2, g2)});
  auto cast = [](const Tensor<double>& d, Tensor<T>& t) {
    for (std::int64_t i = 0; i < d.numel(); ++i) t.data()[i] = static_cast<T>(d.data()[i]);
  };
  auto ps = block.named_parameters(), qs = plain.named_parameters();
  REQUIRE(ps.size() == qs.size());
  for (std::size_t i = 0; i < ps.size(); ++i) {  // LayerNorm's ones and zeros would hide a swapped gamma or beta
    REQUIRE(ps[i].name == qs[i].name);
    const auto v = random_tensor(ps[i].param->value.shape(), 40 + i, 0.5);
    cast(v, ps[i].param->value);
    cast(v, qs[i].param->value);
  }
  auto x = Tensor<T>::empty({2, 5, C}), dy = Tensor<T>::empty({2, 5, C});
  cast(random_tensor(x.shape(), 32), x);
  cast(random_tensor(dy.shape(), 33), dy);
  auto bits_equal = [](const Tensor<T>& a, const Tensor<T>& b) {
    return a.shape() == b.shape() &&
           std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * sizeof(T)) == 0;
  };
  nn::Cache<T> c1, c2;
  CHECK(bits_equal(block.forward(x, c1), plain.forward(x, c2)));
  CHECK(bits_equal(block.backward(dy, c1), plain.backward(dy, c2)));
  for (std::size_t i = 0; i < ps.size(); ++i) {
    INFO(ps[i].name);
    CHECK(bits_equal(ps[i].param->grad, qs[i].param->grad));
  }
}

}  // namespace test_transformer
