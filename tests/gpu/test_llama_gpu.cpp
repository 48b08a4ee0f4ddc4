// A Llama-family model on cuda:0 against the same model on the CPU: RMSNorm,
// rotary positions, grouped-query attention over packed documents, SwiGLU,
// the head and the loss, reached through ops:: and the kernel table as a
// g++-built user program reaches them. Both sides run in T from the same
// initial weights and differ only in the order of floating-point additions.
// Bounds as for the GPT step in test_kernels.cu: float 1e-4 (fp32 sums in
// another order through two layers), bf16 5e-2 for gradients and 1e-2 for the
// loss (the order also decides which way a bf16 value rounds, and the flips add
// up through the model).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/llama.hpp"
#include "ptrain/optim/adamw.hpp"

namespace test_llama_gpu {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

nn::LlamaConfig small_llama(bool tied) {
  return {.vocab_size = 37, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 64, .intermediate_size = 96,
          .max_seq_len = 24, .rope = {.theta = 500000.0, .llama3_scaling = ops::Llama3RopeScaling{
                                          .original_max_position_embeddings = 8}},
          .tie_weights = tied, .document_token = 0};
}

// Token ids with documents (id 0 starts one) and targets with one ignored position.
struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch random_batch(std::int64_t B, std::int64_t S, std::int64_t vocab) {
  std::vector<std::int32_t> x(static_cast<std::size_t>(B * S)), t(x.size());
  for (auto& v : x) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(vocab)));
  for (auto& v : t) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(vocab)));
  x[3] = x[static_cast<std::size_t>(S + 7)] = 0;  // documents start inside rows 0 and 1
  t[5] = -100;
  return {Tensor<std::int32_t>::from(x, {B, S}), Tensor<std::int32_t>::from(t, {B * S})};
}

// One forward + backward on `device`; returns the loss.
template <class T>
double llama_step(nn::Llama<T>& model, const Batch& batch, Device device) {
  nn::CrossEntropyLoss<T> loss_fn;
  nn::Cache<T> cache, loss_cache;
  auto logits = model.forward_tokens(batch.ids.to(device), cache);
  REQUIRE(logits.device() == device);
  const double loss = loss_fn.forward(logits, batch.targets.to(device), loss_cache);
  model.backward(loss_fn.backward(loss_cache), cache);
  return loss;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda: a Llama step (GQA, packed documents, Llama 3 rotary) matches the CPU", "[gpu][llama_gpu]",
                   float, bf16) {
  using T = TestType;
  const double bound = std::is_same_v<T, bf16> ? 5e-2 : 1e-4;
  const double loss_bound = std::is_same_v<T, bf16> ? 1e-2 : 1e-4;
  for (bool tied : {true, false}) {
    const nn::LlamaConfig cfg = small_llama(tied);
    const std::uint64_t init_seed = rng().below(1ull << 62);
    Generator g_cpu(init_seed), g_gpu(init_seed);
    nn::Llama<T> cpu_model(cfg, g_cpu), gpu_model(cfg, g_gpu);
    gpu_model.to(kGpu);
    const Batch batch = random_batch(3, 20, cfg.vocab_size);
    INFO("tied " << tied << " seed " << test_seed());
    // Two steps: the second accumulates onto the first's gradients.
    for (int step = 0; step < 2; ++step) {
      const double loss_cpu = llama_step(cpu_model, batch, Device::cpu());
      const double loss_gpu = llama_step(gpu_model, batch, kGpu);
      INFO("step " << step << " loss cpu " << loss_cpu << " gpu " << loss_gpu);
      CHECK(std::abs(loss_gpu - loss_cpu) <= loss_bound * std::abs(loss_cpu));
    }
    check_same_gradients(cpu_model, gpu_model, bound);
  }
}

// Training: AdamW over the flat parameters on both devices for a few steps on
// one batch; the GPU's losses follow the CPU's step by step (float: the
// differences of one step move the next step's weights by about as much again,
// so the bound grows with the steps, 1e-4 per step).
TEST_CASE("cuda: a Llama trains on the GPU as on the CPU", "[gpu][llama_gpu]") {
  const nn::LlamaConfig cfg = small_llama(true);
  const std::uint64_t init_seed = rng().below(1ull << 62);
  Generator g_cpu(init_seed), g_gpu(init_seed);
  nn::Llama<float> cpu_model(cfg, g_cpu), gpu_model(cfg, g_gpu);
  gpu_model.to(kGpu);
  nn::FlatParameters<float> cpu_flat(cpu_model), gpu_flat(gpu_model);
  const optim::AdamWOptions opt{.lr = 3e-3, .weight_decay = 0.1};
  optim::AdamW<float> cpu_adam(cpu_flat, opt), gpu_adam(gpu_flat, opt);
  const Batch batch = random_batch(2, 24, cfg.vocab_size);
  INFO("seed " << test_seed());
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    cpu_model.zero_grad();
    gpu_model.zero_grad();
    const double loss_cpu = llama_step(cpu_model, batch, Device::cpu());
    const double loss_gpu = llama_step(gpu_model, batch, kGpu);
    cpu_adam.step();
    gpu_adam.step();
    INFO("step " << step << " loss cpu " << loss_cpu << " gpu " << loss_gpu);
    CHECK(std::abs(loss_gpu - loss_cpu) <= 1e-4 * (step + 1) * std::abs(loss_cpu));
    if (step == 0) first = loss_cpu;
    last = loss_cpu;
  }
  CHECK(last < first);  // it learns the batch
}

}  // namespace test_llama_gpu
