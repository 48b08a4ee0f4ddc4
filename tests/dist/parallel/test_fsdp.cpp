// FSDP against one process training on the global batch (which DDP equals,
// see test_ddp.cpp). Every rank runs every test case in the same order;
// checks use CHECK so no rank skips collectives.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <ptrain/ckpt/fsdp_checkpoint.hpp>
#include <ptrain/dist/process_group.hpp>

#include "dist/frozen_model.hpp"
#include "dist/world.hpp"
#include <ptrain/nn/loss.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/clip.hpp>
#include <ptrain/parallel/fsdp.hpp>

namespace test_fsdp {

using namespace ptrain;
using ptrain::testing::world;
using parallel::ShardingStrategy;

namespace {

nn::GPTConfig tiny_gpt(bool tie) {
  // 11-token vocabulary and odd widths: group sizes are not multiples of 2, 3 or 4.
  return {.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 10, .tie_weights = tie};
}

// Tokens in [0, vocab) as T values, and next-token targets.
template <class T = float>
struct TokenBatch {
  Tensor<T> ids;
  Tensor<std::int32_t> targets;
};
template <class T = float>
TokenBatch<T> make_tokens(std::int64_t rows, std::int64_t seq, std::int64_t vocab, std::uint64_t seed) {
  Generator g(seed);
  TokenBatch<T> b{Tensor<T>::empty({rows, seq}), Tensor<std::int32_t>::empty({rows * seq})};
  for (std::int64_t i = 0; i < rows * seq; ++i) {
    b.ids.data()[i] = static_cast<T>(g.below(static_cast<std::uint64_t>(vocab)));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(vocab)));
  }
  return b;
}
template <class T>
TokenBatch<T> rows_of(const TokenBatch<T>& b, std::int64_t start, std::int64_t rows, std::int64_t seq) {
  return {b.ids.narrow(start, rows), b.targets.narrow(start * seq, rows * seq)};
}

template <class T>
double rel_error(const std::vector<T>& a, const std::vector<T>& b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

parallel::FSDPOptions options_for(ShardingStrategy s, std::vector<std::string> names = {}) {
  const int n = world().size();
  return {.strategy = s, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n, .unit_names = std::move(names)};
}

// K AdamW steps of a tiny GPT: FSDP on this rank's rows vs one process on all rows.
// With `recompute`, FSDP's model recomputes its blocks in backward (nn/recompute.hpp);
// with `factory`, FSDP builds the units one at a time with nn::gpt_unit (untied only).
// In double: FSDP reduce-scatters the ranks' gradients, one process sums all rows at once;
// in float AdamW turns those last-bit differences of near-zero gradients into parameter
// differences of ~1e-5 relative within a few steps (lr / eps = 1e4 times the gradient's
// rounding), a value that depends on the vector width (as for the pipelines). In double the
// same amplification leaves ~1e-13; a missing or wrong shard or reduction is off by > 1e-3.
void check_gpt_matches_single_process(ShardingStrategy strategy, bool tie, int micro_batches, bool recompute = false,
                                      bool factory = false) {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const auto cfg = tiny_gpt(tie);
  auto wrapped = cfg;
  wrapped.recompute = recompute;
  const std::int64_t B = 2, S = 6, steps = 3;
  Generator ga(11), gb(11);
  nn::GPT<double> ref(cfg, ga);
  nn::GPT<double> model(wrapped, gb);
  nn::FlatParameters<double> ref_p(ref);
  const optim::AdamWOptions adam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
  optim::AdamW<double> ref_opt(ref_p, adam);
  const Generator gu(11);
  parallel::FSDP<double> fsdp =
      factory ? parallel::FSDP<double>(model.units().size(), [&](std::size_t u) { return nn::gpt_unit<double>(wrapped, u, gu); },
                                      comm, options_for(strategy, model.unit_names()))
              : parallel::FSDP<double>(model.units(), comm, options_for(strategy, model.unit_names()));
  optim::AdamW<double> opt(fsdp.parameters(), adam);
  nn::CrossEntropyLoss<double> ce;

  for (std::int64_t s = 0; s < steps; ++s) {
    // Global batch: micro_batches x n x B rows; micro-batch j of rank r is rows [(j n + r) B, + B).
    auto global = make_tokens<double>(micro_batches * n * B, S, cfg.vocab_size, 500 + static_cast<std::uint64_t>(s));
    {
      nn::Cache<double> c, lc;
      ref_p.zero_grad();
      ce.forward(ref.forward(global.ids, c), global.targets, lc);
      ref.backward(ce.backward(lc), c);
      ref_opt.step();
    }
    fsdp.zero_grad();
    for (int j = 0; j < micro_batches; ++j) {
      auto mine = rows_of(global, (j * n + r) * B, B, S);
      nn::Cache<double> c, lc;
      ce.forward(fsdp.forward(mine.ids, c), mine.targets, lc);
      auto d = ce.backward(lc, 1.0 / static_cast<double>(micro_batches));
      if (j + 1 < micro_batches) {
        auto guard = fsdp.no_sync();
        fsdp.backward(d, c);
      } else {
        fsdp.backward(d, c);
      }
    }
    fsdp.step(opt);
  }
  // Compare by name: FSDP lists parameters group by group, the model unit by unit.
  std::map<std::string, std::vector<double>> full;
  for (auto& [name, t] : fsdp.full_parameters()) full[name] = t.to_vector();
  std::vector<double> got, want;
  for (auto& p : ref.named_parameters()) {
    auto v = p.param->value.to_vector();
    want.insert(want.end(), v.begin(), v.end());
    REQUIRE(full.count(p.name) == 1);
    got.insert(got.end(), full[p.name].begin(), full[p.name].end());
  }
  REQUIRE(full.size() == ref.named_parameters().size());
  const double err = rel_error(got, want);
  INFO(parallel::strategy_name(strategy) << (tie ? " tied" : " untied") << (recompute ? ", recompute" : "") << ", "
                                         << micro_batches << " micro-batches, rank " << r << " of " << n
                                         << ": relative error " << err);
  CHECK(err <= 1e-9);
}

}  // namespace

