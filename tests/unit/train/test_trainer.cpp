// train::Trainer in one process (a world of one): the metrics window after a
// resume, and the start-up decision when every checkpoint is corrupt (issue 35,
// cases 3 and 5). Resume across world sizes is tested with real ranks in
// tests/dist/parallel/test_trainer.cpp.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>
#include <unistd.h>

#include <ptrain/ckpt/sampler_state.hpp>
#include <ptrain/data/sampler.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/nn/moe.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/train/trainer.hpp>

#include "unit/data/instruct_fixtures.hpp"
#include "unit/raw_files.hpp"
#include "unit/train/masked_loss.hpp"

namespace test_trainer {

using namespace ptrain;
namespace fs = std::filesystem;

namespace {

constexpr std::int64_t kBatch = 4;

TensorDataset<float> make_data(std::int64_t n) {
  Generator g(3);
  auto x = Tensor<float>::empty({n, 5});
  auto y = Tensor<std::int32_t>::empty({n});
  for (std::int64_t i = 0; i < n * 5; ++i) x.data()[i] = static_cast<float>(g.uniform() * 2 - 1);
  for (std::int64_t i = 0; i < n; ++i) y.data()[i] = static_cast<std::int32_t>(g.below(3));
  return TensorDataset<float>(x, y);
}

struct Run {
  dist::SelfCommunicator self;
  std::unique_ptr<parallel::Engine<float>> engine;
  std::unique_ptr<optim::AdamW<float>> opt;
  std::unique_ptr<train::Trainer<float>> trainer;

  Run(Dataset<float>& data, train::TrainerOptions o) {
    Generator g(8);
    auto model = std::make_shared<nn::MLP<float>>(5, std::vector<std::int64_t>{6}, 3, nn::Activation::ReLU, g);
    engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
    opt = std::make_unique<optim::AdamW<float>>(engine->parameters(), optim::AdamWOptions{.lr = 0.01});
    o.batch = kBatch;
    trainer = std::make_unique<train::Trainer<float>>(*engine, *opt, data, std::move(o));
  }
};

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + std::to_string(::getpid()));
  fs::remove_all(d);
  return d;
}

std::vector<nlohmann::json> read_lines(const fs::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) v.push_back(nlohmann::json::parse(line));
  return v;
}

}  // namespace

TEST_CASE("Trainer: the first metrics window after a resume holds only the steps run since", "[train][trainer]") {
  const fs::path dir = fresh_dir("ptrain_trainer_window_");
  auto data = make_data(kBatch * 10);  // 10 steps
  const std::string metrics = (dir / "m.jsonl").string();
  fs::create_directories(dir);
  train::TrainerOptions o{.log_every = 4, .metrics = metrics, .checkpoint_dir = (dir / "ckpt").string(),
                          .checkpoint_every = 6};
  {
    Run first(data, o);
    first.trainer->on_step = [](const train::StepInfo& s) {
      if (s.step == 7) throw std::runtime_error("killed");
    };
    CHECK_THROWS_WITH(first.trainer->run(), "killed");
  }
  // Resumed at step 6: the first record (step 8) covers steps 7 and 8 only.
  Run again(data, o);
  // When each on_step call began and ended, in seconds since just before run().
  std::vector<double> losses, entered, left;
  const auto t0 = std::chrono::steady_clock::now();
  auto since_t0 = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  again.trainer->on_step = [&](const train::StepInfo& s) {
    entered.push_back(since_t0());
    losses.push_back(s.loss);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // a window long enough to time
    left.push_back(since_t0());
  };
  CHECK(again.trainer->run().step == 10);
  REQUIRE(losses.size() == 4);

  const auto lines = read_lines(metrics);
  REQUIRE(lines.size() >= 2);
  const auto& rec = lines[lines.size() - 2];  // step 8; the last one is step 10
  REQUIRE(rec.at("step") == 8);
  CHECK(rec.at("loss").get<double>() == Approx((losses[0] + losses[1]) / 2).epsilon(1e-12));
  // samples_per_s is the window's 2 steps of kBatch samples over the window's time. That
  // window opened after t0 and before step 7 (on_step call 0), and closed after on_step
  // of step 8 (call 1) returned and before on_step of step 9 (call 2) began: its length
  // lies between those measured times, whatever the machine's load. A window that also
  // counted the steps before the resume would hold 8 steps' samples and fail this.
  const double sps = rec.at("samples_per_s").get<double>();
  REQUIRE(sps > 0);
  const double window_s = 2 * kBatch / sps;
  INFO("window " << window_s << " s; on_step calls at " << entered[0] << " .. " << left[1] << " .. " << entered[2]);
  CHECK(window_s >= (left[1] - entered[0]) * (1 - 1e-9));
  CHECK(window_s <= entered[2] * (1 + 1e-9));
  fs::remove_all(dir);
}

