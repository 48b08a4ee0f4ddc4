// The training contract (parallel/engine.hpp): a loop that calls only
// zero_grad / forward_backward / clip_grad_norm_ / step gives, in every mode,
// the parameters of one process training on the global batch; a checkpoint of
// every mode loads into one process and into every other mode.
// Every rank runs every test case in the same order; checks use CHECK so no
// rank skips collectives.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_engine {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// In double: the engines add the ranks' and micro-batches' gradients in other orders than
// one process, and under AdamW (lr / eps = 1e4) the float rounding of near-zero gradients
// becomes parameter differences of ~1e-5 relative that depend on the vector width. In
// double that is ~1e-13, so kTol = 1e-9 holds anywhere, while a wrong shard, a missing
// reduction or a lost micro-batch moves parameters and norms by more than 1e-3.
using Real = double;
constexpr double kTol = 1e-9;

constexpr std::int64_t kIn = 7, kOut = 5;
const std::vector<std::int64_t> kHidden = {6, 9};
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
constexpr double kClip = 0.05;  // small enough to clip every step

std::shared_ptr<nn::MLP<Real>> make_mlp() {
  Generator g(3);
  return std::make_shared<nn::MLP<Real>>(kIn, kHidden, kOut, nn::Activation::ReLU, g);
}

struct Batch {
  Tensor<Real> x;
  Tensor<std::int32_t> y;
};
Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  Batch b{Tensor<Real>::empty({rows, kIn}), Tensor<std::int32_t>::empty({rows})};
  for (std::int64_t i = 0; i < rows * kIn; ++i) b.x.data()[i] = static_cast<Real>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < rows; ++i) b.y.data()[i] = static_cast<std::int32_t>(g.below(kOut));
  return b;
}

// Every way to spread the MLP (5 units: Linear ReLU Linear ReLU Linear) over the world.
std::vector<std::pair<std::string, parallel::Plan<Real>>> plans() {
  const int n = world().size();
  using S = parallel::ShardingStrategy;
  std::vector<std::pair<std::string, parallel::Plan<Real>>> p = {
      {"local", parallel::LocalOptions{}},
      {"ddp", parallel::DDPOptions{.first_bucket_bytes = 64}},
      {"fsdp full_shard", parallel::FSDPOptions{.strategy = S::FullShard}},
      {"fsdp shard_grad_op", parallel::FSDPOptions{.strategy = S::ShardGradOp}},
      {"fsdp shard_optimizer", parallel::FSDPOptions{.strategy = S::ShardOptimizer}},
      {"fsdp no_shard", parallel::FSDPOptions{.strategy = S::NoShard}},
      {"fsdp hybrid", parallel::FSDPOptions{.strategy = S::Hybrid, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n}},
  };
  // 2 stages (x n/2 replicas) on an even world, n stages otherwise; each stage holds a Linear.
  p.push_back({"pipeline", parallel::PipelinePlan<Real>{.stages = n % 2 == 0 ? 2 : n,
                                                          .unit_costs = {1, 0, 1, 0, 1},
                                                          .options = {.micro_batches = 2}}});
  return p;
}

// What this rank trains on: its data-parallel shard of the global batch.
Batch shard(const Batch& global, parallel::Engine<Real>& e) {
  dist::Communicator* dp = e.data_parallel_group();
  const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, rows = global.x.size(0) / n;
  return {global.x.narrow(r * rows, rows), global.y.narrow(r * rows, rows)};
}

// The reference: one process, the global batch, plain forward/backward.
struct Reference {
  std::shared_ptr<nn::MLP<Real>> model = make_mlp();
  nn::FlatParameters<Real> params{*model};
  optim::AdamW<Real> opt{params, kAdam};
  std::vector<double> norms;

  void step(const Batch& b) {
    nn::CrossEntropyLoss<Real> ce;
    nn::Cache<Real> c, lc;
    params.zero_grad();
    ce.forward(model->forward(b.x, c), b.y, lc);
    model->backward(ce.backward(lc), c);
    norms.push_back(optim::clip_grad_norm_(params.grads(), kClip));
    opt.step();
  }
};

constexpr std::int64_t kRowsPerRank = 4, kSteps = 3;

// The engine's run of kSteps steps (accum micro-batches each; the ones before the
// last inside no_sync()); returns the clipped norms.
std::vector<double> train(parallel::Engine<Real>& e, optim::Optimizer<Real>& opt, int accum, int world_size) {
  std::vector<double> norms;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const Batch global = make_batch(kRowsPerRank * world_size, 100 + static_cast<std::uint64_t>(s));
    const Batch mine = shard(global, e);
    const std::int64_t rows = mine.x.size(0) / accum;
    e.zero_grad();
    for (int j = 0; j < accum; ++j) {
      auto x = mine.x.narrow(j * rows, rows);
      auto y = mine.y.narrow(j * rows, rows);
      if (j + 1 < accum) {
        auto guard = e.no_sync();
        e.forward_backward(x, y, 1.0 / accum);
      } else {
        e.forward_backward(x, y, 1.0 / accum);
      }
    }
    norms.push_back(e.clip_grad_norm_(kClip));
    e.step(opt);
  }
  return norms;
}

