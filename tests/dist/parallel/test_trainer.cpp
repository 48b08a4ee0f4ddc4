// train::Trainer against one process: W ranks with batch B per rank take, at
// every step, the samples that one process with batch B W takes (positions
// [k B W, (k + 1) B W) of the epoch order, Note [Sampler reshape]), so both end
// with the same parameters. Interrupted runs (an exception, a signal) resume to
// the uninterrupted run's parameters bit for bit.
#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/train/trainer.hpp>

#include "dist/world.hpp"
#include "unit/data/instruct_fixtures.hpp"
#include "unit/raw_files.hpp"
#include "unit/train/masked_loss.hpp"

namespace test_trainer {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// In double: W ranks add their gradients in another order than one process, and ten
// AdamW steps (lr / eps = 2e4) turn the float rounding of near-zero gradients into
// parameter differences near 1e-5 relative that depend on the vector width. In double
// that is ~1e-12: kTol = 1e-9 holds anywhere, while a step on the wrong samples or a
// missing reduction moves the parameters by more than 1e-3.
using Real = double;
constexpr double kTol = 1e-9;

constexpr std::int64_t kIn = 6, kOut = 4, kBatch = 4;

TensorDataset<Real> make_data(std::int64_t n) {
  Generator g(21);
  auto x = Tensor<Real>::empty({n, kIn});
  auto y = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n * kIn; ++i) x.data()[i] = static_cast<Real>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < n; ++i) y.data()[i] = static_cast<std::int32_t>(g.below(kOut));
  return TensorDataset<Real>(x, y);
}

struct Run {
  std::unique_ptr<parallel::Engine<Real>> engine;
  std::unique_ptr<optim::AdamW<Real>> opt;
  std::unique_ptr<train::Trainer<Real>> trainer;
};

// A Trainer over `plan` with batch `batch` per data-parallel rank (2 epochs, accumulation 2, clipping).
// `comm` defaults to the world; a dist::SelfCommunicator makes a world of one.
Run make_run(const parallel::Plan<Real>& plan, Dataset<Real>& data, std::int64_t batch,
             std::string dir = {}, std::int64_t every = 0, dist::Communicator* comm = nullptr) {
  Generator g(5);
  auto model = std::make_shared<nn::MLP<Real>>(kIn, std::vector<std::int64_t>{8}, kOut, nn::Activation::ReLU, g);
  Run r;
  r.engine = parallel::make_engine<Real>(model, comm ? *comm : world(), plan);
  r.opt = std::make_unique<optim::AdamW<Real>>(r.engine->parameters(), optim::AdamWOptions{.lr = 0.02, .eps = 1e-6});
  r.trainer = std::make_unique<train::Trainer<Real>>(
      *r.engine, *r.opt, data,
      train::TrainerOptions{.epochs = 2, .batch = batch, .grad_accum = 2, .grad_clip = 0.5, .seed = 9,
                            .log_every = 0, .checkpoint_dir = std::move(dir), .checkpoint_every = every,
                            .preempt_exit_code = 75});
  r.trainer->schedule = optim::WarmupCosine{.base_lr = 0.02, .warmup = 2, .total = r.trainer->total_steps()};
  return r;
}

// The whole model's parameters in one process, read back from a checkpoint of `run`.
std::vector<Real> parameters_of(Run& run, const std::filesystem::path& dir) {
  if (run.engine->communicator().rank() == 0) std::filesystem::remove_all(dir);
  run.engine->communicator().barrier();
  {
    ckpt::CheckpointManager mgr(dir, &run.engine->communicator());
    ckpt::save(mgr, 0, *run.engine, run.opt.get());
  }
  Generator g(5);
  nn::MLP<Real> back(kIn, {8}, kOut, nn::Activation::ReLU, g);
  nn::FlatParameters<Real> p(back);
  ckpt::CheckpointManager reader(dir);
  reader.load(reader.latest().path, p);
  return p.values().to_vector();
}

}  // namespace