TEST_CASE("FSDP strategies equal one process on a GPT", "[fsdp]") {
  for (auto s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer,
                 ShardingStrategy::NoShard, ShardingStrategy::Hybrid})
    check_gpt_matches_single_process(s, false, 1);
  // Tied LM head: the embedding and head units share one group (Note [FSDP units and groups]).
  check_gpt_matches_single_process(ShardingStrategy::FullShard, true, 1);
  check_gpt_matches_single_process(ShardingStrategy::Hybrid, true, 2);
  // Recomputed blocks: the second forward runs inside FSDP's backward, on the gathered unit.
  check_gpt_matches_single_process(ShardingStrategy::FullShard, true, 2, true);
  // Units built one at a time (Note [FSDP units built one at a time]); ShardGradOp builds them all first.
  for (auto s : {ShardingStrategy::FullShard, ShardingStrategy::Hybrid, ShardingStrategy::ShardGradOp})
    check_gpt_matches_single_process(s, false, 1, false, true);
}

TEST_CASE("FSDP built unit by unit never holds the whole model", "[fsdp][memory]") {
  auto& comm = world();
  const auto cfg = nn::GPTConfig{.vocab_size = 64, .block_size = 16, .n_layer = 8, .n_head = 2, .n_embd = 32,
                                 .tie_weights = false};
  const std::size_t units = static_cast<std::size_t>(cfg.n_layer) + 2;
  const Generator g(5);
  auto make = [&](std::size_t u) { return nn::gpt_unit<float>(cfg, u, g); };
  std::int64_t largest = 0;
  for (std::size_t u = 0; u < units; ++u) largest = std::max(largest, make(u)->num_parameters());
  const auto names = nn::gpt_unit_names(cfg);
  CHECK(names == nn::GPT<float>(cfg).unit_names());

  // Peak bytes above what was live, while `build` runs, and the local shard's elements.
  auto construction_peak = [&](auto build) {
    const auto before = memory_stats().live_bytes;
    reset_peak_memory();
    auto fsdp = build();
    return std::pair{memory_stats().peak_bytes - before, fsdp->parameters().values().numel()};
  };
  const auto [whole, shard] = construction_peak([&] {
    Generator gw(5);
    nn::GPT<float> model(cfg, gw);
    return std::make_unique<parallel::FSDP<float>>(model.units(), comm, parallel::FSDPOptions{.unit_names = names});
  });
  const auto [by_unit, shard2] = construction_peak([&] {
    return std::make_unique<parallel::FSDP<float>>(units, make, comm, parallel::FSDPOptions{.unit_names = names});
  });
  CHECK(shard2 == shard);
  // Unit by unit: one unit's values and gradients and its broadcast copy, the shards
  // twice (values, then values and gradients), and 64 bytes of rounding per tensor.
  // The whole model first: its values and gradients, 8 bytes per parameter, besides.
  const std::int64_t bound = 4 * (3 * largest + 2 * shard) + 64 * 64;
  const std::int64_t model_bytes = 8 * cfg.num_parameters();
  if (comm.rank() == 0)
    std::printf("FSDP construction peak per rank: whole model built first %lld bytes, unit by unit %lld "
                "(bound %lld; the model's values and gradients: %lld)\n",
                static_cast<long long>(whole), static_cast<long long>(by_unit), static_cast<long long>(bound),
                static_cast<long long>(model_bytes));
  CHECK(whole >= model_bytes);
  CHECK(by_unit <= bound);
  CHECK(by_unit < whole / 2);

  // Units built alone cannot share a parameter: a factory of tied units is refused.
  auto tied = cfg;
  tied.tie_weights = true;
  nn::GPT<float> tied_model(tied);
  auto shared = tied_model.units();
  CHECK_THROWS_WITH(parallel::FSDP<float>(units, [&](std::size_t u) { return shared[u]; }, comm),
                    Catch::Contains("[ptrain.fsdp.borrowed]") && Catch::Contains("tie_weights = false"));
}

