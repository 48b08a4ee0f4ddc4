// nn::Llama and the batch context. The references: finite differences in double
// for every parameter's gradient; each document run alone for packed-document
// masking (a row of packed documents must give each document the logits it gets
// as a sequence of its own); the model without recompute for recompute; Hugging
// Face config.json fields written here by hand for LlamaConfig::from_hf_config.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <ptrain/nn/models/llama.hpp>
#include <vector>

#include "unit/gradcheck.hpp"

namespace test_llama {

using namespace ptrain;
using Catch::Matchers::Contains;

namespace {

nn::LlamaConfig small_config() {
  return {.vocab_size = 13, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16, .intermediate_size = 24,
          .rope = {.llama3_scaling = ops::Llama3RopeScaling{.original_max_position_embeddings = 8}}};
}

Tensor<std::int32_t> ids_of(const std::vector<std::int32_t>& v, std::int64_t rows) {
  return Tensor<std::int32_t>::from(v, {rows, static_cast<std::int64_t>(v.size()) / rows});
}

// sum(w * logits) for a fixed pseudo-random w: a scalar whose gradient reaches every parameter.
double weighted_sum(const Tensor<double>& y) {
  double s = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) s += y.data()[i] * std::sin(0.37 * static_cast<double>(i) + 0.1);
  return s;
}

}  // namespace

TEST_CASE("Llama's gradients equal finite differences, tied and untied, with biases and documents", "[nn][llama]") {
  for (int variant = 0; variant < 3; ++variant) {
    nn::LlamaConfig c = small_config();
    c.tie_weights = variant == 1;
    c.attention_bias = c.o_proj_bias = c.mlp_bias = variant == 2;
    c.document_token = variant == 2 ? 0 : -1;
    INFO("tied " << c.tie_weights << ", biases " << c.attention_bias << ", document token " << c.document_token);
    Generator g(11);
    nn::Llama<double> model(c, g);
    Generator r(12);
    for (auto& p : model.named_parameters()) ops::uniform_(p.param->value, -0.3, 0.3, r);
    const auto ids = ids_of({1, 2, 0, 3, 4, 5, 0, 6, 7, 8, 9, 0, 1, 2, 3, 4}, 2);
    nn::Cache<double> cache;
    auto y = model.forward_tokens(ids, cache);
    REQUIRE(y.shape() == Shape({2, 8, 13}));
    auto dy = Tensor<double>::empty(y.shape());
    for (std::int64_t i = 0; i < y.numel(); ++i) dy.data()[i] = std::sin(0.37 * static_cast<double>(i) + 0.1);
    model.zero_grad();
    model.backward(dy, cache);
    double worst = 0;
    std::int64_t checked = 0;
    for (auto& p : model.named_parameters()) {
      auto& v = p.param->value;
      for (std::int64_t i = 0; i < v.numel(); i += std::max<std::int64_t>(1, v.numel() / 7)) {
        const double old = v.data()[i], h = 1e-5;
        nn::Cache<double> c1, c2;
        v.data()[i] = old + h;
        const double up = weighted_sum(model.forward_tokens(ids, c1));
        v.data()[i] = old - h;
        const double down = weighted_sum(model.forward_tokens(ids, c2));
        v.data()[i] = old;
        const double numeric = (up - down) / (2 * h), analytic = p.param->grad.data()[i];
        INFO(p.name << "[" << i << "]: analytic " << analytic << ", numeric " << numeric);
        REQUIRE(std::abs(analytic - numeric) <= 1e-7 * std::max(1.0, std::abs(numeric)));
        worst = std::max(worst, std::abs(analytic - numeric));
        ++checked;
      }
    }
    CHECK(checked > 100);
  }
}

