// Frozen parameters (Note [Frozen parameters] in nn/flat_parameters.hpp). Reference:
// the same model with every parameter trainable, whose frozen parameters' gradients
// are dropped by hand before each AdamW step (and kept out of weight decay), so
// that they stay where they started. A model with frozen parameters must train
// exactly as that reference, and hold no gradient or optimizer memory for them.
#include <catch2/catch.hpp>
#include <functional>
#include <map>
#include <ptrain/nn/batch_norm.hpp>
#include <ptrain/nn/conv.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/local.hpp>

#include "unit/gradcheck.hpp"

namespace test_frozen {

using namespace ptrain;
using Frozen = std::function<bool(const std::string&)>;
using Build = std::function<std::shared_ptr<nn::Module<double>>()>;

namespace {

Tensor<std::int32_t> tokens(std::int64_t b, std::int64_t s, std::int64_t vocab, std::uint64_t seed) {
  Generator g(seed);
  auto t = Tensor<std::int32_t>::empty({b, s});
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<std::int32_t>(g.below(vocab));
  return t;
}

std::map<std::string, std::vector<double>> values_of(nn::Module<double>& m) {
  std::map<std::string, std::vector<double>> out;
  for (auto& p : m.named_parameters()) out[p.name] = p.param->value.to_vector();
  return out;
}

// Trains build() with `frozen` parameters frozen and the reference (all trainable, the
// frozen ones' gradients dropped by hand) for `steps` AdamW steps on the same batches;
// `batch(step, x, y)` gives them. Every loss, gradient and value must agree.
template <class Input>
void check_against_reference(const Build& build, const Frozen& frozen,
                             const std::function<void(int, Input&, Tensor<std::int32_t>&)>& batch, int steps = 3) {
  auto model = build(), ref = build();
  const auto start = values_of(*model);
  int n_frozen = 0;
  for (auto& p : model->named_parameters())
    if (frozen(p.name)) {
      p.param->set_requires_grad(false);
      ++n_frozen;
    }
  REQUIRE(n_frozen > 0);
  REQUIRE(model->num_trainable_parameters() > 0);
  REQUIRE(model->num_trainable_parameters() < model->num_parameters());
  parallel::Local<double> engine(*model), ref_engine(*ref);
  const optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  const auto decays = [](const std::string& name) { return name.find("bias") == std::string::npos; };
  optim::AdamW<double> opt(engine.parameters(), o, decays);
  optim::AdamW<double> ref_opt(ref_engine.parameters(), o,
                               [&](const std::string& name) { return decays(name) && !frozen(name); });
  for (int s = 0; s < steps; ++s) {
    Input x;
    Tensor<std::int32_t> y;
    batch(s, x, y);
    engine.zero_grad();
    ref_engine.zero_grad();
    const double loss = engine.forward_backward(x, y), ref_loss = ref_engine.forward_backward(x, y);
    REQUIRE(loss == Approx(ref_loss).epsilon(0).margin(1e-12));
    std::map<std::string, nn::Parameter<double>*> ref_params;
    for (auto& p : ref->named_parameters()) ref_params[p.name] = p.param;
    for (auto& p : model->named_parameters()) {
      INFO(p.name);
      nn::Parameter<double>& r = *ref_params.at(p.name);
      if (frozen(p.name)) {
        CHECK_FALSE(p.param->grad.defined());
        r.grad.zero_();  // by hand: the reference drops what the frozen model never computes
        continue;
      }
      const auto g = p.param->grad.to_vector(), rg = r.grad.to_vector();
      double worst = 0;
      for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(g[i] - rg[i]));
      CHECK(worst <= 1e-12);
    }
    opt.step();
    ref_opt.step();
  }
  const auto got = values_of(*model), want = values_of(*ref);
  for (const auto& [name, v] : got) {
    INFO(name);
    if (frozen(name)) {
      CHECK(v == start.at(name));
      CHECK(want.at(name) == start.at(name));
      continue;
    }
    CHECK(v != start.at(name));
    double worst = 0;
    for (std::size_t i = 0; i < v.size(); ++i) worst = std::max(worst, std::abs(v[i] - want.at(name)[i]));
    CHECK(worst <= 1e-12);
  }
}

std::function<void(int, Tensor<std::int32_t>&, Tensor<std::int32_t>&)> token_batches(std::int64_t vocab) {
  return [vocab](int s, Tensor<std::int32_t>& x, Tensor<std::int32_t>& y) {
    x = tokens(2, 6, vocab, 100 + s);
    y = tokens(2, 6, vocab, 200 + s);
  };
}

}  // namespace

TEST_CASE("frozen parameters: a GPT trains as the reference that leaves them out by hand", "[nn][frozen]") {
  nn::GPTConfig cfg{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8};
  const Build build = [cfg] {
    Generator g(5);
    return std::make_shared<nn::GPT<double>>(cfg, g);
  };
  // The tied token embedding (also the LM head), one block's first norm and attention
  // input projection, both blocks' c_fc weights (their biases train: the fused GELU
  // backward then writes db_pre only) and the final norm's bias.
  check_against_reference<Tensor<std::int32_t>>(
      build,
      [](const std::string& n) {
        return n == "wte.weight" || n.rfind("h.0.ln_1.", 0) == 0 || n.rfind("h.0.attn.c_attn.", 0) == 0 ||
               n.find("mlp.c_fc.weight") != std::string::npos || n == "ln_f.bias";
      },
      token_batches(cfg.vocab_size));
  // Only the positions frozen; then every weight of one block.
  check_against_reference<Tensor<std::int32_t>>(
      build, [](const std::string& n) { return n == "wpe.weight" || n.rfind("h.1.", 0) == 0; },
      token_batches(cfg.vocab_size));
}

