// The loss kept on the device and the CUDA-graph decisions of the Trainer, on the
// CPU (Notes [Loss on the device] and [CUDA graphs of the step] in
// train/step_graph.hpp): the capture plan on its own, the Trainer with the loss on
// the device against the Trainer that reads each step's loss (the same numbers, bit
// for bit, read only at reports), and AdamW's scalars read from memory against the
// same scalars passed by value. The captured step itself runs in tests/gpu.
#include <catch2/catch.hpp>
#include <cmath>
#include <sstream>

#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/kernels/cpu/adamw_ranges.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/train/trainer.hpp>

namespace test_step_graph {

using namespace ptrain;
using Action = train::StepGraphPlan::Action;

namespace {

train::StepGraphKey key_of(std::int64_t rows, std::int64_t cols, const std::string& settings = "") {
  train::StepGraphKey k;
  k.add_shape({rows, cols});
  k.add_shape({rows});
  k.settings = settings;
  return k;
}

TensorDataset<float> make_data(std::int64_t n) {
  Generator g(5);
  auto x = Tensor<float>::empty({n, 6});
  auto y = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n * 6; ++i) x.data()[i] = static_cast<float>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < n; ++i) y.data()[i] = static_cast<std::int32_t>(g.below(4));
  return TensorDataset<float>(x, y);
}

// A Trainer run on 10 samples x 7 steps of a small MLP; returns its metrics records.
struct Trained {
  std::vector<train::StepInfo> steps;
  std::vector<float> params;
  std::int64_t reads = 0;
  bool graphs_off = false;
};

Trained train_mlp(std::optional<bool> device_loss, int grad_accum, std::int64_t log_every) {
  auto data = make_data(10 * 7);
  dist::SelfCommunicator self;
  Generator g(8);
  auto model = std::make_shared<nn::MLP<float>>(6, std::vector<std::int64_t>{8}, 4, nn::Activation::ReLU, g);
  auto engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
  optim::AdamW<float> opt(engine->parameters(), {.lr = 0.02});
  train::Trainer<float> trainer(*engine, opt, data,
                                {.batch = 10, .grad_accum = grad_accum, .log_every = log_every,
                                 .device_loss = device_loss});
  trainer.schedule = [](std::int64_t s) { return 0.02 / static_cast<double>(s + 1); };
  Trained out;
  trainer.on_step = [&](const train::StepInfo& s) { out.steps.push_back(s); };
  trainer.run();
  out.params = engine->parameters().values().to_vector();
  out.reads = trainer.loss_window().reads();
  out.graphs_off = trainer.graph_plan().off();
  return out;
}

}  // namespace

TEST_CASE("StepGraphPlan: warm-up, capture, replay, and again after a change of shape", "[train][step_graph]") {
  train::StepGraphPlan plan(2);
  const auto a = key_of(8, 16), b = key_of(4, 16);
  CHECK(plan.next(a) == Action::Eager);
  CHECK(plan.next(a) == Action::Eager);
  CHECK(plan.next(a) == Action::Capture);
  plan.captured();
  CHECK(plan.next(a) == Action::Replay);
  CHECK(plan.next(a) == Action::Replay);
  CHECK(plan.captures() == 1);
  // A last, smaller batch: warm-up and capture again.
  CHECK(plan.next(b) == Action::Eager);
  CHECK(plan.next(b) == Action::Eager);
  CHECK(plan.next(b) == Action::Capture);
  plan.captured();
  CHECK(plan.next(b) == Action::Replay);
  CHECK(plan.captures() == 2);
  // A setting is part of the key; a capture that was asked for but not made is asked for again.
  CHECK(plan.next(key_of(4, 16, "grad_accum=2")) == Action::Eager);
  CHECK(plan.next(key_of(4, 16, "grad_accum=2")) == Action::Eager);
  CHECK(plan.next(key_of(4, 16, "grad_accum=2")) == Action::Capture);
  CHECK(plan.next(key_of(4, 16, "grad_accum=2")) == Action::Capture);
  plan.turn_off("a capture failed");
  CHECK(plan.next(a) == Action::Eager);
  CHECK(plan.next(a) == Action::Eager);
  CHECK(plan.off());
  CHECK(plan.why_off() == "a capture failed");
  CHECK_THROWS_WITH(train::StepGraphPlan(0), Catch::Contains("[ptrain.trainer.graph]"));
}

TEST_CASE("StepGraphKey: shapes of another rank or size differ", "[train][step_graph]") {
  train::StepGraphKey k1, k2;
  k1.add_shape({2, 3});
  k2.add_shape({6});
  CHECK(!(k1 == k2));
  k2 = {};
  k2.add_shape({2, 3});
  CHECK(k1 == k2);
}