TEST_CASE("Trainer: every checkpoint corrupt refuses at start-up, start_over sets them aside", "[train][trainer]") {
  const fs::path dir = fresh_dir("ptrain_trainer_corrupt_");
  auto data = make_data(kBatch * 10);
  train::TrainerOptions o{.log_every = 0, .checkpoint_dir = dir.string(), .checkpoint_every = 4};
  {
    Run first(data, o);
    CHECK(first.trainer->run().step == 10);  // checkpoints of steps 4, 8 and 10
  }
  ckpt::CheckpointManager mgr(dir);
  std::vector<fs::path> corrupt;
  for (std::int64_t s : {4, 8, 10}) {
    const fs::path p = mgr.step_path(s);
    REQUIRE(fs::exists(p / "model.safetensors"));
    fs::resize_file(p / "model.safetensors", 20);
    corrupt.push_back(p);
  }

  int steps_run = 0;
  {
    Run refused(data, o);
    refused.trainer->on_step = [&](const train::StepInfo&) { ++steps_run; };
    try {
      refused.trainer->run();
      FAIL("run() did not refuse");
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      CHECK_THAT(what, Catch::Contains("[ptrain.ckpt.corrupt]"));
      for (const auto& p : corrupt) CHECK_THAT(what, Catch::Contains(p.string()));
    }
  }
  CHECK(steps_run == 0);  // refused before any training
  for (const auto& p : corrupt) CHECK(fs::exists(p));

  // A directory without a marker (a first save that never committed) is no checkpoint: no refusal.
  const fs::path fresh = fresh_dir("ptrain_trainer_uncommitted_");
  fs::create_directories(fresh / "step-00000003");
  train::TrainerOptions f = o;
  f.checkpoint_dir = fresh.string();
  {
    Run first_save_died(data, f);
    CHECK(first_save_died.trainer->run().step == 10);
  }
  CHECK_FALSE(fs::exists(fresh / "step-00000003"));
  fs::remove_all(fresh);

  o.start_over = true;
  Run over(data, o);
  CHECK(over.trainer->run().step == 10);
  CHECK(mgr.latest().step == 10);
  CHECK(mgr.latest().skipped.empty());
  for (const auto& p : corrupt) CHECK(fs::exists(p.parent_path() / ("corrupt-" + p.filename().string())));
  fs::remove_all(dir);
}