TEST_CASE("frozen parameters: a Llama trains as the reference that leaves them out by hand", "[nn][frozen]") {
  nn::LlamaConfig cfg{.vocab_size = 13, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 8,
                      .intermediate_size = 12, .max_seq_len = 16, .attention_bias = true};
  const Build build = [cfg] {
    Generator g(6);
    return std::make_shared<nn::Llama<double>>(cfg, g);
  };
  // What LoRA freezes, and the norms: the embedding, the head, every RMSNorm, the
  // attention and MLP projections except layer 1's v_proj and down_proj.
  check_against_reference<Tensor<std::int32_t>>(
      build,
      [](const std::string& n) {
        return n.find("layers.1.self_attn.v_proj") == std::string::npos &&
               n.find("layers.1.mlp.down_proj") == std::string::npos;
      },
      token_batches(cfg.vocab_size));
}

TEST_CASE("frozen parameters: convolutions and batch norm skip frozen weights", "[nn][frozen]") {
  const Build build = [] {
    Generator g(7);
    auto m = std::make_shared<nn::Sequential<double>>();
    m->add(std::make_shared<nn::Conv2d<double>>(2, 3, 3, nn::Conv2dOptions{.padding = {1, 1}}, g));
    m->add(std::make_shared<nn::BatchNorm2d<double>>(3));
    m->add(std::make_shared<nn::ReLU<double>>());
    m->add(std::make_shared<nn::Conv2d<double>>(3, 4, 3, nn::Conv2dOptions{}, g));
    m->add(std::make_shared<nn::AdaptiveAvgPool2d<double>>());
    m->add(std::make_shared<nn::Flatten<double>>());
    m->add(std::make_shared<nn::Linear<double>>(4, 3, true, g));
    return m;
  };
  const std::function<void(int, Tensor<double>&, Tensor<std::int32_t>&)> batch = [](int s, Tensor<double>& x,
                                                                                     Tensor<std::int32_t>& y) {
    x = testing::random_tensor({4, 2, 5, 5}, 300 + s);
    y = tokens(1, 4, 3, 400 + s).reshape({4});
  };
  // The first conv's weight (its bias trains), the norm's weight (its bias trains), the last conv.
  check_against_reference<Tensor<double>>(
      build, [](const std::string& n) { return n == "0.weight" || n == "1.weight" || n.rfind("3.", 0) == 0; },
      batch);
  // The norm's bias only, and the head.
  check_against_reference<Tensor<double>>(
      build, [](const std::string& n) { return n == "1.bias" || n.rfind("6.", 0) == 0; }, batch);
}

TEST_CASE("frozen parameters: no gradient and no optimizer memory (allocator counters)", "[nn][frozen][memory]") {
  // Parameters of 5*7, 7, 7*3, 3 elements: the frozen first layer pads to 48 + 16
  // elements in frozen_values(); the trainable second layer to 32 + 16 in values(),
  // grads() and AdamW's two moments.
  const std::int64_t before = memory_stats().live_bytes;
  {
    Generator g(1);
    nn::MLP<double> model(5, {7}, 3, nn::Activation::ReLU, g);
    model[0].requires_grad_(false);
    CHECK(memory_stats().live_bytes - before == 8 * (35 + 7 + 21 + 3 + 21 + 3));  // values, trainable grads
    parallel::Local<double> engine(model);
    optim::AdamW<double> opt(engine.parameters(), {.lr = 1e-3});
    const std::int64_t frozen = 48 + 16, trainable = 32 + 16;
    CHECK(engine.parameters().frozen_values().numel() == frozen);
    CHECK(engine.parameters().values().numel() == trainable);
    CHECK(opt.state_tensors().size() == 4);  // exp_avg and exp_avg_sq of 2.weight and 2.bias
    CHECK(memory_stats().live_bytes - before == 8 * (frozen + 2 * trainable + 2 * trainable));
    // Training allocates nothing that stays for the frozen layer.
    engine.zero_grad();
    engine.forward_backward(testing::random_tensor({4, 5}, 9), tokens(1, 4, 3, 10).reshape({4}));
    opt.step();
    CHECK(memory_stats().live_bytes - before == 8 * (frozen + 2 * trainable + 2 * trainable));
  }
  CHECK(memory_stats().live_bytes == before);
}

TEST_CASE("frozen parameters: gradcheck, zero_grad and to() skip them; unfreezing gives a zero gradient",
          "[nn][frozen]") {
  Generator g(2);
  nn::Linear<double> lin(4, 3, true, g);
  lin.weight().set_requires_grad(false);
  CHECK(lin.named_trainable_parameters().size() == 1);
  CHECK(lin.num_trainable_parameters() == 3);
  testing::check_module_gradients(lin, testing::random_tensor({2, 4}, 3));  // dx and the bias
  lin.zero_grad();
  lin.to(Device::cpu());
  CHECK_FALSE(lin.weight().grad.defined());
  lin.requires_grad_(true);
  REQUIRE(lin.weight().grad.defined());
  CHECK(lin.weight().grad.to_vector() == std::vector<double>(12, 0.0));
}

TEST_CASE("frozen parameters: check_bound sees a frozen parameter rebound after packing", "[nn][frozen]") {
  Generator g(2);
  nn::MLP<double> model(3, {4}, 2, nn::Activation::ReLU, g);
  model[0].requires_grad_(false);
  nn::FlatParameters<double> params(model);
  optim::AdamW<double> opt(params, {.lr = 1e-3});
  opt.step();
  model[0].named_parameters()[0].param->value = Tensor<double>::zeros({4, 3});
  try {
    opt.step();
    FAIL("a rebound frozen parameter went unnoticed");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("[ptrain.flat.unbound] parameter 0.weight") != std::string::npos);
  }
}

}  // namespace test_frozen