// A bf16 GPT (int32 token ids through forward_tokens, fp32 master weights in
// AdamW) trained with FSDP against the same model in one process on the global
// batch. bf16 rounds each rank's gradients before the reduction and the single
// process rounds the global gradient once, and Adam turns a rounding flip of a
// small gradient into a full step, so the runs drift apart slowly (1e-2 of the
// loss after 8 steps on 3 ranks). The mean loss over ranks must stay within 2e-2
// of the first loss of the single process's at every step, while it falls by a
// fifth (so the steps are real); a wrong gradient or a missed shard is off by
// far more.
TEST_CASE("FSDP trains a bf16 GPT like one process", "[fsdp][bf16]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const auto cfg = tiny_gpt(true);
  const std::int64_t B = 2, S = 6;
  Generator ga(11), gb(11);
  nn::GPT<bf16> ref(cfg, ga), model(cfg, gb);
  nn::FlatParameters<bf16> ref_p(ref);
  const optim::AdamWOptions adam{.lr = 0.02, .weight_decay = 0.1};
  optim::AdamW<bf16> ref_opt(ref_p, adam);
  parallel::FSDP<bf16> fsdp(model.units(), comm, options_for(ShardingStrategy::FullShard, model.unit_names()));
  optim::AdamW<bf16> opt(fsdp.parameters(), adam);
  nn::CrossEntropyLoss<bf16> ce;
  const auto global = make_tokens(n * B, S, cfg.vocab_size, 900);
  auto ids = Tensor<std::int32_t>::empty({n * B, S});
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids.data()[i] = static_cast<std::int32_t>(global.ids.data()[i]);
  double first = 0, last_ref = 0;
  for (int step = 0; step < 8; ++step) {
    nn::Cache<bf16> c, lc;
    ref_p.zero_grad();
    last_ref = ce.forward(ref.forward_tokens(ids, c), global.targets, lc);
    ref.backward(ce.backward(lc), c);
    ref_opt.step();
    if (step == 0) first = last_ref;

    nn::Cache<bf16> fc, flc;
    fsdp.zero_grad();
    double loss = ce.forward(fsdp.forward_tokens(ids.narrow(r * B, B), fc), global.targets.narrow(r * B * S, B * S), flc);
    fsdp.backward(ce.backward(flc), fc);
    fsdp.step(opt);
    comm.all_reduce(&loss, &loss, 1, DType::F64, dist::ReduceOp::Avg);
    INFO("step " << step << ": FSDP " << loss << ", one process " << last_ref << " (rank " << r << " of " << n << ")");
    CHECK(std::abs(loss - last_ref) <= 2e-2 * first);
  }
  CHECK(last_ref < 0.8 * first);
}

