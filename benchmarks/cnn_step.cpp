// One training step of fashion_mnist's CNN (nn::CNN: two blocks of 3x3 conv,
// BatchNorm2d, ReLU, 2x2 max-pool, then Linear; channels --c1, --c2, default
// 16 and 32 as the example's) at batch 128 on one process and
// one thread: forward, cross-entropy, backward, AdamW. Prints one JSON line;
// benchmarks/cnn_step.py is its PyTorch twin and runs both side by side.

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <ptrain/kernels/cpu/gemm.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/cnn.hpp>
#include <ptrain/optim/adamw.hpp>

#include "bench_util.hpp"

using namespace ptrain;

// FLOPs of one step, multiply-adds counted as 2: each convolution and the
// linear layer cost 2 x their forward GEMMs in backward (weight and input
// gradients), except the first convolution, which computes no input gradient.
// Norms, pooling and the optimizer are left out (< 1%).
static double cnn_flops(std::int64_t batch, std::int64_t c1, std::int64_t c2) {
  const double conv1 = 2.0 * batch * c1 * 9 * 28 * 28, conv2 = 2.0 * batch * c2 * c1 * 9 * 14 * 14;
  const double linear = 2.0 * batch * c2 * 7 * 7 * 10;
  return 2 * conv1 + 3 * conv2 + 3 * linear;
}

int main(int argc, char** argv) {
  CLI::App app{"ptrain CNN training-step benchmark (one process, one thread)"};
  std::int64_t batch = 128, c1 = 16, c2 = 32;
  int steps = 20, warmup = 3;
  app.add_option("--batch", batch);
  app.add_option("--c1", c1);
  app.add_option("--c2", c2);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  CLI11_PARSE(app, argc, argv);
  kernels::cpu::set_num_threads(1);

  Generator gen(0);
  nn::CNN<float> model(1, 28, 28, {c1, c2}, 10, false, gen);
  nn::FlatParameters<float> params(model);
  optim::AdamW<float> opt(params, {.lr = 1e-3});
  auto x = Tensor<float>::empty({batch, 28 * 28});
  ops::uniform_(x, 0.0, 1.0, gen);
  auto y = Tensor<std::int32_t>::empty({batch});
  for (std::int64_t i = 0; i < batch; ++i) y.data()[i] = static_cast<std::int32_t>(gen.below(10));
  nn::CrossEntropyLoss<float> ce;
  double loss = 0;
  auto times = bench::time_runs(warmup, steps, [&] {
    nn::Cache<float> c, lc;
    params.zero_grad();
    loss = ce.forward(model.forward(x, c), y, lc);
    model.backward(ce.backward(lc), c);
    opt.step();
  });
  const double ms = bench::median(times), flops = cnn_flops(batch, c1, c2);
  nlohmann::json j{{"bench", "cnn_step"}, {"impl", "ptrain"}, {"batch", batch}, {"channels", {c1, c2}},
                   {"steps", steps}, {"step_ms_median", ms}, {"samples_per_s", 1000.0 * batch / ms},
                   {"gflop_per_step", flops / 1e9}, {"gflops", flops / (ms * 1e6)}, {"final_loss", loss}};
  std::printf("%s\n", j.dump().c_str());
}
