// Expert parallelism inside pipeline stages (PipelineOptions::expert_parallel, Note
// [Pipeline expert parallelism] in parallel/pipeline.hpp), in the pipeline test
// executable: a Mixtral-shaped Llama (2 MoE layers of 4 experts, top-2, dropless, with
// the load-balancing and z losses) cut into pp stages by make_engine, each stage
// replicated dp times with its experts split over ep replicas; 1F1B (and GPipe once) with
// m = 2 micro-batches, 3 AdamW steps in double, clipped at a norm below the gradients'.
// Layouts: pp 2 x dp 2 x ep 2 on four ranks, and pp 1 x dp 4 x ep 2 and ep 4 (the
// experts' average over their dp / ep copies); on two ranks pp 1 x dp 2 x ep 2.
// Reference: one process on the global batch taking the dp x m micro-batches one at a
// time, the cross-entropy and the auxiliary losses (load balancing, z-loss) of each
// scaled by 1/(dp m): a pipeline scales a micro-batch's auxiliary losses by 1/m as its
// cross-entropy (Note [Loss scaling]) and averages over the replicas. Checked within 1e-9: every clip norm, every rank's parameters by
// name, the checkpoint read back into one process, and one more step after resuming
// that checkpoint at ep 1. Bad options are refused with their ids.
// With global_load_balance over the replicas (the token fractions of each micro-batch
// index over the dp replicas): one process taking, for each j, the replicas' j-th
// micro-batches together in one call, the cross-entropy and the auxiliary losses / m.
// Every rank runs every case in the same order; checks use CHECK so no rank skips collectives.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <map>

#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/clip.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_pipeline_ep {

using namespace ptrain;
using ptrain::testing::world;

namespace {

using Real = double;
constexpr double kTol = 1e-9;  // a lost token, a wrong expert or a missing 1/ep moves parameters by > 1e-4
constexpr std::int64_t kSeq = 12, kRowsPerReplica = 4, kSteps = 3;
constexpr int kMicro = 2;
constexpr double kMaxNorm = 0.3;  // below every step's norm: clipping scales each step
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};

nn::LlamaConfig config() {
  nn::LlamaConfig c{.vocab_size = 17, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                    .intermediate_size = 24};
  c.num_experts = 4;
  c.top_k = 2;
  c.moe_intermediate_size = 12;
  c.moe_aux_loss_coef = 0.05;
  c.moe_z_loss_coef = 1e-2;
  return c;
}

std::shared_ptr<nn::Llama<Real>> make_llama(const nn::LlamaConfig& c) {
  Generator g(11);
  return std::make_shared<nn::Llama<Real>>(c, g);
}

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch rows_of(const Batch& b, std::int64_t first, std::int64_t rows) {
  return {b.ids.narrow(first, rows), b.targets.narrow(first * kSeq, rows * kSeq)};
}
Batch global_batch(int dp, std::int64_t step) {
  Generator g(500 + static_cast<std::uint64_t>(step));
  const std::int64_t rows = kRowsPerReplica * dp;
  Batch b{Tensor<std::int32_t>::empty({rows, kSeq}), Tensor<std::int32_t>::empty({rows * kSeq})};
  for (std::int64_t i = 0; i < rows * kSeq; ++i) {
    b.ids.data()[i] = static_cast<std::int32_t>(g.below(17));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(17));
  }
  return b;
}

// One process, `steps` steps: each the dp x m micro-batches of the global batch in turn.
struct Reference {
  std::map<std::string, std::vector<Real>> params;  // after the last step, by name
  std::vector<Real> values;                         // the same, flat
  std::vector<double> norms;                        // each step's norm before clipping
};
// The rows [first, first + rows) of `b` for each first in `firsts`, in that order.
Batch cat_rows(const Batch& b, const std::vector<std::int64_t>& firsts, std::int64_t rows) {
  const auto n = static_cast<std::int64_t>(firsts.size()) * rows;
  Batch out{Tensor<std::int32_t>::empty({n, kSeq}), Tensor<std::int32_t>::empty({n * kSeq})};
  std::int64_t at = 0;
  for (std::int64_t f : firsts)
    for (std::int64_t i = 0; i < rows * kSeq; ++i, ++at) {
      out.ids.data()[at] = b.ids.data()[f * kSeq + i];
      out.targets.data()[at] = b.targets.data()[f * kSeq + i];
    }
  return out;
}