// Sharded checkpoints of a bf16 FSDP model: pieces of the BF16 parameters and
// of the F32 optimizer state (moments, master weights). A run built from other
// weights that loads the checkpoint continues bitwise like the uninterrupted
// run, and one process loads the pieces into the whole model.
TEST_CASE("FSDP bf16 sharded checkpoints resume bitwise and load in one process", "[fsdp][bf16][ckpt]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const auto cfg = tiny_gpt(true);
  const std::int64_t B = 2, S = 6;
  const auto global = make_tokens(n * B, S, cfg.vocab_size, 910);
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i) ids.data()[i] = static_cast<std::int32_t>(global.ids.data()[r * B * S + i]);
  const auto targets = global.targets.narrow(r * B * S, B * S);
  struct Run {
    std::unique_ptr<nn::GPT<bf16>> model;
    std::unique_ptr<parallel::FSDP<bf16>> fsdp;
    std::unique_ptr<optim::AdamW<bf16>> opt;
  };
  auto build = [&](std::uint64_t seed) {
    Run run;
    Generator g(seed);
    run.model = std::make_unique<nn::GPT<bf16>>(cfg, g);
    run.fsdp = std::make_unique<parallel::FSDP<bf16>>(run.model->units(), comm,
                                                      options_for(ShardingStrategy::FullShard, run.model->unit_names()));
    run.opt = std::make_unique<optim::AdamW<bf16>>(run.fsdp->parameters().values(), run.fsdp->parameters().grads(),
                                                   run.fsdp->parameters().entries(), optim::AdamWOptions{.lr = 0.02});
    return run;
  };
  nn::CrossEntropyLoss<bf16> ce;
  auto train = [&](Run& run, int steps) {
    for (int i = 0; i < steps; ++i) {
      nn::Cache<bf16> c, lc;
      run.fsdp->zero_grad();
      ce.forward(run.fsdp->forward_tokens(ids, c), targets, lc);
      run.fsdp->backward(ce.backward(lc), c);
      run.fsdp->step(*run.opt);
    }
  };
  auto bytes = [](const auto& t) {
    const auto v = t.to_vector();
    return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(v[0]));
  };
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_fsdp_bf16_");
  ckpt::CheckpointManager mgr(dir, &comm);

  Run a = build(11);
  train(a, 2);
  mgr.save_sharded(2, ckpt::fsdp_state(*a.fsdp, a.opt.get()), {});
  const auto saved = a.fsdp->full_parameters();
  train(a, 2);

  Run b = build(12);
  ckpt::load_fsdp(mgr.step_path(2), *b.fsdp, b.opt.get());
  train(b, 2);
  CHECK(bytes(b.fsdp->parameters().values()) == bytes(a.fsdp->parameters().values()));
  bool same_state = b.opt->flat_state().size() == 3;  // exp_avg, exp_avg_sq, master
  for (std::size_t k = 0; k < std::min(b.opt->flat_state().size(), a.opt->flat_state().size()); ++k)
    same_state = same_state && bytes(b.opt->flat_state()[k].second) == bytes(a.opt->flat_state()[k].second);
  CHECK(same_state);

  // One process: the pieces of every rank make the whole model, in BF16.
  Generator g(13);
  nn::GPT<bf16> whole(cfg, g);
  nn::FlatParameters<bf16> whole_p(whole);
  optim::AdamW<bf16> whole_opt(whole_p, {.lr = 0.02});
  ckpt::CheckpointManager(dir).load(mgr.step_path(2), whole_p, &whole_opt);
  std::map<std::string, std::string> want;
  for (const auto& [name, t] : saved) want[name] = bytes(t);
  bool same_model = want.size() == whole.named_parameters().size();
  for (auto& p : whole.named_parameters()) same_model = same_model && want[p.name] == bytes(p.param->value);
  CHECK(same_model);
  ckpt::Checkpoint c(mgr.step_path(2));
  for (const auto& name : c.tensor_names("model")) CHECK(c.dtype(name) == DType::BF16);
  for (const auto& name : c.tensor_names("optimizer")) CHECK(c.dtype(name) == DType::F32);
  comm.barrier();
  if (r == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("FSDP gradient accumulation over micro-batches", "[fsdp]") {
  check_gpt_matches_single_process(ShardingStrategy::FullShard, false, 3);
  check_gpt_matches_single_process(ShardingStrategy::ShardOptimizer, false, 2);
}

TEST_CASE("FSDP shards each unit evenly, padding to the world size", "[fsdp]") {
  auto& comm = world();
  Generator g(1);
  nn::MLP<float> mlp(7, {5}, 3, nn::Activation::ReLU, g);  // groups of 40 and 18 elements
  parallel::FSDP<float> fsdp(mlp.units(), comm);
  REQUIRE(fsdp.num_groups() == 2);
  const std::int64_t n = comm.size();
  CHECK(fsdp.group_numel(0) == 7 * 5 + 5);
  CHECK(fsdp.group_padded(0) == (40 + n - 1) / n * n);
  CHECK(fsdp.parameters().values().numel() == fsdp.group_padded(0) / n + fsdp.group_padded(1) / n);
  // The pieces of parameters on all ranks cover every parameter exactly once.
  std::int64_t mine = 0;
  for (auto& e : fsdp.parameters().entries()) mine += e.numel();
  comm.all_reduce(&mine, 1, DType::I64, dist::ReduceOp::Sum);
  CHECK(mine == 40 + 18);
  // Without unit_names each unit's prefix is its index, as Sequential names its
  // layers: the gathered parameters carry the model's names and values (an MLP
  // built from the same seed is the reference).
  Generator g_ref(1);
  nn::MLP<float> ref(7, {5}, 3, nn::Activation::ReLU, g_ref);
  const auto full = fsdp.full_parameters();
  const auto want = ref.named_parameters();
  REQUIRE(full.size() == want.size());
  for (std::size_t i = 0; i < full.size(); ++i) {
    CHECK(full[i].first == want[i].name);
    CHECK(full[i].second.to_vector() == want[i].param->value.to_vector());
  }
  // `device` names where the shards go, and the communicator must move that memory
  // (MPI and Gloo move host memory only); refused before any collective.
  nn::MLP<float> other(7, {5}, 3, nn::Activation::ReLU, g);
  CHECK_THROWS_WITH(parallel::FSDP<float>(other.units(), comm, {.device = Device::cuda(0)}),
                    Catch::Contains("[ptrain.comm.device]") && Catch::Contains("cuda:0"));
}

TEST_CASE("FSDP persistent memory follows the ZeRO formulas", "[fsdp][memory]") {
  auto& comm = world();
  const int n = comm.size();
  const auto cfg = nn::GPTConfig{.vocab_size = 64, .block_size = 16, .n_layer = 4, .n_head = 2, .n_embd = 32,
                                 .tie_weights = false};
  const double psi = static_cast<double>(cfg.num_parameters());
  if (comm.rank() == 0) std::printf("FSDP memory, GPT with %.0f parameters, %d ranks (bytes per rank)\n", psi, n);
  for (auto s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer,
                 ShardingStrategy::NoShard, ShardingStrategy::Hybrid}) {
    const auto before = memory_stats().live_bytes;
    std::int64_t persistent = 0, peak = 0, padding = 0;
    {
      Generator g(3);
      nn::GPT<float> model(cfg, g);
      parallel::FSDP<float> fsdp(model.units(), comm, options_for(s));
      optim::AdamW<float> opt(fsdp.parameters(), {});
      persistent = memory_stats().live_bytes - before;
      for (std::size_t gi = 0; gi < fsdp.num_groups(); ++gi) padding += fsdp.group_padded(gi) - fsdp.group_numel(gi);
      // One step, for the peak.
      auto b = make_tokens(2, 8, cfg.vocab_size, 9);
      nn::CrossEntropyLoss<float> ce;
      nn::Cache<float> c, lc;
      reset_peak_memory();
      fsdp.zero_grad();
      ce.forward(fsdp.forward(b.ids, c), b.targets, lc);
      fsdp.backward(ce.backward(lc), c);
      fsdp.step(opt);
      peak = memory_stats().peak_bytes - before;
    }
    const int ns = s == ShardingStrategy::NoShard ? 1 : (s == ShardingStrategy::Hybrid ? options_for(s).hybrid_shard_size : n);
    const double pad = 4.0 * static_cast<double>(padding);
    double formula = 16.0 * (psi + static_cast<double>(padding)) / ns;  // FullShard, Hybrid, NoShard
    if (s == ShardingStrategy::ShardGradOp) formula = 4.0 * psi + pad + 16.0 * (psi + static_cast<double>(padding)) / n;
    if (s == ShardingStrategy::ShardOptimizer) formula = 8.0 * (psi + static_cast<double>(padding)) + 16.0 * (psi + static_cast<double>(padding)) / n;
    if (comm.rank() == 0)
      std::printf("  %-16s persistent %9lld  formula %9.0f  peak %9lld\n", parallel::strategy_name(s),
                  static_cast<long long>(persistent), formula, static_cast<long long>(peak));
    INFO(parallel::strategy_name(s) << ": persistent " << persistent << " bytes, formula " << formula);
    CHECK(static_cast<double>(persistent) <= formula + 1e-9);
    CHECK(static_cast<double>(persistent) >= formula - pad - 1e-9);
  }
}

