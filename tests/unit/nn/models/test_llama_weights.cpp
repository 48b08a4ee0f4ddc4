// Hugging Face Llama folders in and out (nn/models/llama_weights.hpp):
// folders written by an independent writer (llama_hf_reference.py next to this
// file: plain struct + json, F32 one file, BF16 in shards with an index, F16 tied)
// load to exactly the values it wrote; save_llama_weights and back is bitwise
// equal; what does not fit is refused by id and changes nothing; and
// transformers 4.36's AutoModelForCausalLM gives ptrain's logits on a folder
// ptrain wrote (tools/install-deps.sh --test installs transformers; the test
// fails without it); Mixtral folders: config.json both ways, the experts' tensors,
// and MixtralForCausalLM's logits and gradients.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/llama_weights.hpp>
#include <unistd.h>

#include "unit/raw_files.hpp"

namespace test_llama_weights {

using namespace ptrain;
using testing::read_raw;
namespace fs = std::filesystem;

namespace {

template <class T>
std::vector<std::vector<double>> parameter_values(nn::Llama<T>& m) {
  std::vector<std::vector<double>> out;
  for (auto& p : m.named_parameters()) {
    std::vector<double> v;
    for (std::int64_t i = 0; i < p.param->value.numel(); ++i) v.push_back(static_cast<double>(p.param->value.data()[i]));
    out.push_back(std::move(v));
  }
  return out;
}

const fs::path kScript = fs::path(PTRAIN_TESTS_DIR) / "unit/nn/models/llama_hf_reference.py";

fs::path scratch(const char* what) {
  const fs::path dir = fs::temp_directory_path() / (std::string("ptrain_") + what + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

nlohmann::json read_json(const fs::path& p) {
  nlohmann::json j;
  std::ifstream(p) >> j;
  return j;
}

}  // namespace

TEST_CASE("Hugging Face Llama folders load to exactly the values written", "[llama][ckpt]") {
  const fs::path dir = scratch("llama_hf_in");
  REQUIRE(std::system(("/usr/bin/python3 '" + kScript.string() + "' write '" + dir.string() + "'").c_str()) == 0);
  for (const char* variant : {"f32", "bf16", "f16"}) {
    INFO(variant);
    const fs::path folder = dir / variant;
    const nn::LlamaConfig cfg = nn::LlamaConfig::from_hf_config_file(folder / "config.json");
    const auto check = [&](auto& model, const std::string& what) {
      CHECK(what.find("Hugging Face Llama weights") != std::string::npos);
      CHECK((what.find("3 files") != std::string::npos) == (std::string(variant) == "bf16"));
      for (auto& p : model.named_parameters()) {
        INFO(p.name);
        const std::string file = p.name == "head.lm_head.weight" && !fs::exists(folder / "expected" / (p.name + ".bin"))
                                     ? "embed_tokens.weight" : p.name;
        const auto want = read_raw<double>(folder / "expected" / (file + ".bin"));
        std::vector<double> got;
        for (std::int64_t i = 0; i < p.param->value.numel(); ++i) got.push_back(double(p.param->value.data()[i]));
        REQUIRE(got == want);  // F32, BF16 and F16 values are exact in float and double
      }
    };
    nn::Llama<double> d(cfg);
    check(d, ckpt::load_llama_weights(folder.string(), d));
    nn::Llama<float> f(cfg);
    check(f, ckpt::load_llama_weights(folder.string(), f));
    CHECK(d.tied() == (std::string(variant) == "f16"));
  }
  // One file given directly; an untied model from a tied folder starts lm_head from
  // embed_tokens; a padded vocabulary gets zero rows.
  nn::LlamaConfig cfg = nn::LlamaConfig::from_hf_config_file(dir / "f16" / "config.json");
  cfg.tie_weights = false;
  cfg.vocab_size += 3;
  nn::Llama<double> m(cfg);
  const std::string what = ckpt::load_llama_weights((dir / "f16" / "model.safetensors").string(), m);
  CHECK(what.find("lm_head from embed_tokens") != std::string::npos);
  CHECK(what.find("vocabulary 29 padded to 32") != std::string::npos);
  const auto embed = read_raw<double>(dir / "f16" / "expected" / "embed_tokens.weight.bin");
  const auto lm = m.head().named_parameters().back().param->value.to_vector();
  REQUIRE(lm.size() == embed.size() + 3 * 16);
  CHECK(std::vector<double>(lm.begin(), lm.begin() + embed.size()) == embed);
  CHECK(std::all_of(lm.begin() + embed.size(), lm.end(), [](double x) { return x == 0.0; }));
  fs::remove_all(dir);
}

TEST_CASE("save_llama_weights writes a Hugging Face folder that loads back bitwise; bad folders are refused",
          "[llama][ckpt]") {
  const fs::path dir = scratch("llama_hf_out");
  nn::LlamaConfig cfg{.vocab_size = 31, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                      .intermediate_size = 24, .max_seq_len = 32, .attention_bias = true, .o_proj_bias = true};
  Generator g1(1), g2(2);
  nn::Llama<float> model(cfg, g1);
  const std::size_t n = model.named_parameters().size();

  // One file, then shards into the same folder (the one file goes), then one file again (the shards go).
  const fs::path out = dir / "out";
  CHECK(ckpt::save_llama_weights(out.string(), model) == std::to_string(n) + " tensors in 1 file, vocabulary 31");
  CHECK(read_json(out / "config.json") == cfg.to_hf_config());
  nn::Llama<float> back(cfg, g2);
  REQUIRE(parameter_values(back) != parameter_values(model));
  CHECK(ckpt::load_llama_weights(out.string(), back) == "Hugging Face Llama weights, " + std::to_string(n) + " tensors");
  CHECK(parameter_values(back) == parameter_values(model));

  const std::string sharded = ckpt::save_llama_weights(out.string(), model, 0, 4096);
  CHECK(sharded.find(" files, vocabulary 31") != std::string::npos);
  CHECK(!fs::exists(out / "model.safetensors"));
  const nlohmann::json index = read_json(out / "model.safetensors.index.json");
  CHECK(index["weight_map"].size() == n);
  CHECK(index["weight_map"].contains("lm_head.weight"));
  CHECK(index["weight_map"].contains("model.norm.weight"));
  CHECK(index["weight_map"].contains("model.layers.1.self_attn.o_proj.bias"));
  std::int64_t total = 0;
  for (auto& p : model.named_parameters()) total += p.param->value.numel() * 4;
  CHECK(index["metadata"]["total_size"] == total);
  nn::Llama<float> back2(cfg, g2);
  CHECK(ckpt::load_llama_weights(out.string(), back2).find(" files, " + std::to_string(n) + " tensors") !=
        std::string::npos);
  CHECK(parameter_values(back2) == parameter_values(model));
  ckpt::save_llama_weights(out.string(), model);
  for (const auto& e : fs::directory_iterator(out))
    CHECK((e.path().filename() == "config.json" || e.path().filename() == "model.safetensors"));

  // A padded vocabulary exported without its padding, and back; a tied model has no lm_head.weight.
  nn::LlamaConfig tied = cfg;
  tied.tie_weights = true;
  nn::Llama<double> t(tied, g1);
  CHECK(ckpt::save_llama_weights((dir / "tied").string(), t, 29) ==
        std::to_string(n - 1) + " tensors in 1 file, vocabulary 29 (of 31)");
  CHECK(read_json(dir / "tied" / "config.json")["vocab_size"] == 29);
  CHECK(!ckpt::detail::HfTensors((dir / "tied").string(), "x").contains("lm_head.weight"));
  nn::Llama<double> t2(tied, g2);
  CHECK(ckpt::load_llama_weights((dir / "tied").string(), t2).find("vocabulary 29 padded to 31") != std::string::npos);
  const auto a = t.embedding().weight().value.to_vector(), b = t2.embedding().weight().value.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(i);
    REQUIRE(b[i] == (i < 29 * 16 ? double(float(a[i])) : 0.0));
  }
  CHECK_THROWS_WITH(ckpt::save_llama_weights((dir / "x").string(), t, 32), Catch::Contains("[ptrain.llama_weights.vocab]"));

  // What does not fit the model, or a damaged folder, is refused by id and changes nothing.
  const fs::path bad = dir / "bad";
  ckpt::save_llama_weights(bad.string(), model, 0, 4096);
  const auto refuse = [&](nn::LlamaConfig c, const fs::path& path, const std::string& id) {
    INFO(id << " " << path);
    nn::Llama<float> m(c);
    const auto before = parameter_values(m);
    REQUIRE_THROWS_WITH(ckpt::load_llama_weights(path.string(), m), Catch::Contains(id));
    CHECK(parameter_values(m) == before);
  };
  nn::LlamaConfig c = cfg;
  c.n_layer = 3;
  refuse(c, bad, "[ptrain.llama_weights.missing]");  // no layers.2
  c = cfg;
  c.n_layer = 1;
  refuse(c, bad, "[ptrain.llama_weights.unused]");  // layers.1 left over
  c = cfg;
  c.intermediate_size = 20;
  refuse(c, bad, "expected shape");  // the message names the model's shape
  refuse(c, bad, "[ptrain.llama_weights.shape]");
  c = cfg;
  c.mlp_bias = true;
  refuse(c, bad, "'model.layers.0.mlp.gate_proj.bias'");
  c = cfg;
  c.vocab_size = 30;
  refuse(c, bad, "[ptrain.llama_weights.shape]");  // fewer rows than the file's vocabulary
  refuse(cfg, dir / "nothing-here", "[ptrain.llama_weights.file]");
  fs::create_directories(dir / "empty");
  refuse(cfg, dir / "empty", "[ptrain.llama_weights.folder]");

  const std::string index_text = [&] {
    std::ifstream in(bad / "model.safetensors.index.json");
    return std::string((std::istreambuf_iterator<char>(in)), {});
  }();
  nlohmann::json j = nlohmann::json::parse(index_text);
  const fs::path shard = bad / j["weight_map"]["model.layers.1.mlp.up_proj.weight"].get<std::string>();
  REQUIRE(fs::exists(shard));
  fs::rename(shard, dir / "moved");
  refuse(cfg, bad, "[ptrain.llama_weights.shard]");
  fs::rename(dir / "moved", shard);
  std::ofstream(bad / "model.safetensors.index.json") << index_text.substr(0, index_text.size() / 2);
  refuse(cfg, bad, "[ptrain.llama_weights.index]");  // not JSON
  j["weight_map"]["model.norm.weight"] = "../" + j["weight_map"]["model.norm.weight"].get<std::string>();
  std::ofstream(bad / "model.safetensors.index.json") << j.dump();
  refuse(cfg, bad, "[ptrain.llama_weights.index]");  // outside the folder
  j = nlohmann::json::parse(index_text);
  j["weight_map"].erase("model.norm.weight");
  std::ofstream(bad / "model.safetensors.index.json") << j.dump();
  refuse(cfg, bad, "[ptrain.llama_weights.index]");  // a shard tensor the index does not name
  std::ofstream(bad / "model.safetensors.index.json") << index_text;
  nn::Llama<float> ok(cfg);
  CHECK_NOTHROW(ckpt::load_llama_weights(bad.string(), ok));

  const fs::path one = out / "model.safetensors";
  fs::resize_file(one, fs::file_size(one) - 12);
  refuse(cfg, out, "[ptrain.llama_weights.file]");  // truncated: the tensors' offsets pass its end
  refuse(cfg, out, "are outside the");
  nn::GPT<float> gpt({.vocab_size = 31, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 16});
  std::vector<ckpt::TensorRef> refs;
  for (auto& p : gpt.named_parameters()) refs.push_back(ckpt::tensor_ref(p.name, p.param->value));
  ckpt::write_safetensors((dir / "gpt.safetensors").string(), refs);
  refuse(cfg, dir / "gpt.safetensors", "[ptrain.llama_weights.format]");

  // The model's own names (a ptrain checkpoint's model.safetensors) load too; an integer tensor is refused.
  refs.clear();
  auto ints = Tensor<std::int32_t>::zeros({16});
  for (auto& p : model.named_parameters())
    refs.push_back(p.name == "head.norm.weight" ? ckpt::tensor_ref(p.name, ints) : ckpt::tensor_ref(p.name, p.param->value));
  ckpt::write_safetensors((dir / "ours_int.safetensors").string(), refs);
  refuse(cfg, dir / "ours_int.safetensors", "[ptrain.llama_weights.dtype]");
  refs.clear();
  for (auto& p : model.named_parameters()) refs.push_back(ckpt::tensor_ref(p.name, p.param->value));
  ckpt::write_safetensors((dir / "ours.safetensors").string(), refs);
  nn::Llama<float> own(cfg, g2);
  CHECK(ckpt::load_llama_weights((dir / "ours.safetensors").string(), own) ==
        "ptrain Llama weights, " + std::to_string(n) + " tensors");
  CHECK(parameter_values(own) == parameter_values(model));
  fs::remove_all(dir);
}

TEST_CASE("transformers' AutoModelForCausalLM gives ptrain's logits on a folder save_llama_weights wrote",
          "[llama][ckpt][transformers]") {
  const char* env = std::getenv("PTRAIN_TEST_TOOLS");
  const fs::path tools = fs::path(env && *env ? env : "/opt/ptrain-test-tools") / "transformers";
  const std::string python = "PYTHONPATH='" + tools.string() + "' /usr/bin/python3";
  if (std::system((python + " -c 'import torch, transformers' >/dev/null 2>&1").c_str()) != 0)
    FAIL("/usr/bin/python3 cannot import torch and transformers from " << tools.string()
         << ": run tools/install-deps.sh --test (it installs python3-torch and transformers there)");
  const fs::path dir = scratch("llama_transformers");
  const std::int64_t B = 2, S = 10, V = 37;
  nlohmann::json ids_json;
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 11 + 5) % V);
  for (std::int64_t b = 0; b < B; ++b) ids_json["ids"].push_back(std::vector<std::int32_t>(ids.data() + b * S, ids.data() + (b + 1) * S));
  std::ofstream(dir / "ids.json") << ids_json.dump();
  // transformers 4.36 has no Llama 3 rope scaling, no mlp_bias and no Qwen2: those are checked against the
  // PyTorch reference (test_llama_torch.cpp) only.
  nn::LlamaConfig llama{.vocab_size = V, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32,
                        .intermediate_size = 40, .max_seq_len = 64, .rms_norm_eps = 1e-6};
  llama.rope.theta = 500000.0;
  llama.attention_bias = llama.o_proj_bias = true;
  nn::LlamaConfig mistral = llama;
  mistral.attention_bias = mistral.o_proj_bias = false;
  mistral.sliding_window = 16;
  mistral.tie_weights = true;
  mistral.n_kv_head = 1;
  for (const auto& [name, cfg, arch] : {std::tuple{"llama", llama, "LlamaForCausalLM"},
                                        std::tuple{"mistral", mistral, "MistralForCausalLM"}}) {
    INFO(name);
    Generator gen(3), g(4);
    nn::Llama<float> model(cfg, gen);
    for (auto& p : model.named_parameters())
      ops::uniform_(p.param->value, p.name.find("norm.") != std::string::npos ? 0.5 : -0.3,
                    p.name.find("norm.") != std::string::npos ? 1.5 : 0.3, g);
    const fs::path out = dir / name;
    ckpt::save_llama_weights(out.string(), model, 0, std::string(name) == "mistral" ? 8192 : 0);
    const std::string cmd = python + " '" + kScript.string() + "' transformers '" + out.string() + "' '" +
                            (dir / "ids.json").string() + "' '" + (out / "logits.bin").string() + "' > '" +
                            (out / "class.txt").string() + "'";
    REQUIRE(std::system(cmd.c_str()) == 0);
    std::string cls;
    std::ifstream(out / "class.txt") >> cls;
    CHECK(cls == arch);
    const auto want = read_raw<double>(out / "logits.bin");
    nn::Cache<float> cache;
    const auto got = model.forward_tokens(ids, cache).to_vector();
    REQUIRE(got.size() == want.size());
    double scale = 0, diff = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      scale = std::max(scale, std::abs(want[i]));
      diff = std::max(diff, std::abs(double(got[i]) - want[i]));
    }
    std::printf("llama vs transformers %s (%s): max logit difference %.2e of max %.2f\n", arch, name, diff, scale);
    CHECK(scale > 0.1);
    CHECK(diff <= 1e-5 * std::max(1.0, scale));
  }
  fs::remove_all(dir);
}