Reference reference(int dp, std::int64_t steps, bool global_aux) {
  const std::int64_t rows = kRowsPerReplica / kMicro, calls = global_aux ? kMicro : dp * kMicro;
  nn::LlamaConfig c = config();
  c.moe_aux_loss_coef /= double(calls);
  c.moe_z_loss_coef /= double(calls);
  auto model = make_llama(c);
  nn::FlatParameters<Real> params(*model);
  optim::AdamW<Real> opt(params, kAdam);
  Reference out;
  for (std::int64_t s = 0; s < steps; ++s) {
    const Batch global = global_batch(dp, s);
    params.zero_grad();
    for (std::int64_t k = 0; k < calls; ++k) {
      std::vector<std::int64_t> firsts;  // replica k / m's micro-batch k % m, or micro-batch k of every replica
      if (global_aux)
        for (int r = 0; r < dp; ++r) firsts.push_back(r * kRowsPerReplica + k * rows);
      else
        firsts.push_back(k * rows);
      const Batch b = cat_rows(global, firsts, rows);
      nn::CrossEntropyLoss<Real> ce;
      nn::Cache<Real> cache, lc;
      auto logits = model->forward_tokens(b.ids, cache);
      ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc);
      model->backward(ce.backward(lc, 1.0 / double(calls)).reshape(logits.shape()), cache);
    }
    out.norms.push_back(optim::clip_grad_norm_(params.grads(), kMaxNorm));
    opt.step();
  }
  for (auto& p : model->named_parameters()) out.params[p.name] = p.param->value.to_vector();
  out.values = params.values().to_vector();
  return out;
}

