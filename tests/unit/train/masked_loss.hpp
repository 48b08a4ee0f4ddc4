#pragma once
// Fixtures of the masked, token-weighted loss tests (Note [Token-weighted loss] in
// train/trainer.hpp), in one process (test_trainer.cpp here) and on W ranks
// (tests/dist/parallel/test_trainer.cpp): a bigram model over token ids, an
// optimizer that records the gradients it is given, and the PyTorch reference
// (masked_loss_reference.py next to this file).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <ptrain/nn/embedding.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/optimizer.hpp>

namespace ptrain::test {

/// ids [B, S] -> Embedding(V, D) -> Linear(D, V) -> logits [B, S, V]; parameters "0.weight",
/// "1.weight", "1.bias".
inline std::shared_ptr<nn::Sequential<double>> bigram(std::int64_t vocab, std::int64_t dim) {
  Generator g(17);
  auto m = std::make_shared<nn::Sequential<double>>();
  m->add(std::make_shared<nn::Embedding<double>>(vocab, dim, g));
  m->add(std::make_shared<nn::Linear<double>>(dim, vocab, true, g));
  return m;
}

/// An optimizer whose step() copies the gradients it would apply.
struct GradRecorder : optim::Optimizer<double> {
  explicit GradRecorder(nn::FlatParameters<double>& p) : optim::Optimizer<double>(p, 0.0) {}
  void step() override { grads = this->grads_.to_vector(); }
  std::vector<double> grads;
};

/// PyTorch's F.cross_entropy(ignore_index=-100) over the bigram model's logits, in float64:
/// the loss and the gradients flattened in the model's parameter order.
struct TorchMaskedLoss {
  double loss = 0;
  std::vector<double> grads;
};

inline TorchMaskedLoss torch_masked_loss(const Tensor<std::int32_t>& ids, const Tensor<std::int32_t>& targets,
                                         nn::Module<double>& model) {
  namespace fs = std::filesystem;
  auto rows = [](const Tensor<std::int32_t>& t) {
    nlohmann::json j = nlohmann::json::array();
    for (std::int64_t b = 0; b < t.size(0); ++b)
      j.push_back(std::vector<std::int32_t>(t.data() + b * t.size(1), t.data() + (b + 1) * t.size(1)));
    return j;
  };
  nlohmann::json in = {{"ids", rows(ids)}, {"targets", rows(targets)}};
  const char* keys[] = {"emb", "weight", "bias"};
  std::vector<Shape> shapes;
  int k = 0;
  for (auto& p : model.named_parameters()) {
    const Tensor<double>& v = p.param->value;
    shapes.push_back(v.shape());
    if (v.dim() == 1) {
      in[keys[k++]] = v.to_vector();
    } else {
      nlohmann::json m = nlohmann::json::array();
      for (std::int64_t r = 0; r < v.size(0); ++r)
        m.push_back(std::vector<double>(v.data() + r * v.size(1), v.data() + (r + 1) * v.size(1)));
      in[keys[k++]] = m;
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("ptrain_masked_loss_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "in.json") << in.dump();
  const fs::path script = fs::path(PTRAIN_TESTS_DIR) / "unit/train/masked_loss_reference.py";
  const std::string cmd =
      "/usr/bin/python3 '" + script.string() + "' '" + (dir / "in.json").string() + "' '" + (dir / "out.json").string() + "'";
  TorchMaskedLoss r;
  if (std::system(cmd.c_str()) != 0) throw std::runtime_error("masked_loss_reference.py failed: " + cmd);
  nlohmann::json out;
  std::ifstream(dir / "out.json") >> out;
  r.loss = out["loss"].get<double>();
  for (const char* key : keys) {
    const nlohmann::json& g = out[key];
    if (g.size() > 0 && g[0].is_array())
      for (const auto& row : g)
        for (const auto& x : row) r.grads.push_back(x.get<double>());
    else
      for (const auto& x : g) r.grads.push_back(x.get<double>());
  }
  fs::remove_all(dir);
  return r;
}

/// The largest |a[i] - b[i]| (infinity when the sizes differ).
inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return 1e300;
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

}  // namespace ptrain::test