TEST_CASE("FSDP prefetches the next unit's parameters before the current unit finishes", "[fsdp]") {
  auto& comm = world();
  if (comm.size() == 1) return;
  Generator g(5);
  nn::GPT<float> model(tiny_gpt(false), g);
  parallel::FSDP<float> fsdp(model.units(), comm);
  auto b = make_tokens(2, 6, 11, 3);
  nn::CrossEntropyLoss<float> ce;
  nn::Cache<float> c, lc;
  fsdp.clear_events();
  ce.forward(fsdp.forward(b.ids, c), b.targets, lc);
  fsdp.backward(ce.backward(lc), c);
  fsdp.finish_gradient_sync();
  // Forward: the gather of group 1 (block 0) is issued before unit 0 (embedding) ends.
  double gather1 = -1, fwd0_end = -1;
  const auto& ev = fsdp.events();
  for (const auto& e : ev) {
    if (e.what == "gather" && e.index == 1 && gather1 < 0) gather1 = e.time;
    if (e.what == "forward_end" && e.index == 0 && fwd0_end < 0) fwd0_end = e.time;
  }
  CHECK(gather1 >= 0);
  CHECK(gather1 < fwd0_end);
  // Backward: the last block's group (released after forward) is gathered again
  // before the head's backward ends, i.e. while the head computes.
  const int head = static_cast<int>(model.units().size()) - 1;
  double fwd_head_end = -1, bwd_head_end = -1, regather = -1;
  for (const auto& e : ev) {
    if (e.what == "forward_end" && e.index == head) fwd_head_end = e.time;
    if (e.what == "backward_end" && e.index == head) bwd_head_end = e.time;
  }
  for (const auto& e : ev)
    if (e.what == "gather" && e.index == head - 1 && e.time > fwd_head_end && regather < 0) regather = e.time;
  CHECK(regather > 0);
  CHECK(regather < bwd_head_end);
}