TEST_CASE("Packed documents get the logits each document gets alone", "[nn][llama][batch_context]") {
  nn::LlamaConfig c = small_config();
  c.document_token = 0;
  Generator g(3);
  nn::Llama<double> model(c, g);
  // Two rows; row 0 packs three documents, row 1 starts mid-document (no separator first).
  const std::vector<std::vector<std::int32_t>> rows = {{0, 5, 6, 7, 0, 8, 9, 0, 1, 2, 3, 4},
                                                      {3, 4, 0, 9, 10, 11, 12, 1, 2, 0, 7, 7}};
  std::vector<std::int32_t> flat;
  for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
  nn::Cache<double> cache;
  const auto packed = model.forward_tokens(ids_of(flat, 2), cache);
  const std::int64_t S = 12, V = 13;
  double worst = 0;
  int documents = 0;
  for (std::size_t b = 0; b < rows.size(); ++b) {
    for (std::size_t start = 0; start < rows[b].size();) {
      std::size_t end = start + 1;
      while (end < rows[b].size() && rows[b][end] != 0) ++end;
      const std::vector<std::int32_t> doc(rows[b].begin() + static_cast<std::ptrdiff_t>(start),
                                          rows[b].begin() + static_cast<std::ptrdiff_t>(end));
      nn::Cache<double> alone;
      const auto y = model.forward_tokens(ids_of(doc, 1), alone);
      for (std::size_t i = 0; i < doc.size(); ++i)
        for (std::int64_t v = 0; v < V; ++v) {
          const double a = packed.data()[(static_cast<std::int64_t>(b) * S + static_cast<std::int64_t>(start + i)) * V + v];
          worst = std::max(worst, std::abs(a - y.data()[static_cast<std::int64_t>(i) * V + v]));
        }
      ++documents;
      start = end;
    }
  }
  CHECK(documents == 6);
  CHECK(worst < 1e-12);

  // Without the document token the same rows attend across documents: the logits differ.
  nn::LlamaConfig plain = small_config();
  Generator g2(3);
  nn::Llama<double> unmasked(plain, g2);
  nn::Cache<double> c2;
  const auto y2 = unmasked.forward_tokens(ids_of(flat, 2), c2);
  double differ = 0;
  for (std::int64_t i = 0; i < y2.numel(); ++i) differ = std::max(differ, std::abs(y2.data()[i] - packed.data()[i]));
  CHECK(differ > 1e-3);
}

TEST_CASE("Document masking without token ids is refused by name", "[nn][llama][batch_context]") {
  nn::LlamaConfig c = small_config();
  c.document_token = 0;
  nn::Llama<double> model(c);
  nn::Cache<double> cache;
  auto x = Tensor<double>::full({1, 4}, 2.0);  // ids as values of T: no batch context
  REQUIRE_THROWS_WITH(model.forward(x, cache), Contains("[ptrain.gqa_attention.documents]") &&
                                                   Contains("forward_tokens"));
}

TEST_CASE("Explicit position ids in the batch context reach every attention layer", "[nn][llama][batch_context]") {
  // Positions p + 3 everywhere equal a sequence that starts 3 tokens later with
  // the same relative positions: rotary attention depends on differences only.
  nn::LlamaConfig c = small_config();
  c.rope.llama3_scaling.reset();
  nn::Llama<double> model(c);
  const auto ids = ids_of({1, 2, 3, 4, 5, 6}, 1);
  nn::Cache<double> plain;
  const auto y0 = model.forward_tokens(ids, plain);
  nn::Cache<double> shifted;
  shifted.set_context(std::make_shared<const nn::BatchContext>(
      nn::BatchContext{.position_ids = Tensor<std::int32_t>::from({3, 4, 5, 6, 7, 8}, {6})}));
  const auto y1 = model.forward_tokens(ids, shifted);
  double diff = 0;
  for (std::int64_t i = 0; i < y0.numel(); ++i) diff = std::max(diff, std::abs(y0.data()[i] - y1.data()[i]));
  CHECK(diff < 1e-12);
  // And they are used: absolute positions 0, 2, 4, ... change the logits.
  nn::Cache<double> spread;
  spread.set_context(std::make_shared<const nn::BatchContext>(
      nn::BatchContext{.position_ids = Tensor<std::int32_t>::from({0, 2, 4, 6, 8, 10}, {6})}));
  const auto y2 = model.forward_tokens(ids, spread);
  double moved = 0;
  for (std::int64_t i = 0; i < y0.numel(); ++i) moved = std::max(moved, std::abs(y0.data()[i] - y2.data()[i]));
  CHECK(moved > 1e-4);
}

