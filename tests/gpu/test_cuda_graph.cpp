// The Trainer's step captured in a CUDA graph and replayed (Note [CUDA graphs of
// the step] in train/step_graph.hpp), against the same Trainer run eagerly from
// the same initial weights and data: a small GPT (float and bf16) and a small
// Llama. The two runs differ only in where AdamW computes its step scalars (bias
// corrections and the decay factor: on the device from the learning rate and the
// step in device memory, or on the host), which can move a float scalar by one
// ulp; through a few steps that stays within a few ulp of the parameters' scale:
// bound 1e-5 relative for float, and the bf16 bound of the GPU tests (1e-2) for
// bf16. Also: a batch of another shape warms up and captures again, the schedule
// is followed under replay (the optimizer's step count and learning rate), the
// loss is read on the host only at reports and at the end, and a host read inside
// a capture is refused with an error naming the capture.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/llama.hpp"
#include "ptrain/optim/adamw.hpp"
#include "ptrain/parallel/local.hpp"
#include "ptrain/train/trainer.hpp"

namespace test_cuda_graph {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

// Windows of a fixed random token stream: ids [B, S] and next-token targets [B, S], on the host.
template <class T>
class Windows : public Dataset<T> {
 public:
  Windows(std::int64_t n, std::int64_t seq, std::int64_t vocab) : n_(n), seq_(seq) {
    tokens_.resize(static_cast<std::size_t>(n + seq + 1));
    for (auto& t : tokens_) t = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(vocab)));
  }
  std::int64_t size() const override { return n_; }
  Batch<T> get(const std::vector<std::int64_t>& idx) override {
    const auto b = static_cast<std::int64_t>(idx.size());
    std::vector<std::int32_t> x, y;
    for (std::int64_t i : idx)
      for (std::int64_t s = 0; s < seq_; ++s) {
        x.push_back(tokens_[static_cast<std::size_t>(i + s)]);
        y.push_back(tokens_[static_cast<std::size_t>(i + s + 1)]);
      }
    return {Tensor<T>(), Tensor<std::int32_t>::from(x, {b, seq_}), Tensor<std::int32_t>::from(y, {b, seq_})};
  }

 private:
  std::int64_t n_, seq_;
  std::vector<std::int32_t> tokens_;
};

// Windows whose targets are -100 at about a third of the positions, a different third in
// each batch, and which say so (Note [Token-weighted loss] in train/trainer.hpp).
template <class T>
class MaskedWindows : public Windows<T> {
 public:
  using Windows<T>::Windows;
  Batch<T> get(const std::vector<std::int64_t>& idx) override {
    Batch<T> b = Windows<T>::get(idx);
    std::int32_t* t = b.targets.ids().data();
    for (std::int64_t i = 0; i < b.targets.ids().numel(); ++i)
      if ((i * 7 + idx[0]) % 3 == 0) t[i] = -100;
    return b;
  }
  bool masks_targets() const override { return true; }
};

struct Result {
  std::vector<double> params;
  std::vector<double> report_losses;  // on_step's loss at the reporting steps
  std::int64_t steps = 0, opt_steps = 0, reads = 0;
  double lr = 0;
  int captures = 0;
  bool graphs_off = true;
  std::string why_off;
  std::int64_t live_delta = 0;  // live bytes after the run's objects are gone, less before
};

// `epochs` epochs of `samples` windows in batches of `batch` on cuda:0, logging every 2 steps.
template <class T, class Model>
void train_on(Model& model, Dataset<T>& data, bool graphs, std::int64_t batch, int epochs, int grad_accum,
              Result& r) {
  parallel::Local<T> engine(model);
  optim::AdamW<T> opt(engine.parameters(), {.lr = 3e-3, .weight_decay = 0.1});
  train::Trainer<T> trainer(engine, opt, data,
                            {.epochs = epochs, .batch = batch, .grad_accum = grad_accum, .log_every = 2,
                             .cuda_graphs = graphs});
  trainer.schedule = [](std::int64_t s) { return 3e-3 * (1.0 + static_cast<double>(s)) / 8.0; };
  trainer.on_step = [&](const train::StepInfo& s) {
    if (!std::isnan(s.loss)) r.report_losses.push_back(s.loss);
  };
  r.steps = trainer.run().step;
  for (T v : engine.parameters().values().to_vector()) r.params.push_back(as_double(v));
  r.opt_steps = opt.steps();
  r.lr = opt.lr();
  r.reads = trainer.loss_window().reads();
  r.captures = trainer.graph_plan().captures();
  r.graphs_off = trainer.graph_plan().off();
  r.why_off = trainer.graph_plan().why_off();
}

template <class T, class Model>
Result train(Model& model, Dataset<T>& data, bool graphs, std::int64_t batch, int epochs, int grad_accum = 1) {
  model.to(kGpu);
  Result r;
  const std::int64_t live0 = memory_stats(kGpu).live_bytes;
  train_on(model, data, graphs, batch, epochs, grad_accum, r);
  r.live_delta = memory_stats(kGpu).live_bytes - live0;
  return r;
}

double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

nn::GPTConfig small_gpt() {
  return {.vocab_size = 40, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32};
}

