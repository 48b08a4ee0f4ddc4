// Pretrained GPT weights: Hugging Face's GPT-2 layout written by gpt2_hf_reference.py
// (next to this file, numpy), whose own from-scratch GPT-2 forward pass gives the
// reference logits; and ptrain's own names, round-tripped.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/gpt2_weights.hpp>
#include <unistd.h>

#include "unit/raw_files.hpp"

namespace test_gpt2_weights {

using namespace ptrain;
using testing::read_raw;
namespace fs = std::filesystem;

namespace {

std::vector<std::vector<double>> parameter_values(nn::GPT<double>& m) {
  std::vector<std::vector<double>> out;
  for (auto& p : m.named_parameters()) out.push_back(p.param->value.to_vector());
  return out;
}

}  // namespace

TEST_CASE("GPT-2 weights in Hugging Face's layout give GPT-2's logits", "[ckpt][gpt]") {
  const fs::path dir = fs::temp_directory_path() / ("ptrain_gpt2_weights_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path script = fs::path(__FILE__).parent_path() / "gpt2_hf_reference.py";
  REQUIRE(std::system(("/usr/bin/python3 '" + script.string() + "' '" + dir.string() + "'").c_str()) == 0);
  nlohmann::json meta;
  std::ifstream(dir / "meta.json") >> meta;
  const std::int64_t V = meta["vocab"], C = meta["embd"], B = meta["batch"], S = meta["seq"];
  const auto ids64 = read_raw<std::int64_t>(dir / "tokens.bin");
  const auto want = read_raw<double>(dir / "logits.bin");
  REQUIRE(static_cast<std::int64_t>(want.size()) == B * S * V);
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>(ids64[i]);

  // A padded vocabulary (V + 3 rows, the extra ones zero) and a block shorter than the
  // file's positions (cropped), as nanoGPT and llm.c build GPT-2; tied, and untied.
  for (const char* file : {"hf.safetensors", "hf_plain.safetensors"})
    for (bool tie : {true, false}) {
      INFO(file << ", tie_weights " << tie);
      nn::GPTConfig cfg{.vocab_size = V + 3, .block_size = S, .n_layer = meta["layers"], .n_head = meta["heads"],
                        .n_embd = C, .tie_weights = tie};
      nn::GPT<double> model(cfg);
      const std::string what = ckpt::load_gpt2_weights((dir / file).string(), model);
      CHECK(what.find("Hugging Face GPT-2 weights") != std::string::npos);
      CHECK(what.find("vocabulary 37 padded to 40") != std::string::npos);
      CHECK(what.find("positions cropped from 12 to 8") != std::string::npos);
      nn::Cache<double> cache;
      const auto logits = model.forward_tokens(ids, cache).to_vector();
      REQUIRE(static_cast<std::int64_t>(logits.size()) == B * S * (V + 3));
      for (std::int64_t t = 0; t < B * S; ++t)
        for (std::int64_t v = 0; v < V + 3; ++v) {
          const double got = logits[t * (V + 3) + v];
          INFO("token " << t << ", logit " << v);
          if (v < V) REQUIRE(std::abs(got - want[t * V + v]) <= 1e-10 * (1 + std::abs(want[t * V + v])));
          else REQUIRE(got == 0.0);  // padded rows are zero
        }
    }

  // The model's own names round-trip, and what does not fit changes nothing.
  nn::GPTConfig cfg{.vocab_size = V, .block_size = S, .n_layer = meta["layers"], .n_head = meta["heads"], .n_embd = C};
  nn::GPT<double> source(cfg);
  std::vector<ckpt::TensorRef> refs;
  for (auto& p : source.named_parameters()) refs.push_back(ckpt::tensor_ref(p.name, p.param->value));
  const std::string ours = (dir / "ours.safetensors").string();
  ckpt::write_safetensors(ours, refs);
  Generator other_init(99);
  nn::GPT<double> copy(cfg, other_init);
  REQUIRE(parameter_values(copy) != parameter_values(source));
  CHECK(ckpt::load_gpt2_weights(ours, copy).find("ptrain GPT weights") != std::string::npos);
  CHECK(parameter_values(copy) == parameter_values(source));

  const std::string hf = (dir / "hf.safetensors").string();
  for (auto [layers, embd, vocab, block, msg] :
       {std::tuple{std::int64_t{1}, C, V, S, "tensor(s) the model has no parameter for"},
        std::tuple{std::int64_t{3}, C, V, S, "[ptrain.ckpt.missing]"},
        std::tuple{std::int64_t{2}, 2 * C, V, S, "[ptrain.ckpt.gpt2]"},
        std::tuple{std::int64_t{2}, C, V - 1, S, "[ptrain.ckpt.gpt2]"},
        std::tuple{std::int64_t{2}, C, V, std::int64_t{13}, "[ptrain.ckpt.gpt2]"}}) {
    INFO(msg);
    nn::GPT<double> m({.vocab_size = vocab, .block_size = block, .n_layer = layers, .n_head = 2, .n_embd = embd});
    const auto before = parameter_values(m);
    REQUIRE_THROWS_WITH(ckpt::load_gpt2_weights(hf, m), Catch::Contains(msg));
    CHECK(parameter_values(m) == before);
  }
  REQUIRE_THROWS_WITH(ckpt::load_gpt2_weights((dir / "logits.bin").string(), copy), Catch::Contains("[ptrain.ckpt"));
  fs::remove_all(dir);
}

TEST_CASE("save_gpt2_weights writes a Hugging Face GPT-2 folder with the model's logits", "[ckpt][gpt]") {
  const fs::path dir = fs::temp_directory_path() / ("ptrain_gpt2_save_" + std::to_string(::getpid()));
  const fs::path script = fs::path(__FILE__).parent_path() / "gpt2_hf_reference.py";
  const std::int64_t V = 37, B = 2, S = 8;  // the model pads its vocabulary to V + 3
  fs::create_directories(dir);
  nlohmann::json ids_json;
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 11 + 5) % V);
  for (std::int64_t b = 0; b < B; ++b) {
    std::vector<std::int32_t> row(ids.data() + b * S, ids.data() + (b + 1) * S);
    ids_json["ids"].push_back(row);
  }
  std::ofstream(dir / "ids.json") << ids_json.dump();

