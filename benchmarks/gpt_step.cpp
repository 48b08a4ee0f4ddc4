// One GPT training step (forward, cross-entropy, backward, AdamW) on one
// process and one thread; prints one JSON line. benchmarks/gpt_step.py is its
// PyTorch twin and benchmarks/run_gpt_step.sh runs both side by side.
//
// Default shape: nanoGPT's shakespeare_char model (6 layers, 6 heads, width
// 384, block 256, vocab 65) at batch 8. FLOPs per token are the usual
// 6 * (matmul parameters) + 12 * layers * block * width (GPTConfig::flops_per_token),
// counting attention at full S x S even though the causal kernel skips most
// of the masked half.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/ptrain.hpp>

#include "bench_util.hpp"

using namespace ptrain;

int main(int argc, char** argv) {
  CLI::App app{"ptrain GPT training-step benchmark"};
  nn::GPTConfig cfg{.vocab_size = 65, .block_size = 256, .n_layer = 6, .n_head = 6, .n_embd = 384};
  std::int64_t batch = 8;
  int steps = 10, warmup = 2;
  app.add_flag("--recompute", cfg.recompute, "recompute each block's activations in backward");
  app.add_option("--layers", cfg.n_layer, "transformer blocks");
  app.add_option("--heads", cfg.n_head, "attention heads");
  app.add_option("--embd", cfg.n_embd, "embedding width");
  app.add_option("--block", cfg.block_size, "sequence length");
  app.add_option("--vocab", cfg.vocab_size, "vocabulary size");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  CLI11_PARSE(app, argc, argv);

  kernels::cpu::set_num_threads(1);  // one thread, like torch.set_num_threads(1) in the twin
  manual_seed(0);
  nn::GPT<float> model(cfg);
  nn::FlatParameters<float> flat(model);
  optim::AdamW<float> opt(flat, {.lr = 3e-4, .weight_decay = 0.1}, nn::gpt_decay_filter());
  nn::CrossEntropyLoss<float> loss_fn;

  const std::int64_t S = cfg.block_size;
  Generator gen(1);
  auto x = Tensor<float>::empty({batch, S});
  auto y = Tensor<std::int32_t>::empty({batch * S});
  for (std::int64_t i = 0; i < batch * S; ++i) {
    x.data()[i] = static_cast<float>(gen.below(static_cast<std::uint64_t>(cfg.vocab_size)));
    y.data()[i] = static_cast<std::int32_t>(gen.below(static_cast<std::uint64_t>(cfg.vocab_size)));
  }

  nn::Cache<float> cache, loss_cache;
  double loss = 0;
  const std::int64_t live = memory_stats().live_bytes;  // parameters, gradients, AdamW state, batch
  reset_peak_memory();
  auto times = bench::time_runs(warmup, steps, [&] {
    flat.zero_grad();
    loss = loss_fn.forward(model.forward(x, cache), y, loss_cache);
    model.backward(loss_fn.backward(loss_cache), cache);
    opt.step();
  });

  const double ms = bench::median(times);
  const double tokens = static_cast<double>(batch * S);
  const double fpt = cfg.flops_per_token(S);
  nlohmann::json j = {{"bench", "gpt_step"},
                      {"impl", "ptrain"},
                      {"layers", cfg.n_layer},
                      {"heads", cfg.n_head},
                      {"embd", cfg.n_embd},
                      {"block", S},
                      {"vocab", cfg.vocab_size},
                      {"batch", batch},
                      {"recompute", cfg.recompute},
                      {"steps", steps},
                      {"parameters", model.num_parameters()},
                      {"step_ms_median", ms},
                      {"step_ms_min", *std::min_element(times.begin(), times.end())},
                      {"tokens_per_s", 1000.0 * tokens / ms},
                      {"mflop_per_token", fpt / 1e6},
                      {"gflops", fpt * tokens / (ms * 1e6)},
                      {"step_peak_mb", static_cast<double>(memory_stats().peak_bytes - live) / 1e6},
                      {"final_loss", loss}};
  std::printf("%s\n", j.dump().c_str());
}
