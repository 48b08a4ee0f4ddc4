// nn::Llama against an independent implementation: llama_torch_reference.py (next
// to this file) builds the same network from the published architecture in
// PyTorch float64 and differentiates it with autograd; the logits and the gradient
// of every parameter must agree to 1e-9 of the tensor's largest value. Fails
// when /usr/bin/python3 cannot import torch (tools/install-deps.sh --test
// installs python3-torch).
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <unistd.h>

#include "unit/raw_files.hpp"

namespace test_llama_torch {

using namespace ptrain;
using testing::read_raw;
using testing::torch_available;
using testing::write_raw;
namespace fs = std::filesystem;

namespace {

// max |ours - theirs| / max |theirs|, after checking it is at most 1e-9.
double require_close(const std::vector<double>& ours, const std::vector<double>& theirs, const std::string& what) {
  REQUIRE(ours.size() == theirs.size());
  double scale = 0, diff = 0;
  for (double t : theirs) scale = std::max(scale, std::abs(t));
  REQUIRE(scale > 0);  // a tensor of zeros would compare nothing
  for (std::size_t i = 0; i < ours.size(); ++i) diff = std::max(diff, std::abs(ours[i] - theirs[i]));
  INFO(what << ": max difference " << diff << " of max " << scale);
  REQUIRE(diff <= 1e-9 * scale);
  return diff / scale;
}

}  // namespace

TEST_CASE("Llama logits and every gradient equal an independent PyTorch float64 implementation", "[nn][llama]") {
  if (!torch_available())
    FAIL("/usr/bin/python3 cannot import torch: run tools/install-deps.sh --test (it installs python3-torch)");
  const fs::path script = fs::path(PTRAIN_TESTS_DIR) / "unit/nn/models/llama_torch_reference.py";
  REQUIRE(fs::exists(script));
  struct Case {
    const char* name;
    bool tie, attention_bias, o_proj_bias, mlp_bias, llama3;
    std::int32_t document_token;
  };
  // Llama 3 scaling with head width 8 puts the four frequencies' wavelengths (6.3, 63,
  // 628, 6283) in all three regions of Note [Llama 3 rotary scaling] (32 and 256 here).
  for (const Case c : {Case{"untied, no biases", false, false, false, false, true, -1},
                       Case{"tied, Llama's attention and MLP biases", true, true, true, true, true, -1},
                       Case{"untied, Qwen2's q/k/v biases, packed documents", false, true, false, false, true, 3},
                       Case{"tied, packed documents, plain rotary", true, false, false, false, false, 3}}) {
    INFO(c.name);
    nn::LlamaConfig cfg{.vocab_size = 13, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32,
                        .intermediate_size = 24, .max_seq_len = 64, .rms_norm_eps = 1e-5};
    cfg.rope.theta = 10000.0;
    if (c.llama3)
      cfg.rope.llama3_scaling = ops::Llama3RopeScaling{
          .factor = 8.0, .low_freq_factor = 1.0, .high_freq_factor = 8.0, .original_max_position_embeddings = 256};
    cfg.tie_weights = c.tie;
    cfg.attention_bias = c.attention_bias;
    cfg.o_proj_bias = c.o_proj_bias;
    cfg.mlp_bias = c.mlp_bias;
    cfg.document_token = c.document_token;
    Generator gen(1);
    nn::Llama<double> model(cfg, gen);
    Generator g(2);
    for (auto& p : model.named_parameters()) {
      if (p.name.find("norm.") != std::string::npos) ops::uniform_(p.param->value, 0.5, 1.5, g);
      else ops::uniform_(p.param->value, -0.4, 0.4, g);
    }
    const std::int64_t B = 2, S = 12;
    auto ids = Tensor<std::int32_t>::empty({B, S});
    std::vector<std::int64_t> ids64(B * S);
    for (std::int64_t i = 0; i < B * S; ++i) ids64[i] = static_cast<std::int64_t>(g.below(13));
    // Several documents per row, a one-token document among them. Rotary scores depend
    // on position differences only, so what the logits see of packing is the mask.
    if (c.document_token >= 0)
      for (std::int64_t i : {0, 4, 5, 9, 12 + 2, 12 + 7}) ids64[i] = c.document_token;
    for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>(ids64[i]);

    const fs::path dir = fs::temp_directory_path() / ("ptrain_llama_torch_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    nlohmann::json manifest;
    manifest["config"] = {{"n_layer", cfg.n_layer}, {"n_head", cfg.n_head}, {"n_kv_head", cfg.n_kv_head},
                          {"n_embd", cfg.n_embd}, {"rms_norm_eps", cfg.rms_norm_eps}, {"rope_theta", cfg.rope.theta},
                          {"tie_weights", c.tie}, {"document_token", c.document_token}, {"llama3", nullptr}};
    if (c.llama3) {
      const auto& s = *cfg.rope.llama3_scaling;
      manifest["config"]["llama3"] = {{"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
                                      {"high_freq_factor", s.high_freq_factor},
                                      {"original_max_position_embeddings", s.original_max_position_embeddings}};
    }
    manifest["tokens_shape"] = {B, S};
    for (auto& p : model.named_parameters()) {
      const std::string file = p.name + ".bin";
      write_raw(dir / file, p.param->value.data(), static_cast<std::size_t>(p.param->value.numel()));
      manifest["params"].push_back({{"name", p.name}, {"file", file}, {"shape", p.param->value.shape().vec()}});
    }
    std::ofstream(dir / "manifest.json") << manifest.dump(1);
    write_raw(dir / "tokens.bin", ids64.data(), ids64.size());

    nn::Cache<double> cache;
    auto logits = model.forward_tokens(ids, cache);
    auto dlogits = Tensor<double>::empty(logits.shape());
    ops::uniform_(dlogits, -1.0, 1.0, g);
    write_raw(dir / "dlogits.bin", dlogits.data(), static_cast<std::size_t>(dlogits.numel()));
    model.zero_grad();
    model.backward(dlogits, cache);

    REQUIRE(std::system(("/usr/bin/python3 '" + script.string() + "' '" + dir.string() + "'").c_str()) == 0);
    const double dl = require_close(logits.to_vector(),
                                    read_raw(dir / "logits.bin", static_cast<std::size_t>(logits.numel())), "logits");
    double dg = 0;
    for (auto& p : model.named_parameters())
      dg = std::max(dg, require_close(p.param->grad.to_vector(),
                                      read_raw(dir / ("grad." + p.name + ".bin"),
                                               static_cast<std::size_t>(p.param->grad.numel())),
                                      "grad " + p.name));
    std::printf("llama vs torch reference (%s): max relative difference logits %.2e, gradients %.2e\n", c.name, dl, dg);
    fs::remove_all(dir);
  }
}

}  // namespace test_llama_torch
