// SyncBatchNorm across real processes against one process holding the global
// batch (Note [Synchronised batch statistics]): forward output, input and
// parameter gradients, running statistics; then a CNN with SyncBatchNorm
// trained under DDP, FSDP and a pipeline against BatchNorm in one process, and
// its buffers through a checkpoint of each mode. Every rank runs every case in the same order;
// checks use CHECK so that no rank skips a collective.

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/nn/batch_norm.hpp>
#include <ptrain/nn/models/cnn.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/local.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_sync_batch_norm {

using namespace ptrain;
using ptrain::testing::world;

namespace {
template <class T>
Tensor<T> random_tensor(const Shape& s, std::uint64_t seed, double lo, double hi) {
  auto t = Tensor<T>::empty(s);
  Generator g(seed);
  ops::uniform_(t, lo, hi, g);
  return t;
}

template <class T>
double max_abs_diff(const Tensor<T>& a, const Tensor<T>& b) {
  REQUIRE(a.numel() == b.numel());
  double d = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    d = std::max(d, std::abs(static_cast<double>(a.data()[i]) - static_cast<double>(b.data()[i])));
  return d;
}
}  // namespace

TEST_CASE("SyncBatchNorm on every rank's part equals BatchNorm on the global batch", "[dist][sync_batch_norm]") {
  auto& comm = world();
  const std::int64_t n = comm.size(), rows = 3, c = 4;
  const auto x = random_tensor<double>({rows * n, c, 3, 2}, 1, -1.0, 3.0);
  const auto r = random_tensor<double>(x.shape(), 2, -1.0, 1.0);
  const auto w = random_tensor<double>({c}, 3, 0.5, 1.5), b = random_tensor<double>({c}, 4, -0.5, 0.5);

  nn::BatchNorm2d<double> ref(c, {.momentum = 0.3});
  nn::SyncBatchNorm<double> sync(c, {.momentum = 0.3});
  for (auto* m : std::initializer_list<nn::BatchNorm<double>*>{&ref, &sync}) {
    m->weight()->value.copy_(w);
    m->bias()->value.copy_(b);
  }
  sync.set_replica_sum([&comm](Tensor<double>& t) { comm.all_reduce(t, dist::ReduceOp::Sum); });
  CHECK(sync.synchronised() == (n > 1));

  for (int step = 0; step < 2; ++step) {  // twice: the running statistics move again
    nn::Cache<double> rc, sc;
    ref.zero_grad();
    sync.zero_grad();
    auto y_ref = ref.forward(x, rc);
    auto dx_ref = ref.backward(r, rc);
    auto mine = x.narrow(comm.rank() * rows, rows);
    auto y = sync.forward(mine, sc);
    auto dx = sync.backward(r.narrow(comm.rank() * rows, rows), sc);
    CHECK(max_abs_diff(y, y_ref.narrow(comm.rank() * rows, rows)) < 1e-12);
    CHECK(max_abs_diff(dx, dx_ref.narrow(comm.rank() * rows, rows)) < 1e-12);
    // Each rank's parameter gradients are its own part; their sum is the global one.
    for (auto* g : {&sync.weight()->grad, &sync.bias()->grad}) comm.all_reduce(*g, dist::ReduceOp::Sum);
    CHECK(max_abs_diff(sync.weight()->grad, ref.weight()->grad) < 1e-12);
    CHECK(max_abs_diff(sync.bias()->grad, ref.bias()->grad) < 1e-12);
    CHECK(max_abs_diff(*sync.running_mean(), *ref.running_mean()) < 1e-14);
    CHECK(max_abs_diff(*sync.running_var(), *ref.running_var()) < 1e-14);
  }
  CHECK(sync.num_batches_tracked()->data()[0] == 2);
}