TEST_CASE("Mixtral folders: config.json both ways, weights back bitwise, what Mixtral cannot hold refused",
          "[llama][ckpt][mixtral]") {
  const fs::path dir = scratch("mixtral_hf");
  nn::LlamaConfig cfg{.vocab_size = 23, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                      .intermediate_size = 12, .max_seq_len = 32, .sliding_window = 8};
  cfg.num_experts = 4;
  cfg.top_k = 2;
  cfg.moe_aux_loss_coef = 0.02;
  const nlohmann::json j = cfg.to_hf_config();
  CHECK(j["architectures"][0] == "MixtralForCausalLM");
  CHECK(j["model_type"] == "mixtral");
  CHECK(j["num_local_experts"] == 4);
  CHECK(j["num_experts_per_tok"] == 2);
  CHECK(j["router_aux_loss_coef"] == 0.02);
  CHECK(j["output_router_logits"] == true);
  CHECK(j["sliding_window"] == 8);
  const nn::LlamaConfig back = nn::LlamaConfig::from_hf_config(j);
  CHECK(back.num_experts == 4);
  CHECK(back.top_k == 2);
  CHECK(back.moe_every == 1);
  CHECK(back.moe_aux_loss_coef == 0.02);
  CHECK(back.sliding_window == 8);
  CHECK(back.to_hf_config() == j);
  nlohmann::json quiet = j;  // transformers adds the loss only with output_router_logits
  quiet["output_router_logits"] = false;
  CHECK(nn::LlamaConfig::from_hf_config(quiet).moe_aux_loss_coef == 0);
  quiet["sliding_window"] = nullptr;
  CHECK(nn::LlamaConfig::from_hf_config(quiet).sliding_window == 0);
  quiet["router_jitter_noise"] = 0.1;
  CHECK_THROWS_WITH(nn::LlamaConfig::from_hf_config(quiet), Catch::Contains("router_jitter_noise"));
  const auto refuse = [&](auto change, const char* what) {
    INFO(what);
    nn::LlamaConfig c = cfg;
    change(c);
    CHECK_THROWS_WITH(c.to_hf_config(), Catch::Contains("[ptrain.llama.hf_config]") && Catch::Contains(what));
  };
  refuse([](nn::LlamaConfig& c) { c.moe_every = 2; }, "moe_every");
  refuse([](nn::LlamaConfig& c) { c.moe_shared_size = 8; }, "shared experts");
  refuse([](nn::LlamaConfig& c) { c.moe_intermediate_size = 8; }, "moe_intermediate_size");
  refuse([](nn::LlamaConfig& c) { c.attention_bias = true; }, "biases");

  Generator g1(5), g2(6);
  nn::Llama<float> model(cfg, g1);
  const std::size_t n = model.named_parameters().size();
  const fs::path out = dir / "out";
  ckpt::save_llama_weights(out.string(), model, 0, 2048);
  const nlohmann::json index = read_json(out / "model.safetensors.index.json");
  for (const char* name : {"model.layers.1.block_sparse_moe.gate.weight",
                           "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                           "model.layers.0.block_sparse_moe.experts.0.w2.weight",
                           "model.layers.1.block_sparse_moe.experts.2.w3.weight"})
    CHECK(index["weight_map"].contains(name));
  CHECK(index["weight_map"].size() == n);
  nn::Llama<float> loaded(nn::LlamaConfig::from_hf_config_file(out / "config.json"), g2);
  REQUIRE(parameter_values(loaded) != parameter_values(model));
  CHECK(ckpt::load_llama_weights(out.string(), loaded).find(std::to_string(n) + " tensors") != std::string::npos);
  CHECK(parameter_values(loaded) == parameter_values(model));
  // moe_loss: the layers' auxiliary losses of the latest forward, with the coefficient.
  nn::Cache<float> cache;
  model.forward_tokens(Tensor<std::int32_t>::from({1, 5, 7, 2, 9, 11}, {1, 6}), cache);
  const double l0 = model.block(0).moe()->stats().aux_loss, l1 = model.block(1).moe()->stats().aux_loss;
  CHECK((l0 > 0 && l1 > 0));
  CHECK(model.moe_loss() == Approx(0.02 * (l0 + l1)).epsilon(1e-12));
  nn::LlamaConfig fewer = cfg;
  fewer.num_experts = 3;
  nn::Llama<float> m3(fewer);
  CHECK_THROWS_WITH(ckpt::load_llama_weights(out.string(), m3), Catch::Contains("[ptrain.llama_weights."));
  fs::remove_all(dir);
}