TEST_CASE("Trainer: a checkpoint directory that cannot be written is refused before the first step",
          "[train][trainer]") {
  const fs::path dir = fresh_dir("ptrain_trainer_unwritable_");
  fs::create_directories(dir);
  std::ofstream(dir / "a_file") << "not a directory";
  auto data = make_data(kBatch * 4);
  // Below a regular file nothing can be created, whoever runs the test (root included).
  train::TrainerOptions o{.log_every = 0, .checkpoint_dir = (dir / "a_file" / "ckpt").string()};
  int steps_run = 0;
  {
    Run refused(data, o);
    refused.trainer->on_step = [&](const train::StepInfo&) { ++steps_run; };
    CHECK_THROWS_WITH(refused.trainer->run(), Catch::Contains("[ptrain.ckpt.unwritable]") &&
                                                  Catch::Contains(o.checkpoint_dir) &&
                                                  Catch::Contains("choose a writable directory"));
  }
  CHECK(steps_run == 0);
  // A directory that does not exist yet is made, and training runs.
  o.checkpoint_dir = (dir / "new" / "ckpt").string();
  {
    Run fine(data, o);
    CHECK(fine.trainer->run().step == 4);
  }
  CHECK(fs::exists(dir / "new" / "ckpt" / "step-00000004"));
  for (auto& e : fs::directory_iterator(dir / "new" / "ckpt"))
    CHECK(e.path().filename().string().rfind(".write-probe", 0) != 0);  // the probe is gone
  fs::remove_all(dir);
}

// Note [Trainer steps]: a run saved after k steps on W ranks and resumed on M
// ranks (any of 1..8, odd k and odd sizes included) stands at resumed_step, and
// the batches the M-rank sampler then yields (counted here by drawing them, as
// run() does) end the epoch exactly on (epoch + 1) * steps_per_epoch(M); the
// same world size resumes at step k.
TEST_CASE("Trainer: a resume at any world size ends each epoch on its last step", "[train][trainer]") {
  std::int64_t cases = 0;
  for (const std::int64_t n : {97, 120, 1001})
    for (const std::int64_t batch : {1, 3, 8})
      for (const bool drop_last : {false, true})
        for (int w = 1; w <= 8; ++w)
          for (int m = 1; m <= 8; ++m) {
            DistributedSampler saved(n, 0, w, 5, true, drop_last);
            const std::int64_t per_epoch_w = num_batches(saved.num_samples(), batch, drop_last);
            for (std::int64_t k = 1; k < per_epoch_w; k += 2) {
              saved.set_epoch(1, k * batch);  // k steps into epoch 1 (0-based) on w ranks
              const ckpt::SamplerState st = ckpt::sampler_state(saved, w);
              DistributedSampler sampler(n, 0, m, 5, true, drop_last);
              ckpt::restore_sampler(sampler, st, m, /*allow_repeat=*/true);
              const std::int64_t per_epoch = num_batches(sampler.num_samples(), batch, drop_last);
              std::int64_t step =
                  train::resumed_step(1, per_epoch, sampler.num_samples(), sampler.position(), batch, drop_last);
              INFO("n " << n << " batch " << batch << " drop_last " << drop_last << " w " << w << " m " << m
                        << " k " << k << ": resumed at step " << step << " of " << per_epoch << " per epoch");
              REQUIRE(step >= per_epoch);
              if (m == w) REQUIRE(step == per_epoch + k);
              while (!sampler.epoch_done()) {
                if (static_cast<std::int64_t>(sampler.next(batch).size()) < batch && drop_last) break;
                ++step;
              }
              REQUIRE(step == 2 * per_epoch);
              ++cases;
            }
          }
  CHECK(cases > 10000);
}

