// Float targets end to end: a regression model (MSELoss on values of T, a data
// set of float targets) trained by train::Trainer through every engine on W
// ranks, each data-parallel replica taking its share of a global batch, ends
// with the parameters of one process training on the global batch (the
// argument of test_trainer.cpp); the pipeline splits the float targets into
// micro-batches by rows. Checks use CHECK so no rank skips collectives.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/train/trainer.hpp>

#include "dist/world.hpp"

namespace test_regression {

using namespace ptrain;
using ptrain::testing::world;

namespace {

constexpr std::int64_t kIn = 3, kOut = 2, kBatch = 4;

// y = (sin(x0 + x1), x2^2 - x0): two float targets per row.
TensorDataset<float> make_data(std::int64_t n) {
  Generator g(31);
  auto x = Tensor<float>::empty({n, kIn});
  auto y = Tensor<float>::empty({n, kOut});
  for (std::int64_t i = 0; i < n * kIn; ++i) x.data()[i] = static_cast<float>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < n; ++i) {
    const float* r = x.data() + i * kIn;
    y.data()[i * kOut] = std::sin(r[0] + r[1]);
    y.data()[i * kOut + 1] = r[2] * r[2] - r[0];
  }
  return TensorDataset<float>(x, y);
}

std::shared_ptr<nn::MLP<float>> make_mlp() {
  Generator g(8);
  return std::make_shared<nn::MLP<float>>(kIn, std::vector<std::int64_t>{8, 8}, kOut, nn::Activation::Tanh, g);
}

// Trains `plan` for 2 epochs on `global_batch` rows per step, split over the
// engine's data-parallel replicas; returns the whole model's parameters, read
// back in one process from a checkpoint in `dir`.
std::vector<float> train_and_gather(const parallel::Plan<float>& plan, Dataset<float>& data,
                                    std::int64_t global_batch, const std::filesystem::path& dir) {
  auto engine = parallel::make_engine<float>(make_mlp(), world(), plan);
  engine->set_loss(parallel::loss_fn<float>(nn::MSELoss<float>()));
  optim::AdamW<float> opt(engine->parameters(), {.lr = 0.02, .eps = 1e-6});
  dist::Communicator* dp = engine->data_parallel_group();
  const std::int64_t batch = global_batch / (dp ? dp->size() : 1);
  train::Trainer<float> trainer(*engine, opt, data,
                                {.epochs = 2, .batch = batch, .grad_accum = 2, .seed = 4, .log_every = 0});
  CHECK(trainer.run().step == 10);
  if (engine->communicator().rank() == 0) std::filesystem::remove_all(dir);
  world().barrier();
  {
    ckpt::CheckpointManager mgr(dir, &engine->communicator());
    ckpt::save(mgr, 0, *engine, &opt);
  }
  auto back = make_mlp();
  nn::FlatParameters<float> p(*back);
  ckpt::CheckpointManager reader(dir);
  reader.load(reader.latest().path, p);
  return p.values().to_vector();
}

double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("A regression model with float targets trains in every engine like one process", "[regression]") {
  auto& comm = world();
  const int n = comm.size();
  auto data = make_data(kBatch * n * 5);  // 5 full steps per epoch on every world size
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_regression_");
  // Local on every rank: a world of one per rank, so each writes its own directory.
  const auto want = train_and_gather(parallel::LocalOptions{}, data, kBatch * n,
                                     dir / ("local" + std::to_string(comm.rank())));
  using S = parallel::ShardingStrategy;
  const std::vector<std::pair<std::string, parallel::Plan<float>>> plans = {
      {"ddp", parallel::DDPOptions{}},
      {"fsdp", parallel::FSDPOptions{.strategy = S::FullShard}},
      {"pipeline", parallel::PipelinePlan<float>{.stages = n % 2 == 0 ? 2 : n,
                                                 .unit_costs = {1, 0, 1, 0, 1},
                                                 .options = {.micro_batches = 2}}},
  };
  for (const auto& [name, plan] : plans) {
    INFO(name << " on " << n << " ranks");
    CHECK(rel_error(train_and_gather(plan, data, kBatch * n, dir / name), want) < 1e-5);
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("An engine given the wrong kind of targets for its loss says so on every rank", "[regression]") {
  auto engine = parallel::make_engine<float>(make_mlp(), world(), parallel::DDPOptions{});
  engine->set_loss(parallel::loss_fn<float>(nn::MSELoss<float>()));
  const auto x = Tensor<float>::zeros({2, kIn});
  CHECK_THROWS_WITH(engine->eval_loss(x, Tensor<std::int32_t>::zeros({2})),
                    Catch::Contains("[ptrain.loss.targets] MSELoss takes floating-point target values"));
  engine->set_loss({});  // back to cross-entropy, which takes class ids
  CHECK_THROWS_WITH(engine->eval_loss(x, Tensor<float>::zeros({2, kOut})),
                    Catch::Contains("[ptrain.loss.targets] CrossEntropyLoss takes int32 class ids"));
}

}  // namespace test_regression