namespace {
constexpr std::int64_t kSide = 8, kClasses = 5, kRowsPerRank = 4;

// The CNN runs in double: each engine sums the batch statistics and gradients in another
// order than one process (per-rank partial sums, all-reduced), and two AdamW steps (eps
// 1e-8, scale-free: m / (sqrt(v) + eps)) turn the last-bit differences of near-zero float
// gradients into parameter differences of up to lr = 1e-2, which depend on the processor's
// vector width. In double the rounding is 2^-29 of float's, so parameters and running
// statistics agree to ~1e-13 relative (the model of test_pipeline.cpp's kDoubleTol); 1e-9
// leaves four orders of margin, and statistics over one rank's rows instead of the global
// batch, or a lost gradient, are off by more than 1e-3.
constexpr double kDoubleTol = 1e-9;

std::shared_ptr<nn::CNN<double>> make_cnn(bool sync) {
  Generator g(11);
  return std::make_shared<nn::CNN<double>>(1, kSide, kSide, std::vector<std::int64_t>{3, 4}, kClasses, sync, g);
}

struct Batch {
  Tensor<double> x;
  Tensor<std::int32_t> y;
};
Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  Batch b{Tensor<double>::empty({rows, kSide * kSide}), Tensor<std::int32_t>::empty({rows})};
  for (std::int64_t i = 0; i < b.x.numel(); ++i) b.x.data()[i] = g.uniform() * 2 - 1;
  for (std::int64_t i = 0; i < rows; ++i) b.y.data()[i] = static_cast<std::int32_t>(g.below(kClasses));
  return b;
}

// Two AdamW steps on the global batch (the engine's rank takes its rows).
void train(parallel::Engine<double>& e, int world_size) {
  optim::AdamW<double> opt(e.parameters(), {.lr = 0.01});
  dist::Communicator* dp = e.data_parallel_group();
  const std::int64_t parts = dp ? dp->size() : 1, part = dp ? dp->rank() : 0;
  for (std::uint64_t s = 0; s < 2; ++s) {
    const Batch global = make_batch(kRowsPerRank * world_size, 50 + s);
    const std::int64_t rows = global.x.size(0) / parts;
    e.zero_grad();
    e.forward_backward(global.x.narrow(part * rows, rows), global.y.narrow(part * rows, rows));
    e.step(opt);
  }
}

std::map<std::string, std::vector<double>> parameters_and_buffers(nn::Module<double>& m) {
  std::map<std::string, std::vector<double>> out;
  for (auto& p : m.named_parameters()) out[p.name] = p.param->value.to_vector();
  for (auto& b : m.named_buffers()) out[b.name] = b.buffer->to_vector();
  return out;
}
}  // namespace

TEST_CASE("A CNN with SyncBatchNorm under DDP, FSDP and a pipeline trains as BatchNorm on one process",
          "[dist][sync_batch_norm]") {
  const int n = world().size();
  auto ref_model = make_cnn(false);
  parallel::Local<double> ref(*ref_model);
  train(ref, n);
  const auto want = parameters_and_buffers(*ref_model);

  const std::vector<std::pair<std::string, parallel::Plan<double>>> plans = {
      {"ddp", parallel::DDPOptions{.first_bucket_bytes = 64}},
      {"fsdp full_shard", parallel::FSDPOptions{.strategy = parallel::ShardingStrategy::FullShard}},
      // One micro-batch: a stage's statistics then span its replicas' whole batch.
      {"pipeline", parallel::PipelinePlan<double>{.stages = n % 2 == 0 ? 2 : n, .options = {.micro_batches = 1}}},
  };
  for (const auto& [name, plan] : plans) {
    INFO(name);
    auto model = make_cnn(true);
    auto engine = parallel::make_engine<double>(model, world(), plan);
    train(*engine, n);
    // The trained model, gathered into one process through a checkpoint of the engine's mode.
    const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_syncbn_" + std::to_string(name.size()) + "_");
    if (world().rank() == 0) std::filesystem::remove_all(dir);
    world().barrier();
    {
      ckpt::CheckpointManager mgr(dir, &engine->communicator());
      ckpt::save(mgr, 2, *engine, nullptr);
    }
    auto loaded = make_cnn(false);
    parallel::Local<double> local(*loaded);
    ckpt::CheckpointManager reader(dir, &local.communicator());
    ckpt::load(reader, reader.latest().path, local);
    const auto got = parameters_and_buffers(*loaded);
    CHECK(got.size() == want.size());
    for (const auto& [k, v] : want) {
      INFO(k);
      REQUIRE(got.count(k));
      double d = 0, scale = 1e-3;
      for (std::size_t i = 0; i < v.size(); ++i) {
        d = std::max(d, std::abs(static_cast<double>(v[i]) - got.at(k)[i]));
        scale = std::max(scale, std::abs(static_cast<double>(v[i])));
      }
      CHECK(d / scale < kDoubleTol);
    }
    CHECK(got.at("2.num_batches_tracked")[0] == 2.0);
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
}

}  // namespace test_sync_batch_norm