TEST_CASE("Trainer: a model's named_metrics (an MoE layer's routing) join its records and TensorBoard",
          "[train][trainer][moe]") {
  const fs::path dir = fresh_dir("ptrain_trainer_moe_");
  fs::create_directories(dir);
  auto data = make_data(kBatch * 3);  // 3 steps
  Generator g(9);
  auto model = std::make_shared<nn::Sequential<float>>();
  const auto moe = model->add(std::make_shared<nn::MoE<float>>(
      nn::MoeConfig{.n_embd = 5, .num_experts = 3, .top_k = 2, .expert_hidden = 4, .capacity_factor = 0.7,
                    .aux_loss_coef = 0.1, .z_loss_coef = 0.01},
      g));
  model->add(std::make_shared<nn::Linear<float>>(5, 3, true, g));
  CHECK(model->named_metrics().empty());  // no forward yet
  dist::SelfCommunicator self;
  auto engine = parallel::make_engine<float>(model, self, parallel::LocalOptions{});
  optim::AdamW<float> opt(engine->parameters(), optim::AdamWOptions{.lr = 0.01});
  const std::string metrics = (dir / "m.jsonl").string();
  train::Trainer<float> trainer(*engine, opt, data,
                                {.batch = kBatch, .log_every = 1, .metrics = metrics,
                                 .tensorboard = (dir / "tb").string()});
  CHECK(trainer.run().step == 3);

  const auto lines = read_lines(metrics);
  REQUIRE(!lines.empty());
  const nlohmann::json& rec = lines.back();  // step 3: the forward that moe->stats() describes
  REQUIRE(rec.at("step") == 3);
  const nn::MoeStats& s = moe->stats();
  const std::string p = "0.";
  CHECK(rec.at(p + "aux_loss").get<double>() == s.aux_loss);
  CHECK(rec.at(p + "z_loss").get<double>() == s.z_loss);
  CHECK(rec.at(p + "moe_loss").get<double>() == s.loss);
  CHECK(rec.at(p + "moe_loss").get<double>() == Approx(0.1 * s.aux_loss + 0.01 * s.z_loss));
  CHECK(rec.at(p + "dropped").get<double>() == double(s.dropped));
  CHECK(s.dropped > 0);  // capacity ceil(0.7 * 4 * 2 / 3) = 2 of 8 slots over 3 experts
  CHECK(rec.at(p + "load_imbalance").get<double>() == s.max_load / s.mean_load);
  std::int64_t routed = 0;
  for (std::size_t e = 0; e < 3; ++e) {
    CHECK(rec.at(p + "tokens_per_expert." + std::to_string(e)).get<double>() == double(s.tokens_per_expert[e]));
    routed += s.tokens_per_expert[e];
  }
  CHECK(routed == kBatch * 2);
  CHECK(!rec.contains(p + "tokens_per_expert.3"));
  // The same names are TensorBoard scalars (the tags are plain bytes in the event records).
  std::string events;
  for (const auto& e : fs::directory_iterator(dir / "tb")) {
    std::ifstream in(e.path(), std::ios::binary);
    events += std::string((std::istreambuf_iterator<char>(in)), {});
  }
  CHECK(events.find("0.load_imbalance") != std::string::npos);
  CHECK(events.find("0.tokens_per_expert.2") != std::string::npos);
  fs::remove_all(dir);
}

