// One training step of an MLP (forward, cross-entropy, backward, AdamW) on one
// process; prints one JSON line. benchmarks/train_step.py is its PyTorch twin
// and benchmarks/run_train_step.sh runs both side by side.
//
// FLOPs per step: each Linear(in, out) costs 2*B*in*out for forward, the same
// for dW, and the same again for dx except in the first layer, whose input is
// data (PyTorch skips it too). Elementwise work and AdamW are not counted.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ptrain/ptrain.hpp>

#include "bench_util.hpp"

using namespace ptrain;

// Throughput of one large float GEMM: the practical peak of this CPU core.
static double gemm_peak_gflops() {
  const std::int64_t n = 1024;
  auto a = Tensor<float>::full({n, n}, 0.5f), b = Tensor<float>::full({n, n}, 0.25f), c = Tensor<float>::zeros({n, n});
  auto t = bench::time_runs(2, 7, [&] { ops::matmul_into(a, b, c); });
  return 2.0 * n * n * n / (bench::median(t) * 1e6);
}

int main(int argc, char** argv) {
  CLI::App app{"ptrain MLP training-step benchmark"};
  std::int64_t hidden = 1024, batch = 128;
  int layers = 3, steps = 30, warmup = 5;
  app.add_option("--hidden", hidden, "hidden width");
  app.add_option("--layers", layers, "number of hidden layers");
  app.add_option("--batch", batch, "batch size");
  app.add_option("--steps", steps, "timed steps");
  app.add_option("--warmup", warmup, "untimed steps first");
  CLI11_PARSE(app, argc, argv);

  const std::int64_t in = 784, classes = 10;
  manual_seed(0);
  nn::MLP<float> model(in, std::vector<std::int64_t>(static_cast<std::size_t>(layers), hidden), classes);
  model.set_need_input_grad(false);
  nn::FlatParameters<float> flat(model);
  optim::AdamW<float> opt(flat, {});
  nn::CrossEntropyLoss<float> loss_fn;

  Generator gen(1);
  auto x = Tensor<float>::empty({batch, in});
  ops::uniform_(x, 0.0, 1.0, gen);
  auto y = Tensor<std::int32_t>::empty({batch});
  for (std::int64_t i = 0; i < batch; ++i) y.data()[i] = static_cast<std::int32_t>(gen.below(classes));

  nn::Cache<float> cache, loss_cache;
  double loss = 0;
  auto times = bench::time_runs(warmup, steps, [&] {
    flat.zero_grad();
    auto logits = model.forward(x, cache);
    loss = loss_fn.forward(logits, y, loss_cache);
    model.backward(loss_fn.backward(loss_cache), cache);
    opt.step();
  });

  double flops = 0;
  std::int64_t width = in;
  for (int l = 0; l <= layers; ++l) {
    const std::int64_t out = l < layers ? hidden : classes;
    flops += 2.0 * batch * width * out * (l == 0 ? 2 : 3);
    width = out;
  }
  const double ms = bench::median(times);
  const double peak = gemm_peak_gflops();
  nlohmann::json j = {{"bench", "train_step"},       {"impl", "ptrain"},
                      {"hidden", hidden},            {"layers", layers},
                      {"batch", batch},              {"steps", steps},
                      {"step_ms_median", ms},        {"samples_per_s", 1000.0 * batch / ms},
                      {"gflop_per_step", flops / 1e9}, {"gflops", flops / (ms * 1e6)},
                      {"gemm_peak_gflops", peak},    {"fraction_of_gemm_peak", flops / (ms * 1e6) / peak},
                      {"final_loss", loss}};
  std::printf("%s\n", j.dump().c_str());
}
