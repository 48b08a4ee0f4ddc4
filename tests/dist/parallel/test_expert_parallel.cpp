// Expert parallelism (parallel/expert_parallel.hpp) through DDP (and FSDP: the [fsdp] cases,
// checkpoints across the two, global load balancing [aux]): a Llama whose blocks
// are mixtures of experts, its experts split over ep ranks (and dp = world / ep copies
// of each split), trained a few AdamW steps in double (and in float), against one process:
// - dropless, with the load-balancing loss (computed on each rank's tokens): one process
//   that takes the global batch as one micro-batch per rank, the loss and the auxiliary
//   coefficients divided by the world size as DDP's average does;
// - with a capacity factor (and shared experts), without the load-balancing loss: one
//   process on the global batch in one call (the capacity rule over the global batch,
//   Note [Expert-parallel layout]).
// A checkpoint written at ep 2 is loaded at ep 1 (plain DDP) and at ep 4 (on 4 ranks)
// and trained one more step. The routing statistics all-reduced over the ranks equal one
// process's on the global batch, and gather_experts gives rank 0 the whole trained model.
// With tensor parallelism (tp 2 x ep 1, 2 and 4) the same model trains like the same one
// process, and its checkpoints load into one process and at another ep.
// Every rank runs every case in the same order; checks use CHECK so no rank skips collectives.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <type_traits>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/nn/sequential.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/expert_parallel.hpp>
#include <ptrain/parallel/make_engine.hpp>
#include <ptrain/parallel/tensor_parallel.hpp>
#include <ptrain/train/trainer.hpp>

#include "dist/world.hpp"

namespace test_expert_parallel {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// Double, as test_llama_engine.cpp: the ranks add gradients in another order than one
// process, which AdamW amplifies to ~1e-13 relative in double (float is held to the
// issue's bound, 2e-4); a lost token, a wrong expert or a missing 1/ep moves the parameters
// by more than 1e-3.
using Real = double;
template <class T>
constexpr double kTol = std::is_same_v<T, double> ? 1e-9 : 2e-4;
constexpr std::int64_t kSeq = 12, kRowsPerRank = 2, kSteps = 3;
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};

nn::LlamaConfig config(bool capacity, std::int64_t experts = 4) {
  nn::LlamaConfig c{.vocab_size = 17, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                    .intermediate_size = 24};
  c.num_experts = experts;
  c.top_k = 2;
  c.moe_intermediate_size = 12;
  c.moe_z_loss_coef = 1e-2;
  if (capacity) {
    c.moe_capacity_factor = 0.75;  // each expert keeps 9 of 12 slots on average (24 tokens per rank)
    c.moe_shared_size = 8;
  } else {
    c.moe_aux_loss_coef = 0.05;
  }
  return c;
}

// With `freeze`, fine-tuning's freezing (Note [Frozen parameters] in nn/flat_parameters.hpp):
// the token embedding, layer 0's attention and expert 1 of every MoE layer.
template <class T = Real>
std::shared_ptr<nn::Llama<T>> make_llama(const nn::LlamaConfig& c, bool freeze = false) {
  Generator g(11);
  auto m = std::make_shared<nn::Llama<T>>(c, g);
  if (freeze)
    for (auto& p : m->named_parameters())
      if (p.name.rfind("embed_tokens.", 0) == 0 || p.name.rfind("layers.0.self_attn.", 0) == 0 ||
          p.name.find(".experts.1.") != std::string::npos)
        p.param->set_requires_grad(false);
  return m;
}

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  Batch b{Tensor<std::int32_t>::empty({rows, kSeq}), Tensor<std::int32_t>::empty({rows * kSeq})};
  for (std::int64_t i = 0; i < rows * kSeq; ++i) {
    b.ids.data()[i] = static_cast<std::int32_t>(g.below(17));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(17));
  }
  return b;
}
Batch rows_of(const Batch& b, std::int64_t first, std::int64_t rows) {
  return {b.ids.narrow(first, rows), b.targets.narrow(first * kSeq, rows * kSeq)};
}
std::uint64_t seed_of(std::int64_t step) { return 300 + static_cast<std::uint64_t>(step); }

// One process: `steps` AdamW steps on the global batches of a world of n; the batch in
// one call, or, with the load-balancing loss (a product of means over each rank's tokens),
// one call per rank's rows with the loss and the auxiliary coefficients divided by n.
// The parameters after each step and the gradients' norms.
template <class T = Real>
struct Reference {
  std::vector<std::vector<T>> params;
  std::vector<double> norms;
};
// With global_aux (parallel::global_load_balance) the batch in one call also with the
// load-balancing loss.
template <class T = Real>
Reference<T> reference(nn::LlamaConfig c, int n, std::int64_t steps, bool freeze = false, bool global_aux = false) {
  const bool per_rank = c.moe_aux_loss_coef > 0 && !global_aux;
  if (per_rank) {
    c.moe_aux_loss_coef /= n;
    c.moe_z_loss_coef /= n;
  }
  auto model = make_llama<T>(c, freeze);
  nn::FlatParameters<T> params(*model);
  optim::AdamW<T> opt(params, kAdam);
  Reference<T> out;
  for (std::int64_t s = 0; s < steps; ++s) {
    const Batch global = make_batch(kRowsPerRank * n, seed_of(s));
    params.zero_grad();
    const int calls = per_rank ? n : 1;
    for (int r = 0; r < calls; ++r) {
      const Batch b = rows_of(global, r * (global.ids.size(0) / calls), global.ids.size(0) / calls);
      nn::CrossEntropyLoss<T> ce;
      nn::Cache<T> cache, lc;
      auto logits = model->forward_tokens(b.ids, cache);
      ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc);
      model->backward(ce.backward(lc, 1.0 / calls).reshape(logits.shape()), cache);
    }
    out.norms.push_back(std::sqrt(ops::sum_squares(params.grads())));
    opt.step();
    out.params.push_back(params.values().to_vector());
  }
  return out;
}

