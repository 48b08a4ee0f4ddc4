#pragma once
// The MLP training-step benchmark shared by train_step (one process) and
// ddp_step (data parallel): the model 784 -> hidden x layers -> 10, a random
// batch, AdamW, and the FLOP count.
//
// FLOPs per step: each Linear(in, out) costs 2*B*in*out for forward, the same
// for dW, and the same again for dx except in the first layer, whose input is
// data (PyTorch skips it too). Elementwise work and AdamW are not counted.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <ptrain/ptrain.hpp>

#include "bench_util.hpp"

namespace ptrain::bench {

struct MlpOptions {
  std::int64_t hidden = 1024, batch = 128;
  int layers = 3, steps = 30, warmup = 5;

  void add_to(CLI::App& app) {
    app.add_option("--hidden", hidden, "hidden width");
    app.add_option("--layers", layers, "number of hidden layers");
    app.add_option("--batch", batch, "batch size (per rank)");
    app.add_option("--steps", steps, "timed steps");
    app.add_option("--warmup", warmup, "untimed steps first");
  }
  double flops_per_step() const {
    double flops = 0;
    std::int64_t width = 784;
    for (int l = 0; l <= layers; ++l) {
      const std::int64_t out = l < layers ? hidden : 10;
      flops += 2.0 * static_cast<double>(batch * width * out) * (l == 0 ? 2 : 3);
      width = out;
    }
    return flops;
  }
};

/// Model, optimizer and one random batch; step() runs forward, loss, backward,
/// `sync` (DDP's gradient all-reduce, or nothing) and the AdamW update.
struct MlpStep {
  nn::MLP<float> model;
  nn::FlatParameters<float> params;
  optim::AdamW<float> opt;
  nn::CrossEntropyLoss<float> loss_fn;
  Tensor<float> x;
  Tensor<std::int32_t> y;
  nn::Cache<float> cache, loss_cache;
  double loss = 0;

  MlpStep(const MlpOptions& o, std::uint64_t data_seed)
      : model(784, std::vector<std::int64_t>(static_cast<std::size_t>(o.layers), o.hidden), 10),
        params((model.set_need_input_grad(false), model)),
        opt(params, {}),
        x(Tensor<float>::empty({o.batch, 784})),
        y(Tensor<std::int32_t>::empty({o.batch})) {
    Generator gen(data_seed);
    ops::uniform_(x, 0.0, 1.0, gen);
    for (std::int64_t i = 0; i < o.batch; ++i) y.data()[i] = static_cast<std::int32_t>(gen.below(10));
  }

  template <class Sync>
  void step(nn::Module<float>& m, Sync&& sync) {
    params.zero_grad();
    loss = loss_fn.forward(m.forward(x, cache), y, loss_cache);
    m.backward(loss_fn.backward(loss_cache), cache);
    sync();
    opt.step();
  }
};

/// The JSON line both benchmarks print.
inline nlohmann::json mlp_record(const char* bench, const MlpOptions& o, const std::vector<double>& times_ms,
                                 int ranks, double loss) {
  const double ms = median(times_ms);
  const double flops = o.flops_per_step() * ranks;
  return {{"bench", bench},
          {"impl", "ptrain"},
          {"hidden", o.hidden},
          {"layers", o.layers},
          {"batch", o.batch},
          {"ranks", ranks},
          {"steps", o.steps},
          {"step_ms_median", ms},
          {"samples_per_s", 1000.0 * static_cast<double>(o.batch * ranks) / ms},
          {"gflop_per_step", flops / 1e9},
          {"gflops", flops / (ms * 1e6)},
          {"final_loss", loss}};
}

}  // namespace ptrain::bench
