// Checkpoint manager (single process), asynchronous saves, preemption flag and
// the sampler reshape rule. References: the tensors' own values before saving,
// hand-computed sampler positions, and a simulation of DistributedSampler on
// N and M ranks that counts how often each sample is seen.
#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/checkpoint.hpp>
#include <ptrain/ckpt/preemption.hpp>
#include <ptrain/data/sampler.hpp>
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <unistd.h>

namespace test_checkpoint {

using namespace ptrain;
namespace fs = std::filesystem;

namespace {

struct TmpDir {
  fs::path path;
  TmpDir() {
    char t[] = "/tmp/ptrain_ckpt_XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TmpDir() { fs::remove_all(path); }
};

void train_steps(nn::Module<float>& model, nn::FlatParameters<float>& params, optim::Optimizer<float>& opt,
                 int steps) {
  Generator data(99);
  for (int s = 0; s < steps; ++s) {
    auto x = Tensor<float>::empty({5, 4});
    for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = static_cast<float>(data.uniform() - 0.5);
    auto y = Tensor<std::int32_t>::empty({5});
    for (std::int64_t i = 0; i < 5; ++i) y.data()[i] = static_cast<std::int32_t>(data.below(3));
    nn::CrossEntropyLoss<float> ce;
    nn::Cache<float> c, lc;
    params.zero_grad();
    ce.forward(model.forward(x, c), y, lc);
    model.backward(ce.backward(lc), c);
    opt.step();
  }
}

// A model, its flat parameters and AdamW, trained a few steps so the state is not zero.
struct Run {
  Generator gen;
  nn::MLP<float> model;
  nn::FlatParameters<float> params;
  optim::AdamW<float> opt;
  explicit Run(std::uint64_t seed, std::int64_t hidden = 8)
      : gen(seed), model(4, {hidden}, 3, nn::Activation::ReLU, gen), params(model), opt(params, {.lr = 0.01}) {}
  void train(int steps) { train_steps(model, params, opt, steps); }
};

std::vector<float> flat(const Tensor<float>& t) { return t.to_vector(); }
std::vector<float> state_of(optim::Optimizer<float>& o) {
  std::vector<float> v;
  for (auto& [n, t] : o.state_tensors())
    for (float x : t.to_vector()) v.push_back(x);
  return v;
}

void flip_byte(const fs::path& p, std::uint64_t offset) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x01));
}

std::string load_error(const ckpt::CheckpointManager& mgr, const fs::path& p, Run& r) {
  try {
    mgr.load(p, r.params, &r.opt);
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("checkpoint round trip restores parameters, optimizer state and trainer state", "[ckpt]") {
  TmpDir d;
  Run a(1);
  a.train(3);
  ckpt::CheckpointManager mgr(d.path);
  ckpt::TrainerState ts;
  ts.sampler = ckpt::SamplerState{2, 40, 4};
  ts.rng["data"] = {7, 1234};
  ts.schedule = optim::WarmupCosine{0.01, 10, 100, 1e-4};
  ts.user = {{"run", "unit"}, {"loss", 0.125}};
  manual_seed(11);
  default_generator().reserve(77);
  mgr.save(3, a.params, &a.opt, ts);
  manual_seed(0);

  const fs::path p = d.path / "step-00000003";
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "index.json", "trainer.json", "COMMITTED"})
    CHECK(fs::exists(p / f));
  int entries = 0;
  for (auto& e : fs::directory_iterator(p)) (void)e, ++entries;
  CHECK(entries == 5);  // no temporary files or manifests left behind

  auto last = mgr.latest();
  REQUIRE(last.found());
  CHECK(last.step == 3);
  CHECK(last.skipped.empty());

  Run b(2);  // different initial values
  REQUIRE(flat(b.params.values()) != flat(a.params.values()));
  auto got = mgr.load(last.path, b.params, &b.opt);
  CHECK(flat(b.params.values()) == flat(a.params.values()));
  CHECK(state_of(b.opt) == state_of(a.opt));
  CHECK(b.opt.steps() == 3);
  CHECK(b.opt.lr() == a.opt.lr());
  CHECK(got.step == 3);
  CHECK(got.world_size == 1);
  REQUIRE(got.sampler);
  CHECK(got.sampler->epoch == 2);
  CHECK(got.sampler->consumed == 40);
  CHECK(got.rng.at("data").offset == 1234);
  CHECK(got.rng.at("default").seed == 11);  // recorded by save()
  REQUIRE(got.schedule);
  CHECK(got.schedule->min_lr == 1e-4);
  CHECK(got.user["loss"] == 0.125);
  CHECK(default_generator().seed() == 11);  // restored from rng["default"]
  CHECK(default_generator().offset() == 77);
  manual_seed(0);
  // Training on from both gives the same parameters, bit for bit.
  a.train(2);
  b.train(2);
  CHECK(flat(b.params.values()) == flat(a.params.values()));

  // The model file is a plain safetensors state dict with the module's names.
  ckpt::SafetensorsReader r((p / "model.safetensors").string());
  CHECK(r.contains("0.weight"));
  CHECK(r.contains("2.bias"));
  CHECK(r.metadata().at("format") == "pt");
}