// Steps [from, to) of the engine on this rank's rows of the global batches; returns the
// token slots the MoE layers of `model` (default: the engine's local module) dropped on
// this rank. Each step's gradient norm (clipping at a bound it never reaches) goes to *norms.
// (Tensor parallelism: the rows of this rank's replica, the same on its tp ranks.)
template <class T>
std::int64_t train(parallel::Engine<T>& engine, optim::AdamW<T>& opt, std::int64_t from, std::int64_t to,
                   std::vector<double>* norms = nullptr, nn::Module<T>* model = nullptr) {
  const int n = engine.communicator().size();
  dist::Communicator* dp = engine.data_parallel_group();
  const std::int64_t rows = kRowsPerRank * n / (dp ? dp->size() : 1), r = dp ? dp->rank() : 0;
  std::int64_t dropped = 0;
  for (std::int64_t s = from; s < to; ++s) {
    const Batch mine = rows_of(make_batch(kRowsPerRank * n, seed_of(s)), r * rows, rows);
    engine.zero_grad();
    engine.forward_backward(mine.ids, mine.targets);
    const double norm = engine.clip_grad_norm_(1e9);
    if (norms) norms->push_back(norm);
    engine.step(opt);
    for (auto* moe : parallel::moe_layers(model ? *model : engine.local_module())) dropped += moe->stats().dropped;
  }
  return dropped;
}

// The whole model's parameters through the engine's checkpoint, read back into one process.
template <class T>
std::vector<T> whole_parameters(parallel::Engine<T>& engine, optim::AdamW<T>& opt, const nn::LlamaConfig& c,
                                const std::filesystem::path& where, bool freeze = false) {
  auto& comm = engine.communicator();
  if (comm.rank() == 0) std::filesystem::remove_all(where);
  comm.barrier();
  ckpt::CheckpointManager mgr(where, &comm);
  ckpt::save(mgr, kSteps, engine, &opt, {});
  auto whole = make_llama<T>(c, freeze);
  nn::FlatParameters<T> back(*whole);
  const auto frozen_before = back.frozen_values().to_vector();
  ckpt::CheckpointManager reader(where);
  reader.load(reader.latest().path, back);
  CHECK(back.frozen_values().to_vector() == frozen_before);  // frozen experts and layers saved, unchanged
  return back.values().to_vector();
}

template <class T>
double rel_diff(const std::vector<T>& got, const std::vector<T>& ref) {
  REQUIRE(got.size() == ref.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(double(got[i]) - double(ref[i])));
    scale = std::max(scale, std::abs(double(ref[i])));
  }
  return diff / scale;
}

std::vector<int> ep_degrees(int n) {
  std::vector<int> out;
  for (int ep : {2, 4})
    if (n % ep == 0) out.push_back(ep);
  return out;
}

}  // namespace