TEST_CASE("Trainer on W ranks equals one process with W times the batch", "[trainer]") {
  auto& comm = world();
  const int n = comm.size();
  auto data = make_data(kBatch * n * 5);  // 5 full steps per epoch on every world size
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_trainer_");

  auto one = make_run(parallel::LocalOptions{}, data, kBatch * n);
  const auto done = one.trainer->run();
  CHECK(done.step == 10);
  const auto want = parameters_of(one, dir / ("local" + std::to_string(comm.rank())));  // a world of one per rank

  for (const auto& [name, plan] :
       std::vector<std::pair<std::string, parallel::Plan<Real>>>{{"ddp", parallel::DDPOptions{}},
                                                                  {"fsdp", parallel::FSDPOptions{}}}) {
    INFO(name << " on " << n << " ranks");
    auto r = make_run(plan, data, kBatch);
    CHECK(r.trainer->total_steps() == 10);
    const auto res = r.trainer->run();
    CHECK(res.step == 10);
    CHECK_FALSE(res.preempted);
    const auto got = parameters_of(r, dir / name);
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
      scale = std::max(scale, std::abs(static_cast<double>(want[i])));
    }
    CHECK(diff / scale < kTol);
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Trainer resumes bit for bit after an exception and after a signal", "[trainer][resume]") {
  auto& comm = world();
  const int n = comm.size();
  auto data = make_data(kBatch * n * 5);
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_trainer_resume_");
  auto whole = make_run(parallel::DDPOptions{}, data, kBatch);
  whole.trainer->run();
  const auto want = parameters_of(whole, dir / "whole");

  // Killed (an exception on every rank) at step 7, after the checkpoint of step 6.
  const auto ckpt = dir / "ckpt";
  if (comm.rank() == 0) std::filesystem::remove_all(ckpt);
  comm.barrier();
  {
    auto r = make_run(parallel::DDPOptions{}, data, kBatch, ckpt.string(), 3);
    r.trainer->on_step = [](const train::StepInfo& s) {
      if (s.step == 7) throw std::runtime_error("killed");
    };
    CHECK_THROWS_WITH(r.trainer->run(), "killed");
  }
  // A signal to rank 0 at step 8: every rank stops at the same step, saves and returns 75.
  {
    auto r = make_run(parallel::DDPOptions{}, data, kBatch, ckpt.string(), 3);
    r.trainer->on_step = [&](const train::StepInfo& s) {
      if (s.step == 8 && comm.rank() == 0) std::raise(SIGUSR1);
    };
    const auto res = r.trainer->run();
    CHECK(res.preempted);
    CHECK(res.exit_code == 75);
    CHECK(res.step == 8);
  }
  // The rest of the run.
  auto r = make_run(parallel::DDPOptions{}, data, kBatch, ckpt.string(), 3);
  const auto res = r.trainer->run();
  CHECK(res.step == 10);
  CHECK(parameters_of(r, dir / "resumed") == want);
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

// make_run's schedule, written out: warmup 2, cosine to 0 at `total`.
double schedule_lr(std::int64_t step, std::int64_t total) {
  if (step < 2) return 0.02 * static_cast<double>(step + 1) / 2;
  return 0.01 * (1 + std::cos(3.141592653589793 * static_cast<double>(step - 2) / static_cast<double>(total - 2)));
}

// Issue 35, case 1: a checkpoint of one process resumed on W ranks (steps
// renumbered down: its later saves must replace the checkpoint it came from),
// and one of W ranks resumed by one process. The step, the schedule's position
// and the end of training follow the new world size (Note [Trainer steps]); the
// W-rank continuation equals one process with batch B W resumed from the same checkpoint.
TEST_CASE("Trainer resumed on another world size keeps the schedule", "[trainer][resume][reshape]") {
  auto& comm = world();
  const int n = comm.size();
  auto data = make_data(kBatch * n * 5);  // 2 epochs: 10 n steps on one process, 10 on n ranks
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_trainer_reshape_");
  const auto ckpt = dir / "one_to_n", copy = dir / "one_to_n_copy";
  dist::SelfCommunicator self;
  if (comm.rank() == 0) {  // one process: checkpoint of step 8 n (epoch 2, 3 n of 5 n steps), killed after it
    std::filesystem::remove_all(dir);
    auto r = make_run(parallel::LocalOptions{}, data, kBatch, ckpt.string(), 8 * n, &self);
    r.trainer->on_step = [&](const train::StepInfo& s) {
      if (s.step == 8 * n + 1) throw std::runtime_error("killed");
    };
    CHECK_THROWS_WITH(r.trainer->run(), "killed");
    std::filesystem::copy(ckpt, copy, std::filesystem::copy_options::recursive);
  }
  comm.barrier();

  std::vector<train::StepInfo> seen;
  auto on_n = make_run(parallel::DDPOptions{}, data, kBatch, ckpt.string(), 1);  // a save after every step
  on_n.trainer->on_step = [&](const train::StepInfo& s) { seen.push_back(s); };
  const auto res = on_n.trainer->run();
  CHECK(res.step == 10);
  REQUIRE(seen.size() == 2);  // steps 9 and 10 of 10 (8 n samples per rank of the old run = 8 steps here)
  CHECK(seen[0].step == 9);
  CHECK(seen[0].epoch == 2);
  CHECK(seen[0].lr == Approx(schedule_lr(8, 10)).epsilon(1e-12));
  CHECK(seen[1].lr == Approx(schedule_lr(9, 10)).epsilon(1e-12));
  comm.barrier();
  if (comm.rank() == 0) {
    ckpt::CheckpointManager mgr(ckpt);
    CHECK(mgr.latest().step == 10);  // the old step-8n checkpoint is gone, not the newest
    CHECK_FALSE(std::filesystem::exists(mgr.step_path(8 * n)));
  }
  const auto got = parameters_of(on_n, dir / "n");
  std::vector<Real> want;
  if (comm.rank() == 0) {
    auto big = make_run(parallel::LocalOptions{}, data, kBatch * n, copy.string(), 0, &self);
    CHECK(big.trainer->run().step == 10);
    want = parameters_of(big, dir / "big");
  }
  comm.barrier();
  if (comm.rank() == 0) {
    REQUIRE(want.size() == got.size());
    double diff = 0, scale = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
      scale = std::max(scale, std::abs(static_cast<double>(want[i])));
    }
    CHECK(diff / scale < kTol);
  }

  // n ranks: checkpoint of step 3 (3 B samples per rank), killed after it; one process resumes at step 3 n.
  const auto back = dir / "n_to_one";
  {
    auto r = make_run(parallel::DDPOptions{}, data, kBatch, back.string(), 3);
    r.trainer->on_step = [](const train::StepInfo& s) {
      if (s.step == 4) throw std::runtime_error("killed");
    };
    CHECK_THROWS_WITH(r.trainer->run(), "killed");
  }
  comm.barrier();
  if (comm.rank() == 0) {
    std::vector<train::StepInfo> one_seen;
    auto one = make_run(parallel::LocalOptions{}, data, kBatch, back.string(), 0, &self);
    one.trainer->on_step = [&](const train::StepInfo& s) { one_seen.push_back(s); };
    CHECK(one.trainer->run().step == 10 * n);
    REQUIRE(one_seen.size() == static_cast<std::size_t>(7 * n));
    CHECK(one_seen.front().step == 3 * n + 1);
    CHECK(one_seen.front().lr == Approx(schedule_lr(3 * n, 10 * n)).epsilon(1e-12));
    CHECK(one_seen.back().lr == Approx(schedule_lr(10 * n - 1, 10 * n)).epsilon(1e-12));
  }
  comm.barrier();

  // Issue 44: one process's checkpoint of an odd step (8 n + 1) resumed on n ranks
  // stands between two of their steps (3 n + 1 batches of one process are 3 + 1/n of
  // theirs); the run still ends on step 10, where the schedule ends, not one later.
  const auto odd = dir / "odd";
  if (comm.rank() == 0) {
    auto r = make_run(parallel::LocalOptions{}, data, kBatch, odd.string(), 8 * n + 1, &self);
    r.trainer->on_step = [&](const train::StepInfo& s) {
      if (s.step == 8 * n + 2) throw std::runtime_error("killed");
    };
    CHECK_THROWS_WITH(r.trainer->run(), "killed");
  }
  comm.barrier();
  {
    std::vector<train::StepInfo> odd_seen;
    auto r = make_run(parallel::DDPOptions{}, data, kBatch, odd.string(), 0);
    r.trainer->on_step = [&](const train::StepInfo& s) { odd_seen.push_back(s); };
    CHECK(r.trainer->run().step == 10);
    REQUIRE_FALSE(odd_seen.empty());
    CHECK(odd_seen.back().step == 10);
    CHECK(odd_seen.back().epoch == 2);
    CHECK(odd_seen.back().lr == Approx(schedule_lr(9, 10)).epsilon(1e-12));
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

// Note [Token-weighted loss] on W ranks: each rank takes 2 instruction rows whose
// answers differ in length, in 2 micro-batches; one SGD step of lr 1 under DDP and
// FSDP moves the parameters by the gradient of the mean over every answer token of
// the 2 W rows, which one process computes over the whole batch and PyTorch
// (masked_loss_reference.py) on the same ids and targets; the loss averaged over the
// ranks is that mean.
TEST_CASE("Trainer's masked loss on W ranks is the token-weighted mean of one process and of PyTorch",
          "[trainer][masked]") {
  auto& comm = world();
  const int n = comm.size();
  const std::filesystem::path tok_path = test::tiny_tokenizer("dist_masked");  // one per process (the name holds the pid)
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  std::string lines;
  for (int i = 0; i < 2 * n; ++i)
    lines += "{\"prompt\": \"q" + std::to_string(i) + "\", \"completion\": \"" + std::string((i * 7) % 11 + 1, 'a' + i % 26) +
             "\"}\n";
  const std::filesystem::path file = test::instruct_file("dist_masked", lines);
  InstructDataset<double> data(file.string(), tok, {.seq_len = 40, .layout = InstructLayout::Padded});
  REQUIRE(data.size() == 2 * n);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(2 * n));
  for (int i = 0; i < 2 * n; ++i) rows[static_cast<std::size_t>(i)] = i;
  const Batch<double> all = data.get(rows);
  const std::int64_t V = tok.vocab_size(), D = 3;

  dist::SelfCommunicator self;
  auto one_model = test::bigram(V, D);
  auto one = parallel::make_engine<double>(one_model, self, parallel::LocalOptions{});
  const std::vector<double> before = one->parameters().values().to_vector();
  one->zero_grad();
  const double whole = one->forward_backward(all.ids, all.targets.ids(), 1.0);
  const std::vector<double> want = one->parameters().grads().to_vector();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_trainer_masked_");

  for (const auto& [name, plan] :
       std::vector<std::pair<std::string, parallel::Plan<double>>>{{"ddp", parallel::DDPOptions{}},
                                                                    {"fsdp", parallel::FSDPOptions{}}}) {
    INFO(name << " on " << n << " ranks");
    auto engine = parallel::make_engine<double>(test::bigram(V, D), comm, plan);
    optim::SGD<double> sgd(engine->parameters(), {.lr = 1.0});
    train::Trainer<double> trainer(*engine, sgd, data, {.batch = 2, .grad_accum = 2, .log_every = 0});
    const double loss = engine->average(trainer.step(data.get({2 * comm.rank(), 2 * comm.rank() + 1})));
    CHECK(std::abs(loss - whole) <= 1e-12);
    // The parameters after the step, gathered through a checkpoint.
    if (comm.rank() == 0) std::filesystem::remove_all(dir / name);
    comm.barrier();
    {
      ckpt::CheckpointManager mgr(dir / name, &comm);
      ckpt::save(mgr, 0, *engine, &sgd);
    }
    auto back = test::bigram(V, D);
    nn::FlatParameters<double> p(*back);
    ckpt::CheckpointManager reader(dir / name);
    reader.load(reader.latest().path, p);
    const std::vector<double> after = p.values().to_vector();
    std::vector<double> step(after.size());
    for (std::size_t i = 0; i < after.size(); ++i) step[i] = before[i] - after[i];
    CHECK(test::max_abs_diff(step, want) <= 1e-12);
  }
  if (comm.rank() == 0) {
    REQUIRE(ptrain::testing::torch_available());
    const test::TorchMaskedLoss torch = test::torch_masked_loss(all.ids, all.targets.ids(), *one_model);
    CHECK(std::abs(torch.loss - whole) <= 1e-12);
    CHECK(test::max_abs_diff(torch.grads, want) <= 1e-12);
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
  std::filesystem::remove(file);
  std::filesystem::remove(tok_path);
}

}  // namespace test_trainer