template <class T>
void check_gpt_graph(std::int64_t samples, std::int64_t batch, int epochs, int expected_captures, int grad_accum) {
  Windows<T> data(samples, 16, 40);
  Generator g1(11), g2(11);
  nn::GPT<T> eager_model(small_gpt(), g1), graph_model(small_gpt(), g2);
  const Result eager = train<T>(eager_model, data, false, batch, epochs, grad_accum);
  const Result graph = train<T>(graph_model, data, true, batch, epochs, grad_accum);
  INFO(graph.captures << " captures; graphs off: " << graph.graphs_off);
  REQUIRE_FALSE(graph.graphs_off);
  CHECK(graph.captures == expected_captures);
  CHECK(eager.graphs_off);
  CHECK(graph.steps == eager.steps);
  // The schedule under replay: every step counted, the last step's learning rate.
  CHECK(graph.opt_steps == graph.steps);
  CHECK(graph.lr == eager.lr);
  // One host read of the loss per report (every 2 steps and the last) and one at the end.
  CHECK(graph.reads == (graph.steps + 1) / 2 + 1);
  CHECK(graph.reads == eager.reads);
  // The allocator's counters: the graph's pool is reserved, never live, once the run ends.
  CHECK(graph.live_delta == eager.live_delta);
  CHECK(rel_error(graph.params, eager.params) <= (std::is_same_v<T, bf16> ? tol<bf16>() : 1e-5));
  CHECK(rel_error(graph.report_losses, eager.report_losses) <= (std::is_same_v<T, bf16> ? tol<bf16>() : 1e-5));
}

}  // namespace

TEST_CASE("CUDA graph of the Trainer's step: a GPT replayed equals the GPT run eagerly",
          "[cuda:cuda_graph_step]") {
  // 6 steps of one shape: 1 warm-up, 1 capture, 4 replays.
  check_gpt_graph<float>(24, 4, 1, 1, 1);
  check_gpt_graph<bf16>(24, 4, 1, 1, 1);
  // Micro-batches inside the captured step.
  check_gpt_graph<float>(24, 4, 1, 1, 2);
}

TEST_CASE("CUDA graph of the Trainer's step: a batch of another shape captures again",
          "[cuda:cuda_graph_step]") {
  // 14 samples in batches of 4: 4, 4, 4, 2 per epoch; two epochs. Rows 4: warm-up,
  // capture, replay; rows 2: warm-up; then rows 4 again: warm-up, capture, replay; rows 2: warm-up.
  check_gpt_graph<float>(14, 4, 2, 2, 1);
}

TEST_CASE("CUDA graph of the Trainer's step: a Llama replayed equals the Llama run eagerly",
          "[cuda:cuda_graph_step]") {
  const nn::LlamaConfig cfg{.vocab_size = 40, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 64,
                            .intermediate_size = 96, .max_seq_len = 16};
  Windows<float> data(24, 16, 40);
  Generator g1(12), g2(12);
  nn::Llama<float> eager_model(cfg, g1), graph_model(cfg, g2);
  const Result eager = train<float>(eager_model, data, false, 4, 1);
  const Result graph = train<float>(graph_model, data, true, 4, 1);
  REQUIRE_FALSE(graph.graphs_off);
  CHECK(graph.captures == 1);
  CHECK(graph.opt_steps == 6);
  CHECK(rel_error(graph.params, eager.params) <= 1e-5);
  CHECK(rel_error(graph.report_losses, eager.report_losses) <= 1e-5);
}

// The token weights of masked targets change every step, so the Trainer does not capture
// (Note [Token-weighted loss]); the eager GPU run with the loss on the device ends with the
// CPU run's parameters.
TEST_CASE("CUDA graph of the Trainer's step: a data set that masks targets runs eagerly, as on the CPU",
          "[cuda:cuda_graph_step]") {
  MaskedWindows<float> data(24, 16, 40);
  Generator g1(11), g2(11);
  nn::GPT<float> gpu_model(small_gpt(), g1), cpu_model(small_gpt(), g2);
  const Result gpu = train<float>(gpu_model, data, true, 4, 1, 2);
  Result cpu;
  train_on(cpu_model, data, false, 4, 1, 2, cpu);
  CHECK(gpu.graphs_off);
  CHECK_THAT(gpu.why_off, Catch::Contains("masks targets"));
  CHECK(gpu.captures == 0);
  CHECK(gpu.steps == cpu.steps);
  CHECK(rel_error(gpu.params, cpu.params) <= 1e-4);  // float on two devices, six AdamW steps
}

TEST_CASE("CUDA graph: a host read inside a capture is refused, naming the capture", "[cuda:cuda_graph_step]") {
  auto t = Tensor<float>::from(std::vector<float>(4, 1.0f), {4}).to(kGpu);
  train::CudaStepGraph graph(0);
  CHECK_THROWS_WITH(graph.capture("the test's step", [&] {
                      t.zero_();
                      (void)t.to_vector();
                    }),
                    Catch::Contains("[ptrain.cuda.graph_host_sync]") && Catch::Contains("the test's step"));
  // The failed capture left the stream usable, and nothing it recorded ran.
  CHECK(t.to_vector() == std::vector<float>(4, 1.0f));
  graph.capture("the test's step", [&] { t.zero_(); });
  CHECK(t.to_vector() == std::vector<float>(4, 1.0f));  // a capture records; it runs nothing
  graph.launch();
  CHECK(t.to_vector() == std::vector<float>(4, 0.0f));
}

}  // namespace test_cuda_graph