// Note [Mixtral's auxiliary loss in transformers 4.36.2]
// transformers 4.36.2's load_balancing_loss_func (huggingface/transformers#28093) takes
// the top-k of the concatenated router logits of all layers, softmaxes those k values
// and averages them per token: 1/k for every token, whatever the logits; with a one-hot
// mask averaged over the k choices, the loss is E/k, a constant with no gradient.
// ptrain's is the Switch/GShard loss per layer (docs/moe.md), which does depend on the
// router. So the test compares the logits, the cross entropy, and the gradients of
// transformers' loss (cross entropy + coef * E/k) with ptrain's gradients of the cross
// entropy (moe_aux_loss_coef 0), and checks that transformers' aux_loss is E/k and its
// gradients equal those without output_router_logits. ptrain's own loss is then checked
// against the same per-layer loss written in the script on transformers' router logits
// (its values, and autograd's gradients of cross entropy + coef * their sum).
TEST_CASE("transformers' MixtralForCausalLM gives ptrain's logits and gradients on a Mixtral folder",
          "[llama][ckpt][transformers][mixtral]") {
  const char* env = std::getenv("PTRAIN_TEST_TOOLS");
  const fs::path tools = fs::path(env && *env ? env : "/opt/ptrain-test-tools") / "transformers";
  const std::string python = "PYTHONPATH='" + tools.string() + "' /usr/bin/python3";
  if (std::system((python + " -c 'import torch, transformers' >/dev/null 2>&1").c_str()) != 0)
    FAIL("/usr/bin/python3 cannot import torch and transformers from " << tools.string()
         << ": run tools/install-deps.sh --test (it installs python3-torch and transformers there)");
  const fs::path dir = scratch("mixtral_transformers");
  const std::int64_t B = 2, S = 12, V = 29, E = 4, k = 2;
  nlohmann::json ids_json;
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 7 + 3) % V);
  for (std::int64_t b = 0; b < B; ++b)
    ids_json["ids"].push_back(std::vector<std::int32_t>(ids.data() + b * S, ids.data() + (b + 1) * S));
  std::ofstream(dir / "ids.json") << ids_json.dump();
  nn::LlamaConfig cfg{.vocab_size = V, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                      .intermediate_size = 20, .max_seq_len = 64, .rms_norm_eps = 1e-6, .sliding_window = 8};
  cfg.num_experts = E;
  cfg.top_k = k;
  cfg.moe_aux_loss_coef = 0.02;  // written as router_aux_loss_coef with output_router_logits
  Generator gen(3), g(4);
  nn::Llama<double> model(cfg, gen);
  for (auto& p : model.named_parameters())
    ops::uniform_(p.param->value, p.name.find("norm.") != std::string::npos ? 0.5 : -0.4,
                  p.name.find("norm.") != std::string::npos ? 1.5 : 0.4, g);
  const fs::path out = dir / "mixtral";
  ckpt::save_llama_weights(out.string(), model);
  // The model as the folder holds it (F32): both sides start from the same values.
  cfg.moe_aux_loss_coef = 0;
  nn::Llama<double> ours(cfg);
  ckpt::load_llama_weights(out.string(), ours);
  const std::string cmd = python + " '" + kScript.string() + "' mixtral '" + out.string() + "' '" +
                          (dir / "ids.json").string() + "' '" + out.string() + "'";
  REQUIRE(std::system(cmd.c_str()) == 0);
  const nlohmann::json r = read_json(out / "result.json");
  CHECK(r["class"] == "MixtralForCausalLM");

  nn::Cache<double> cache;
  const auto logits = ours.forward_tokens(ids, cache);
  const auto want = read_raw<double>(out / "logits.bin");
  REQUIRE(static_cast<std::int64_t>(want.size()) == logits.numel());
  double scale = 0, diff = 0;
  for (std::int64_t i = 0; i < logits.numel(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    diff = std::max(diff, std::abs(logits.data()[i] - want[i]));
  }
  std::printf("mixtral vs transformers: max logit difference %.2e of max %.2f\n", diff, scale);
  CHECK(scale > 0.1);
  // transformers computes the routing weights in float32 (softmax(dtype=torch.float)).
  CHECK(diff <= 1e-6 * std::max(1.0, scale));

  // Cross entropy of token s+1 from position s, mean over B (S - 1) positions, and its gradient.
  auto dlogits = Tensor<double>::zeros(logits.shape());
  double ce = 0;
  const double count = double(B * (S - 1));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s + 1 < S; ++s) {
      const double* z = logits.data() + (b * S + s) * V;
      double* dz = dlogits.data() + (b * S + s) * V;
      const double m = *std::max_element(z, z + V);
      double sum = 0;
      for (std::int64_t v = 0; v < V; ++v) sum += std::exp(z[v] - m);
      const std::int32_t target = ids.data()[b * S + s + 1];
      ce += (m + std::log(sum) - z[target]) / count;
      for (std::int64_t v = 0; v < V; ++v) dz[v] = (std::exp(z[v] - m) / sum - (v == target ? 1.0 : 0.0)) / count;
    }
  const double coef = r["coef"].get<double>(), aux = r["aux_loss"].get<double>();
  CHECK(coef == 0.02);
  CHECK(aux == Approx(double(E) / double(k)).epsilon(1e-6));
  CHECK(r["grad_aux_diff"].get<double>() <= 1e-12);
  CHECK(r["ce"].get<double>() == Approx(ce).epsilon(1e-6));
  CHECK(r["loss"].get<double>() == Approx(ce + coef * aux).epsilon(1e-6));

  ours.zero_grad();
  ours.backward(dlogits, cache);
  double worst = 0;
  for (auto& p : ours.named_parameters()) {
    const std::string hf = ckpt::detail::hf_llama_name(p.name);
    INFO(hf);
    const auto gw = read_raw<double>(out / "grad" / (hf + ".bin"));
    REQUIRE(static_cast<std::int64_t>(gw.size()) == p.param->grad.numel());
    double gscale = 0, gdiff = 0;
    for (std::size_t i = 0; i < gw.size(); ++i) {
      gscale = std::max(gscale, std::abs(gw[i]));
      gdiff = std::max(gdiff, std::abs(p.param->grad.data()[i] - gw[i]));
    }
    CHECK(gscale > 0);
    CHECK(gdiff <= 1e-5 * std::max(gscale, 1e-3));
    worst = std::max(worst, gdiff / std::max(gscale, 1e-3));
  }
  std::printf("mixtral vs transformers: worst relative gradient difference %.2e\n", worst);

  // With ptrain's load-balancing loss (the Switch form per layer, coefficient 0.02): its
  // value per layer and the gradients against the same loss written in the script on
  // transformers' router logits and differentiated by autograd.
  cfg.moe_aux_loss_coef = coef;
  nn::Llama<double> balanced(cfg);
  ckpt::load_llama_weights(out.string(), balanced);
  nn::Cache<double> bc;
  balanced.forward_tokens(ids, bc);
  const auto switch_loss = r["switch"].get<std::vector<double>>();
  REQUIRE(switch_loss.size() == 2);
  for (std::size_t l = 0; l < 2; ++l) {
    INFO("layer " << l);
    CHECK(balanced.block(l).moe()->stats().aux_loss == Approx(switch_loss[l]).epsilon(1e-6));
  }
  CHECK(balanced.moe_loss() == Approx(coef * (switch_loss[0] + switch_loss[1])).epsilon(1e-6));
  balanced.zero_grad();
  balanced.backward(dlogits, bc);
  worst = 0;
  for (auto& p : balanced.named_parameters()) {
    const std::string hf = ckpt::detail::hf_llama_name(p.name);
    INFO(hf);
    const auto gw = read_raw<double>(out / "grad_switch" / (hf + ".bin"));
    REQUIRE(static_cast<std::int64_t>(gw.size()) == p.param->grad.numel());
    double gscale = 0, gdiff = 0;
    for (std::size_t i = 0; i < gw.size(); ++i) {
      gscale = std::max(gscale, std::abs(gw[i]));
      gdiff = std::max(gdiff, std::abs(p.param->grad.data()[i] - gw[i]));
    }
    CHECK(gdiff <= 1e-5 * std::max(gscale, 1e-3));
    worst = std::max(worst, gdiff / std::max(gscale, 1e-3));
    if (p.name.find(".gate.weight") != std::string::npos) {  // the balancing loss moves the routers
      const auto plain = read_raw<double>(out / "grad" / (hf + ".bin"));
      double moved = 0;
      for (std::size_t i = 0; i < gw.size(); ++i) moved = std::max(moved, std::abs(gw[i] - plain[i]));
      CHECK(moved > 100 * gdiff);
    }
  }
  std::printf("mixtral with the per-layer load-balancing loss vs autograd on transformers' router logits: worst "
              "relative gradient difference %.2e\n", worst);
  fs::remove_all(dir);
}

}  // namespace test_llama_weights