TEST_CASE("Llama with recompute equals Llama without, documents included", "[nn][llama]") {
  nn::LlamaConfig c = small_config();
  c.document_token = 0;
  Generator g1(4), g2(4);
  nn::Llama<double> plain(c, g1);
  c.recompute = true;
  nn::Llama<double> recomputed(c, g2);
  const auto ids = ids_of({1, 0, 2, 3, 0, 4, 5, 6}, 2);
  nn::Cache<double> c1, c2;
  auto y1 = plain.forward_tokens(ids, c1);
  auto y2 = recomputed.forward_tokens(ids, c2);
  auto dy = Tensor<double>::full(y1.shape(), 0.5);
  plain.backward(dy, c1);
  recomputed.backward(dy, c2);
  auto p1 = plain.named_parameters(), p2 = recomputed.named_parameters();
  REQUIRE(p1.size() == p2.size());
  for (std::size_t i = 0; i < p1.size(); ++i) {
    INFO(p1[i].name);
    CHECK(p1[i].name == p2[i].name);
    for (std::int64_t k = 0; k < p1[i].param->grad.numel(); ++k)
      REQUIRE(p1[i].param->grad.data()[k] == p2[i].param->grad.data()[k]);
  }
}

TEMPLATE_TEST_CASE("LlamaBlock's fused residual norm gives PreNormBlock's bits", "[nn][llama]", float, double) {
  // The same four modules wired by PreNormBlock (the add, then post_attention_layernorm as a
  // module of its own) and by LlamaBlock (ops::residual_rms_norm): output, dx and every
  // parameter gradient must be the same bits.
  using T = TestType;
  nn::LlamaConfig c = small_config();
  c.mlp_bias = true;
  Generator gen(8);
  nn::LlamaBlock<T> block(c, gen);
  auto part = [](nn::Module<T>& m) { return std::shared_ptr<nn::Module<T>>(std::shared_ptr<void>(), &m); };
  nn::PreNormBlock<T> plain({"input_layernorm", part(block.input_layernorm())}, {"self_attn", part(block.self_attn())},
                            {"post_attention_layernorm", part(block.post_attention_layernorm())},
                            {"mlp", part(block.mlp())});
  Generator data(9);
  for (auto& p : block.named_parameters()) ops::uniform_(p.param->value, -0.5, 0.5, data);  // norms too
  auto x = Tensor<T>::empty({2, 5, c.n_embd}), dy = Tensor<T>::empty({2, 5, c.n_embd});
  ops::uniform_(x, -1.0, 1.0, data);
  ops::uniform_(dy, -1.0, 1.0, data);

  auto run = [&](nn::Module<T>& m) {
    block.zero_grad();
    nn::Cache<T> cache;
    auto y = m.forward(x, cache);
    auto dx = m.backward(dy, cache);
    std::vector<std::vector<T>> out{y.to_vector(), dx.to_vector()};
    for (auto& p : block.named_parameters()) out.push_back(p.param->grad.to_vector());
    return out;
  };
  const auto want = run(plain), got = run(block);
  REQUIRE(want.size() == got.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("output " << i << " (y, dx, then the parameters' gradients)");
    REQUIRE(want[i].size() == got[i].size());
    CHECK(std::memcmp(want[i].data(), got[i].data(), want[i].size() * sizeof(T)) == 0);
  }
}