// Note [MoE metrics window]: with gradient accumulation each record holds the routing of every
// micro-batch of every step since the previous record (a small Mixtral, dropless: each
// layer's counts add up to the window's tokens times top-k), not the last micro-batch's, and
// the evaluations between records add nothing.
TEST_CASE("Trainer: MoE metrics cover every micro-batch of the steps since the previous record",
          "[train][trainer][moe]") {
  constexpr std::int64_t kSeq = 6, kRows = 24, kTopK = 2;
  struct Tokens : Dataset<double> {
    Tensor<std::int32_t> ids = Tensor<std::int32_t>::empty({kRows, kSeq + 1});
    std::int64_t size() const override { return kRows; }
    Batch<double> get(const std::vector<std::int64_t>& idx) override {
      const auto n = static_cast<std::int64_t>(idx.size());
      Batch<double> b{{}, Tensor<std::int32_t>::empty({n, kSeq}), Tensor<std::int32_t>::empty({n, kSeq})};
      for (std::int64_t r = 0; r < n; ++r)
        for (std::int64_t t = 0; t < kSeq; ++t) {
          b.ids.data()[r * kSeq + t] = ids.data()[idx[std::size_t(r)] * (kSeq + 1) + t];
          b.targets.ids().data()[r * kSeq + t] = ids.data()[idx[std::size_t(r)] * (kSeq + 1) + t + 1];
        }
      return b;
    }
  } data;
  Generator gd(5);
  for (std::int64_t i = 0; i < data.ids.numel(); ++i) data.ids.data()[i] = static_cast<std::int32_t>(gd.below(11));
  nn::LlamaConfig c{.vocab_size = 11, .n_layer = 2, .n_head = 2, .n_kv_head = 1, .n_embd = 8, .intermediate_size = 12};
  c.num_experts = 4;
  c.top_k = kTopK;
  c.moe_intermediate_size = 6;
  c.moe_aux_loss_coef = 0.01;
  Generator g(7);
  auto model = std::make_shared<nn::Llama<double>>(c, g);
  const fs::path dir = fresh_dir("ptrain_trainer_moe_accum_");
  fs::create_directories(dir);
  dist::SelfCommunicator self;
  auto engine = parallel::make_engine<double>(model, self, parallel::LocalOptions{});
  optim::AdamW<double> opt(engine->parameters(), optim::AdamWOptions{.lr = 0.01});
  const std::string metrics = (dir / "m.jsonl").string();
  // 6 steps of 4 rows in 2 micro-batches each, a record every 3 steps, an evaluation every step.
  train::Trainer<double> trainer(*engine, opt, data,
                                 {.batch = 4, .grad_accum = 2, .log_every = 3, .eval_every = 1, .metrics = metrics});
  const Batch<double> held_out = data.get({0, 1, 2, 3, 4});
  trainer.evaluate = [&](parallel::Engine<double>& e) {
    return nlohmann::json{{"eval_loss", e.eval_loss(held_out.ids, held_out.targets)}};
  };
  CHECK(trainer.run().step == 6);
  CHECK(model->named_metrics().empty());  // the Trainer starts a new window after each record

  int records = 0;
  for (const nlohmann::json& rec : read_lines(metrics)) {
    if (!rec.contains("loss")) continue;  // an evaluation's record
    ++records;
    INFO("step " << rec.at("step"));
    for (int l = 0; l < 2; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".block_sparse_moe.";
      double routed = 0, most = 0;
      for (int e = 0; e < 4; ++e) {
        const double n = rec.at(p + "tokens_per_expert." + std::to_string(e)).get<double>();
        routed += n;
        most = std::max(most, n);
      }
      CHECK(routed == double(3 * 4 * kSeq * kTopK));  // 3 steps of 4 rows of kSeq tokens, k slots each
      CHECK(rec.at(p + "load_imbalance").get<double>() == Approx(most / (routed / 4)).epsilon(1e-15));
      CHECK(rec.at(p + "dropped").get<double>() == 0);
      CHECK(rec.at(p + "moe_loss").get<double>() == Approx(0.01 * rec.at(p + "aux_loss").get<double>()));
      CHECK(rec.at(p + "aux_loss").get<double>() >= 1.0);  // E sum_e f_e P_e >= 1, k when balanced
    }
  }
  CHECK(records == 2);
  fs::remove_all(dir);
}

