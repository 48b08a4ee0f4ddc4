// Cross-check against PyTorch: the same GPT weights and tokens give the same
// logits, loss and gradients. The weights go to raw float64 files plus a JSON
// manifest; gpt_torch_reference.py (next to this file) builds the model from
// torch.nn.functional and writes its results back. Fails when /usr/bin/python3
// cannot import torch (tools/install-deps.sh --test installs python3-torch).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <unistd.h>

#include "unit/raw_files.hpp"

namespace test_gpt_torch {

using namespace ptrain;
using testing::read_raw;
using testing::torch_available;
using testing::write_raw;
namespace fs = std::filesystem;

namespace {

void require_close(const std::vector<double>& ours, const std::vector<double>& theirs, const std::string& what) {
  REQUIRE(ours.size() == theirs.size());
  for (std::size_t i = 0; i < ours.size(); ++i) {
    INFO(what << "[" << i << "]: ptrain " << ours[i] << ", torch " << theirs[i]);
    REQUIRE(std::abs(ours[i] - theirs[i]) <= 1e-5 * std::abs(theirs[i]) + 1e-12);
  }
}

}  // namespace

TEST_CASE("GPT logits, loss and gradients equal PyTorch's", "[nn][gpt][torch]") {
  if (!torch_available())
    FAIL("/usr/bin/python3 cannot import torch: run tools/install-deps.sh --test (it installs python3-torch)");
  const fs::path script = fs::path(__FILE__).parent_path() / "gpt_torch_reference.py";
  REQUIRE(fs::exists(script));
  for (bool tie : {true, false}) {
    INFO("tie_weights = " << tie);
    nn::GPTConfig cfg{.vocab_size = 11, .block_size = 9, .n_layer = 2, .n_head = 2, .n_embd = 12, .tie_weights = tie};
    Generator gen(1);
    nn::GPT<double> model(cfg, gen);
    Generator g(2);
    for (auto& p : model.named_parameters()) {
      if (p.name.find("ln_") != std::string::npos && p.name.find("weight") != std::string::npos)
        ops::uniform_(p.param->value, 0.5, 1.5, g);
      else
        ops::uniform_(p.param->value, -0.4, 0.4, g);
    }
    const std::int64_t B = 3, S = 9;
    auto x = Tensor<double>::empty({B, S});
    auto targets = Tensor<std::int32_t>::empty({B * S});
    std::vector<std::int64_t> ids64(B * S), targets64(B * S);
    for (std::int64_t i = 0; i < B * S; ++i) {
      ids64[i] = static_cast<std::int64_t>(g.below(11));
      targets64[i] = static_cast<std::int64_t>(g.below(11));
      x.data()[i] = static_cast<double>(ids64[i]);
      targets.data()[i] = static_cast<std::int32_t>(targets64[i]);
    }
    targets.data()[4] = -100;  // an ignored target: both sides skip it
    targets64[4] = -100;

    const fs::path dir = fs::temp_directory_path() / ("ptrain_gpt_torch_" + std::to_string(::getpid()));
    fs::create_directories(dir);
    nlohmann::json manifest;
    manifest["config"] = {{"vocab_size", cfg.vocab_size}, {"n_layer", cfg.n_layer}, {"n_head", cfg.n_head},
                          {"n_embd", cfg.n_embd}, {"tie_weights", tie}};
    manifest["tokens_shape"] = {B, S};
    for (auto& p : model.named_parameters()) {
      const std::string file = p.name + ".bin";
      write_raw(dir / file, p.param->value.data(), static_cast<std::size_t>(p.param->value.numel()));
      manifest["params"].push_back({{"name", p.name},
                                    {"file", file},
                                    {"shape", std::vector<std::int64_t>(p.param->value.shape().begin(),
                                                                        p.param->value.shape().end())}});
    }
    std::ofstream(dir / "manifest.json") << manifest.dump(1);
    write_raw(dir / "tokens.bin", ids64.data(), ids64.size());
    write_raw(dir / "targets.bin", targets64.data(), targets64.size());

    const std::string cmd = "/usr/bin/python3 '" + script.string() + "' '" + dir.string() + "'";
    REQUIRE(std::system(cmd.c_str()) == 0);

    nn::Cache<double> cache, loss_cache;
    nn::CrossEntropyLoss<double> ce;
    auto logits = model.forward(x, cache);
    const double loss = ce.forward(logits, targets, loss_cache);
    model.zero_grad();
    model.backward(ce.backward(loss_cache), cache);

    nlohmann::json result;
    std::ifstream(dir / "result.json") >> result;
    REQUIRE(loss == Approx(result["loss"].get<double>()).epsilon(1e-5));
    require_close(logits.to_vector(), read_raw(dir / "logits.bin", static_cast<std::size_t>(logits.numel())),
                  "logits");
    for (auto& p : model.named_parameters())
      require_close(p.param->grad.to_vector(),
                    read_raw(dir / ("grad." + p.name + ".bin"), static_cast<std::size_t>(p.param->grad.numel())),
                    "grad " + p.name);
    fs::remove_all(dir);
  }
}

}  // namespace test_gpt_torch