TEST_CASE("Llama names its parameters like Hugging Face and counts them", "[nn][llama]") {
  nn::LlamaConfig c = small_config();
  nn::Llama<float> model(c);
  const auto params = model.named_parameters();
  CHECK(params.front().name == "embed_tokens.weight");
  CHECK(params[1].name == "layers.0.input_layernorm.weight");
  CHECK(params[2].name == "layers.0.self_attn.q_proj.weight");
  CHECK(params.back().name == "head.lm_head.weight");
  CHECK(model.num_parameters() == c.num_parameters());
  CHECK(model.unit_names() == std::vector<std::string>{"embed_tokens", "layers.0", "layers.1", "head"});
  // Hugging Face's initialisation: weights N(0, 0.02), norms 1.
  double sq = 0;
  std::int64_t n = 0;
  for (auto& p : params) {
    if (p.name.find("norm.") != std::string::npos) {
      for (std::int64_t i = 0; i < p.param->value.numel(); ++i) REQUIRE(p.param->value.data()[i] == 1.0f);
      continue;
    }
    for (std::int64_t i = 0; i < p.param->value.numel(); ++i, ++n) sq += std::pow(p.param->value.data()[i], 2);
  }
  CHECK(std::sqrt(sq / static_cast<double>(n)) == Approx(0.02).epsilon(0.05));
  const auto decay = nn::llama_decay_filter();
  CHECK(decay("layers.0.self_attn.q_proj.weight"));
  CHECK_FALSE(decay("layers.0.input_layernorm.weight"));
  CHECK_FALSE(decay("embed_tokens.weight"));
  CHECK_FALSE(decay("layers.0.self_attn.q_proj.bias"));
}

TEST_CASE("LlamaConfig reads Hugging Face configs and refuses what it cannot train", "[nn][llama][hf]") {
  // SmolLM-135M's config.json (the fields that matter).
  const auto smol = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "max_position_embeddings": 2048, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "rope_scaling": null, "tie_word_embeddings": true, "vocab_size": 49152,
    "attention_bias": false, "initializer_range": 0.02})");
  const auto c = nn::LlamaConfig::from_hf_config(smol);
  CHECK(c.n_embd == 576);
  CHECK(c.n_kv_head == 3);
  CHECK(c.head_dim() == 64);
  CHECK(c.tie_weights);
  CHECK(c.rms_norm_eps == 1e-5);
  CHECK(c.num_parameters() == 134515008);  // SmolLM-135M's published parameter count
  const auto back = nn::LlamaConfig::from_hf_config(c.to_hf_config());
  CHECK(back.num_parameters() == c.num_parameters());
  CHECK(back.to_hf_config() == c.to_hf_config());

  // Llama 3.2's rope scaling.
  auto l3 = smol;
  l3["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  l3["rope_theta"] = 500000.0;
  const auto c3 = nn::LlamaConfig::from_hf_config(l3);
  REQUIRE(c3.rope.llama3_scaling);
  CHECK(c3.rope.llama3_scaling->factor == 32.0);
  CHECK(c3.rope.theta == 500000.0);

  // Qwen2: q/k/v biases, o_proj without.
  auto qwen = smol;
  qwen["model_type"] = "qwen2";
  const auto cq = nn::LlamaConfig::from_hf_config(qwen);
  CHECK(cq.attention_bias);
  CHECK_FALSE(cq.o_proj_bias);
  CHECK(nn::LlamaConfig::from_hf_config(cq.to_hf_config()).num_parameters() == cq.num_parameters());

  // Mistral: a sliding window; longer sequences are attended through it.
  auto mistral = smol;
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 4;
  auto cm = nn::LlamaConfig::from_hf_config(mistral);
  CHECK(cm.sliding_window == 4);
  cm.vocab_size = 13;
  cm.n_layer = 1;
  cm.n_embd = 18;
  cm.intermediate_size = 8;
  nn::Llama<float> windowed(cm);
  nn::Cache<float> cache;
  CHECK_NOTHROW(windowed.forward_tokens(ids_of({1, 2, 3, 4}, 1), cache));
  CHECK(windowed.block(0).self_attn().sliding_window() == 4);
  nn::Cache<float> longer;
  CHECK(windowed.forward_tokens(ids_of({1, 2, 3, 4, 5}, 1), longer).shape() == Shape{1, 5, 13});

  // Refused by name.
  auto gelu = smol;
  gelu["hidden_act"] = "gelu";
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(gelu), Contains("hidden_act") && Contains("gelu"));
  auto gemma = smol;
  gemma["model_type"] = "gemma";
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(gemma), Contains("model_type \"gemma\""));
  auto yarn = smol;
  yarn["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(yarn), Contains("rope_scaling type \"yarn\""));
  auto sliding_qwen = qwen;
  sliding_qwen["use_sliding_window"] = true;
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(sliding_qwen), Contains("use_sliding_window"));
  auto odd = smol;
  odd["head_dim"] = 128;
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(odd), Contains("head_dim 128"));
  auto missing = smol;
  missing.erase("hidden_size");
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(missing), Contains("\"hidden_size\""));
  auto bad_kv = smol;
  bad_kv["num_key_value_heads"] = 2;
  REQUIRE_THROWS_WITH(nn::LlamaConfig::from_hf_config(bad_kv), Contains("n_kv_head 2 must divide n_head 9"));
}