// Note [Token-weighted loss]: instruction rows whose answers differ in length, in 2 and
// in 3 micro-batches, give the loss and gradients of one process over the whole batch
// (the mean over every answer token), and PyTorch's on the same ids and targets.
TEST_CASE("Trainer: the masked loss over micro-batches is the token-weighted mean of the whole batch and PyTorch's",
          "[train][trainer][masked]") {
  if (!testing::torch_available())
    FAIL("/usr/bin/python3 cannot import torch: run tools/install-deps.sh --test (it installs python3-torch)");
  const fs::path tok_path = test::tiny_tokenizer("trainer_masked");
  const Tokenizer tok = Tokenizer::load(tok_path.string());
  InstructDataset<double> data(test::instruct_file("trainer_masked").string(), tok,
                               {.seq_len = 64, .layout = InstructLayout::Padded});
  REQUIRE(data.size() == 6);
  const Batch<double> batch = data.get({0, 1, 2, 3, 4, 5});
  const Tensor<std::int32_t> targets = batch.targets.ids();

  dist::SelfCommunicator self;
  auto model = test::bigram(tok.vocab_size(), 3);
  auto engine = parallel::make_engine<double>(model, self, parallel::LocalOptions{});
  // One process over the whole batch: the mean over its counted targets.
  engine->zero_grad();
  const double whole = engine->forward_backward(batch.ids, targets, 1.0);
  const std::vector<double> want = engine->parameters().grads().to_vector();
  // The mean of the micro-batch means is another number: the test tells the two apart.
  const double half = (engine->eval_loss(batch.ids.narrow(0, 3), targets.narrow(0, 3)) +
                       engine->eval_loss(batch.ids.narrow(3, 3), targets.narrow(3, 3))) / 2;
  CHECK(std::abs(half - whole) > 1e-3);

  for (int accum : {2, 3}) {
    INFO(accum << " micro-batches");
    test::GradRecorder rec(engine->parameters());
    train::Trainer<double> trainer(*engine, rec, data, {.batch = 6, .grad_accum = accum, .log_every = 0});
    const double loss = trainer.step(batch);
    CHECK(std::abs(loss - whole) <= 1e-12);
    CHECK(test::max_abs_diff(rec.grads, want) <= 1e-12);
  }

  const test::TorchMaskedLoss torch = test::torch_masked_loss(batch.ids, targets, *model);
  CHECK(std::abs(torch.loss - whole) <= 1e-12);
  CHECK(test::max_abs_diff(torch.grads, want) <= 1e-12);
  fs::remove(tok_path);
}

// Note [Prefetching loader]: get() on worker threads, any number of them and any depth,
// trains exactly as get() on the training thread (loader_workers = 0: the loop before the
// loader): the same losses step by step and the same parameters, bit for bit; and the
// data wait the loop measured is in every metrics record.
TEST_CASE("Trainer: the prefetching loader trains bit for bit as the synchronous loop", "[train][trainer][loader]") {
  TensorDataset<float> data = make_data(37);  // 37 = 9 batches of 4 and 1 left: a partial batch
  struct Result {
    std::vector<double> losses;
    std::vector<float> params;
  };
  auto train = [&](int workers, int prefetch, bool drop_last, const fs::path& metrics) {
    Run run(data, {.epochs = 2, .grad_accum = 2, .drop_last = drop_last, .seed = 4, .log_every = 3,
                   .metrics = metrics.string(), .loader_workers = workers, .prefetch = prefetch});
    Result r;
    run.trainer->on_step = [&](const train::StepInfo& s) { r.losses.push_back(s.loss); };
    run.trainer->run();
    const Tensor<float> p = run.engine->parameters().values();
    r.params.assign(p.data(), p.data() + p.numel());
    return r;
  };
  const fs::path dir = fresh_dir("ptrain_trainer_loader_");
  fs::create_directories(dir);
  for (const bool drop_last : {false, true}) {
    const Result sync = train(0, 1, drop_last, dir / "sync.jsonl");
    REQUIRE(sync.losses.size() == (drop_last ? 18u : 20u));
    for (const auto& [workers, prefetch] : {std::pair{1, 1}, {1, 2}, {3, 4}}) {
      CAPTURE(drop_last, workers, prefetch);
      const fs::path metrics = dir / ("w" + std::to_string(workers) + ".jsonl");
      const Result got = train(workers, prefetch, drop_last, metrics);
      REQUIRE(got.losses == sync.losses);
      REQUIRE(got.params == sync.params);
      const auto records = read_lines(metrics);
      REQUIRE(records.size() == (drop_last ? 6u : 7u));  // every 3 steps and the last
      for (const auto& rec : records) {
        REQUIRE(rec.contains("data_wait_s"));
        CHECK(rec["data_wait_s"].get<double>() >= 0);
        CHECK(rec["data_wait_s"].get<double>() <= rec["step_time_s"].get<double>());
      }
    }
  }
  REQUIRE_THROWS_WITH(Run(data, {.loader_workers = -1}), Catch::Contains("[ptrain.trainer.options]"));
  fs::remove_all(dir);
}

}  // namespace test_trainer
