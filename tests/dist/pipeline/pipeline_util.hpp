#pragma once
// Helpers shared by the pipeline tests (one executable, several sources): the
// world communicator, the eight-unit test model, batches and optimizers.
#include <memory>
#include <vector>

#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/activation.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>

#include "dist/world.hpp"

namespace pipeline_test {

using namespace ptrain;

using ptrain::testing::world;

// Eight MLP-style units: Linear + GELU, the last one a plain Linear to the
// classes. Unit u draws its weights from its own seed, so a rank that builds
// only some units gets exactly the values the full model has.
inline constexpr std::int64_t kFeatures = 6, kClasses = 4;
inline const std::vector<std::int64_t> kWidths{kFeatures, 12, 10, 14, 9, 11, 13, 8, kClasses};
inline constexpr std::size_t kUnits = 8;

/// Unit u with weights drawn from seed `seed_base + u`; unit kUnits (past the
/// classifier) is a parameter-free GELU, for models with a stage without weights.
/// In T = double for the checks that compare schedules rather than float rounding.
template <class T = float>
std::shared_ptr<nn::Module<T>> make_unit_seeded(std::size_t u, std::uint64_t seed_base) {
  auto s = std::make_shared<nn::Sequential<T>>();
  if (u == kUnits) {
    s->add(std::make_shared<nn::GELU<T>>());
    return s;
  }
  Generator g(seed_base + u);
  s->add(std::make_shared<nn::Linear<T>>(kWidths[u], kWidths[u + 1], true, g));
  if (u + 1 < kUnits) s->add(std::make_shared<nn::GELU<T>>());
  return s;
}
inline std::shared_ptr<nn::Module<float>> make_unit(std::size_t u) { return make_unit_seeded(u, 1000); }
template <class T>
std::shared_ptr<nn::Module<T>> make_unit_as(std::size_t u) { return make_unit_seeded<T>(u, 1000); }

/// The first `units` units (kUnits, or kUnits + 1 with the trailing GELU) in one module.
template <class T = float>
std::unique_ptr<nn::Sequential<T>> full_model(std::size_t units = kUnits) {
  auto m = std::make_unique<nn::Sequential<T>>();
  for (std::size_t u = 0; u < units; ++u) m->add(make_unit_as<T>(u));
  return m;
}

template <class T = float>
struct BatchOf {
  Tensor<T> x;
  Tensor<std::int32_t> y;
};
using Batch = BatchOf<float>;
template <class T = float>
BatchOf<T> make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  BatchOf<T> b{Tensor<T>::empty({rows, kFeatures}), Tensor<std::int32_t>::empty({rows})};
  ops::uniform_(b.x, -1.0, 1.0, g);
  for (std::int64_t i = 0; i < rows; ++i) b.y.data()[i] = static_cast<std::int32_t>(g.below(kClasses));
  return b;
}

enum class Opt { SGD, AdamW };
template <class T>
std::unique_ptr<optim::Optimizer<T>> make_opt(Opt kind, nn::FlatParameters<T>& p) {
  if (kind == Opt::SGD) return std::make_unique<optim::SGD<T>>(p, optim::SGDOptions{.lr = 0.1, .momentum = 0.9});
  // eps 1e-6: see the note in tests/dist/parallel/test_ddp.cpp (rounding noise on near-zero gradients).
  return std::make_unique<optim::AdamW<T>>(p, optim::AdamWOptions{.lr = 0.01, .eps = 1e-6});
}

/// A small untied GPT for pipelines (block_size 8, 2 heads, width 16) of n_layer blocks.
inline nn::GPTConfig pipeline_gpt(int n_layer) {
  return {.vocab_size = 11, .block_size = 8, .n_layer = n_layer, .n_head = 2, .n_embd = 16, .tie_weights = false};
}
/// Unit u of GPT<T>(c) built from Generator(seed): alone (nn::gpt_unit), so the
/// pipelines built from it also test that each stage starts from the one-process
/// values. A tied head cannot be built alone: for a tied config every rank builds
/// the whole model and keeps unit u (what the pipeline must then refuse).
template <class T>
auto gpt_units(nn::GPTConfig c, std::uint64_t seed) {
  return [c, seed](std::size_t u) -> std::shared_ptr<nn::Module<T>> {
    Generator g(seed);
    if (!c.tie_weights) return nn::gpt_unit<T>(c, u, g);
    nn::GPT<T> gpt(c, g);
    return gpt.units().at(u);
  };
}
/// Token ids and targets [rows, seq] in [0, vocab).
inline std::pair<Tensor<std::int32_t>, Tensor<std::int32_t>> make_tokens(std::int64_t rows, std::int64_t seq,
                                                                         std::int64_t vocab, std::uint64_t seed) {
  Generator g(seed);
  auto ids = Tensor<std::int32_t>::empty({rows, seq}), tgt = Tensor<std::int32_t>::empty({rows, seq});
  for (std::int64_t k = 0; k < rows * seq; ++k) {
    ids.data()[k] = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(vocab)));
    tgt.data()[k] = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(vocab)));
  }
  return {ids, tgt};
}

}  // namespace pipeline_test