TEST_CASE("FSDP global-norm clipping equals clipping the full gradient", "[fsdp]") {
  auto& comm = world();
  const auto cfg = tiny_gpt(false);
  Generator ga(13), gb(13);
  nn::GPT<float> ref(cfg, ga);
  nn::GPT<float> model(cfg, gb);
  nn::FlatParameters<float> ref_p(ref);
  parallel::FSDP<float> fsdp(model.units(), comm, options_for(ShardingStrategy::Hybrid));
  const int n = comm.size(), r = comm.rank();
  auto global = make_tokens(2 * n, 6, cfg.vocab_size, 77);
  nn::CrossEntropyLoss<float> ce;
  {
    nn::Cache<float> c, lc;
    ce.forward(ref.forward(global.ids, c), global.targets, lc);
    ref.backward(ce.backward(lc), c);
  }
  auto mine = rows_of(global, 2 * r, 2, 6);
  nn::Cache<float> c, lc;
  fsdp.zero_grad();
  ce.forward(fsdp.forward(mine.ids, c), mine.targets, lc);
  fsdp.backward(ce.backward(lc), c);
  const double want = optim::clip_grad_norm_(ref_p.grads(), 1e-3);
  const double got = fsdp.clip_grad_norm_(1e-3);
  // One float backward, the rows' gradients summed in another order (<= 48 rows, plus the
  // blocks' width-10 and 6-token reductions, k ~ 100): |dg| <= k u sum|terms| ~ 6e-6 sum|terms|,
  // and sum|terms| exceeds |g| where the rows' terms cancel, so 1e-5 was below the bound:
  // 1e-4. A missing or doubled reduction changes the norm by a factor of sqrt(2) or more.
  CHECK(got == Approx(want).epsilon(1e-4));
  // The clipped local shard has norm 1e-3 / (norm + 1e-6) * norm over the shard group;
  // both sides use FSDP's own norm, so only the scaling's rounding (a few u) separates them.
  double sq = ops::sum_squares(fsdp.parameters().grads());
  comm.all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
  const int replicas = n / options_for(ShardingStrategy::Hybrid).hybrid_shard_size;
  CHECK(std::sqrt(sq / replicas) == Approx(1e-3 * want / (want + 1e-6)).epsilon(1e-4));
}