// Every ep degree that divides the world, dropless and with a capacity factor, in T.
template <class T>
void trains_like_one_process(const char* tmp_prefix) {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, tmp_prefix);
  for (bool capacity : {false, true}) {
    const nn::LlamaConfig c = config(capacity);
    const auto ref = reference<T>(c, n, kSteps);
    for (int ep : ep_degrees(n)) {
      INFO((capacity ? "capacity" : "dropless") << ", ep " << ep << " x dp " << n / ep << ", " << comm.backend()
                                                << (std::is_same_v<T, float> ? ", float" : ", double"));
      auto engine = parallel::make_engine<T>(make_llama<T>(c), comm,
                                             parallel::DDPOptions{.first_bucket_bytes = 256, .expert_parallel = ep});
      auto& ddp = static_cast<parallel::DDP<T>&>(*engine);
      // This rank holds experts [e E/ep, (e+1) E/ep) of each layer, under their global names.
      auto layers = parallel::moe_layers(engine->local_module());
      REQUIRE(layers.size() == 2);
      CHECK(layers[0]->experts().size() == 4 / ep);
      CHECK(layers[0]->experts().first() == ddp.expert_mesh()->ep_rank() * (4 / ep));
      optim::AdamW<T> opt(engine->parameters(), kAdam);
      std::vector<double> norms;
      std::int64_t dropped = train(*engine, opt, 0, kSteps, &norms);
      comm.all_reduce(&dropped, 1, DType::I64, dist::ReduceOp::Sum);
      CHECK((dropped > 0) == capacity);  // the capacity case does drop
      // Clipping sees the whole model's gradient norm (the experts' squares summed over ep).
      for (std::size_t s = 0; s < norms.size(); ++s)
        CHECK(std::abs(norms[s] - ref.norms[s]) < kTol<T> * ref.norms[s]);
      const auto got = whole_parameters(*engine, opt, c, dir / ("ep" + std::to_string(ep)));
      CHECK(rel_diff(got, ref.params.back()) < kTol<T>);
      // gather_experts: rank 0's own model holds every trained expert again and runs alone.
      parallel::gather_experts(engine->local_module(), *ddp.expert_mesh(), comm);
      if (comm.rank() == 0) {
        std::vector<T> whole;
        for (auto& p : engine->local_module().named_parameters()) {
          const auto v = p.param->value.to_vector();
          whole.insert(whole.end(), v.begin(), v.end());
        }
        CHECK(rel_diff(whole, ref.params.back()) < kTol<T>);
        CHECK(parallel::moe_layers(engine->local_module())[0]->experts().size() == 4);
      }
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

// Expert parallelism with tensor parallelism (Note [Expert parallelism x TP] in
// parallel/tp_moe.hpp): tp 2 x ep 2 (dp 2 on 4 ranks: the expert-parallel groups are the
// tp groups), tp 2 x ep 4 (one group over dp and tp) and tp 2 x ep 1, against the same
// one process as DDP: each world rank routes its own slice of the global batch; dropless,
// with a capacity, and with a dense (tensor-parallel) MLP in layer 0 (moe_every 2). The
// checkpoint loads into one process and resumes, one more step, at another ep degree.
template <class T>
void tensor_parallel_trains_like_one_process(const char* tmp_prefix) {
  auto& comm = world();
  const int n = comm.size();
  if (n % 2 != 0) return;  // every rank returns alike
  const auto dir = ptrain::testing::shared_tmp_dir(comm, tmp_prefix);
  for (int kind : {0, 1, 2}) {  // dropless, capacity, dropless with a dense layer 0
    const bool capacity = kind == 1;
    nn::LlamaConfig c = config(capacity);
    if (kind == 2) c.moe_every = 2;
    const auto ref = reference<T>(c, n, kSteps + 1);
    std::vector<int> eps{2, 1};
    if (n % 4 == 0) eps.push_back(4);
    for (int ep : eps) {
      INFO((capacity ? "capacity" : "dropless") << ", moe_every " << c.moe_every << ", tp 2 x ep " << ep << " on "
                                                << n << " ranks, "
                                                << comm.backend() << (std::is_same_v<T, float> ? ", float" : ""));
      const parallel::TensorParallelPlan plan{.tp = 2, .expert_parallel = ep};
      auto engine = parallel::make_engine<T>(make_llama<T>(c), comm, plan);
      auto& tp = static_cast<parallel::TensorParallel<T>&>(*engine);
      CHECK(parallel::moe_layers(engine->local_module()).back()->experts().first() ==
            tp.expert_mesh()->ep_rank() * (4 / ep));
      optim::AdamW<T> opt(engine->parameters(), kAdam);
      std::vector<double> norms;
      std::int64_t dropped = train(*engine, opt, 0, kSteps, &norms);
      comm.all_reduce(&dropped, 1, DType::I64, dist::ReduceOp::Sum);
      CHECK((dropped > 0) == capacity);
      for (std::size_t s = 0; s < norms.size(); ++s) CHECK(std::abs(norms[s] - ref.norms[s]) < kTol<T> * ref.norms[s]);
      const auto saved = dir / ("tp2_ep" + std::to_string(ep));
      CHECK(rel_diff(whole_parameters(*engine, opt, c, saved), ref.params[kSteps - 1]) < kTol<T>);
      // Resumed at tp 2 x another ep degree for one more step.
      const parallel::TensorParallelPlan other{.tp = 2, .expert_parallel = ep == 2 ? 1 : 2};
      auto resumed = parallel::make_engine<T>(make_llama<T>(c), comm, other);
      optim::AdamW<T> opt2(resumed->parameters(), kAdam);
      ckpt::CheckpointManager mgr(saved, &comm);
      ckpt::load(mgr, mgr.latest().path, *resumed, &opt2);
      CHECK(opt2.steps() == kSteps);
      train(*resumed, opt2, kSteps, kSteps + 1);
      CHECK(rel_diff(whole_parameters(*resumed, opt2, c, dir / ("resumed" + std::to_string(ep))), ref.params[kSteps]) <
            kTol<T>);
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Expert parallelism with tensor parallelism trains like one process", "[ep][tp]") {
  tensor_parallel_trains_like_one_process<double>("ptrain_ep_tp_");
  tensor_parallel_trains_like_one_process<float>("ptrain_ep_tp_float_");
}

TEST_CASE("Expert-parallel Llama MoE trains like one process", "[ep]") {
  trains_like_one_process<double>("ptrain_ep_");
}

// The issue's float bound: 2e-4 relative after the same AdamW steps.
TEST_CASE("Expert-parallel Llama MoE trains like one process in float", "[ep][float]") {
  trains_like_one_process<float>("ptrain_ep_float_");
}

// FSDP with expert parallelism (Note [FSDP with expert parallelism] in parallel/fsdp.hpp):
// the dense parameters sharded over the world, each rank's experts over the dp ranks that
// hold them; every ep degree that divides the world, dropless and with a capacity factor,
// against the same one process as DDP's (clip norms included); dropless also under
// shard_grad_op and shard_optimizer. Under full_shard the engine keeps 1/n of the model
// (values and gradients: its live bytes), and full_parameters() with gather_experts gives
// rank 0 the whole trained model.
template <class T>
void fsdp_trains_like_one_process(const char* tmp_prefix) {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, tmp_prefix);
  for (bool capacity : {false, true}) {
    const nn::LlamaConfig c = config(capacity);
    const auto ref = reference<T>(c, n, kSteps);
    const std::int64_t whole = nn::FlatParameters<T>(*make_llama<T>(c)).numel();
    using parallel::ShardingStrategy;
    std::vector<std::pair<int, ShardingStrategy>> runs;
    for (int ep : ep_degrees(n))
      for (auto st : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer})
        if (!capacity || st == ShardingStrategy::FullShard) runs.emplace_back(ep, st);
    for (const auto& [ep, st] : runs) {
      INFO((capacity ? "capacity" : "dropless") << ", fsdp " << parallel::strategy_name(st) << ", ep " << ep << " x dp "
                                                << n / ep << ", " << comm.backend()
                                                << (std::is_same_v<T, float> ? ", float" : ", double"));
      const std::int64_t before = memory_stats().live_bytes;
      auto model = make_llama<T>(c);
      auto engine =
          parallel::make_engine<T>(model, comm, parallel::FSDPOptions{.strategy = st, .expert_parallel = ep});
      const std::int64_t kept = memory_stats().live_bytes - before;
      auto& fsdp = static_cast<parallel::FSDP<T>&>(engine->local_module());
      auto layers = parallel::moe_layers(*model);
      REQUIRE(layers.size() == 2);
      CHECK(layers[0]->experts().size() == 4 / ep);
      CHECK(layers[0]->experts().first() == fsdp.expert_mesh()->ep_rank() * (4 / ep));
      // Sharding: a shard of each group (padded to its group's size) per rank, 1/n of the
      // model; the shards of all ranks hold it once. Values and gradients, nothing else kept
      // (the model's full tensors and the other ranks' experts are released).
      const std::int64_t local = engine->parameters().numel();
      std::int64_t total = local, buffers = 0;
      comm.all_reduce(&total, 1, DType::I64, dist::ReduceOp::Sum);
      CHECK(local <= whole / n + static_cast<std::int64_t>(fsdp.num_groups()));
      CHECK((total >= whole && total <= whole + n * static_cast<std::int64_t>(fsdp.num_groups())));
      for (const auto& b : engine->parameters().buffers()) buffers += b.buffer->numel();
      if (st == ShardingStrategy::FullShard)
        CHECK(kept == static_cast<std::int64_t>(sizeof(T)) * (2 * local + buffers));
      optim::AdamW<T> opt(engine->parameters(), kAdam);
      std::vector<double> norms;
      std::int64_t dropped = train(*engine, opt, 0, kSteps, &norms, model.get());
      comm.all_reduce(&dropped, 1, DType::I64, dist::ReduceOp::Sum);
      CHECK((dropped > 0) == capacity);
      // Clipping sees the whole model's gradient norm: every shard's squares once, over the world.
      for (std::size_t s = 0; s < norms.size(); ++s)
        CHECK(std::abs(norms[s] - ref.norms[s]) < kTol<T> * ref.norms[s]);
      // The sharded checkpoint read back in one process.
      CHECK(rel_diff(whole_parameters(*engine, opt, c, dir / ("fsdp" + std::to_string(ep))), ref.params.back()) <
            kTol<T>);
      // As gpt_char: the model's own parameters bound to full_parameters() (the dense ones and
      // this rank's experts), then gather_experts gives rank 0 every expert.
      std::map<std::string, Tensor<T>> full;
      for (auto& [name, value] : fsdp.full_parameters()) full[name] = value;
      for (auto& p : model->named_parameters()) p.param->value = full.at(p.name);
      parallel::gather_experts(*model, *fsdp.expert_mesh(), comm);
      if (comm.rank() == 0) {
        std::vector<T> got;
        for (auto& p : model->named_parameters()) {
          const auto v = p.param->value.to_vector();
          got.insert(got.end(), v.begin(), v.end());
        }
        CHECK(static_cast<std::int64_t>(got.size()) == whole);
        CHECK(rel_diff(got, ref.params.back()) < kTol<T>);
      }
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("FSDP with expert parallelism trains a Llama MoE like one process", "[ep][fsdp]") {
  fsdp_trains_like_one_process<double>("ptrain_ep_fsdp_");
}

TEST_CASE("FSDP with expert parallelism trains a Llama MoE like one process in float", "[ep][fsdp][float]") {
  fsdp_trains_like_one_process<float>("ptrain_ep_fsdp_float_");
}

// FSDP(num_units, make_unit, ...) shards each unit's experts as it builds it: the same
// pieces of the same parameters (in another order: its groups follow the units) as
// make_engine on the built model, and the same after a step (up to rounding).
TEST_CASE("FSDP with expert parallelism builds its units one at a time", "[ep][fsdp]") {
  auto& comm = world();
  if (comm.size() % 2 != 0) return;  // every rank returns alike
  const nn::LlamaConfig c = config(true);
  auto whole = make_llama(c);
  auto engine = parallel::make_engine<Real>(whole, comm, parallel::FSDPOptions{.expert_parallel = 2});
  auto& fsdp = static_cast<parallel::FSDP<Real>&>(engine->local_module());
  auto model = make_llama(c);
  const auto units = model->units();
  parallel::FSDP<Real> built(
      units.size(), [&](std::size_t u) { return units[u]; }, comm,
      parallel::FSDPOptions{.unit_names = model->unit_names(), .expert_parallel = 2});
  auto pieces = [](parallel::FSDP<Real>& f) {
    std::map<std::string, std::vector<Real>> out;
    for (const auto& p : f.shard_pieces())
      out[p.name + "@" + std::to_string(p.param_offset)] = f.piece_values(p).to_vector();
    return out;
  };
  CHECK(pieces(built) == pieces(fsdp));
  optim::AdamW<Real> a(engine->parameters(), kAdam), b(built.parameters(), kAdam);
  train(*engine, a, 0, 1, nullptr, whole.get());
  train<Real>(built, b, 0, 1, nullptr, model.get());
  // The same up to rounding: the buffers' other layout moves elements between vector and scalar loops.
  const auto got = pieces(built), want = pieces(fsdp);
  CHECK(got.size() == want.size());
  for (const auto& [name, values] : got)
    if (want.count(name)) CHECK(rel_diff(values, want.at(name)) < 1e-14);
  comm.barrier();
}

// parallel::global_load_balance: the load-balancing loss's fractions over all ranks, so
// plain DDP and FSDP and both at every ep degree, dropless with the load-balancing loss,
// equal one process taking the global batch in one call (each rank's own fractions give
// the other reference, one micro-batch per rank: the two differ).
TEST_CASE("Global load balancing trains like one process on the global batch", "[ep][aux]") {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_ep_aux_");
  const nn::LlamaConfig c = config(false);
  const auto ref = reference(c, n, kSteps, false, true);
  if (n > 1) CHECK(rel_diff(reference(c, n, kSteps).params.back(), ref.params.back()) > 1e-6);
  std::vector<int> degrees{1};
  for (int ep : ep_degrees(n)) degrees.push_back(ep);
  for (int ep : degrees)
    for (bool fsdp : {false, true}) {
      INFO("global aux, ep " << ep << " x dp " << n / ep << (fsdp ? ", fsdp, " : ", ddp, ") << comm.backend());
      auto model = make_llama(c);
      auto engine = parallel::make_engine<Real>(
          model, comm,
          fsdp ? parallel::Plan<Real>{parallel::FSDPOptions{.expert_parallel = ep}}
               : parallel::Plan<Real>{parallel::DDPOptions{.expert_parallel = ep}});
      parallel::global_load_balance(*model, comm);
      optim::AdamW<Real> opt(engine->parameters(), kAdam);
      std::vector<double> norms;
      train(*engine, opt, 0, kSteps, &norms, model.get());
      for (std::size_t s = 0; s < norms.size(); ++s)
        CHECK(std::abs(norms[s] - ref.norms[s]) < kTol<Real> * ref.norms[s]);
      CHECK(rel_diff(whole_parameters(*engine, opt, c, dir / "aux"), ref.params.back()) < kTol<Real>);
    }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

// The routing statistics after all_reduce_moe_stats describe the step over all ranks, as
// one process sees it: the counts (and so the imbalance) and the drops of one process on
// the global batch in one call (dropless, and with a capacity under expert parallelism,
// whose rule is the global batch's), exactly; plain DDP applies the capacity to each rank's
// tokens: then one process taking one micro-batch per rank. The auxiliary losses (each
// rank's, on its own tokens) are the mean over those micro-batches. Plain data parallelism
// (ep 1) and every ep degree that divides the world.
TEST_CASE("MoE routing statistics over all ranks equal one process's", "[ep][metrics]") {
  auto& comm = world();
  const int n = comm.size();
  const Batch global = make_batch(kRowsPerRank * n, seed_of(0));
  for (bool capacity : {false, true}) {
    const nn::LlamaConfig c = config(capacity);
    // One process: the global batch in one forward (calls 1) or one per rank's rows (calls n).
    auto one_process = [&](int calls) {
      std::vector<nn::MoeStats> want(2);
      auto model = make_llama(c);
      for (int r = 0; r < calls; ++r) {
        const Batch b = rows_of(global, r * (kRowsPerRank * n / calls), kRowsPerRank * n / calls);
        nn::Cache<Real> cache;
        model->forward_tokens(b.ids, cache);
        const auto layers = parallel::moe_layers(*model);
        for (std::size_t l = 0; l < 2; ++l) {
          const nn::MoeStats& s = layers[l]->stats();
          auto& w = want[l];
          w.tokens_per_expert.resize(s.tokens_per_expert.size());
          for (std::size_t e = 0; e < s.tokens_per_expert.size(); ++e) w.tokens_per_expert[e] += s.tokens_per_expert[e];
          w.dropped += s.dropped;
          w.aux_loss += s.aux_loss / calls;
          w.z_loss += s.z_loss / calls;
          w.loss += s.loss / calls;
        }
      }
      return want;
    };
    const auto whole = one_process(1), per_rank = one_process(n);
    if (capacity && n > 1)  // the two rules drop different slots here (so the checks below tell them apart)
      CHECK((whole[0].dropped != per_rank[0].dropped || whole[1].dropped != per_rank[1].dropped));
    std::vector<int> degrees{1};
    for (int ep : ep_degrees(n)) degrees.push_back(ep);
    for (int ep : degrees) {
      INFO((capacity ? "capacity" : "dropless") << ", ep " << ep << " x dp " << n / ep << ", " << comm.backend());
      auto engine = parallel::make_engine<Real>(make_llama(c), comm, parallel::DDPOptions{.expert_parallel = ep});
      const Batch mine = rows_of(global, comm.rank() * kRowsPerRank, kRowsPerRank);
      engine->forward_backward(mine.ids, mine.targets);
      parallel::all_reduce_moe_stats(engine->local_module(), comm);
      std::map<std::string, double> got;
      for (const auto& [name, value] : engine->local_module().named_metrics()) got[name] = value;
      const auto layers = parallel::moe_layers(engine->local_module());
      // Which drops: the global batch's rule under ep > 1, each rank's under plain DDP.
      const auto& want = capacity && ep == 1 ? per_rank : whole;
      for (std::size_t l = 0; l < 2; ++l) {
        const std::string p = "layers." + std::to_string(l) + ".block_sparse_moe.";
        const auto& w = want[l];
        std::int64_t total = 0, most = 0;
        for (std::size_t e = 0; e < 4; ++e) {
          CHECK(got.at(p + "tokens_per_expert." + std::to_string(e)) == double(w.tokens_per_expert[e]));
          total += w.tokens_per_expert[e];
          most = std::max(most, w.tokens_per_expert[e]);
        }
        CHECK(total == kRowsPerRank * n * kSeq * 2);  // every token's k = 2 slots
        CHECK(got.at(p + "load_imbalance") == Approx(double(most) / (double(total) / 4)).epsilon(1e-15));
        CHECK(got.at(p + "dropped") == double(w.dropped));
        CHECK((w.dropped > 0) == capacity);
        CHECK(got.at(p + "z_loss") == Approx(w.z_loss).epsilon(1e-12));  // a mean over tokens: any split
        // Means of products over each rank's tokens; layer 1's routing follows layer 0's drops.
        if (!capacity || ep == 1) {
          CHECK(got.at(p + "aux_loss") == Approx(per_rank[l].aux_loss).epsilon(1e-12));
          CHECK(got.at(p + "moe_loss") == Approx(per_rank[l].loss).epsilon(1e-12));
        }
        CHECK(layers[l]->window_stats().mean_load == double(total) / 4);
        CHECK(layers[l]->window().forwards == n);
      }
    }
  }
  comm.barrier();
}

// Frozen parameters, frozen experts among them, under expert parallelism (DDP and FSDP): only trainable
// gradients are reduced, and the checkpoint holds every frozen tensor (each expert from
// the rank that holds it), unchanged bit for bit.
// The Trainer's records carry the routing of every micro-batch of the steps since the previous
// record, over all ranks (Note [MoE metrics window] in nn/moe.hpp): plain DDP and ep 2 (even
// worlds), an MoE layer with a capacity over 6 features, 2 micro-batches per step, a record
// every 2 steps, an evaluation every step. The reference is what stats() said after each
// training forward on each rank (a wrapper keeps them): each record equals those of its
// window summed (counts, drops) or averaged (losses) over the forwards and the ranks (the
// test's own all-reduce); the counts add up to every rank's tokens of the window times k.
TEST_CASE("Trainer records MoE routing over all ranks", "[ep][metrics]") {
  // nn::MoE as it is (no level added to the names), keeping each training forward's stats().
  struct MoeSpy : nn::Module<Real> {
    explicit MoeSpy(std::shared_ptr<nn::MoE<Real>> m) : moe(std::move(m)) { this->register_module("", moe); }
    Tensor<Real> forward(const Tensor<Real>& x, nn::Cache<Real>& cache) override {
      auto y = moe->forward(x, cache);
      if (this->training()) seen.push_back(moe->stats());
      return y;
    }
    Tensor<Real> backward(const Tensor<Real>& dy, nn::Cache<Real>& cache) override { return moe->backward(dy, cache); }
    std::string describe() const override { return "MoeSpy(" + moe->describe() + ")"; }
    std::shared_ptr<nn::MoE<Real>> moe;
    std::vector<nn::MoeStats> seen;
  };
  auto& comm = world();
  const int n = comm.size();
  constexpr std::int64_t kBatch = 4, kFeatures = 6, kSteps = 4, kAccum = 2, kEvery = 2;
  constexpr std::int64_t kWindow = kEvery * kAccum;  // a record's forwards on each rank
  Generator gd(21);
  auto x = Tensor<Real>::empty({kBatch * n * kSteps, kFeatures});
  auto y = Tensor<std::int32_t>::empty({kBatch * n * kSteps});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data()[i] = gd.uniform() * 2 - 1;
  for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] = static_cast<std::int32_t>(gd.below(3));
  TensorDataset<Real> data(x, y);
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_ep_trainer_");
  if (comm.rank() == 0) std::filesystem::create_directories(dir);
  comm.barrier();
  std::vector<int> degrees{1};
  if (n % 2 == 0) degrees.push_back(2);
  for (int ep : degrees) {
    INFO("ep " << ep << " x dp " << n / ep << ", " << comm.backend());
    Generator g(9);
    auto model = std::make_shared<nn::Sequential<Real>>();
    const auto spy = model->add(std::make_shared<MoeSpy>(std::make_shared<nn::MoE<Real>>(
        nn::MoeConfig{.n_embd = kFeatures, .num_experts = 4, .top_k = 2, .expert_hidden = 4, .capacity_factor = 0.7,
                      .aux_loss_coef = 0.1, .z_loss_coef = 0.01},
        g)));
    model->add(std::make_shared<nn::Linear<Real>>(kFeatures, 3, true, g));
    auto engine = parallel::make_engine<Real>(model, comm, parallel::DDPOptions{.expert_parallel = ep});
    optim::AdamW<Real> opt(engine->parameters(), kAdam);
    const std::string metrics = (dir / ("m" + std::to_string(ep) + ".jsonl")).string();
    train::Trainer<Real> trainer(*engine, opt, data,
                                 {.batch = kBatch, .grad_accum = kAccum, .log_every = kEvery, .eval_every = 1,
                                  .metrics = metrics});
    trainer.evaluate = [&](parallel::Engine<Real>& e) {  // collective: under ep its forward is an all-to-all
      return nlohmann::json{{"eval_loss", e.eval_loss(x.narrow(0, 3), y.narrow(0, 3))}};
    };
    CHECK(trainer.run().step == kSteps);
    CHECK(spy->seen.size() == std::size_t(kSteps * kAccum));  // evaluations left out
    // Per record: 4 counts, dropped, aux_loss, z_loss, loss; summed over its forwards and the ranks.
    std::vector<double> want(std::size_t(kSteps / kEvery * 8), 0.0);
    for (std::size_t f = 0; f < spy->seen.size() && f < std::size_t(kSteps * kAccum); ++f) {
      const nn::MoeStats& s = spy->seen[f];
      double* w = want.data() + f / kWindow * 8;
      for (std::size_t e = 0; e < 4; ++e) w[e] += double(s.tokens_per_expert[e]);
      w[4] += double(s.dropped);
      w[5] += s.aux_loss;
      w[6] += s.z_loss;
      w[7] += s.loss;
    }
    comm.all_reduce(want.data(), want.size(), DType::F64, dist::ReduceOp::Sum);
    if (comm.rank() != 0) continue;
    std::ifstream in(metrics);
    std::vector<nlohmann::json> recs;
    for (std::string line; std::getline(in, line);)
      if (auto j = nlohmann::json::parse(line); j.contains("loss")) recs.push_back(j);
    REQUIRE(recs.size() == std::size_t(kSteps / kEvery));
    for (std::size_t r = 0; r < recs.size(); ++r) {
      const nlohmann::json& rec = recs[r];
      const double* w = want.data() + r * 8;
      INFO("record at step " << rec.value("step", 0));
      CHECK(rec.value("step", 0) == std::int64_t(r + 1) * kEvery);
      double total = 0, most = 0;
      for (std::size_t e = 0; e < 4; ++e) {
        const double c = rec.at("0.tokens_per_expert." + std::to_string(e)).get<double>();
        CHECK(c == w[e]);
        total += c;
        most = std::max(most, c);
      }
      CHECK(total == double(kBatch * n * kEvery * 2));  // every rank's rows of the window, k = 2 slots each
      CHECK(rec.at("0.load_imbalance").get<double>() == most / (total / 4));
      CHECK(rec.at("0.dropped").get<double>() == w[4]);
      CHECK(w[4] > 0);
      const double forwards = double(n * kWindow);
      CHECK(rec.at("0.aux_loss").get<double>() == Approx(w[5] / forwards).epsilon(1e-12));
      CHECK(rec.at("0.z_loss").get<double>() == Approx(w[6] / forwards).epsilon(1e-12));
      CHECK(rec.at("0.moe_loss").get<double>() == Approx(w[7] / forwards).epsilon(1e-12));
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Expert-parallel Llama MoE with frozen experts and layers trains like one process", "[ep][frozen]") {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_ep_frozen_");
  const nn::LlamaConfig c = config(false);
  const auto ref = reference(c, n, kSteps, true);
  for (int ep : ep_degrees(n))
    for (bool fsdp : {false, true}) {
      INFO("frozen, ep " << ep << " x dp " << n / ep << (fsdp ? ", fsdp, " : ", ddp, ") << comm.backend());
      auto model = make_llama(c, true);
      auto engine = parallel::make_engine<Real>(
          model, comm,
          fsdp ? parallel::Plan<Real>{parallel::FSDPOptions{.expert_parallel = ep}}
               : parallel::Plan<Real>{parallel::DDPOptions{.first_bucket_bytes = 256, .expert_parallel = ep}});
      if (!fsdp) {
        auto& ddp = static_cast<parallel::DDP<Real>&>(*engine);
        std::int64_t frozen_experts = 0;
        for (std::size_t i = 0; i < ddp.parameters().frozen_entries().size(); ++i)
          frozen_experts += ddp.is_frozen_expert(i);
        comm.all_reduce(&frozen_experts, 1, DType::I64, dist::ReduceOp::Sum);
        CHECK(frozen_experts == 2 * 3 * (n / ep));  // 2 layers x w1, w2, w3, on each replica
      }
      optim::AdamW<Real> opt(engine->parameters(), kAdam);
      std::vector<double> norms;
      train(*engine, opt, 0, kSteps, &norms, model.get());
      for (std::size_t s = 0; s < norms.size(); ++s)
        CHECK(std::abs(norms[s] - ref.norms[s]) < kTol<Real> * ref.norms[s]);
      const auto got = whole_parameters(*engine, opt, c, dir / ("ep" + std::to_string(ep)), true);
      CHECK(rel_diff(got, ref.params.back()) < kTol<Real>);
    }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

// Saved at ep 2 under DDP and under FSDP (whose pieces keep the experts' global names), the
// checkpoint loads in one process (whole_parameters), and resumes under DDP and FSDP at
// ep 1 (every rank all experts), ep 2 in the other engine and ep 4 (on 4 ranks), one more
// step equal to one process's.
TEST_CASE("An expert-parallel checkpoint resumes at another ep degree", "[ep]") {
  auto& comm = world();
  const int n = comm.size();
  if (n % 2 != 0) return;  // every rank returns alike
  const nn::LlamaConfig c = config(false);
  const auto ref = reference(c, n, kSteps + 1);
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_ep_ckpt_");
  auto plan = [](bool fsdp, int ep) {
    return fsdp ? parallel::Plan<Real>{parallel::FSDPOptions{.expert_parallel = ep}}
                : parallel::Plan<Real>{parallel::DDPOptions{.expert_parallel = ep}};
  };
  std::vector<int> targets{1, 2};
  if (n % 4 == 0) targets.push_back(4);
  for (bool saved_fsdp : {false, true}) {
    const auto saved = dir / (saved_fsdp ? "fsdp_ep2" : "ddp_ep2");
    {
      auto model = make_llama(c);
      auto engine = parallel::make_engine<Real>(model, comm, plan(saved_fsdp, 2));
      optim::AdamW<Real> opt(engine->parameters(), kAdam);
      train(*engine, opt, 0, kSteps, nullptr, model.get());
      CHECK(rel_diff(whole_parameters(*engine, opt, c, saved), ref.params[kSteps - 1]) < kTol<Real>);
    }
    for (bool fsdp : {false, true})
      for (int ep : targets) {
        if (fsdp == saved_fsdp && ep == 2) continue;
        INFO("saved at ep 2 under " << (saved_fsdp ? "FSDP" : "DDP") << ", resumed at ep " << ep << " under "
                                    << (fsdp ? "FSDP" : "DDP") << " on " << n << " ranks");
        auto model = make_llama(c);
        auto engine = parallel::make_engine<Real>(model, comm, plan(fsdp, ep));
        optim::AdamW<Real> opt(engine->parameters(), kAdam);
        ckpt::CheckpointManager mgr(saved, &comm);
        ckpt::load(mgr, mgr.latest().path, *engine, &opt);
        CHECK(opt.steps() == kSteps);
        train(*engine, opt, kSteps, kSteps + 1, nullptr, model.get());
        const auto got = whole_parameters(*engine, opt, c, dir / "resumed");
        CHECK(rel_diff(got, ref.params[kSteps]) < kTol<Real>);
      }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Expert parallelism refuses bad plans on every rank", "[ep]") {
  auto& comm = world();
  const int n = comm.size();
  using Catch::Matchers::Contains;
  // ep must divide the world (3 ranks), and the experts (3 of them at ep 2).
  if (n % 2 != 0)
    CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(config(false)), comm,
                                                  parallel::DDPOptions{.expert_parallel = 2}),
                      Contains("[ptrain.ep.world]"));
  else
    CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(config(false, 3)), comm,
                                                  parallel::DDPOptions{.expert_parallel = 2}),
                      Contains("[ptrain.ep.experts]"));
  // Ranks given different ep degrees all stop (rank 0's plan against the others' first parameter).
  if (n > 1)
    CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(config(false)), comm,
                                                  parallel::DDPOptions{.expert_parallel = comm.rank() == 0 ? 2 : 1}),
                      Contains("[ptrain.parallel.mismatch]") && Contains("rank 0: DDPOptions{.expert_parallel = 2}") &&
                          Contains("rank 1: embed_tokens.weight"));
  // A model without MoE layers.
  nn::LlamaConfig dense = config(false);
  dense.num_experts = 0;
  if (n % 2 == 0)
    CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(dense), comm, parallel::DDPOptions{.expert_parallel = 2}),
                      Contains("[ptrain.ep.model]"));
  // With tensor parallelism: the same, and what TP does not combine with MoE layers.
  if (n % 2 == 0) {
    auto tp = [&](const nn::LlamaConfig& c, parallel::TensorParallelPlan plan) {
      return parallel::make_engine<Real>(make_llama(c), comm, plan);
    };
    CHECK_THROWS_WITH(tp(dense, {.tp = 2, .expert_parallel = 2}), Contains("[ptrain.ep.model]"));
    CHECK_THROWS_WITH(tp(config(false, 3), {.tp = 2, .expert_parallel = 2}), Contains("[ptrain.ep.experts]"));
    CHECK_THROWS_WITH(tp(config(false), {.tp = 2, .expert_parallel = 3}), Contains("[ptrain.ep.world]"));
    CHECK_THROWS_WITH(tp(config(false), {.tp = 2, .sequence_parallel = true, .expert_parallel = 2}),
                      Contains("[ptrain.tp.moe]"));
    CHECK_THROWS_WITH(tp(config(false), {.tp = 2, .fsdp = parallel::FSDPOptions{}}), Contains("[ptrain.tp.moe]"));
    CHECK_THROWS_WITH(tp(config(false), {.tp = 2, .expert_parallel = comm.rank() == 0 ? 2 : 1}),
                      Contains("[ptrain.tp.plan]"));
    // 7 tokens do not split over the 2 tp ranks (every rank holds the same batch shape).
    auto engine = tp(config(false), {.tp = 2, .expert_parallel = 2});
    const Batch b = make_batch(1, 5);
    CHECK_THROWS_WITH(engine->forward_backward(b.ids.view(0, {1, 7}), b.targets.view(0, {7})),
                      Contains("[ptrain.tp.moe_tokens]"));
    if (n % 4 == 0) CHECK_THROWS_WITH(tp(config(false), {.tp = 2, .cp = 2}), Contains("[ptrain.tp.moe]"));
  }
  // FSDP: the same, and the strategies whose replicas would average different experts.
  if (n % 2 == 0) {
    CHECK_THROWS_WITH(parallel::make_engine<Real>(make_llama(dense), comm, parallel::FSDPOptions{.expert_parallel = 2}),
                      Contains("[ptrain.ep.model]"));
    for (auto st : {parallel::ShardingStrategy::NoShard, parallel::ShardingStrategy::Hybrid})
      CHECK_THROWS_WITH(parallel::make_engine<Real>(
                            make_llama(config(false)), comm,
                            parallel::FSDPOptions{.strategy = st, .hybrid_shard_size = 1, .expert_parallel = 2}),
                        Contains("[ptrain.ep.strategy]"));
  }
  comm.barrier();
}

}  // namespace test_expert_parallel