TEST_CASE("LossWindow: sums of micro-batches, then of steps, as the host loop adds them", "[train][step_graph]") {
  train::LossWindow w;
  const std::vector<std::vector<double>> steps = {{0.1, 0.7}, {1.0 / 3, 2.0 / 7}, {0.9, 1e-17}};
  double old_window = 0;  // ReportWindow's sum of the steps' losses
  for (const auto& micro : steps) {
    w.begin_step();
    double old_step = 0;  // Trainer::step's sum of weighted micro-batch losses
    for (double l : micro) {
      Tensor<double>& acc = w.step().bind(Device::cpu());
      acc.data()[0] += l;  // what fused_classifier adds (loss_weight * loss)
      old_step += l;
    }
    w.end_step();
    old_window += old_step;
  }
  CHECK(w.reads() == 0);
  CHECK(w.sum() == old_window);
  CHECK(w.reads() == 1);
  w.reset();
  CHECK(w.sum() == 0);
}

TEST_CASE("Trainer: the loss on the device gives the numbers of a read per step, read only at reports",
          "[train][trainer][step_graph]") {
  for (int accum : {1, 2}) {
    INFO("grad_accum " << accum);
    const Trained host = train_mlp(std::nullopt, accum, 3);  // on the CPU: a read per step, as before
    const Trained dev = train_mlp(true, accum, 3);
    REQUIRE(host.steps.size() == 7);
    REQUIRE(dev.steps.size() == 7);
    CHECK(host.reads == 0);
    // Reports at steps 3, 6 and 7 (the last), and one read at the end.
    CHECK(dev.reads == 4);
    // The same gradients and updates, bit for bit.
    CHECK(dev.params == host.params);
    double window = 0;
    std::int64_t in_window = 0;
    for (std::size_t i = 0; i < 7; ++i) {
      window += host.steps[i].loss;
      ++in_window;
      CHECK(dev.steps[i].lr == host.steps[i].lr);
      const bool report = (i + 1) % 3 == 0 || i + 1 == 7;
      if (report) {
        // The mean of the window's steps, as the progress line and the metrics record show it.
        CHECK(dev.steps[i].loss == window / static_cast<double>(in_window));
        window = 0;
        in_window = 0;
      } else {
        CHECK(std::isnan(dev.steps[i].loss));
      }
    }
  }
  // No logging: the loss is read once, at the end.
  CHECK(train_mlp(true, 1, 0).reads == 1);
  // On the CPU there is nothing to capture.
  CHECK(train_mlp(true, 1, 0).graphs_off);
}

TEST_CASE("Trainer: the device loss refuses a loss of the user's own", "[train][trainer][step_graph]") {
  auto data = make_data(20);
  dist::SelfCommunicator self;
  Generator g(8);
  auto model = std::make_shared<nn::MLP<float>>(6, std::vector<std::int64_t>{8}, 4, nn::Activation::ReLU, g);
  auto engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
  engine->set_loss(parallel::cross_entropy<float>);
  optim::AdamW<float> opt(engine->parameters(), {});
  train::Trainer<float> trainer(*engine, opt, data, {.batch = 10, .log_every = 0, .device_loss = true});
  CHECK_THROWS_WITH(trainer.run(), Catch::Contains("[ptrain.trainer.device_loss]"));
}

TEST_CASE("AdamW scalars read from memory (CUDA graphs) equal the same scalars by value", "[train][step_graph]") {
  const std::int64_t n = 37;
  std::vector<float> p0(n), m0(n, 0.1f), v0(n, 0.2f), g(n);
  for (std::int64_t i = 0; i < n; ++i) {
    p0[i] = 0.01f * static_cast<float>(i) - 0.1f;
    g[i] = std::sin(static_cast<float>(i));
  }
  const std::int64_t ends[2] = {20, n};
  const std::uint8_t decay[2] = {1, 0};
  // Both updates on the same buffers (the vectorised loop's split depends on the address).
  std::vector<float> p = p0, m = m0, v = v0;
  auto update = [&](const kernels::AdamWStep& s) {
    p = p0;
    m = m0;
    v = v0;
    kernels::cpu::adamw_update_ranges<float>(n, 2, ends, decay, p.data(), g.data(), m.data(), v.data(), nullptr, s);
    return std::vector<std::vector<float>>{p, m, v};
  };
  kernels::AdamWStep by_value;
  by_value.lr = 3e-3;
  by_value.step = 7;
  const auto expected = update(by_value);
  const double lr_step[2] = {3e-3, 7};
  kernels::AdamWStep in_memory;
  in_memory.lr = 1;    // ignored
  in_memory.step = 1;  // ignored
  in_memory.lr_step = lr_step;
  CHECK(update(in_memory) == expected);
  CHECK(expected[0] != p0);  // it did update
  // On the CPU AdamW has nothing to read from device memory: it declines.
  auto x = Tensor<float>::zeros({4});
  optim::AdamW<float> opt(x, Tensor<float>::zeros({4}), {{"x", 0, {4}, nullptr}}, {});
  CHECK_FALSE(opt.use_device_scalars(true));
  CHECK(opt.use_device_scalars(false));
}

}  // namespace test_step_graph