namespace {
// Note [Frozen parameters under FSDP]: testing::frozen_mlp (a wholly frozen unit, a
// mixed one, trainable ones) under `strategy` against one process on the global batch,
// AdamW with weight decay and clipping; then a sharded checkpoint of it loads into one
// process. Frozen values must not move by one bit. Ranks other than 0 build the
// model from another seed: the sharding broadcasts rank 0's values.
template <class T>
void check_frozen_fsdp(ShardingStrategy strategy, double tol, const std::filesystem::path& dir, bool factory = false) {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 3, features = 10, steps = 4;
  Generator ga(7), gb(7 + static_cast<std::uint64_t>(r));  // FSDP must take rank 0's values, frozen ones too
  auto ref = testing::frozen_mlp<T>(ga);
  auto model = testing::frozen_mlp<T>(gb);
  nn::FlatParameters<T> ref_p(*ref);
  std::map<std::string, std::vector<T>> frozen_before;
  for (const auto& e : ref_p.frozen_entries()) frozen_before[e.name] = e.param->value.to_vector();
  // With `factory`, units built one at a time (Note [FSDP units built one at a time]).
  auto unit = [&](std::size_t u) {
    Generator gu(7 + static_cast<std::uint64_t>(r));
    return testing::frozen_mlp<T>(gu)->units()[u];
  };
  parallel::FSDP<T> fsdp = factory ? parallel::FSDP<T>(model->units().size(), unit, comm, options_for(strategy))
                                   : parallel::FSDP<T>(model->units(), comm, options_for(strategy));
  const optim::AdamWOptions adam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
  optim::AdamW<T> ref_opt(ref_p, adam), opt(fsdp.parameters(), adam);
  nn::CrossEntropyLoss<T> ce;
  for (std::int64_t s = 0; s < steps; ++s) {
    Generator gd(300 + static_cast<std::uint64_t>(s));
    auto x = Tensor<T>::empty({n * B, features});
    auto y = Tensor<std::int32_t>::empty({n * B});
    ops::uniform_(x, -1.0, 1.0, gd);
    for (std::int64_t i = 0; i < n * B; ++i) y.data()[i] = static_cast<std::int32_t>(gd.below(4));
    nn::Cache<T> rc, rlc;
    ref_p.zero_grad();
    ce.forward(ref->forward(x, rc), y, rlc);
    ref->backward(ce.backward(rlc), rc);
    const double ref_norm = optim::clip_grad_norm_(ref_p.grads(), 1.0);
    ref_opt.step();
    nn::Cache<T> c, lc;
    fsdp.zero_grad();
    ce.forward(fsdp.forward(x.narrow(r * B, B), c), y.narrow(r * B, B), lc);
    fsdp.backward(ce.backward(lc), c);
    const double norm = fsdp.clip_grad_norm_(1.0);
    CHECK(std::abs(norm - ref_norm) <= tol * ref_norm);
    fsdp.step(opt);
  }
  std::map<std::string, std::vector<T>> full;
  for (auto& [name, t] : fsdp.full_parameters()) full[name] = t.to_vector();
  CHECK(full.size() == 8);
  std::vector<T> got, want;
  for (const auto& e : ref_p.entries()) {
    auto v = e.param->value.to_vector();
    want.insert(want.end(), v.begin(), v.end());
    got.insert(got.end(), full[e.name].begin(), full[e.name].end());
  }
  const double err = rel_error(got, want);
  INFO(parallel::strategy_name(strategy) << ", frozen MLP, rank " << r << " of " << n << ": relative error " << err);
  CHECK(err <= tol);
  for (const auto& [name, v] : frozen_before) CHECK(full[name] == v);  // bit for bit
  // A sharded checkpoint keeps the frozen parameters under their names: it loads into one process.
  ckpt::CheckpointManager mgr(dir / parallel::strategy_name(strategy), &comm);
  mgr.save_sharded(1, ckpt::fsdp_state(fsdp, &opt), {});
  ckpt::Checkpoint saved(mgr.latest().path);
  CHECK(saved.tensor_names("optimizer").size() == 2 * 4);  // two moments of the four trainable tensors
  Generator gc(99);
  auto one = testing::frozen_mlp<T>(gc);
  {
    nn::FlatParameters<T> one_p(*one);
    optim::AdamW<T> one_opt(one_p, adam);
    ckpt::CheckpointManager(dir / parallel::strategy_name(strategy)).load(mgr.latest().path, one_p, &one_opt);
    for (auto& p : one->named_parameters()) CHECK(p.param->value.to_vector() == full[p.name]);
  }
  // And back into FSDP: the same values, trainable and frozen.
  parallel::FSDP<T> again(one->units(), comm, options_for(strategy));
  optim::AdamW<T> again_opt(again.parameters(), adam);
  ckpt::load_fsdp(mgr.latest().path, again, &again_opt);
  for (auto& [name, t] : again.full_parameters()) CHECK(t.to_vector() == full[name]);
}
}  // namespace