TEST_CASE("frozen parameters are saved and loaded by name, without optimizer state; a resume is exact",
          "[ckpt][frozen]") {
  // The first layer frozen (a fine-tuning run's base), the second trains.
  struct Frozen {
    Generator gen;
    nn::MLP<float> model;
    std::unique_ptr<nn::FlatParameters<float>> params;
    std::unique_ptr<optim::AdamW<float>> opt;
    explicit Frozen(std::uint64_t seed) : gen(seed), model(4, {8}, 3, nn::Activation::ReLU, gen) {
      model[0].requires_grad_(false);
      params = std::make_unique<nn::FlatParameters<float>>(model);
      opt = std::make_unique<optim::AdamW<float>>(*params, optim::AdamWOptions{.lr = 0.01});
    }
    std::vector<float> all() {
      std::vector<float> v;
      for (auto& p : model.named_parameters())
        for (float x : p.param->value.to_vector()) v.push_back(x);
      return v;
    }
  };
  TmpDir d;
  Frozen a(1);
  const auto base = a.model[0].named_parameters()[0].param->value.to_vector();
  train_steps(a.model, *a.params, *a.opt, 3);
  CHECK(a.model[0].named_parameters()[0].param->value.to_vector() == base);
  ckpt::CheckpointManager mgr(d.path);
  mgr.save(3, *a.params, a.opt.get(), {});
  const fs::path p = d.path / "step-00000003";
  ckpt::SafetensorsReader model_file((p / "model.safetensors").string());
  ckpt::SafetensorsReader opt_file((p / "optimizer.safetensors").string());
  for (const char* n : {"0.weight", "0.bias", "2.weight", "2.bias"}) CHECK(model_file.contains(n));
  CHECK(opt_file.contains("2.weight.exp_avg"));
  CHECK_FALSE(opt_file.contains("0.weight.exp_avg"));
  CHECK_FALSE(opt_file.contains("0.bias.exp_avg_sq"));

  Frozen b(2);  // other values, the frozen layer's too
  REQUIRE(b.all() != a.all());
  mgr.load(p, *b.params, b.opt.get());
  CHECK(b.all() == a.all());
  CHECK(state_of(*b.opt) == state_of(*a.opt));
  train_steps(a.model, *a.params, *a.opt, 2);
  train_steps(b.model, *b.params, *b.opt, 2);
  CHECK(b.all() == a.all());
}

TEST_CASE("keep_last deletes older checkpoints", "[ckpt]") {
  TmpDir d;
  Run a(1);
  {
    ckpt::CheckpointManager mgr(d.path, nullptr, {.keep_last = 2});
    for (int s = 1; s <= 5; ++s) mgr.save(s * 10, a.params, &a.opt, {});
    CHECK(mgr.latest().step == 50);
  }  // waits for the background deletion
  std::vector<std::string> dirs;
  for (auto& e : fs::directory_iterator(d.path)) dirs.push_back(e.path().filename().string());
  std::sort(dirs.begin(), dirs.end());
  CHECK(dirs == std::vector<std::string>{"step-00000040", "step-00000050"});
  // Resuming from step 40 and saving step 45 drops step 50 (abandoned timeline).
  {
    ckpt::CheckpointManager mgr(d.path, nullptr, {.keep_last = 2});
    mgr.save(45, a.params, &a.opt, {});
    CHECK(mgr.latest().step == 45);
  }
  dirs.clear();
  for (auto& e : fs::directory_iterator(d.path)) dirs.push_back(e.path().filename().string());
  std::sort(dirs.begin(), dirs.end());
  CHECK(dirs == std::vector<std::string>{"step-00000040", "step-00000045"});
}