// Where `e` saves: one directory for the ranks of its world; a Local engine on
// several ranks is a world of one per rank, so each gets its own.
std::filesystem::path save_dir(const std::filesystem::path& base, parallel::Engine<Real>& e) {
  if (e.communicator().size() == world().size()) return base;
  return base.string() + ".rank" + std::to_string(world().rank());
}

// An empty `path` (removed by the ranks that share it), once every rank got here.
void fresh(const std::filesystem::path& path, parallel::Engine<Real>& e) {
  if (e.communicator().rank() == 0) std::filesystem::remove_all(path);
  world().barrier();
}

double max_rel_error(nn::FlatParameters<Real>& a, nn::FlatParameters<Real>& b) {
  const auto va = a.values().to_vector(), vb = b.values().to_vector();
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(va[i]) - vb[i]));
    scale = std::max(scale, std::abs(static_cast<double>(vb[i])));
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("Every engine trains like one process on the global batch, with accumulation and clipping",
          "[engine]") {
  auto& comm = world();
  const int n = comm.size();
  // Modes that see n shards of the data train on the global batch of n x kRowsPerRank rows;
  // Local sees all of its rows itself, so its reference is the same.
  Reference ref;
  for (std::int64_t s = 0; s < kSteps; ++s) ref.step(make_batch(kRowsPerRank * n, 100 + static_cast<std::uint64_t>(s)));

  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_engine_");
  for (const auto& [name, plan] : plans()) {
    for (int accum : {1, 2}) {
      INFO(name << ", " << accum << " micro-batch(es) per step, " << n << " ranks");
      auto engine = parallel::make_engine<Real>(make_mlp(), comm, plan);
      optim::AdamW<Real> opt(engine->parameters(), kAdam);
      const auto norms = train(*engine, opt, accum, n);
      for (std::size_t s = 0; s < norms.size(); ++s) CHECK(norms[s] == Approx(ref.norms[s]).epsilon(kTol));

      // The checkpoint of this mode, loaded into one process, holds the reference's parameters.
      const auto where = save_dir(dir / name, *engine);
      fresh(where, *engine);
      ckpt::CheckpointManager mgr(where, &engine->communicator());
      ckpt::save(mgr, kSteps, *engine, &opt, {});
      auto back = make_mlp();
      nn::FlatParameters<Real> back_p(*back);
      optim::AdamW<Real> back_opt(back_p, kAdam);
      ckpt::CheckpointManager reader(where);
      reader.load(reader.latest().path, back_p, &back_opt);
      CHECK(max_rel_error(back_p, ref.params) < kTol);
      CHECK(back_opt.steps() == kSteps);
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("A checkpoint of every engine resumes in every other engine", "[engine][ckpt]") {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_engine_resume_");
  Reference ref;
  for (std::int64_t s = 0; s < kSteps; ++s) ref.step(make_batch(kRowsPerRank * n, 100 + static_cast<std::uint64_t>(s)));
  for (const auto& [from, from_plan] : plans()) {
    // Train and save in `from`...
    std::filesystem::path saved;
    {
      auto e = parallel::make_engine<Real>(make_mlp(), comm, from_plan);
      saved = save_dir(dir / from, *e);
      fresh(saved, *e);
      optim::AdamW<Real> opt(e->parameters(), kAdam);
      train(*e, opt, 1, n);
      ckpt::CheckpointManager mgr(saved, &e->communicator());
      ckpt::save(mgr, kSteps, *e, &opt, {});
    }
    comm.barrier();
    // ...load into every mode: the parameters, read back through its own checkpoint, are the reference's.
    for (const auto& [to, to_plan] : plans()) {
      INFO(from << " -> " << to);
      auto e = parallel::make_engine<Real>(make_mlp(), comm, to_plan);
      optim::AdamW<Real> opt(e->parameters(), kAdam);
      ckpt::CheckpointManager mgr(saved, &e->communicator());
      const auto state = ckpt::load(mgr, mgr.latest().path, *e, &opt);
      CHECK(state.step == kSteps);
      CHECK(opt.steps() == kSteps);
      const auto again = save_dir(dir / (from + ".to." + to), *e);
      fresh(again, *e);
      ckpt::CheckpointManager out(again, &e->communicator());
      ckpt::save(out, kSteps, *e, &opt, {});
      auto back = make_mlp();
      nn::FlatParameters<Real> back_p(*back);
      ckpt::CheckpointManager reader(again);
      reader.load(reader.latest().path, back_p);
      CHECK(max_rel_error(back_p, ref.params) < kTol);
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("A single process is a world of one", "[engine][self]") {
  dist::SelfCommunicator self;
  CHECK(self.size() == 1);
  CHECK(self.rank() == 0);
  float v[3] = {1, 2, 3}, out[3] = {};
  self.all_reduce(v, out, 3, DType::F32, dist::ReduceOp::Sum);
  CHECK(out[2] == 3);
  float gathered[3] = {};
  self.all_gather(v, gathered, 3, DType::F32);
  CHECK(gathered[1] == 2);
  CHECK_THROWS_AS(self.send(v, 3, DType::F32, 1), CommError);
  auto sub = self.split(0, 0);
  REQUIRE(sub != nullptr);
  CHECK(sub->size() == 1);
  CHECK(self.split(-1, 0) == nullptr);
}

}  // namespace test_engine
