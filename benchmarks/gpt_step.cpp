// One GPT or Llama (--model llama) training step (forward, cross-entropy,
// backward, AdamW) on one process and one thread; prints one JSON line.
// benchmarks/gpt_step.py is its PyTorch twin and benchmarks/run_gpt_step.sh runs
// both side by side.
//
// Default shape: nanoGPT's shakespeare_char model (6 layers, 6 heads, width
// 384, block 256, vocab 65) at batch 8. FLOPs per token are the usual
// 6 * (matmul parameters) + 12 * layers * block * width (GPTConfig::flops_per_token),
// counting attention at full S x S even though the causal kernel skips most
// of the masked half. --model llama: Llama layers (RMSNorm, grouped-query
// attention with rotary positions, SwiGLU, untied head), default 2 kv heads and
// SwiGLU width 1024 (LlamaConfig::flops_per_token).

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/ptrain.hpp>

#include "bench_util.hpp"

using namespace ptrain;

// Peak resident memory of this process (both twins report it; Linux: ru_maxrss in KiB).
double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// Times `steps` steps of forward, cross-entropy, backward and AdamW; prints the JSON line.
template <class M>
void bench_step(M& model, nn::FlatParameters<float>& flat, optim::AdamW<float>& opt, std::int64_t batch,
                std::int64_t S, std::int64_t vocab, int warmup, int steps, double flops_per_token,
                nlohmann::json j) {
  nn::CrossEntropyLoss<float> loss_fn;
  Generator gen(1);
  auto x = Tensor<std::int32_t>::empty({batch, S});
  auto y = Tensor<std::int32_t>::empty({batch * S});
  for (std::int64_t i = 0; i < batch * S; ++i) {
    x.data()[i] = static_cast<std::int32_t>(gen.below(static_cast<std::uint64_t>(vocab)));
    y.data()[i] = static_cast<std::int32_t>(gen.below(static_cast<std::uint64_t>(vocab)));
  }
  nn::Cache<float> cache, loss_cache;
  double loss = 0;
  const std::int64_t live = memory_stats().live_bytes;  // parameters, gradients, AdamW state, batch
  reset_peak_memory();
  auto times = bench::time_runs(warmup, steps, [&] {
    flat.zero_grad();
    loss = loss_fn.forward(model.forward_tokens(x, cache), y, loss_cache);
    model.backward(loss_fn.backward(loss_cache), cache);
    opt.step();
  });
  const double ms = bench::median(times);
  const double tokens = static_cast<double>(batch * S);
  j.update({{"impl", "ptrain"},
            {"block", S},
            {"vocab", vocab},
            {"batch", batch},
            {"steps", steps},
            {"parameters", model.num_parameters()},
            {"step_ms_median", ms},
            {"step_ms_min", *std::min_element(times.begin(), times.end())},
            {"tokens_per_s", 1000.0 * tokens / ms},
            {"mflop_per_token", flops_per_token / 1e6},
            {"gflops", flops_per_token * tokens / (ms * 1e6)},
            {"step_peak_mb", static_cast<double>(memory_stats().peak_bytes - live) / 1e6},
            {"peak_rss_mb", peak_rss_mb()},
            {"final_loss", loss}});
  std::printf("%s\n", j.dump().c_str());
}

int main(int argc, char** argv) {
  CLI::App app{"ptrain GPT or Llama training-step benchmark"};
  nn::GPTConfig cfg{.vocab_size = 65, .block_size = 256, .n_layer = 6, .n_head = 6, .n_embd = 384};
  std::string model_kind = "gpt";
  std::int64_t kv_heads = 2, intermediate = 1024;
  std::int64_t batch = 8;
  int steps = 10, warmup = 2;
  app.add_option("--model", model_kind, "gpt or llama")->check(CLI::IsMember({"gpt", "llama"}));
  app.add_flag("--recompute", cfg.recompute, "recompute each block's activations in backward");
  app.add_option("--layers", cfg.n_layer, "transformer blocks");
  app.add_option("--heads", cfg.n_head, "attention heads");
  app.add_option("--kv-heads", kv_heads, "--model llama: key/value heads");
  app.add_option("--intermediate", intermediate, "--model llama: SwiGLU width");
  app.add_option("--embd", cfg.n_embd, "embedding width");
  app.add_option("--block", cfg.block_size, "sequence length");
  app.add_option("--vocab", cfg.vocab_size, "vocabulary size");
  app.add_option("--batch", batch, "sequences per step");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  CLI11_PARSE(app, argc, argv);

  kernels::cpu::set_num_threads(1);  // one thread, like torch.set_num_threads(1) in the twin
  manual_seed(0);
  const nlohmann::json common = {{"layers", cfg.n_layer}, {"heads", cfg.n_head}, {"embd", cfg.n_embd},
                                 {"recompute", cfg.recompute}};
  if (model_kind == "llama") {
    nn::LlamaConfig lc;
    lc.vocab_size = cfg.vocab_size;
    lc.n_layer = cfg.n_layer;
    lc.n_head = cfg.n_head;
    lc.n_kv_head = kv_heads;
    lc.n_embd = cfg.n_embd;
    lc.intermediate_size = intermediate;
    lc.max_seq_len = cfg.block_size;
    lc.recompute = cfg.recompute;
    nn::Llama<float> model(lc);
    nn::FlatParameters<float> flat(model);
    optim::AdamW<float> opt(flat, {.lr = 3e-4, .weight_decay = 0.1}, nn::llama_decay_filter());
    nlohmann::json j = common;
    j.update({{"bench", "llama_step"}, {"kv_heads", kv_heads}, {"intermediate", intermediate}});
    bench_step(model, flat, opt, batch, cfg.block_size, cfg.vocab_size, warmup, steps,
               lc.flops_per_token(cfg.block_size), j);
    return 0;
  }
  nn::GPT<float> model(cfg);
  nn::FlatParameters<float> flat(model);
  optim::AdamW<float> opt(flat, {.lr = 3e-4, .weight_decay = 0.1}, nn::gpt_decay_filter());
  nlohmann::json j = common;
  j["bench"] = "gpt_step";
  bench_step(model, flat, opt, batch, cfg.block_size, cfg.vocab_size, warmup, steps, cfg.flops_per_token(cfg.block_size),
             j);
}