TEST_CASE("Llama's KV-cached generation equals running the whole context each step", "[nn][llama][generate]") {
  nn::LlamaConfig c = small_config();
  c.max_seq_len = 10;  // short: the cache restarts during the run
  Generator g(21);
  nn::Llama<double> model(c, g);
  Generator r(22);
  for (auto& p : model.named_parameters()) ops::uniform_(p.param->value, -0.6, 0.6, r);
  const std::vector<std::int32_t> prompt = {3, 1, 4, 1, 5};
  for (double temperature : {0.0, 1.0}) {
    INFO("temperature " << temperature);
    Generator ga(7), gb(7);
    const auto cached = nn::generate(model, prompt, 17, temperature, 0, ga);
    // The reference: the whole context (as the cache holds it) through forward_tokens each step.
    std::vector<std::int32_t> seq = prompt;
    std::size_t start = 0;  // the cache's first token
    for (int n = 0; n < 17; ++n) {
      if (seq.size() - start > static_cast<std::size_t>(c.max_seq_len)) start = seq.size() - c.max_seq_len / 2;
      const std::vector<std::int32_t> ctx(seq.begin() + static_cast<std::ptrdiff_t>(start), seq.end());
      nn::Cache<double> cache;
      const auto logits = model.forward_tokens(ids_of(ctx, 1), cache);
      const double* row = logits.data() + (static_cast<std::int64_t>(ctx.size()) - 1) * c.vocab_size;
      seq.push_back(nn::sample_logits(row, c.vocab_size, temperature, 0, gb.uniform()));
    }
    CHECK(cached == seq);
  }
  // The decode step's hidden states equal forward's, not only the sampled ids.
  nn::Cache<double> cache;
  const auto full = model.forward_tokens(ids_of(prompt, 1), cache);
  std::vector<nn::KVCache<double>> kv(2);
  nn::Cache<double> scratch;
  for (std::size_t t = 0; t < prompt.size(); ++t) {
    auto h = model.embedding().forward_tokens(ids_of({prompt[t]}, 1), scratch.child(t));
    for (std::size_t l = 0; l < 2; ++l) h = model.block(l).decode(h, kv[l], 10);
    const auto logits = model.head().forward(h, scratch.child(100 + t));
    for (std::int64_t v = 0; v < c.vocab_size; ++v)
      REQUIRE(std::abs(logits.data()[v] - full.data()[static_cast<std::int64_t>(t) * c.vocab_size + v]) < 1e-12);
  }
}

}  // namespace test_llama
