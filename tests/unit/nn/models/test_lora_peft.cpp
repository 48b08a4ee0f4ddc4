// LoRA adapters in PEFT's folder format (nn/models/peft.hpp): peft 0.7.1 on
// transformers 4.36.2 (tools/install-deps.sh --test installs both; the test fails
// without them) loads ptrain's adapter onto the same base and gives ptrain's logits,
// ptrain loads an adapter PEFT wrote and gives PEFT's logits, a merged folder gives
// the adapted model's logits in transformers, and bad folders are refused by id.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/peft.hpp>
#include <unistd.h>

#include "unit/raw_files.hpp"

namespace test_lora_peft {

using namespace ptrain;
using testing::read_raw;
namespace fs = std::filesystem;

namespace {

const fs::path kPeft = fs::path(PTRAIN_TESTS_DIR) / "unit/nn/models/peft_reference.py";
const fs::path kHf = fs::path(PTRAIN_TESTS_DIR) / "unit/nn/models/llama_hf_reference.py";

fs::path scratch(const char* what) {
  const fs::path dir = fs::temp_directory_path() / (std::string("ptrain_") + what + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string python() {
  const char* env = std::getenv("PTRAIN_TEST_TOOLS");
  const fs::path tools = fs::path(env && *env ? env : "/opt/ptrain-test-tools") / "transformers";
  return "PYTHONPATH='" + tools.string() + "' /usr/bin/python3";
}

nn::LlamaConfig small_llama() {
  nn::LlamaConfig c{.vocab_size = 37, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32,
                    .intermediate_size = 40, .max_seq_len = 64, .rms_norm_eps = 1e-6};
  c.attention_bias = c.o_proj_bias = true;  // Llama with biases (attention_bias alone is Qwen2, which transformers 4.36 lacks)
  return c;
}

Tensor<std::int32_t> token_ids(std::int64_t B, std::int64_t S, std::int64_t V) {
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>((i * 11 + 5) % V);
  return ids;
}

void write_ids(const Tensor<std::int32_t>& ids, const fs::path& path) {
  nlohmann::json j;
  const std::int64_t S = ids.size(1);
  for (std::int64_t b = 0; b < ids.size(0); ++b)
    j["ids"].push_back(std::vector<std::int32_t>(ids.data() + b * S, ids.data() + (b + 1) * S));
  std::ofstream(path) << j.dump();
}

std::vector<float> logits(nn::Llama<float>& model, const Tensor<std::int32_t>& ids) {
  nn::Cache<float> cache;
  return model.forward_tokens(ids, cache).to_vector();
}

// Largest |got - want| over max |want|; checks the scale is not trivially small.
double relative_difference(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double scale = 0, diff = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::max(scale, std::abs(want[i]));
    diff = std::max(diff, std::abs(double(got[i]) - want[i]));
  }
  CHECK(scale > 0.1);
  return diff / std::max(1.0, scale);
}

void randomize(nn::Llama<float>& model, std::uint64_t seed) {
  Generator g(seed);
  for (auto& p : model.named_parameters()) {
    const bool norm = p.name.find("norm.") != std::string::npos;
    ops::uniform_(p.param->value, norm ? 0.5 : -0.3, norm ? 1.5 : 0.3, g);
  }
}

int run(const std::string& cmd) { return std::system(cmd.c_str()); }

}  // namespace

TEST_CASE("PEFT loads ptrain's adapters and ptrain loads PEFT's, with the same logits; merged folders agree",
          "[lora][peft][transformers]") {
  if (run(python() + " -c 'import torch, transformers, peft' >/dev/null 2>&1") != 0)
    FAIL("/usr/bin/python3 cannot import torch, transformers and peft from the test tools folder: run "
         "tools/install-deps.sh --test (it installs python3-torch, transformers 4.36.2 and peft 0.7.1)");
  const fs::path dir = scratch("lora_peft");
  const auto ids = token_ids(2, 10, 37);
  write_ids(ids, dir / "ids.json");
  const nn::LlamaConfig cfg = small_llama();
  Generator gen(3);
  nn::Llama<float> model(cfg, gen);
  randomize(model, 4);
  ckpt::save_llama_weights((dir / "base").string(), model);

  // ptrain -> PEFT: every projection adapted, A and B random.
  const nn::LoraConfig lora{.r = 4, .alpha = 8,
                            .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"}};
  const auto names = nn::apply_lora(model, lora, gen);
  CHECK(names.size() == 2 * 7 * 2);
  Generator g(5);
  for (auto& p : model.named_parameters())
    if (p.name.find(".lora_") != std::string::npos) ops::uniform_(p.param->value, -0.3, 0.3, g);
  CHECK(ckpt::save_lora_adapter((dir / "ours").string(), model, lora, "base") ==
        "28 adapter tensors (r 4, 7 target modules)");
  const auto ours = logits(model, ids);
  REQUIRE(run(python() + " '" + kPeft.string() + "' read '" + (dir / "base").string() + "' '" +
              (dir / "ours").string() + "' '" + (dir / "ids.json").string() + "' '" + (dir / "read.bin").string() +
              "' > '" + (dir / "read.txt").string() + "'") == 0);
  int modules = 0;
  std::ifstream(dir / "read.txt") >> modules;
  CHECK(modules == 14);
  const double read_diff = relative_difference(ours, read_raw<double>(dir / "read.bin"));
  std::printf("PEFT on ptrain's adapter: max logit difference %.2e (relative)\n", read_diff);
  CHECK(read_diff <= 1e-5);

  // The merged folder: transformers alone gives the adapted model's logits.
  ckpt::save_llama_weights((dir / "merged").string(), model);
  REQUIRE(run(python() + " '" + kHf.string() + "' transformers '" + (dir / "merged").string() + "' '" +
              (dir / "ids.json").string() + "' '" + (dir / "merged.bin").string() + "' > /dev/null") == 0);
  CHECK(relative_difference(ours, read_raw<double>(dir / "merged.bin")) <= 1e-5);
  nn::Llama<float> plain(cfg, gen);
  ckpt::load_llama_weights((dir / "merged").string(), plain);
  CHECK(relative_difference(logits(plain, ids), std::vector<double>(ours.begin(), ours.end())) <= 1e-5);

  // PEFT -> ptrain: an adapter PEFT wrote on three module kinds, loaded onto a fresh base.
  REQUIRE(run(python() + " '" + kPeft.string() + "' write '" + (dir / "base").string() + "' '" +
              (dir / "theirs").string() + "' '" + (dir / "ids.json").string() + "' '" +
              (dir / "write.bin").string() + "' 2 6 q_proj,v_proj,down_proj > /dev/null") == 0);
  nn::Llama<float> fresh(cfg, gen);
  ckpt::load_llama_weights((dir / "base").string(), fresh);
  CHECK(ckpt::load_lora_adapter((dir / "theirs").string(), fresh) == "PEFT adapter, 12 tensors (r 2)");
  CHECK(nn::lora_adapters(fresh).size() == 6);
  CHECK(fresh.num_trainable_parameters() == 2 * (2 * (32 + 32) + 2 * (32 + 16) + 2 * (40 + 32)));
  const double write_diff = relative_difference(logits(fresh, ids), read_raw<double>(dir / "write.bin"));
  std::printf("ptrain on PEFT's adapter: max logit difference %.2e (relative)\n", write_diff);
  CHECK(write_diff <= 1e-5);
  fs::remove_all(dir);
}

TEST_CASE("PEFT folders ptrain cannot build the same way are refused by id", "[lora][peft]") {
  const fs::path dir = scratch("lora_peft_bad");
  const nn::LoraConfig lora{.r = 2, .alpha = 4, .target_modules = {"q_proj", "v_proj"}};
  Generator gen(1);
  nn::Llama<float> model(small_llama(), gen);
  auto refuses = [](auto&& fn, const char* id) { CHECK_THROWS_WITH(fn(), Catch::Contains(id)); };
  refuses([&] { ckpt::save_lora_adapter((dir / "none").string(), model, lora); }, "[ptrain.peft.none]");
  refuses([&] { ckpt::load_lora_adapter((dir / "missing").string(), model); }, "[ptrain.peft.config]");
  nn::apply_lora(model, lora, gen);
  ckpt::save_lora_adapter((dir / "ok").string(), model, lora);
  auto with_config = [&](const char* name, auto&& edit) {
    fs::create_directories(dir / name);
    fs::copy_file(dir / "ok" / ckpt::kPeftWeights, dir / name / ckpt::kPeftWeights);
    nlohmann::json j;
    std::ifstream(dir / "ok" / ckpt::kPeftConfig) >> j;
    edit(j);
    std::ofstream(dir / name / ckpt::kPeftConfig) << j.dump();
    return (dir / name).string();
  };
  const auto rslora = with_config("rslora", [](nlohmann::json& j) { j["use_rslora"] = true; });
  const auto regex = with_config("regex", [](nlohmann::json& j) { j["target_modules"] = ".*q_proj"; });
  const auto prefix = with_config("prefix", [](nlohmann::json& j) { j["peft_type"] = "PREFIX_TUNING"; });
  const auto rank = with_config("rank", [](nlohmann::json& j) { j["r"] = 3; });
  const auto more = with_config("more", [](nlohmann::json& j) { j["target_modules"].push_back("k_proj"); });
  for (const auto& [folder, id] : {std::pair{rslora, "[ptrain.peft.config]"}, {regex, "[ptrain.peft.config]"},
                                   {prefix, "[ptrain.peft.config]"}}) {
    INFO(folder);
    nn::Llama<float> m(small_llama(), gen);
    refuses([&] { ckpt::load_lora_adapter(folder, m); }, id);
  }
  nn::Llama<float> m3(small_llama(), gen);
  refuses([&] { ckpt::load_lora_adapter(rank, m3); }, "[ptrain.peft.shape]");
  nn::Llama<float> m4(small_llama(), gen);
  refuses([&] { ckpt::load_lora_adapter(more, m4); }, "[ptrain.peft.missing]");
  nn::Llama<float> m5(small_llama(), gen);
  nn::apply_lora(m5, nn::LoraConfig{.r = 2, .alpha = 4, .target_modules = {"q_proj"}}, gen);
  refuses([&] { ckpt::load_lora_adapter((dir / "ok").string(), m5); }, "[ptrain.peft.unused]");
  nn::merge_lora(model);
  refuses([&] { ckpt::save_lora_adapter((dir / "merged").string(), model, lora); }, "[ptrain.peft.merged]");
  fs::remove_all(dir);
}

}  // namespace test_lora_peft