TEST_CASE("FSDP with frozen parameters equals one process under every strategy; checkpoints load in one process",
          "[fsdp][frozen]") {
  const auto dir = testing::shared_tmp_dir(world(), "ptrain_fsdp_frozen_");
  for (auto s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer,
                 ShardingStrategy::NoShard, ShardingStrategy::Hybrid}) {
    check_frozen_fsdp<double>(s, 1e-9, dir);
    check_frozen_fsdp<float>(s, 2e-4, dir / "f32");
  }
  check_frozen_fsdp<double>(ShardingStrategy::FullShard, 1e-9, dir / "factory", true);
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// docs/finetuning.md, "Frozen parameters under DDP, FSDP, pipeline and TP": float AdamW,
// P and F the trainable and frozen elements as FSDP pads them (per group, to a multiple
// of the shard group Ns). A frozen element costs 4 bytes sharded, or whole where the
// strategy keeps full parameters, and nothing else: no gradient, no optimizer state.
TEST_CASE("FSDP with frozen parameters holds the bytes of the formula under every strategy", "[fsdp][frozen][memory]") {
  auto& comm = world();
  for (auto s : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer,
                 ShardingStrategy::NoShard, ShardingStrategy::Hybrid}) {
    const auto before = memory_stats().live_bytes;
    std::int64_t bytes = 0, after_step = 0, P = 0, F = 0;
    const int ns = s == ShardingStrategy::NoShard ? 1 : (s == ShardingStrategy::Hybrid ? options_for(s).hybrid_shard_size : comm.size());
    {
      Generator g(3);
      auto model = testing::frozen_mlp<float>(g);
      parallel::FSDP<float> fsdp(model->units(), comm, options_for(s));
      optim::AdamW<float> opt(fsdp.parameters(), {});
      bytes = memory_stats().live_bytes - before;
      for (std::size_t gi = 0; gi < fsdp.num_groups(); ++gi) {
        P += fsdp.group_padded(gi);
        F += fsdp.group_frozen_padded(gi);
      }
      auto x = Tensor<float>::full({4, 10}, 0.5f);
      auto y = Tensor<std::int32_t>::zeros({4});
      nn::CrossEntropyLoss<float> ce;
      nn::Cache<float> c, lc;
      fsdp.zero_grad();
      ce.forward(fsdp.forward(x, c), y, lc);
      fsdp.backward(ce.backward(lc), c);
      fsdp.step(opt);
      c.clear();
      lc.clear();
      after_step = memory_stats().live_bytes - before - static_cast<std::int64_t>(x.nbytes() + y.nbytes());
    }
    std::int64_t formula = 4 * (4 * P + F) / ns;  // FullShard, Hybrid, NoShard
    if (s == ShardingStrategy::ShardGradOp) formula = 4 * (P + F) + 16 * P / ns;
    if (s == ShardingStrategy::ShardOptimizer) formula = 8 * P + 4 * F + 16 * P / ns;
    if (s == ShardingStrategy::NoShard) formula = 16 * P + 4 * F;
    if (comm.rank() == 0)
      std::printf("FSDP with frozen parameters, %d ranks, %-16s P %lld F %lld: %lld bytes per rank\n", comm.size(),
                  parallel::strategy_name(s), static_cast<long long>(P), static_cast<long long>(F),
                  static_cast<long long>(bytes));
    INFO(parallel::strategy_name(s) << ": P " << P << ", F " << F << ", " << bytes << " bytes, after a step "
                                    << after_step << ", formula " << formula);
    CHECK(F > 0);
    CHECK(bytes == formula);
    CHECK(after_step == formula);
  }
}

}  // namespace test_fsdp