TEST_CASE("corrupt or partial checkpoints raise CheckpointError and latest falls back", "[ckpt]") {
  struct Damage {
    const char* what;
    std::function<void(const fs::path&)> apply;
    std::vector<const char*> expect;  // parts of the error message
  };
  const std::vector<Damage> damages = {
      {"flipped data byte", [](const fs::path& p) {
         ckpt::SafetensorsReader r((p / "model.safetensors").string());
         const auto& e = r.entry("2.weight");
         const auto off = static_cast<std::uint64_t>(r.data(e) - r.file_bytes()) + 5;
         flip_byte(p / "model.safetensors", off);
       }, {"model.safetensors", "tensor '2.weight'", "CRC-32"}},
      {"flipped header byte", [](const fs::path& p) { flip_byte(p / "optimizer.safetensors", 20); },
       {"optimizer.safetensors"}},
      {"truncated file", [](const fs::path& p) { fs::resize_file(p / "optimizer.safetensors", 100); },
       {"optimizer.safetensors"}},
      {"header length beyond file", [](const fs::path& p) {
         std::fstream f(p / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
         const std::uint64_t n = 1 << 20;
         f.write(reinterpret_cast<const char*>(&n), 8);
       }, {"model.safetensors", "past the end"}},
      {"missing shard", [](const fs::path& p) { fs::remove(p / "optimizer.safetensors"); },
       {"optimizer.safetensors", "missing"}},
      {"missing marker", [](const fs::path& p) { fs::remove(p / "COMMITTED"); }, {"COMMITTED", "did not finish"}},
      {"edited index", [](const fs::path& p) {
         auto text = ckpt::detail::read_text(p / "index.json");
         text[text.find("crc32")] = 'C';
         std::ofstream(p / "index.json") << text;
       }, {"index.json", "CRC-32"}},
      {"edited trainer.json", [](const fs::path& p) { std::ofstream(p / "trainer.json") << "{}"; },
       {"trainer.json"}},
  };
  for (const auto& dmg : damages) {
    INFO(dmg.what);
    TmpDir d;
    Run a(1);
    ckpt::CheckpointManager mgr(d.path);
    a.train(1);
    mgr.save(10, a.params, &a.opt, {});
    const auto good = flat(a.params.values());
    a.train(1);
    mgr.save(20, a.params, &a.opt, {});
    dmg.apply(d.path / "step-00000020");

    auto last = mgr.latest();
    REQUIRE(last.found());
    CHECK(last.step == 10);
    REQUIRE(last.skipped.size() == 1);
    CHECK(last.skipped[0].path.filename() == "step-00000020");
    for (const char* e : dmg.expect) CHECK_THAT(last.skipped[0].reason, Catch::Contains(e));

    Run b(3);
    CHECK_THAT(load_error(mgr, d.path / "step-00000020", b), Catch::Contains("step-00000020"));
    mgr.load(last.path, b.params, &b.opt);
    CHECK(flat(b.params.values()) == good);
  }
}

TEST_CASE("loading into a different model names the file and the tensor", "[ckpt]") {
  TmpDir d;
  Run a(1);
  ckpt::CheckpointManager mgr(d.path);
  mgr.save(1, a.params, &a.opt, {});
  const fs::path p = d.path / "step-00000001";

  Run wider(1, 9);
  const auto before = flat(wider.params.values());
  CHECK_THAT(load_error(mgr, p, wider),
             Catch::Contains("model.safetensors") && Catch::Contains("'0.weight'") && Catch::Contains("shape"));
  CHECK(flat(wider.params.values()) == before);

  // Only the last layer differs: the first layer must not be overwritten either.
  Generator g3(5);
  nn::MLP<float> two_classes(4, {8}, 2, nn::Activation::ReLU, g3);
  nn::FlatParameters<float> tp(two_classes);
  const auto tp_before = flat(tp.values());
  CHECK_THROWS_WITH(mgr.load(p, tp), Catch::Contains("'2.weight'") && Catch::Contains("[2, 8]"));
  CHECK(flat(tp.values()) == tp_before);  // nothing copied on a mismatch

  Generator g(0);
  nn::MLP<double> dmodel(4, {8}, 3, nn::Activation::ReLU, g);
  nn::FlatParameters<double> dparams(dmodel);
  CHECK_THROWS_WITH(mgr.load(p, dparams), Catch::Contains("model.safetensors") && Catch::Contains("'0.weight'") &&
                                              Catch::Contains("F32") && Catch::Contains("F64"));

  // A smaller model: the checkpoint's extra tensors are reported (strict load).
  Generator g2(0);
  nn::MLP<float> small(4, {}, 3, nn::Activation::ReLU, g2);
  nn::FlatParameters<float> sp(small);
  CHECK_THROWS_AS(mgr.load(p, sp), CheckpointError);
}

TEST_CASE("sharded save: pieces are assembled, checked for coverage and exported", "[ckpt]") {
  TmpDir d;
  ckpt::CheckpointManager mgr(d.path);
  auto w = Tensor<float>::from({1, 2, 3, 4, 5, 6}, {2, 3});
  auto s = Tensor<std::int64_t>::from({42}, {1});
  // w in two pieces [0, 4) and [4, 6), as two ranks of FSDP would hold it.
  ckpt::ShardedState part;
  part.model = {ckpt::piece("w", w.shape(), 4, w.view(4, {2})), ckpt::piece("w", w.shape(), 0, w.view(0, {4}))};
  part.optimizer = {ckpt::whole("count", s)};
  mgr.save_sharded(5, part, {});
  auto last = mgr.latest();
  REQUIRE(last.step == 5);
  ckpt::Checkpoint c(last.path);
  CHECK(c.weight_map().at("w@0") == "model-00000-of-00001.safetensors");
  CHECK(c.weight_map().at("count") == "optimizer-00000-of-00001.safetensors");
  CHECK(c.tensor_names() == std::vector<std::string>{"count", "w"});
  CHECK(c.tensor_names("model") == std::vector<std::string>{"w"});
  CHECK(c.shape_of("w") == Shape{2, 3});
  auto back = Tensor<float>::zeros({2, 3});
  c.read_into("w", back);
  CHECK(back.to_vector() == w.to_vector());
  auto mid = Tensor<float>::zeros({3});
  c.read_range("w", 2, mid);
  CHECK(mid.to_vector() == std::vector<float>{3, 4, 5});
  auto wrong = Tensor<float>::zeros({6});
  CHECK_THROWS_WITH(c.read_into("w", wrong), Catch::Contains("[ptrain.ckpt.shape]") && Catch::Contains("'w'"));
  auto wrong_type = Tensor<double>::zeros({2, 3});
  CHECK_THROWS_WITH(c.read_into("w", wrong_type), Catch::Contains("[ptrain.ckpt.dtype]"));
  CHECK_THROWS_WITH(c.read_into("nope", wrong), Catch::Contains("'nope'"));
  // The export is a plain safetensors file holding w whole.
  const std::string out = (d.path / "full.safetensors").string();
  c.export_model(out);
  ckpt::SafetensorsReader r(out);
  REQUIRE(r.tensors().size() == 1);
  CHECK(r.tensor<float>("w").to_vector() == w.to_vector());
  CHECK(r.entry("w").shape == Shape{2, 3});

  // A gap or an overlap fails the commit, and the failed step stays invisible.
  ckpt::ShardedState gap;
  gap.model = {ckpt::piece("w", w.shape(), 0, w.view(0, {4}))};
  CHECK_THROWS_WITH(mgr.save_sharded(6, gap, {}), Catch::Contains("[ptrain.ckpt.pieces]") &&
                                                      Catch::Contains("cover 4 of its 6"));
  ckpt::ShardedState overlap;
  overlap.model = {ckpt::piece("w", w.shape(), 0, w.view(0, {4})), ckpt::piece("w", w.shape(), 3, w.view(3, {3}))};
  CHECK_THROWS_WITH(mgr.save_sharded(7, overlap, {}), Catch::Contains("overlap"));
  CHECK(mgr.latest().step == 5);
  CHECK_THROWS_WITH(ckpt::piece("w", w.shape(), 5, w.view(0, {2})), Catch::Contains("[ptrain.ckpt.piece]"));
}

TEST_CASE("saving a committed step again keeps the old checkpoint until the new one commits", "[ckpt]") {
  TmpDir d;
  auto w_of = [](const fs::path& path) {
    auto back = Tensor<float>::zeros({2, 3});
    ckpt::Checkpoint(path).read_into("w", back);
    return back.to_vector();
  };
  const auto w = Tensor<float>::from({1, 2, 3, 4, 5, 6}, {2, 3}), w2 = Tensor<float>::from({6, 5, 4, 3, 2, 1}, {2, 3});
  ckpt::ShardedState gap;  // a rewrite that fails its commit: w's pieces leave a gap
  gap.model = {ckpt::piece("w", w.shape(), 0, w.view(0, {4}))};
  {
    ckpt::CheckpointManager mgr(d.path);
    mgr.save_sharded(5, {{ckpt::whole("w", w)}, {}}, {});
    CHECK_THROWS_WITH(mgr.save_sharded(5, gap, {}), Catch::Contains("[ptrain.ckpt.pieces]"));
    auto last = mgr.latest();  // the set-aside copy stands in for the failed rewrite
    REQUIRE(last.step == 5);
    CHECK(w_of(last.path) == w.to_vector());
    // The next save puts it back in place; a rewrite that commits replaces it.
    CHECK_THROWS_WITH(mgr.save_sharded(5, gap, {}), Catch::Contains("[ptrain.ckpt.pieces]"));
    CHECK(w_of(mgr.latest().path) == w.to_vector());
    mgr.save_sharded(5, {{ckpt::whole("w", w2)}, {}}, {});
    last = mgr.latest();
    CHECK(last.path == d.path / "step-00000005");
    CHECK(w_of(last.path) == w2.to_vector());
  }  // waits for the background deletion
  std::vector<std::string> dirs;
  for (auto& e : fs::directory_iterator(d.path)) dirs.push_back(e.path().filename().string());
  CHECK(dirs == std::vector<std::string>{"step-00000005"});
}

TEST_CASE("a run that did not resume may not delete newer checkpoints; one that resumed may; steps are not negative", "[ckpt]") {
  TmpDir d;
  Run a(1);
  ckpt::CheckpointManager mgr(d.path);
  mgr.save(10, a.params, &a.opt, {});
  mgr.save(20, a.params, &a.opt, {});
  // A fresh run in the same directory (say, without --resume) must not wipe them.
  CHECK_THROWS_WITH(mgr.save(2, a.params, &a.opt, {}),
                    Catch::Contains("[ptrain.ckpt.newer]") && Catch::Contains("up to step 20"));
  CHECK(mgr.latest().step == 20);
  CHECK(fs::exists(d.path / "step-00000010" / "COMMITTED"));
  CHECK_FALSE(fs::exists(d.path / "step-00000002"));
  CHECK_THROWS_WITH(mgr.save(-5, a.params, &a.opt, {}), Catch::Contains("[ptrain.ckpt.step]"));
  {
    // A run that resumed from step 20 (ckpt::load tells the manager): on more ranks its
    // steps are smaller (Note [Trainer steps]), and its save supersedes the larger ones.
    ckpt::CheckpointManager resumed(d.path);
    const auto last = resumed.latest();
    REQUIRE(last.step == 20);
    resumed.resumed_from(last.path);
    resumed.save(14, a.params, &a.opt, {});
    CHECK(resumed.latest().step == 14);
  }  // waits for the background deletion
  CHECK_FALSE(fs::exists(d.path / "step-00000020"));
  // Loading from a wrong path says so (not "the save did not finish").
  CHECK_THROWS_WITH(mgr.load(d.path / "nope", a.params), Catch::Contains("[ptrain.ckpt.path]") &&
                                                            Catch::Contains("does not exist"));
  CHECK_THROWS_WITH(mgr.load(d.path, a.params), Catch::Contains("not a checkpoint step directory") &&
                                                    Catch::Contains("latest()"));
  CHECK_THROWS_WITH(mgr.load(d.path / "step-00000010" / "index.json", a.params),
                    Catch::Contains("is not a directory"));
  CHECK_THROWS_WITH(ckpt::CheckpointManager(d.path / "step-00000010" / "index.json"),
                    Catch::Contains("[ptrain.ckpt.path]"));
}

TEST_CASE("load reads a sharded checkpoint whole, or only a stage's part", "[ckpt]") {
  TmpDir d;
  ckpt::CheckpointManager mgr(d.path);
  Run a(1);
  a.train(2);
  // Each parameter (and its AdamW state) cut in two pieces at a different place.
  ckpt::ShardedState part;
  for (const auto& e : a.params.entries()) {
    const std::int64_t cut = e.numel() / 3;
    for (auto [lo, hi] : {std::pair{std::int64_t{0}, cut}, std::pair{cut, e.numel()}}) {
      if (lo == hi) continue;
      part.model.push_back(ckpt::piece(e.name, e.shape, lo, a.params.values().view(e.offset + lo, {hi - lo})));
      for (const auto& [kind, buf] : a.opt.flat_state())
        part.optimizer.push_back(ckpt::piece(e.name + "." + kind, e.shape, lo, buf.view(e.offset + lo, {hi - lo})));
    }
  }
  part.record(a.opt);
  mgr.save_sharded(2, part, {});
  Run b(2);
  mgr.load(mgr.latest().path, b.params, &b.opt);
  CHECK(flat(b.params.values()) == flat(a.params.values()));
  CHECK(state_of(b.opt) == state_of(a.opt));
  CHECK(b.opt.steps() == a.opt.steps());
  // A smaller model is refused unless the load is partial (a pipeline stage).
  Generator g(3);
  nn::Sequential<float> stage;
  stage.add(std::make_shared<nn::Linear<float>>(4, 8, true, g));
  nn::FlatParameters<float> sp(stage);
  CHECK_THROWS_WITH(mgr.load(mgr.latest().path, sp), Catch::Contains("[ptrain.ckpt.unexpected]"));
  mgr.load(mgr.latest().path, sp, nullptr, {.partial = true});
  auto w = Tensor<float>::empty(sp.entries()[0].shape);
  ckpt::Checkpoint(mgr.latest().path).read_into(sp.entries()[0].name, w);
  CHECK(flat(sp.entries()[0].param->value) == flat(w));
}

TEST_CASE("asynchronous save snapshots at the call and reports failures at the next call", "[ckpt][async]") {
  TmpDir d;
  Run a(1);
  a.train(1);
  ckpt::CheckpointManager mgr(d.path);
  {
    ckpt::AsyncCheckpointer saver(mgr);
    const auto at_save = flat(a.params.values());
    const auto opt_at_save = state_of(a.opt);
    saver.save(1, a.params, &a.opt, {});
    a.train(3);  // training goes on while the file is written
    saver.save(4, a.params, &a.opt, {});  // waits for the first one
    saver.wait();
    CHECK_FALSE(saver.in_flight());
    Run b(2);
    mgr.load(d.path / "step-00000001", b.params, &b.opt);
    CHECK(flat(b.params.values()) == at_save);
    CHECK(state_of(b.opt) == opt_at_save);
    mgr.load(d.path / "step-00000004", b.params, &b.opt);
    CHECK(flat(b.params.values()) == flat(a.params.values()));

    // Invalid UTF-8 in a name fails inside the background thread.
    auto t = Tensor<float>::zeros({2});
    saver.save_sharded(6, {{ckpt::whole("bad\xff", t)}, {}}, {});
    CHECK_THROWS_WITH(saver.wait(), Catch::Contains("[ptrain.ckpt.async]") && Catch::Contains("UTF-8"));
    saver.save_sharded(7, {{ckpt::whole("bad\xff", t)}, {}}, {});
    CHECK_THROWS_WITH(saver.save(8, a.params, &a.opt, {}), Catch::Contains("[ptrain.ckpt.async]"));
    saver.save(9, a.params, &a.opt, {});  // the failure was reported once; saving works again
  }
  auto last = mgr.latest();
  CHECK(last.step == 9);
  CHECK_FALSE(fs::exists(d.path / "step-00000006" / "COMMITTED"));
}

TEST_CASE("preemption handler turns a signal into a stop flag", "[ckpt][preempt]") {
  struct sigaction before {};
  ::sigaction(SIGUSR1, nullptr, &before);
  {
    ckpt::PreemptionHandler h;
    CHECK_FALSE(h.should_stop(nullptr));
    ::raise(SIGUSR1);
    CHECK(h.local_signal() == SIGUSR1);
    CHECK(h.should_stop(nullptr));
    CHECK(h.signal() == SIGUSR1);
    CHECK_THROWS_AS(ckpt::PreemptionHandler(), Error);
    h.reset();
    CHECK_FALSE(h.should_stop(nullptr));
    ::raise(SIGTERM);
    CHECK(h.should_stop(nullptr));
    CHECK(h.signal() == SIGTERM);
  }
  struct sigaction after {};
  ::sigaction(SIGUSR1, nullptr, &after);
  CHECK(after.sa_handler == before.sa_handler);
}

TEST_CASE("sampler reshape: hand-computed positions", "[ckpt][sampler]") {
  // 2 ranks consumed 18 each: 36 global; 3 ranks continue at 12, 1 rank at 36.
  ckpt::SamplerState st{0, 36, 2};
  CHECK(ckpt::resume_position(st, 3, 100) == 12);
  CHECK(ckpt::resume_position(st, 1, 100) == 36);
  CHECK(ckpt::resume_position(st, 4, 100) == 9);
  CHECK(ckpt::resume_position(st, 4, 5) == 5);  // past the data: epoch over
  CHECK_THROWS_WITH(ckpt::resume_position(st, 5, 100), Catch::Contains("36 % 5"));
  CHECK(ckpt::resume_position(st, 5, 100, true) == 7);
}

TEST_CASE("sampler reshape: N ranks then M ranks see every sample exactly once", "[ckpt][sampler]") {
  for (std::int64_t n : {24, 25, 31}) {
    for (int N = 1; N <= 4; ++N) {
      for (int M = 1; M <= 4; ++M) {
        const std::int64_t per_rank_n = (n + N - 1) / N;
        for (std::int64_t p = 0; p <= per_rank_n; ++p) {
          INFO("n " << n << " N " << N << " M " << M << " p " << p);
          std::vector<int> seen(static_cast<std::size_t>(n), 0);
          std::vector<std::int64_t> positions;  // order positions consumed, to count padding
          ckpt::SamplerState st;
          for (int r = 0; r < N; ++r) {
            DistributedSampler s(n, r, N, 5);
            s.set_epoch(3);
            const std::vector<std::int64_t> batch = s.next(p);
            for (auto i : batch) ++seen[static_cast<std::size_t>(i)];
            if (r == 0) st = ckpt::sampler_state(s, N);
          }
          const bool exact = st.consumed % M == 0;
          for (int r = 0; r < M; ++r) {
            DistributedSampler s(n, r, M, 5);
            if (!exact) {
              CHECK_THROWS_AS(ckpt::restore_sampler(s, st, M), CheckpointError);
              ckpt::restore_sampler(s, st, M, true);
            } else {
              ckpt::restore_sampler(s, st, M);
            }
            CHECK(s.epoch() == 3);
            while (!s.epoch_done())
              for (auto i : s.next(2)) ++seen[static_cast<std::size_t>(i)];
          }
          // Nothing skipped. Extra visits come only from padding (at most
          // N - 1 + M - 1 over the epoch) and, when not exact, the rounding
          // (at most M - 1).
          std::int64_t extra = 0;
          for (int c : seen) {
            CHECK(c >= 1);
            extra += c - 1;
          }
          const std::int64_t pad_bound = (N - 1) + (M - 1) + (exact ? 0 : M - 1);
          CHECK(extra <= pad_bound);
          if (n % N == 0 && n % M == 0 && exact) CHECK(extra == 0);
        }
      }
    }
  }
}

}  // namespace test_checkpoint