  for (bool tie : {true, false}) {
    INFO("tie_weights " << tie);
    const nn::GPTConfig cfg{.vocab_size = V + 3, .block_size = S, .n_layer = 2, .n_head = 2, .n_embd = 16,
                            .tie_weights = tie};
    Generator init(tie ? 3 : 4);
    nn::GPT<double> model(cfg, init);
    for (auto& p : model.named_parameters())  // values a float holds exactly: the file is F32
      for (std::int64_t i = 0; i < p.param->value.numel(); ++i)
        p.param->value.data()[i] = static_cast<float>(p.param->value.data()[i] + 0.01 * std::sin(double(i)));
    const fs::path out = dir / (tie ? "tied" : "untied");
    CHECK(ckpt::save_gpt2_weights(out.string(), model, V) ==
          std::to_string(tie ? 28 : 29) + " tensors, vocabulary 37 (of 40)");

    // The reference's forward pass reads the folder as transformers would (config.json, names, layout).
    const std::string cmd = "/usr/bin/python3 '" + script.string() + "' logits '" + out.string() + "' '" +
                            (dir / "ids.json").string() + "' '" + (out / "logits.bin").string() + "'";
    REQUIRE(std::system(cmd.c_str()) == 0);
    const auto want = read_raw<double>(out / "logits.bin");
    REQUIRE(static_cast<std::int64_t>(want.size()) == B * S * V);
    nn::Cache<double> cache;
    const auto got = model.forward_tokens(ids, cache).to_vector();
    for (std::int64_t t = 0; t < B * S; ++t)
      for (std::int64_t v = 0; v < V; ++v) {
        INFO("token " << t << ", logit " << v);
        REQUIRE(std::abs(got[t * (V + 3) + v] - want[t * V + v]) <= 1e-10 * (1 + std::abs(want[t * V + v])));
      }

    // And back: the same parameters, the dropped rows zero.
    nn::GPT<double> back(cfg);
    CHECK(ckpt::load_gpt2_weights(out.string(), back).find("padded to 40") != std::string::npos);  // the folder
    const auto a = parameter_values(model), b = parameter_values(back);
    std::size_t k = 0;
    for (auto& p : model.named_parameters()) {
      INFO(p.name);
      const bool vocab_rows = p.name == "embed.wte.weight" || p.name == "head.lm_head.weight";
      const std::size_t keep = vocab_rows ? static_cast<std::size_t>(V * cfg.n_embd) : a[k].size();
      CHECK(std::vector<double>(b[k].begin(), b[k].begin() + keep) == std::vector<double>(a[k].begin(), a[k].begin() + keep));
      CHECK(std::all_of(b[k].begin() + keep, b[k].end(), [](double x) { return x == 0.0; }));
      ++k;
    }
  }
  nn::GPT<double> small({.vocab_size = V, .block_size = S, .n_layer = 1, .n_head = 2, .n_embd = 16});
  CHECK_THROWS_WITH(ckpt::save_gpt2_weights((dir / "x").string(), small, V + 1), Catch::Contains("at most the model's"));
  fs::remove_all(dir);
}

}  // namespace test_gpt2_weights
