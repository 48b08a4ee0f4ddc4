// The context-parallel engine (parallel/cp_engine.hpp) with the model on cuda:0, cp = 1
// over a SelfCommunicator: GPT and Llama (packed documents) trained by AdamW on the
// GPU against the same engine on the CPU. It runs what the staged test
// (tests/dist/parallel/test_staged_engines.cpp, a stand-in cuda:0 whose memory is host
// memory) cannot: the real kernels and real device memory, so a host read of a device
// pointer (ids, positions, document starts, targets) fails here. The ids and targets
// are given on the host for GPT and on the device for Llama (the engine takes both).
// The ring's kernels are gated (Note [The verification gate]): run with
// PTRAIN_UNVERIFIED_CUDA=1, as tools/gpu/run.sh does.
//
// Bounds: float on both sides, the same initial weights; the GPU sums in another
// order (the gqa flash kernels for the ring's blocks against the CPU's loops), so
// losses within 1e-4 relative per step, and the parameters' change over three steps
// within 1e-3 of the CPU's (max-norm relative). AdamW runs with eps = 1 and no weight
// decay, so that each change is about lr times the gradient (|g| << 1): a near-zero
// gradient whose sign differs in the last bits moves a parameter by about as little
// on both sides (with a small eps it would move by +lr on one, -lr on the other).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/optim/adamw.hpp"
#include "ptrain/parallel/cp_engine.hpp"

namespace test_cp_engine_gpu {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

constexpr std::int32_t kDocument = 1;
constexpr std::int64_t kS = 24;

// Three AdamW steps of the context-parallel engine (cp = 1) over `model` on `d`; the
// ids and targets are moved to `data` first. The losses, then the parameters' change.
template <class M>
std::pair<std::vector<double>, std::vector<double>> train(M& model, Device d, Device data, std::int32_t vocab) {
  dist::SelfCommunicator self;
  model.to(d);
  parallel::ContextParallel<float> e(model, self, parallel::ContextParallelPlan{.cp = 1});
  REQUIRE(e.parameters().values().device() == d);
  const auto before = e.parameters().values().to_vector();
  optim::AdamW<float> opt(e.parameters(), {.lr = 1e-2, .eps = 1, .weight_decay = 0});
  std::vector<double> losses;
  for (int s = 0; s < 3; ++s) {
    Generator g(70 + static_cast<std::uint64_t>(s));
    auto ids = Tensor<std::int32_t>::empty({2, kS}), targets = Tensor<std::int32_t>::empty({2 * kS});
    for (std::int64_t i = 0; i < 2 * kS; ++i) {
      ids.data()[i] = i % kS == 9 ? kDocument : static_cast<std::int32_t>(g.below(vocab));
      targets.data()[i] = i % 7 == 3 ? -100 : static_cast<std::int32_t>(g.below(vocab));
    }
    e.zero_grad();
    losses.push_back(e.forward_backward(data.is_cpu() ? ids : ids.to(data),
                                        data.is_cpu() ? targets : targets.to(data)));
    e.step(opt);
  }
  const auto after = e.parameters().values().to_vector();
  std::vector<double> change(after.size());
  for (std::size_t i = 0; i < after.size(); ++i) change[i] = double(after[i]) - double(before[i]);
  return {losses, change};
}

template <class M, class Cfg>
void check_like_cpu(const Cfg& cfg, Device data, std::int32_t vocab) {
  const std::uint64_t seed = rng().below(1ull << 62);
  Generator g_cpu(seed), g_gpu(seed);
  M cpu_model(cfg, g_cpu), gpu_model(cfg, g_gpu);
  INFO("seed " << test_seed());
  const auto want = train(cpu_model, Device::cpu(), Device::cpu(), vocab);
  const auto got = train(gpu_model, kGpu, data, vocab);
  REQUIRE(got.first.size() == want.first.size());
  for (std::size_t s = 0; s < want.first.size(); ++s) {
    INFO("step " << s << " loss cpu " << want.first[s] << " gpu " << got.first[s]);
    CHECK(std::abs(got.first[s] - want.first[s]) <= 1e-4 * std::abs(want.first[s]));
  }
  double moved = 0;  // the reference's largest change: a model that does not train fails
  for (double c : want.second) moved = std::max(moved, std::abs(c));
  CHECK(moved > 1e-3);
  CHECK(rel_err(got.second, want.second) < 1e-3);
}

}  // namespace

TEST_CASE("cuda: the context-parallel engine trains GPT and Llama on the GPU as on the CPU",
          "[gpu][cp_engine][cuda:ring_attention_block_forward][cuda:ring_attention_block_backward]"
          "[cuda:copy_strided_rows]") {
  {
    INFO("GPT, ids and targets on the host");
    const nn::GPTConfig cfg{.vocab_size = 29, .block_size = kS, .n_layer = 2, .n_head = 4, .n_embd = 64};
    check_like_cpu<nn::GPT<float>>(cfg, Device::cpu(), 29);
  }
  {
    INFO("Llama on packed documents, ids and targets on the device");
    const nn::LlamaConfig cfg{.vocab_size = 31, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 64,
                              .intermediate_size = 96, .max_seq_len = kS, .document_token = kDocument};
    check_like_cpu<nn::Llama<float>>(cfg, kGpu, 31);
  }
}

}  // namespace test_cp_engine_gpu
