// LoRA adapters (Note [LoRA] in nn/lora.hpp). References: a hand-written double loop of
// y = x W^T + b + s (x A^T) B^T and its gradients; finite differences; a plain model
// whose weights are W + s B A worked out by hand; the names PEFT's rule selects in a
// Llama; the allocator's counters against a formula.
#include <catch2/catch.hpp>
#include <map>
#include <ptrain/data/dataset.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/lora.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/moe.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/local.hpp>
#include <ptrain/train/trainer.hpp>

#include "unit/gradcheck.hpp"

namespace test_lora {

using namespace ptrain;

namespace {

double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

std::map<std::string, std::vector<double>> values_of(nn::Module<double>& m) {
  std::map<std::string, std::vector<double>> out;
  for (auto& p : m.named_parameters()) out[p.name] = p.param->value.to_vector();
  return out;
}

Tensor<std::int32_t> tokens(std::int64_t b, std::int64_t s, std::int64_t vocab, std::uint64_t seed) {
  Generator g(seed);
  auto t = Tensor<std::int32_t>::empty({b, s});
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<std::int32_t>(g.below(vocab));
  return t;
}

nn::LlamaConfig small_llama() {
  return {.vocab_size = 13, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 8, .intermediate_size = 12,
          .max_seq_len = 16};
}

const std::vector<std::string> kLlamaTargets = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"};

}  // namespace

TEST_CASE("LoRA: a Linear with an adapter equals the hand-written double loop, values and gradients",
          "[nn][lora]") {
  const std::int64_t n = 6, in = 5, out = 4, r = 3;
  Generator g(1);
  nn::Sequential<double> model;
  auto lin = model.add(std::make_shared<nn::Linear<double>>(in, out, true, g));
  const auto names = nn::apply_lora(model, {.r = r, .alpha = 6, .target_modules = {"0"}}, g);
  CHECK(names == std::vector<std::string>{"0.lora_A.weight", "0.lora_B.weight"});
  auto adapters = nn::lora_adapters(model);
  REQUIRE(adapters.size() == 1);
  CHECK(adapters[0].first == "0");
  auto& A = adapters[0].second->lora_A().weight();
  auto& B = adapters[0].second->lora_B().weight();
  REQUIRE(A.value.shape() == Shape{r, in});
  REQUIRE(B.value.shape() == Shape{out, r});
  CHECK(B.value.to_vector() == std::vector<double>(out * r, 0.0));  // a fresh adapter changes nothing
  for (double a : A.value.to_vector()) CHECK(std::abs(a) <= 1 / std::sqrt(double(in)));  // kaiming_uniform(sqrt(5))
  B.value.copy_(testing::random_tensor({out, r}, 2));
  CHECK_FALSE(lin->weight().requires_grad);
  CHECK_FALSE(lin->bias()->requires_grad);

  const auto x = testing::random_tensor({2, 3, in}, 3), dy = testing::random_tensor({2, 3, out}, 4);
  nn::Cache<double> cache;
  const auto y = model.forward(x, cache).to_vector();
  model.zero_grad();
  const auto dx = model.backward(dy, cache).to_vector();

  const auto X = x.to_vector(), DY = dy.to_vector(), W = lin->weight().value.to_vector(),
             b = lin->bias()->value.to_vector(), a = A.value.to_vector(), bb = B.value.to_vector();
  const double s = 6.0 / r;
  std::vector<double> want_y(n * out), want_dx(n * in, 0.0), want_dA(r * in, 0.0), want_dB(out * r, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<double> u(r, 0.0), du(r, 0.0);  // u = x A^T, du = s dy B
    for (std::int64_t k = 0; k < r; ++k)
      for (std::int64_t j = 0; j < in; ++j) u[k] += X[i * in + j] * a[k * in + j];
    for (std::int64_t o = 0; o < out; ++o) {
      double v = b[o];
      for (std::int64_t j = 0; j < in; ++j) v += X[i * in + j] * W[o * in + j];
      for (std::int64_t k = 0; k < r; ++k) v += s * u[k] * bb[o * r + k];
      want_y[i * out + o] = v;
      for (std::int64_t k = 0; k < r; ++k) {
        du[k] += s * DY[i * out + o] * bb[o * r + k];
        want_dB[o * r + k] += s * DY[i * out + o] * u[k];
      }
      for (std::int64_t j = 0; j < in; ++j) want_dx[i * in + j] += DY[i * out + o] * W[o * in + j];
    }
    for (std::int64_t k = 0; k < r; ++k)
      for (std::int64_t j = 0; j < in; ++j) {
        want_dA[k * in + j] += du[k] * X[i * in + j];
        want_dx[i * in + j] += du[k] * a[k * in + j];
      }
  }
  CHECK(max_diff(y, want_y) < 1e-13);
  CHECK(max_diff(dx, want_dx) < 1e-13);
  CHECK(max_diff(A.grad.to_vector(), want_dA) < 1e-13);
  CHECK(max_diff(B.grad.to_vector(), want_dB) < 1e-13);
  CHECK_FALSE(lin->weight().grad.defined());

  // Finite differences through the adapter (A, B and x; the base is frozen).
  testing::check_module_gradients(model, x);

  // Merged: W + s B A by hand, the same output, and the adapter adds nothing.
  nn::merge_lora(model);
  std::vector<double> merged = W;
  for (std::int64_t o = 0; o < out; ++o)
    for (std::int64_t j = 0; j < in; ++j)
      for (std::int64_t k = 0; k < r; ++k) merged[o * in + j] += s * bb[o * r + k] * a[k * in + j];
  CHECK(max_diff(lin->weight().value.to_vector(), merged) < 1e-14);
  nn::Cache<double> c2;
  CHECK(max_diff(model.forward(x, c2).to_vector(), want_y) < 1e-13);
  nn::unmerge_lora(model);
  CHECK(max_diff(lin->weight().value.to_vector(), W) < 1e-14);
}

TEST_CASE("LoRA: PEFT's name patterns select exactly the projections of a Llama; names and freezing",
          "[nn][lora]") {
  Generator g(3);
  nn::Llama<double> model(small_llama(), g);
  std::vector<std::string> base;
  for (auto& p : model.named_parameters()) base.push_back(p.name);
  const auto names = nn::apply_lora(model, {.r = 2, .alpha = 4, .target_modules = kLlamaTargets}, g);
  std::vector<std::string> want;
  for (int l = 0; l < 2; ++l)
    for (const char* m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"})
      for (const char* ab : {"lora_A", "lora_B"})
        want.push_back("layers." + std::to_string(l) + "." + m + "." + ab + ".weight");
  CHECK(names == want);
  // The base keeps its names (the Hugging Face loaders still fill it) and is frozen.
  std::vector<std::string> kept;
  for (auto& p : model.named_parameters()) {
    INFO(p.name);
    const bool adapter = p.name.find(".lora_") != std::string::npos;
    CHECK(p.param->requires_grad == adapter);
    if (!adapter) kept.push_back(p.name);
  }
  CHECK(kept == base);
  // Shapes: A [r, in], B [out, r]; q_proj is 8 -> 8, k_proj 8 -> 4 (two kv heads of 2), down_proj 12 -> 8.
  std::map<std::string, Shape> shapes;
  for (auto& p : model.named_parameters()) shapes[p.name] = p.param->value.shape();
  CHECK(shapes.at("layers.0.self_attn.k_proj.lora_A.weight") == Shape{2, 8});
  CHECK(shapes.at("layers.0.self_attn.k_proj.lora_B.weight") == Shape{4, 2});
  CHECK(shapes.at("layers.1.mlp.down_proj.lora_A.weight") == Shape{2, 12});
  CHECK(shapes.at("layers.1.mlp.down_proj.lora_B.weight") == Shape{8, 2});

  // A longer pattern selects by its last parts; a part of a name is no match (PEFT's rule).
  CHECK(nn::lora_target_matches("layers.0.self_attn.q_proj", "self_attn.q_proj"));
  CHECK(nn::lora_target_matches("q_proj", "q_proj"));
  CHECK_FALSE(nn::lora_target_matches("layers.0.self_attn.q_proj", "proj"));
  CHECK_FALSE(nn::lora_target_matches("layers.0.self_attn.xq_proj", "q_proj"));
  Generator g2(3);
  nn::Llama<double> other(small_llama(), g2);
  const auto only = nn::apply_lora(other, {.r = 2, .target_modules = {"layers.1.self_attn.v_proj"}}, g2);
  CHECK(only == std::vector<std::string>{"layers.1.self_attn.v_proj.lora_A.weight",
                                         "layers.1.self_attn.v_proj.lora_B.weight"});
  // lm_head is a Linear too (an untied head), reached through its own forward.
  Generator g3(3);
  nn::Llama<double> head(small_llama(), g3);
  CHECK(nn::apply_lora(head, {.r = 2, .target_modules = {"lm_head"}}, g3).front() == "head.lm_head.lora_A.weight");
}

TEST_CASE("LoRA: finite differences through the adapters of a GPT and a Llama", "[nn][lora]") {
  auto ids = Tensor<double>::empty({2, 5});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<double>((i * 7 + 3) % 11);
  nn::GPTConfig cfg{.vocab_size = 11, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 8};
  Generator g(12);
  nn::GPT<double> gpt(cfg, g);
  nn::apply_lora(gpt, {.r = 2, .alpha = 4, .target_modules = {"c_attn", "c_proj", "c_fc"}}, g);
  for (auto& [name, a] : nn::lora_adapters(gpt)) {  // B = 0 would make A's gradient zero
    auto& b = a->lora_B().weight().value;
    b.copy_(testing::random_tensor(b.shape(), 13));
  }
  testing::check_module_gradients(gpt, ids, false);
  Generator g2(14);
  nn::Llama<double> llama(small_llama(), g2);
  nn::apply_lora(llama, {.r = 2, .alpha = 4, .target_modules = kLlamaTargets}, g2);
  for (auto& [name, a] : nn::lora_adapters(llama)) {
    auto& b = a->lora_B().weight().value;
    b.copy_(testing::random_tensor(b.shape(), 15));
  }
  testing::check_module_gradients(llama, ids, false, 1e-6);
}

TEST_CASE("LoRA: bad configurations and targets are refused with what to do", "[nn][lora]") {
  Generator g(4);
  nn::Llama<double> model(small_llama(), g);
  CHECK_THROWS_WITH(nn::apply_lora(model, {.r = 0, .target_modules = {"q_proj"}}),
                    Catch::Contains("[ptrain.lora.config]"));
  CHECK_THROWS_WITH(nn::apply_lora(model, {.target_modules = {"q_proj"}, .bias = "all"}),
                    Catch::Contains("bias 'all'"));
  CHECK_THROWS_WITH(nn::apply_lora(model, {.dropout = 1.0, .target_modules = {"q_proj"}}), Catch::Contains("dropout"));
  CHECK_THROWS_WITH(nn::apply_lora(model, {}), Catch::Contains("target_modules is empty"));
  CHECK_THROWS_WITH(nn::apply_lora(model, {.target_modules = {"c_attn"}}), Catch::Contains("[ptrain.lora.targets]"));
  CHECK(model.num_trainable_parameters() == model.num_parameters());  // a refused call changes nothing
  nn::apply_lora(model, {.target_modules = {"q_proj"}}, g);
  CHECK_THROWS_WITH(nn::apply_lora(model, {.target_modules = {"q_proj"}}), Catch::Contains("already has an adapter"));
  // Routed experts run as grouped GEMMs over their weights: an adapter there is refused at forward.
  nn::LlamaConfig moe = small_llama();
  moe.num_experts = 2;
  moe.top_k = 1;
  Generator g2(5);
  nn::Llama<double> mixtral(moe, g2);
  nn::apply_lora(mixtral, {.target_modules = {"w1"}}, g2);
  nn::Cache<double> c;
  CHECK_THROWS_WITH(mixtral.forward_tokens(tokens(1, 4, 13, 1), c), Catch::Contains("[ptrain.lora.moe]"));
}

namespace {
// Trains `model` (LoRA applied) under the Trainer with the Local engine on a copy task and
// checks: the loss falls, only the adapters change, merge then forward equals the unmerged
// forward, and unmerge gives the trained weights back.
void train_and_check(nn::Module<double>& model, std::int64_t vocab) {
  const auto start = values_of(model);
  const std::int64_t N = 16, S = 6;
  auto ids = tokens(N, S, vocab, 7);
  auto x = Tensor<double>::empty({N, S});
  for (std::int64_t i = 0; i < ids.numel(); ++i) x.data()[i] = ids.data()[i];
  TensorDataset<double> data(x, ids);  // predict the token itself
  dist::SelfCommunicator self;
  parallel::Local<double> engine(model);
  optim::AdamW<double> opt(engine.parameters(), {.lr = 3e-2, .weight_decay = 0});
  std::vector<double> losses;
  train::Trainer<double> trainer(engine, opt, data, {.epochs = 10, .batch = 8, .log_every = 0});
  trainer.on_step = [&](const train::StepInfo& s) { losses.push_back(s.loss); };
  CHECK(trainer.run().step == 20);
  REQUIRE(losses.size() == 20);
  const double first = (losses[0] + losses[1]) / 2, last = (losses[18] + losses[19]) / 2;
  CHECK(last < first - 0.05);
  const auto end = values_of(model);
  for (const auto& [name, v] : end) {
    INFO(name);
    const bool lora = name.find(".lora_") != std::string::npos;
    if (lora) CHECK(v != start.at(name));
    else CHECK(v == start.at(name));
  }
  nn::Cache<double> c1, c2;
  model.train(false);
  const auto probe = tokens(2, S, vocab, 8);
  const auto unmerged = model.forward_tokens(probe, c1).to_vector();
  nn::merge_lora(model);
  const auto merged = model.forward_tokens(probe, c2).to_vector();
  CHECK(max_diff(merged, unmerged) < 1e-12);
  nn::unmerge_lora(model);
  for (auto& p : model.named_parameters()) CHECK(max_diff(p.param->value.to_vector(), end.at(p.name)) < 1e-14);
}
}  // namespace

TEST_CASE("LoRA: a Llama and a GPT train their adapters under the Trainer with the Local engine", "[nn][lora][train]") {
  // Weights of a trained model's size (init_std 0.3), and the head adapted too: a frozen
  // head of std 0.02 behind RMSNorm bounds the logits near zero, whatever the adapters do.
  nn::LlamaConfig cfg = small_llama();
  cfg.init_std = 0.3;
  Generator g(6);
  nn::Llama<double> llama(cfg, g);
  auto targets = kLlamaTargets;
  targets.push_back("lm_head");
  nn::apply_lora(llama, {.r = 4, .alpha = 32, .target_modules = targets}, g);
  train_and_check(llama, 13);

  nn::GPTConfig gcfg{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8};
  Generator g2(7);
  nn::GPT<double> gpt(gcfg, g2);
  for (auto& p : gpt.named_parameters())  // a trained model's size of projections, as for the Llama
    if (p.name.find("attn.c_") != std::string::npos || p.name.find("mlp.c_") != std::string::npos)
      ops::scale_(p.param->value, 15.0);
  nn::apply_lora(gpt, {.r = 4, .alpha = 32, .dropout = 0.1, .target_modules = {"c_attn", "c_proj", "c_fc"}}, g2);
  train_and_check(gpt, 11);
}

TEST_CASE("LoRA: frozen, trainable, gradient and optimizer bytes follow the formula (allocator counters)",
          "[nn][lora][memory]") {
  // Elements padded to FlatParameters' 16: frozen base F, adapters A. Bytes per element
  // of T: values F + A, gradients A, AdamW's moments 2A in acc_t<T> (fp32 for bf16),
  // and for bf16 the fp32 master copy A. Nothing for the base but its values.
  const auto padded = [](std::int64_t n) { return (n + 15) / 16 * 16; };
  SECTION("double Llama") {
    const std::int64_t before = memory_stats().live_bytes;
    {
      Generator g(8);
      nn::Llama<double> model(small_llama(), g);
      nn::apply_lora(model, {.r = 2, .target_modules = kLlamaTargets}, g);
      std::int64_t F = 0, A = 0;
      for (auto& p : model.named_parameters()) (p.param->requires_grad ? A : F) += padded(p.param->value.numel());
      const std::int64_t model_bytes = memory_stats().live_bytes - before;
      parallel::Local<double> engine(model);
      optim::AdamW<double> opt(engine.parameters(), {.lr = 1e-3});
      CHECK(engine.parameters().frozen_values().numel() == F);
      CHECK(engine.parameters().values().numel() == A);
      CHECK(A < F);
      // The engine replaced the model's own tensors (values and the adapters' gradients) by views.
      std::int64_t unpadded = 0;
      for (auto& p : model.named_parameters()) unpadded += p.param->value.numel() * (p.param->requires_grad ? 2 : 1);
      CHECK(model_bytes >= 8 * unpadded);
      const std::int64_t other = model_bytes - 8 * unpadded;  // the model's own non-parameter tensors
      CHECK(memory_stats().live_bytes - before == other + 8 * (F + A + A + 2 * A));
    }
    CHECK(memory_stats().live_bytes == before);
  }
  SECTION("bf16 GPT: the adapters get fp32 master copies and moments, the base nothing") {
    const std::int64_t before = memory_stats().live_bytes;
    {
      nn::GPTConfig cfg{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
      Generator g(9);
      nn::GPT<bf16> model(cfg, g);
      nn::apply_lora(model, {.r = 2, .target_modules = {"c_attn", "c_proj"}}, g);
      std::int64_t F = 0, A = 0, unpadded = 0;
      for (auto& p : model.named_parameters()) {
        (p.param->requires_grad ? A : F) += padded(p.param->value.numel());
        unpadded += p.param->value.numel() * (p.param->requires_grad ? 2 : 1);
      }
      const std::int64_t other = memory_stats().live_bytes - before - 2 * unpadded;
      parallel::Local<bf16> engine(model);
      optim::AdamW<bf16> opt(engine.parameters(), {.lr = 1e-3});
      REQUIRE(opt.flat_state().size() == 3);
      for (const auto& [kind, t] : opt.flat_state()) CHECK(t.numel() == A);
      CHECK(memory_stats().live_bytes - before == other + 2 * (F + A + A) + 4 * (3 * A));
      // A step moves the adapters (their first step only moves B: A's gradient is zero while B is)
      // and not one bit of the base, and leaves nothing behind.
      const auto bits = [](const Tensor<bf16>& t) {
        std::vector<std::uint16_t> v;
        for (const bf16& x : t.to_vector()) v.push_back(x.bits);
        return v;
      };
      const auto base0 = bits(engine.parameters().frozen_values()), adapters0 = bits(engine.parameters().values());
      engine.zero_grad();
      engine.forward_backward(tokens(2, 6, 11, 1), tokens(2, 6, 11, 2));
      opt.step();
      CHECK(bits(engine.parameters().frozen_values()) == base0);
      CHECK(bits(engine.parameters().values()) != adapters0);
      CHECK(memory_stats().live_bytes - before == other + 2 * (F + A + A) + 4 * (3 * A));
    }
    CHECK(memory_stats().live_bytes == before);
  }
}

}  // namespace test_lora