double rel_diff(const std::vector<Real>& got, const std::vector<Real>& ref) {
  REQUIRE(got.size() == ref.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(got[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return diff / scale;
}

std::unique_ptr<parallel::Engine<Real>> make_pipeline(int pp, int ep, bool global_aux = false,
                                                      parallel::Schedule schedule = parallel::Schedule::OneFOneB) {
  auto engine = parallel::make_engine<Real>(
      make_llama(config()), world(),
      parallel::PipelinePlan<Real>{.stages = pp,
                                   .options = {.schedule = schedule, .micro_batches = kMicro, .expert_parallel = ep}});
  if (global_aux) parallel::global_load_balance(engine->local_module(), *engine->data_parallel_group());
  return engine;
}

// Steps [from, to) on this replica's rows; each step's clip norm to `norms`.
void train(parallel::Engine<Real>& engine, optim::AdamW<Real>& opt, std::int64_t from, std::int64_t to,
           std::vector<double>& norms) {
  dist::Communicator* dp = engine.data_parallel_group();
  const int replicas = dp ? dp->size() : 1, r = dp ? dp->rank() : 0;
  for (std::int64_t s = from; s < to; ++s) {
    const Batch mine = rows_of(global_batch(replicas, s), r * kRowsPerReplica, kRowsPerReplica);
    engine.zero_grad();
    engine.forward_backward(mine.ids, mine.targets);
    norms.push_back(engine.clip_grad_norm_(kMaxNorm));
    engine.step(opt);
  }
}

// This rank's parameters (its stage's dense ones and its experts, by global name) against the reference.
double stage_diff(parallel::Engine<Real>& engine, const Reference& ref) {
  double worst = 0;
  for (auto& e : engine.parameters().entries()) {
    const auto it = ref.params.find(e.name);
    CHECK(it != ref.params.end());
    if (it != ref.params.end()) worst = std::max(worst, rel_diff(e.param->value.to_vector(), it->second));
  }
  return worst;
}

struct Layout {
  int pp, dp, ep;
  bool global_aux = false;  // parallel::global_load_balance over the replicas
  parallel::Schedule schedule = parallel::Schedule::OneFOneB;
};
std::vector<Layout> layouts(int n) {
  if (n == 2) return {{1, 2, 2}, {1, 2, 2, true}};
  if (n == 4) return {{2, 2, 2}, {2, 2, 2, true}, {2, 2, 2, false, parallel::Schedule::GPipe}, {1, 4, 2}, {1, 4, 4}};
  return {};
}

}  // namespace

TEST_CASE("pipeline x expert parallelism trains like one process; its checkpoint loads in one process and "
          "resumes at ep 1",
          "[pipeline][ep]") {
  auto& comm = world();
  const auto cases = layouts(comm.size());
  if (cases.empty()) return;  // every rank returns alike
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_pipe_ep_");
  for (const Layout& l : cases) {
    INFO("pp " << l.pp << " x dp " << l.dp << " x ep " << l.ep << (l.global_aux ? ", global balance" : "")
               << ", " << parallel::schedule_name(l.schedule) << ", rank " << comm.rank() << ", "
               << comm.backend());
    const Reference ref = reference(l.dp, kSteps + 1, l.global_aux);
    const Reference ref_before = reference(l.dp, kSteps, l.global_aux);
    auto engine = make_pipeline(l.pp, l.ep, l.global_aux, l.schedule);
    auto& pipe = static_cast<parallel::Pipeline<Real>&>(*engine);
    REQUIRE(pipe.expert_mesh() != nullptr);
    for (auto* moe : parallel::moe_layers(pipe.module())) {  // this replica's E / ep experts
      CHECK(moe->experts().size() == 4 / l.ep);
      CHECK(moe->experts().first() == pipe.expert_mesh()->ep_rank() * (4 / l.ep));
    }
    optim::AdamW<Real> opt(engine->parameters(), kAdam);
    std::vector<double> norms;
    train(*engine, opt, 0, kSteps, norms);
    REQUIRE(norms.size() == static_cast<std::size_t>(kSteps));
    for (std::size_t s = 0; s < norms.size(); ++s) {
      CHECK(ref_before.norms[s] > kMaxNorm);  // clipping did scale the step
      CHECK(std::abs(norms[s] - ref_before.norms[s]) < kTol * ref_before.norms[s]);
    }
    CHECK(stage_diff(*engine, ref_before) < kTol);

    // The checkpoint holds every tensor once under its global name: one process reads the whole model.
    const auto where = dir / ("pp" + std::to_string(l.pp) + "ep" + std::to_string(l.ep) + (l.global_aux ? "g" : "") +
                              parallel::schedule_name(l.schedule));
    if (comm.rank() == 0) std::filesystem::remove_all(where);
    comm.barrier();
    {
      ckpt::CheckpointManager mgr(where, &comm);
      ckpt::save(mgr, kSteps, *engine, &opt);
    }
    {
      auto whole = make_llama(config());
      nn::FlatParameters<Real> back(*whole);
      ckpt::CheckpointManager reader(where);
      reader.load(reader.latest().path, back);
      CHECK(rel_diff(back.values().to_vector(), ref_before.values) < kTol);
    }
    // Resumed at ep 1 (same cut and dp): one more step equals the reference's fourth.
    comm.barrier();
    {
      auto again = make_pipeline(l.pp, 1, l.global_aux);
      CHECK(static_cast<parallel::Pipeline<Real>&>(*again).expert_mesh() == nullptr);
      optim::AdamW<Real> opt1(again->parameters(), kAdam);
      ckpt::CheckpointManager mgr(where, &comm);
      ckpt::load(mgr, mgr.latest().path, *again, &opt1);
      CHECK(stage_diff(*again, ref_before) < kTol);
      std::vector<double> more;
      train(*again, opt1, kSteps, kSteps + 1, more);
      CHECK(std::abs(more.at(0) - ref.norms.at(kSteps)) < kTol * ref.norms.at(kSteps));
      CHECK(stage_diff(*again, ref) < kTol);
    }
    comm.barrier();
  }
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("pipeline x expert parallelism: bad options are refused on every rank", "[pipeline][ep]") {
  auto& comm = world();
  const int n = comm.size();
  // Without a data-parallel group (every rank a stage): nothing to split the experts over.
  CHECK_THROWS_WITH(make_pipeline(n, 2), Catch::Contains("[ptrain.ep.pipeline]"));
  if (n % 2 != 0) return;
  const int dp = 2, pp = n / 2;
  // ep not dividing dp (3), virtual stages, a capacity factor, ep not dividing E, a model without MoE layers.
  CHECK_THROWS_WITH(make_pipeline(pp, 3), Catch::Contains("[ptrain.ep.pipeline]"));
  if (pp >= 2)  // interleaving needs two stages
  CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(config()), comm,
                                                parallel::PipelinePlan<Real>{
                                                    .stages = pp,
                                                    .options = {.schedule = parallel::Schedule::Interleaved,
                                                                .micro_batches = 2 * pp,
                                                                .virtual_stages = 2,
                                                                .expert_parallel = dp}}),
                    Catch::Contains("[ptrain.ep.pipeline]"));
  nn::LlamaConfig capped = config();
  capped.moe_capacity_factor = 1.0;
  CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(capped), comm,
                                                parallel::PipelinePlan<Real>{
                                                    .stages = pp, .options = {.micro_batches = 2, .expert_parallel = dp}}),
                    Catch::Contains("[ptrain.ep.pipeline]"));
  nn::LlamaConfig three = config();  // 3 experts: ep 2 does not divide them
  three.num_experts = 3;
  CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(three), comm,
                                                parallel::PipelinePlan<Real>{
                                                    .stages = pp, .options = {.micro_batches = 2, .expert_parallel = dp}}),
                    Catch::Contains("[ptrain.ep.experts]"));
  nn::LlamaConfig dense = config();
  dense.num_experts = 0;
  CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(dense), comm,
                                                parallel::PipelinePlan<Real>{
                                                    .stages = pp, .options = {.micro_batches = 2, .expert_parallel = dp}}),
                    Catch::Contains("[ptrain.ep.model]"));
}

}  // namespace test_pipeline_ep
