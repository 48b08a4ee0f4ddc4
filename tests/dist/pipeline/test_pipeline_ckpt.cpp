// Pipeline checkpoints (ckpt/stage_checkpoint.hpp), in the pipeline test
// executable: every rank is one stage of one replica, on every layout the world
// size allows (p stages; dp = 2 x pp = n / 2 for n = 4; p stages of a model
// whose last stage has no parameters; p stages of two interleaved chunks each).
//
// References: (1) the same run without interruption (A) against a run rebuilt
// from other random weights, a fresh optimizer and a scrambled generator that
// then loads the checkpoint (B): bitwise equal; (2) the checkpoint loaded in
// one process into the full model: bitwise equal to the stages' values at the
// save, and so is an asynchronous save taken while training goes on. Failures:
// another cut or dp size is refused on every rank; a load that fails on one
// rank fails on all. Value checks use CHECK so that no rank skips a collective.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>

#include <ptrain/ckpt/async_writer.hpp>
#include <ptrain/ckpt/stage_checkpoint.hpp>
#include <ptrain/parallel/mesh.hpp>
#include <ptrain/parallel/pipeline.hpp>

#include "dist/pipeline/pipeline_util.hpp"

namespace test_pipeline_ckpt {

using namespace ptrain;
using namespace pipeline_test;

namespace {

using Values = std::map<std::string, std::vector<float>>;

struct Layout {
  int dp, pp;
  std::size_t units;  // kUnits, or kUnits + 1: the last stage holds only the parameter-free GELU
  int v = 1;          // chunks per stage (Schedule::Interleaved)
};

// Layouts for n ranks: n stages; 2 x n/2 when n >= 4 is even; n stages whose last has no weights;
// n stages of 2 interleaved chunks where n divides the 8 rows of a batch (m = n).
std::vector<Layout> layouts(int n) {
  std::vector<Layout> out{{1, n, kUnits}};
  if (n >= 4 && n % 2 == 0) out.push_back({2, n / 2, kUnits});
  out.push_back({1, n, kUnits + 1});
  if (8 % n == 0 && 2 * static_cast<std::size_t>(n) <= kUnits) out.push_back({1, n, kUnits, 2});
  return out;
}

parallel::StagePartition partition_for(const Layout& l) {
  std::vector<double> cost;
  for (std::size_t u = 0; u < kUnits; ++u) cost.push_back(static_cast<double>(make_unit(u)->num_parameters()));
  if (l.units == kUnits) return parallel::partition_balanced(cost, l.pp * l.v);
  auto b = parallel::partition_balanced(cost, l.pp - 1).bounds();  // the weights on pp - 1 stages...
  b.push_back(kUnits + 1);                                         // ...and the GELU alone on the last
  return parallel::StagePartition(b);
}

// The first cut moved by one unit: the same number of stages, another layout.
parallel::StagePartition moved(const parallel::StagePartition& p) {
  auto b = p.bounds();
  b[1] = b[1] + 1 < b[2] ? b[1] + 1 : b[1] - 1;
  return parallel::StagePartition(b);
}

// Values as floats (exact for bf16, so equal floats mean equal bits).
template <class T>
std::vector<float> floats(const Tensor<T>& t) {
  std::vector<float> out;
  for (T x : t.to_vector()) out.push_back(static_cast<float>(x));
  return out;
}
template <class T>
Values values_of(nn::Module<T>& m) {
  Values v;
  for (auto& p : m.named_parameters()) v[p.name] = floats(p.param->value);
  return v;
}
template <class T>
Values state_of(optim::Optimizer<T>* opt) {
  Values v;
  if (opt)
    for (auto& [n, t] : opt->state_tensors()) v[n] = floats(t);
  return v;
}

// A learning rate per stage, so that a load which gave every stage the same one would show.
double stage_lr(int stage) { return 0.01 * (1 + stage); }

struct Run {
  std::unique_ptr<parallel::Pipeline<float>> pipe;
  std::unique_ptr<optim::AdamW<float>> opt;
};

Run build(parallel::Mesh& mesh, const Layout& l, const parallel::StagePartition& part, std::uint64_t seed_base,
          double lr) {
  Run r;
  r.pipe = std::make_unique<parallel::Pipeline<float>>(
      mesh.pipeline_group(), l.units, [seed_base](std::size_t u) { return make_unit_seeded(u, seed_base); }, part,
      parallel::PipelineOptions<float>{
          .schedule = l.v > 1 ? parallel::Schedule::Interleaved : parallel::Schedule::OneFOneB,
          .micro_batches = l.v > 1 ? l.pp : 2, .virtual_stages = l.v, .data_parallel = &mesh.data_group()});
  if (r.pipe->has_parameters())
    r.opt = std::make_unique<optim::AdamW<float>>(r.pipe->parameters(), optim::AdamWOptions{.lr = lr, .eps = 1e-6});
  return r;
}

// K steps on batches drawn from each rank's default_generator() (the first
// stage draws inputs, the last targets), so the generator must resume too.
void train(Run& r, int steps) {
  constexpr std::int64_t rows = 8;
  for (int i = 0; i < steps; ++i) {
    Tensor<float> x;
    Tensor<std::int32_t> y;
    if (r.pipe->is_first()) {
      x = Tensor<float>::empty({rows, kFeatures});
      ops::uniform_(x, -1.0, 1.0, default_generator());
    }
    if (r.pipe->is_last()) {
      y = Tensor<std::int32_t>::empty({rows});
      for (std::int64_t k = 0; k < rows; ++k) y.data()[k] = static_cast<std::int32_t>(default_generator().below(kClasses));
    }
    r.pipe->train_step(x, y);
    if (r.opt) r.opt->step();
  }
}

bool same_bits(const Values& a, const Values& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [n, v] : a) {
    auto it = b.find(n);
    if (it == b.end() || it->second.size() != v.size() ||
        std::memcmp(v.data(), it->second.data(), v.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

std::filesystem::path shared_dir(dist::Communicator& comm) { return testing::shared_tmp_dir(comm, "ptrain_pipe_ckpt_"); }

}  // namespace

TEST_CASE("pipeline checkpoints: same-layout resume is bitwise, one process loads the whole model, "
          "another layout is refused on every rank",
          "[pipeline][ckpt]") {
  auto& comm = world();
  const auto root = shared_dir(comm);
  constexpr int K = 2;
  for (const Layout& l : layouts(comm.size())) {
    parallel::Mesh mesh(comm, l.dp, l.pp);
    const auto part = partition_for(l);
    const int stage = mesh.stage(), replica = mesh.replica();
    INFO("layout " << l.dp << " x " << l.pp << " x " << l.v << " chunks, " << l.units << " units " << part.str() << ", stage " << stage
                   << ", replica " << replica);
    const auto dir = root / ("dp" + std::to_string(l.dp) + "_pp" + std::to_string(l.pp) + "_u" +
                             std::to_string(l.units) + "_v" + std::to_string(l.v));
    ckpt::CheckpointManager mgr(dir, &comm);

    // A: K steps, save, K more.
    manual_seed(100 + static_cast<std::uint64_t>(comm.rank()));  // a different stream on every rank
    Run a = build(mesh, l, part, 1000, stage_lr(stage));
    CHECK(a.pipe->has_parameters() == (l.units == kUnits || stage + 1 < l.pp));
    train(a, K);
    ckpt::TrainerState ts;
    ts.user["note"] = "kept";
    ckpt::save_stage(mgr, K, *a.pipe, a.opt.get(), ts);
    const Values saved = values_of(a.pipe->module()), saved_state = state_of(a.opt.get());
    train(a, K);
    const Values a_values = values_of(a.pipe->module()), a_state = state_of(a.opt.get());
    // An asynchronous save of step 2K, with training going on before it is waited for:
    // the checkpoint must hold the values at 2K (checked in one process below).
    {
      ckpt::AsyncCheckpointer saver(mgr);
      auto snap = ckpt::stage_snapshot(&comm, *a.pipe, a.opt.get(), {});
      saver.save_sharded(2 * K, snap.tensors, snap.state);
      train(a, 1);
      saver.wait();
      comm.barrier();  // rank 0 commits in the background; the others wait for it here
    }

    // B: other weights, a fresh optimizer with another rate, a scrambled generator; then load.
    manual_seed(999);
    Run b = build(mesh, l, part, 5000, 0.5);
    if (b.pipe->has_parameters()) CHECK_FALSE(same_bits(values_of(b.pipe->module()), saved));
    const auto st = ckpt::load_stage(mgr, mgr.step_path(K), *b.pipe, b.opt.get());
    CHECK(st.step == K);
    CHECK(st.user.value("note", "") == "kept");
    CHECK(same_bits(values_of(b.pipe->module()), saved));
    CHECK(same_bits(state_of(b.opt.get()), saved_state));
    if (b.opt) {
      CHECK(b.opt->steps() == K);
      CHECK(b.opt->lr() == stage_lr(stage));
    }
    train(b, K);
    CHECK(same_bits(values_of(b.pipe->module()), a_values));
    CHECK(same_bits(state_of(b.opt.get()), a_state));

    // One process, the full model: the union of the stage files is the whole model.
    {
      ckpt::CheckpointManager solo(dir);
      auto full = full_model(l.units);
      nn::FlatParameters<float> fp(*full);
      optim::AdamW<float> fopt(fp, {.lr = 1.0});
      const auto fst = solo.load(mgr.step_path(K), fp, &fopt);
      const Values fv = values_of(*full), fs = state_of(&fopt);
      bool stage_matches = true;
      for (const auto& [n, v] : saved) stage_matches = stage_matches && fv.count(n) && fv.at(n) == v;
      for (const auto& [n, v] : saved_state) stage_matches = stage_matches && fs.count(n) && fs.at(n) == v;
      CHECK(stage_matches);
      CHECK(fopt.steps() == K);
      CHECK(fopt.lr() == stage_lr(0));  // the first stage with an optimizer speaks for the run
      CHECK(fst.user.at("ptrain.pipeline").at("partition") == part.str());
      // Every parameter of the full model is in the checkpoint exactly once.
      ckpt::Checkpoint c(mgr.step_path(K));
      CHECK(c.tensor_names("model").size() == fv.size());
      // ... and export_model() writes them all to one plain safetensors file.
      const auto one = dir / ("export-rank" + std::to_string(comm.rank()) + ".safetensors");
      c.export_model(one.string());
      ckpt::SafetensorsReader r(one.string());
      bool export_matches = r.tensors().size() == fv.size();
      for (auto& p : full->named_parameters()) {
        auto t = Tensor<float>::empty(p.param->value.shape());
        r.read_into(p.name, t);
        export_matches = export_matches && t.to_vector() == fv.at(p.name);
      }
      CHECK(export_matches);
      // The asynchronous checkpoint of step 2K.
      solo.load(mgr.step_path(2 * K), fp, &fopt);
      const Values fv2 = values_of(*full), fs2 = state_of(&fopt);
      bool async_matches = true;
      for (const auto& [n, v] : a_values) async_matches = async_matches && fv2.count(n) && fv2.at(n) == v;
      for (const auto& [n, v] : a_state) async_matches = async_matches && fs2.count(n) && fs2.at(n) == v;
      CHECK(async_matches);
      CHECK(fopt.steps() == 2 * K);
    }

    // Cut points moved (and, on four ranks, dp 2 x pp 2 read as 4 stages): refused on every rank.
    // (Eight chunks of one unit each have no other cut.)
    if (l.pp >= 2 && part.num_stages() < static_cast<int>(part.num_units())) {
      const auto other = moved(part);
      Run c = build(mesh, l, other, 1000, 0.01);
      CHECK_THROWS_WITH(ckpt::load_stage(mgr, mgr.step_path(K), *c.pipe, c.opt.get()),
                        Catch::Contains("[ptrain.ckpt.layout]") && Catch::Contains(part.str()) &&
                            Catch::Contains(other.str()) && Catch::Contains("full model in one process"));
    }
    // Stage 0 saved without optimizer state: its load with an optimizer fails, and
    // every other rank, whose own load worked, fails with it instead of training on.
    if (l.dp == 1 && l.units == kUnits) {
      Run d = build(mesh, l, part, 1000, 0.01);
      ckpt::save_stage(mgr, 3 * K, *d.pipe, stage == 0 ? nullptr : d.opt.get());
      if (stage == 0)
        CHECK_THROWS_WITH(ckpt::load_stage(mgr, mgr.step_path(3 * K), *d.pipe, d.opt.get()),
                          Catch::Contains("exp_avg"));
      else
        CHECK_THROWS_WITH(ckpt::load_stage(mgr, mgr.step_path(3 * K), *d.pipe, d.opt.get()),
                          Catch::Contains("[ptrain.ckpt.stage_peer] rank 0 failed"));
    }
    if (l.dp == 2) {
      parallel::Mesh flat(comm, 1, comm.size());
      const auto four = parallel::partition_balanced(std::vector<double>(kUnits, 1.0), comm.size());
      parallel::Pipeline<float> p4(flat.pipeline_group(), kUnits, make_unit, four);
      CHECK_THROWS_WITH(ckpt::load_stage(mgr, mgr.step_path(K), p4),
                        Catch::Contains("[ptrain.ckpt.layout]") && Catch::Contains("dp = 2") &&
                            Catch::Contains("dp = 1"));
    }
  }
  comm.barrier();
  if (comm.rank() == 0 && std::getenv("PTRAIN_PIPE_CKPT_KEEP") == nullptr) std::filesystem::remove_all(root);
}

// bf16 stages (GPT from token ids, AdamW with fp32 master weights): a run that
// loads the checkpoint continues bitwise like the uninterrupted run; the files
// hold the parameters in BF16 and the optimizer state (moments, master weights) in F32.
TEST_CASE("a bf16 GPT pipeline resumes bitwise from its stage checkpoint", "[pipeline][ckpt][bf16]") {
  auto& comm = world();
  const auto dir = shared_dir(comm) / "bf16";
  const nn::GPTConfig cfg = pipeline_gpt(std::max(2, comm.size() - 1));
  const std::size_t units = static_cast<std::size_t>(cfg.n_layer) + 2;
  const auto [ids, tgt] = make_tokens(4, 8, cfg.vocab_size, 31);
  const auto part = parallel::partition_balanced(std::vector<double>(units, 1.0), comm.size());
  struct Bf16Run {
    std::unique_ptr<parallel::Pipeline<bf16>> pipe;
    std::unique_ptr<optim::AdamW<bf16>> opt;
    void train(const Tensor<std::int32_t>& x, const Tensor<std::int32_t>& y, int steps) {
      for (int i = 0; i < steps; ++i) {
        pipe->train_step(x, y);
        opt->step();
      }
    }
  };
  auto build_run = [&](std::uint64_t seed) {
    Bf16Run r;
    r.pipe = std::make_unique<parallel::Pipeline<bf16>>(comm, units, gpt_units<bf16>(cfg, seed), part,
                                                        parallel::PipelineOptions<bf16>{.micro_batches = 2});
    r.opt = std::make_unique<optim::AdamW<bf16>>(r.pipe->parameters(), optim::AdamWOptions{.lr = 0.02});
    return r;
  };
  ckpt::CheckpointManager mgr(dir, &comm);
  Bf16Run a = build_run(7);
  a.train(ids, tgt, 2);
  ckpt::save_stage(mgr, 2, *a.pipe, a.opt.get());
  a.train(ids, tgt, 2);

  Bf16Run b = build_run(8);
  ckpt::load_stage(mgr, mgr.step_path(2), *b.pipe, b.opt.get());
  b.train(ids, tgt, 2);
  CHECK(same_bits(values_of(b.pipe->module()), values_of(a.pipe->module())));
  CHECK(same_bits(state_of(b.opt.get()), state_of(a.opt.get())));

  ckpt::Checkpoint c(mgr.step_path(2));
  bool dtypes = !c.tensor_names("model").empty();
  for (const auto& n : c.tensor_names("model")) dtypes = dtypes && c.dtype(n) == DType::BF16;
  for (const auto& n : c.tensor_names("optimizer")) dtypes = dtypes && c.dtype(n) == DType::F32;
  CHECK(dtypes);
  CHECK(c.tensor_names("optimizer").size() == 3 * c.tensor_names("model").size());  // exp_avg, exp_avg_sq, master
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir.parent_path());
}

}  // namespace test_pipeline_ckpt
