// Floating-point targets end to end: a regression model (MSELoss on values of T, a
// data set of T targets) trained by train::Trainer through every engine on W
// ranks, each data-parallel replica taking its share of a global batch, ends
// with the parameters of one process training on the global batch (the
// argument of test_trainer.cpp); the pipeline splits the targets into
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

// Real-valued targets in double (T = double): the engines add the replicas' and
// micro-batches' gradients in another order than one process, and ten AdamW steps
// (lr / eps = 2e4) turn the float rounding of near-zero gradients into parameter
// differences near 1e-5 relative that depend on the vector width. In double that is
// ~1e-12: kTol = 1e-9 holds anywhere, and targets split on the wrong rows or a missing
// reduction still move the parameters by more than 1e-3.
using Real = double;
constexpr double kTol = 1e-9;

constexpr std::int64_t kIn = 3, kOut = 2, kBatch = 4;

// y = (sin(x0 + x1), x2^2 - x0): two real-valued targets per row.
TensorDataset<Real> make_data(std::int64_t n) {
  Generator g(31);
  auto x = Tensor<Real>::empty({n, kIn});
  auto y = Tensor<Real>::empty({n, kOut});
  for (std::int64_t i = 0; i < n * kIn; ++i) x.data()[i] = static_cast<Real>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < n; ++i) {
    const Real* r = x.data() + i * kIn;
    y.data()[i * kOut] = std::sin(r[0] + r[1]);
    y.data()[i * kOut + 1] = r[2] * r[2] - r[0];
  }
  return TensorDataset<Real>(x, y);
}

std::shared_ptr<nn::MLP<Real>> make_mlp() {
  Generator g(8);
  return std::make_shared<nn::MLP<Real>>(kIn, std::vector<std::int64_t>{8, 8}, kOut, nn::Activation::Tanh, g);
}

// Trains `plan` for 2 epochs on `global_batch` rows per step, split over the
// engine's data-parallel replicas; returns the whole model's parameters, read
// back in one process from a checkpoint in `dir`.
std::vector<Real> train_and_gather(const parallel::Plan<Real>& plan, Dataset<Real>& data,
                                    std::int64_t global_batch, const std::filesystem::path& dir) {
  auto engine = parallel::make_engine<Real>(make_mlp(), world(), plan);
  engine->set_loss(parallel::loss_fn<Real>(nn::MSELoss<Real>()));
  optim::AdamW<Real> opt(engine->parameters(), {.lr = 0.02, .eps = 1e-6});
  dist::Communicator* dp = engine->data_parallel_group();
  const std::int64_t batch = global_batch / (dp ? dp->size() : 1);
  train::Trainer<Real> trainer(*engine, opt, data,
                                {.epochs = 2, .batch = batch, .grad_accum = 2, .seed = 4, .log_every = 0});
  CHECK(trainer.run().step == 10);
  if (engine->communicator().rank() == 0) std::filesystem::remove_all(dir);
  world().barrier();
  {
    ckpt::CheckpointManager mgr(dir, &engine->communicator());
    ckpt::save(mgr, 0, *engine, &opt);
  }
  auto back = make_mlp();
  nn::FlatParameters<Real> p(*back);
  ckpt::CheckpointManager reader(dir);
  reader.load(reader.latest().path, p);
  return p.values().to_vector();
}

double rel_error(const std::vector<Real>& got, const std::vector<Real>& want) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("A regression model with floating-point targets trains in every engine like one process", "[regression]") {
  auto& comm = world();
  const int n = comm.size();
  auto data = make_data(kBatch * n * 5);  // 5 full steps per epoch on every world size
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_regression_");
  // Local on every rank: a world of one per rank, so each writes its own directory.
  const auto want = train_and_gather(parallel::LocalOptions{}, data, kBatch * n,
                                     dir / ("local" + std::to_string(comm.rank())));
  using S = parallel::ShardingStrategy;
  const std::vector<std::pair<std::string, parallel::Plan<Real>>> plans = {
      {"ddp", parallel::DDPOptions{}},
      {"fsdp", parallel::FSDPOptions{.strategy = S::FullShard}},
      {"pipeline", parallel::PipelinePlan<Real>{.stages = n % 2 == 0 ? 2 : n,
                                                 .unit_costs = {1, 0, 1, 0, 1},
                                                 .options = {.micro_batches = 2}}},
  };
  for (const auto& [name, plan] : plans) {
    INFO(name << " on " << n << " ranks");
    CHECK(rel_error(train_and_gather(plan, data, kBatch * n, dir / name), want) < kTol);
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("An engine given the wrong kind of targets for its loss says so on every rank", "[regression]") {
  auto engine = parallel::make_engine<Real>(make_mlp(), world(), parallel::DDPOptions{});
  engine->set_loss(parallel::loss_fn<Real>(nn::MSELoss<Real>()));
  const auto x = Tensor<Real>::zeros({2, kIn});
  CHECK_THROWS_WITH(engine->eval_loss(x, Tensor<std::int32_t>::zeros({2})),
                    Catch::Contains("[ptrain.loss.targets] MSELoss takes floating-point target values"));
  engine->set_loss({});  // back to cross-entropy, which takes class ids
  CHECK_THROWS_WITH(engine->eval_loss(x, Tensor<Real>::zeros({2, kOut})),
                    Catch::Contains("[ptrain.loss.targets] CrossEntropyLoss takes int32 class ids"));
}

}  // namespace test_regression
