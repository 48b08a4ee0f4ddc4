// Tensor parallelism (parallel/tensor_parallel.hpp) against one process: a GPT
// trained with tp = 2 and 4 and dp x tp = 2 x 2, with sequence parallelism off
// and on, holds, after a few AdamW steps with clipping, the parameters of nn::GPT
// trained alone on the global batch; a checkpoint saved at tp = 2 resumes at
// tp = 1 and 4; mismatched plans end every rank with an error; the bytes handed to
// collectives match the Megatron count; a block's activations match the memory
// formula of docs/tensor_parallel.md on the allocator's counters; FSDP x TP (dp 2 x
// tp 2, each tp shard sharded over the replicas) trains like one process, keeps 1/dp
// of TP alone's bytes, and its checkpoints load into one process and TP alone.
// Each case runs on a sub-world of the ranks it needs (the others wait), so the
// binary runs under any world size.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <map>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>
#include <ptrain/parallel/local.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_tensor_parallel {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// A vocabulary that neither 2 nor 4 divides (padding), 4 heads, untied or tied.
nn::GPTConfig config(bool tied) {
  return {.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 16, .tie_weights = tied};
}
// The same with grouped-query attention (2 key/value heads), packed documents
// (token 0 starts one) and every bias.
nn::LlamaConfig llama_config(bool tied) {
  return {.vocab_size = 11, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16, .intermediate_size = 24,
          .max_seq_len = 8, .tie_weights = tied, .attention_bias = true, .o_proj_bias = true, .mlp_bias = true,
          .document_token = 0};
}
const optim::AdamWOptions kAdam{.lr = 0.02, .eps = 1e-8, .weight_decay = 0.1};
const optim::SGDOptions kSgd{.lr = 0.1, .momentum = 0.9};
enum class Opt { AdamW, SGD };
template <class T>
std::unique_ptr<optim::Optimizer<T>> make_opt(Opt kind, nn::FlatParameters<T>& params) {
  if (kind == Opt::SGD) return std::make_unique<optim::SGD<T>>(params, kSgd);
  return std::make_unique<optim::AdamW<T>>(params, kAdam);
}

// Tensor parallelism is checked against one process in double with AdamW (1e-9, the
// model of test_pipeline.cpp's kDoubleTol) and, for the float path, with SGD: AdamW in
// float (eps 1e-8) is scale-free, m / (sqrt(v) + eps), and turns the last-bit differences
// of near-zero gradients summed in another order into parameter differences of up to lr
// per step, which depend on the processor's vector width. The float SGD bound: tp splits
// dot products (<= 64 terms: C = 16, 4C = 64, Llama's 24) into partial sums added by an
// all-reduce, the vocabulary-parallel loss its sums over <= 11 logits, and sequence
// parallelism the sums over the 32 tokens; along forward and backward through 2 blocks
// that is <= ~600 terms' rounding, |err| <= 600 u ~ 3.6e-5 of the terms' magnitudes (u =
// 2^-24) for the loss and for the gradient norm (and the clipping factor 0.5 / norm).
// Every step clips the gradient to norm 0.5, so 3 SGD steps (lr 0.1, momentum 0.9) move
// a parameter by at most lr (1 + 1.9 + 2.71) * 0.5 = 0.28 times that relative error,
// ~1e-5 against LayerNorm weights of ~1. 1e-4 holds on any vector width; a missing
// all-reduce, a shard of the wrong rank or an unscaled gradient is off by more than 1e-3.
constexpr double kFloatSgdTol = 1e-4;
constexpr double kClip = 0.5;
constexpr std::int64_t kBatch = 4, kSeq = 8, kSteps = 3;

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch make_batch(std::uint64_t seed, std::int64_t vocab) {
  Generator g(seed);
  Batch b{Tensor<std::int32_t>::empty({kBatch, kSeq}), Tensor<std::int32_t>::empty({kBatch, kSeq})};
  for (std::int64_t i = 0; i < kBatch * kSeq; ++i) {
    b.ids.data()[i] = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(vocab)));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(vocab)));
  }
  return b;
}

// The ranks [0, n) of the world as one group, null on the others. Split once per n
// (collective over the world on the first call; every rank calls it in the same
// order) and kept for the process, as a job keeps its groups.
dist::Communicator* first_ranks(int n) {
  static std::map<int, std::unique_ptr<dist::Communicator>> groups;
  auto& w = world();
  if (!groups.count(n)) groups[n] = w.split(w.rank() < n ? 0 : -1, w.rank());
  return groups[n].get();
}

// One step of engine `e` on its data-parallel slice of `global`; returns (mean loss over dp, norm).
template <class T>
std::pair<double, double> step(parallel::Engine<T>& e, optim::Optimizer<T>& opt, const Batch& global) {
  dist::Communicator* dp = e.data_parallel_group();
  const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, rows = kBatch / n;
  e.zero_grad();
  const double loss = e.average(e.forward_backward(global.ids.narrow(r * rows, rows), global.targets.narrow(r * rows, rows)));
  const double norm = e.clip_grad_norm_(kClip);
  e.step(opt);
  return {loss, norm};
}

// One process: nn::GPT (or nn::Llama) on the global batch.
template <class T, template <class> class M = nn::GPT>
struct Reference {
  std::shared_ptr<M<T>> model;
  parallel::Local<T> engine;
  std::unique_ptr<optim::Optimizer<T>> opt;
  std::vector<std::pair<double, double>> history;
  explicit Reference(const typename std::remove_cvref_t<decltype(std::declval<M<T>>().config())>& cfg,
                     Opt kind = Opt::AdamW)
      : model(std::make_shared<M<T>>(cfg, *std::make_unique<Generator>(7))), engine(*model),
        opt(make_opt(kind, engine.parameters())) {}
  void train(std::int64_t steps, std::int64_t first = 0) {
    for (std::int64_t s = first; s < first + steps; ++s)
      history.push_back(
          step(engine, *opt, make_batch(100 + static_cast<std::uint64_t>(s), model->config().vocab_size)));
  }
};

// Every trainable parameter of a tensor-parallel engine, full, by name (collective);
// under FSDP x TP every parameter, gathered over the replicas first.
template <class T>
std::vector<std::pair<std::string, Tensor<T>>> full_parameters(parallel::TensorParallel<T>& e) {
  std::vector<std::pair<std::string, Tensor<T>>> out;
  if (auto* f = e.fsdp()) {
    for (auto& [name, shard] : f->full_parameters())
      out.emplace_back(name, parallel::detail::gather_full(shard, e.spec_of(name), e.group()));
    return out;
  }
  const auto& entries = e.parameters().entries();
  for (std::size_t i = 0; i < entries.size(); ++i)
    out.emplace_back(entries[i].name, parallel::detail::gather_full(entries[i].param->value, e.spec(i), e.group()));
  return out;
}

// A module's parameters by name (copies).
template <class T>
std::vector<std::pair<std::string, Tensor<T>>> named_values(nn::Module<T>& m) {
  std::vector<std::pair<std::string, Tensor<T>>> out;
  for (auto& p : m.named_parameters()) out.emplace_back(p.name, p.param->value.clone());
  return out;
}

// Largest |value - reference| over the named tensors, relative to the largest reference value.
template <class T>
double max_rel_error(const std::vector<std::pair<std::string, Tensor<T>>>& all, nn::Module<T>& ref) {
  auto ref_params = ref.named_parameters();
  double diff = 0, scale = 0;
  for (const auto& [name, full] : all) {
    auto it = std::find_if(ref_params.begin(), ref_params.end(), [&](auto& p) { return p.name == name; });
    REQUIRE(it != ref_params.end());
    REQUIRE(full.shape() == it->param->value.shape());
    const auto a = full.to_vector(), b = it->param->value.to_vector();
    for (std::size_t k = 0; k < a.size(); ++k) {
      diff = std::max(diff, std::abs(static_cast<double>(a[k]) - static_cast<double>(b[k])));
      scale = std::max(scale, std::abs(static_cast<double>(b[k])));
    }
  }
  return diff / scale;
}
// The same for a tensor-parallel engine's full parameters.
template <class T>
double max_rel_error(parallel::TensorParallel<T>& e, nn::Module<T>& ref) {
  const auto all = full_parameters(e);
  if (e.fsdp()) CHECK(all.size() == ref.named_parameters().size());  // every parameter, by name
  return max_rel_error(all, ref);
}

// A GPT is split unit by unit from its config, a Llama from the built model.
template <class T, template <class> class M = nn::GPT>
void check_against_reference(dist::Communicator& comm, const parallel::TensorParallelPlan& plan, bool tied,
                             double tol, Opt kind = Opt::AdamW) {
  const auto cfg = [&] {
    if constexpr (std::is_same_v<M<T>, nn::GPT<T>>) return config(tied);
    else return llama_config(tied);
  }();
  Reference<T, M> ref(cfg, kind);
  ref.train(kSteps);
  Generator g(7);
  M<T> init(cfg, g);
  auto e = [&] {
    if constexpr (std::is_same_v<M<T>, nn::GPT<T>>) return parallel::TensorParallel<T>(cfg, comm, plan, Generator(7));
    else return parallel::TensorParallel<T>(init, comm, plan);
  }();
  auto opt = make_opt(kind, e.parameters());
  INFO(init.describe() << ": tp " << plan.tp << " x pp " << plan.pp << " x dp " << e.mesh().dp_size()
                       << (plan.sequence_parallel ? ", sp" : "")
                       << (plan.fsdp ? std::string(", fsdp ") + strategy_name(plan.fsdp->strategy) : "") << ", "
                       << comm.backend()
                       << (kind == Opt::SGD ? ", SGD" : ", AdamW"));
  CHECK(max_rel_error(e, init) == 0.0);  // the same initial values, bit for bit
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const auto [loss, norm] = step(e, *opt, make_batch(100 + static_cast<std::uint64_t>(s), cfg.vocab_size));
    CHECK(loss == Approx(ref.history[static_cast<std::size_t>(s)].first).epsilon(tol));
    CHECK(norm == Approx(ref.history[static_cast<std::size_t>(s)].second).epsilon(tol));
    CHECK(norm > kClip);  // every step clips, so the norm counts every parameter once
  }
  CHECK(max_rel_error(e, *ref.model) < tol);
}

}  // namespace

TEST_CASE("Tensor parallel GPT trains like one process (tp 2 and 4, dp x tp 2 x 2)", "[tp]") {
  const int n = world().size();
  for (bool tied : {true, false})
    for (bool sp : {false, true}) {
      if (auto two = first_ranks(2)) {
        check_against_reference<double>(*two, {.tp = 2, .sequence_parallel = sp}, tied, 1e-9);
        check_against_reference<float>(*two, {.tp = 2, .sequence_parallel = sp}, tied, kFloatSgdTol, Opt::SGD);
      }
      if (n >= 4)
        if (auto four = first_ranks(4)) {
          check_against_reference<double>(*four, {.tp = 4, .sequence_parallel = sp}, tied, 1e-9);
          check_against_reference<double>(*four, {.tp = 2, .sequence_parallel = sp}, tied, 1e-9);  // dp 2 x tp 2
        }
    }
  world().barrier();
}

TEST_CASE("Tensor parallel Llama trains like one process (tp 2, dp x tp 2 x 2, tp x pp 2 x 2)", "[tp]") {
  const int n = world().size();
  for (bool sp : {false, true}) {
    for (bool tied : {true, false})
      if (auto two = first_ranks(2)) {
        check_against_reference<double, nn::Llama>(*two, {.tp = 2, .sequence_parallel = sp}, tied, 1e-9);
        check_against_reference<float, nn::Llama>(*two, {.tp = 2, .sequence_parallel = sp}, tied, kFloatSgdTol,
                                                  Opt::SGD);
      }
    if (n >= 4)
      if (auto four = first_ranks(4)) {
        check_against_reference<double, nn::Llama>(*four, {.tp = 2, .sequence_parallel = sp}, true, 1e-9);
        check_against_reference<double, nn::Llama>(
            *four, {.tp = 2, .sequence_parallel = sp, .pp = 2, .micro_batches = 2}, false, 1e-9);
        // 2 key/value heads do not split over 4 ranks.
        Generator g(7);
        nn::Llama<double> full(llama_config(true), g);
        CHECK_THROWS_WITH(parallel::TensorParallel<double>(full, *four, {.tp = 4}),
                          Catch::Contains("[ptrain.tp.heads]") && Catch::Contains("2 heads"));
      }
  }
  world().barrier();
}

TEST_CASE("Tensor parallel stages of a pipeline train like one process (tp x pp 2 x 2, dp x tp x pp 2 x 2 x 2, interleaved)",
          "[tp][tp3d]") {
  const int n = world().size();
  for (bool sp : {false, true}) {
    const parallel::TensorParallelPlan plan{.tp = 2, .sequence_parallel = sp, .pp = 2, .micro_batches = 2};
    if (n >= 4)
      if (auto four = first_ranks(4)) check_against_reference<double>(*four, plan, false, 1e-9);
    if (n >= 8)
      if (auto eight = first_ranks(8)) check_against_reference<double>(*eight, plan, false, 1e-9);
  }
  // The interleaved schedule: 2 chunks (of one unit) per stage.
  if (n >= 4)
    if (auto four = first_ranks(4))
      check_against_reference<double>(*four, {.tp = 2, .pp = 2, .micro_batches = 2, .virtual_stages = 2}, false, 1e-9);
  // A checkpoint of the 3-D engine holds the full tensors under nn::GPT's names.
  const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_tp3d_ckpt_");
  const auto cfg = config(false);
  Reference<double> ref(cfg);
  ref.train(kSteps);
  if (n >= 4)
    if (auto four = first_ranks(4)) {
      parallel::TensorParallel<double> e(cfg, *four, {.tp = 2, .pp = 2, .micro_batches = 2}, Generator(7));
      optim::AdamW<double> opt(e.parameters(), kAdam);
      for (std::int64_t s = 0; s < kSteps; ++s) step(e, opt, make_batch(100 + static_cast<std::uint64_t>(s), cfg.vocab_size));
      if (four->rank() == 0) std::filesystem::remove_all(dir);
      four->barrier();
      ckpt::CheckpointManager mgr(dir, four);
      ckpt::save(mgr, kSteps, e, &opt, {});
      // A rank holding another tp index, stage or plan than its peers: every rank throws.
      CHECK_THROWS_WITH(parallel::TensorParallel<double>(cfg, *four, {.tp = 2, .pp = 1 + four->rank() % 2}),
                        Catch::Contains("[ptrain.tp.plan]"));
      CHECK_THROWS_WITH(parallel::TensorParallel<double>(config(true), *four, {.tp = 2, .pp = 2}),
                        Catch::Contains("[ptrain.tp.tied]"));
    }
  world().barrier();
  if (n >= 4) {
    dist::SelfCommunicator self;
    auto plain = std::make_shared<nn::GPT<double>>(cfg, *std::make_unique<Generator>(1));
    parallel::Local<double> local(*plain);
    ckpt::CheckpointManager mgr(dir, &self);
    ckpt::load(mgr, mgr.latest().path, local, nullptr);
    double diff = 0;
    auto a = plain->named_parameters(), b = ref.model->named_parameters();
    REQUIRE(a.size() == b.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto x = a[i].param->value.to_vector(), y = b[i].param->value.to_vector();
      for (std::size_t j = 0; j < x.size(); ++j) diff = std::max(diff, std::abs(x[j] - y[j]));
    }
    CHECK(diff < 1e-9);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

namespace {
// Fine-tuning's freezing (Note [Frozen parameters] in nn/flat_parameters.hpp): the
// embeddings, block 0 and the LM head's weight (vocabulary-parallel, column-parallel,
// row-parallel and replicated shards frozen; ln_f trains beside the frozen head).
template <class T>
void freeze_for_finetuning(nn::GPT<T>& m) {
  for (auto& p : m.named_parameters())
    if (p.name.rfind("embed.", 0) == 0 || p.name.rfind("h.0.", 0) == 0 || p.name == "head.lm_head.weight")
      p.param->set_requires_grad(false);
}

// A GPT with frozen parameters under `plan` against one process (AdamW with weight decay,
// eps 1e-6 as the other engines' frozen cases, and clipping); frozen shards must not move
// by one bit; a checkpoint of the engine loads into one process.
template <class T>
void check_frozen_tp(dist::Communicator& comm, const parallel::TensorParallelPlan& plan, double tol,
                     const std::filesystem::path& dir) {
  const auto cfg = config(false);
  const optim::AdamWOptions adam{.lr = 0.02, .eps = 1e-6, .weight_decay = 0.1};
  Generator ga(7), gb(7);
  nn::GPT<T> ref(cfg, ga), full(cfg, gb);
  freeze_for_finetuning(ref);
  freeze_for_finetuning(full);
  std::map<std::string, std::vector<T>> frozen_before;
  for (auto& p : ref.named_parameters())
    if (!p.param->requires_grad) frozen_before[p.name] = p.param->value.to_vector();
  parallel::Local<T> ref_e(ref);
  optim::AdamW<T> ref_opt(ref_e.parameters(), adam);
  parallel::TensorParallel<T> e(full, comm, plan);
  optim::AdamW<T> opt(e.parameters(), adam);
  INFO("frozen GPT: tp " << plan.tp << " x pp " << plan.pp << " x dp " << e.mesh().dp_size()
                         << (plan.sequence_parallel ? ", sp" : "") << ", " << comm.backend());
  const auto& frozen = e.parameters().frozen_entries();  // under FSDP in fsdp()->frozen_values()
  CHECK(frozen.empty() == plan.fsdp.has_value());
  for (const auto& f : frozen) CHECK(!f.param->grad.defined());
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const auto batch = make_batch(100 + static_cast<std::uint64_t>(s), cfg.vocab_size);
    const auto [ref_loss, ref_norm] = step<T>(ref_e, ref_opt, batch);
    const auto [loss, norm] = step<T>(e, opt, batch);
    CHECK(loss == Approx(ref_loss).epsilon(tol));
    CHECK(norm == Approx(ref_norm).epsilon(tol));  // over the trainable gradients, each once
  }
  // With pp 2, stage 0 (the embeddings and block 0) holds frozen parameters only.
  if (!e.parameters().entries().empty()) CHECK(max_rel_error(e, ref) < tol);
  for (std::size_t i = 0; i < frozen.size(); ++i)
    CHECK(parallel::detail::gather_full(frozen[i].param->value, e.frozen_spec(i), e.group()).to_vector() ==
          frozen_before[frozen[i].name]);
  if (plan.fsdp)
    for (const auto& [name, value] : full_parameters(e))
      if (frozen_before.count(name)) CHECK(value.to_vector() == frozen_before[name]);
  // The checkpoint holds the frozen tensors whole: it loads into one process.
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
  comm.barrier();
  ckpt::CheckpointManager mgr(dir, &comm);
  ckpt::save(mgr, kSteps, e, &opt, {});
  comm.barrier();
  if (comm.rank() == 0) {
    dist::SelfCommunicator self;
    Generator gc(1);
    nn::GPT<T> plain(cfg, gc);
    freeze_for_finetuning(plain);
    parallel::Local<T> local(plain);
    ckpt::CheckpointManager one(dir, &self);
    ckpt::load(one, one.latest().path, local, nullptr);
    auto a = plain.named_parameters(), b = ref.named_parameters();
    double diff = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const auto x = a[i].param->value.to_vector(), y = b[i].param->value.to_vector();
      if (!a[i].param->requires_grad) CHECK(x == frozen_before[a[i].name]);
      for (std::size_t j = 0; j < x.size(); ++j) diff = std::max(diff, std::abs(static_cast<double>(x[j]) - y[j]));
    }
    CHECK(diff < 10 * tol);
  }
  comm.barrier();
}
}  // namespace

TEST_CASE("Tensor parallel GPT with frozen parameters trains like one process (tp 2, dp x tp 2 x 2, tp x pp 2 x 2, FSDP x TP)",
          "[tp][frozen]") {
  const int n = world().size();
  const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_tp_frozen_");
  if (auto two = first_ranks(2)) {
    check_frozen_tp<double>(*two, {.tp = 2}, 1e-9, dir);
    check_frozen_tp<double>(*two, {.tp = 2, .sequence_parallel = true}, 1e-9, dir);
    check_frozen_tp<float>(*two, {.tp = 2}, 2e-4, dir);
  }
  if (n >= 4)
    if (auto four = first_ranks(4)) {
      check_frozen_tp<double>(*four, {.tp = 2}, 1e-9, dir);  // dp 2 x tp 2
      check_frozen_tp<double>(*four, {.tp = 2, .pp = 2, .micro_batches = 2}, 1e-9, dir);
      check_frozen_tp<double>(*four, {.tp = 2, .fsdp = parallel::FSDPOptions{}}, 1e-9, dir);  // FSDP x TP
    }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("make_engine builds a tensor-parallel engine from a GPT", "[tp]") {
  auto two = first_ranks(2);
  if (two) {
    const auto cfg = config(true);
    Generator g(7);
    auto model = std::make_shared<nn::GPT<float>>(cfg, g);
    // One step in float with SGD (kFloatSgdTol: one AdamW step would be lr * sign(g), flipped
    // by the last bits of near-zero gradients).
    Reference<float> ref(cfg, Opt::SGD);
    ref.train(1);
    auto e = parallel::make_engine<float>(model, *two, parallel::TensorParallelPlan{.tp = 2});
    CHECK(e->mode() == parallel::Mode::TensorParallel);
    auto opt = make_opt(Opt::SGD, e->parameters());
    const auto [loss, norm] = step(*e, *opt, make_batch(100, cfg.vocab_size));
    CHECK(loss == Approx(ref.history[0].first).epsilon(kFloatSgdTol));
    CHECK(norm == Approx(ref.history[0].second).epsilon(kFloatSgdTol));
    CHECK(max_rel_error(static_cast<parallel::TensorParallel<float>&>(*e), *ref.model) < kFloatSgdTol);
    // A model without a tensor-parallel form is refused on every rank.
    auto mlp = std::make_shared<nn::Sequential<float>>();
    mlp->add(std::make_shared<nn::Linear<float>>(3, 2));
    CHECK_THROWS_WITH(parallel::make_engine<float>(mlp, *two, parallel::TensorParallelPlan{.tp = 2}),
                      Catch::Contains("[ptrain.tp.model]"));
  }
  world().barrier();
}

TEST_CASE("Tensor-parallel collectives carry the Megatron byte count, with and without sequence parallelism",
          "[tp]") {
  auto two = first_ranks(2);
  if (two) {
    // Per layer without SP: the f and g of attention and of the MLP, one B*S*C
    // all-reduce each in forward (g) and backward (f); with SP an all-gather (f) and
    // a reduce-scatter (g) in forward and, in backward, g's all-gather, the column
    // layer's gather of its input again and f's reduce-scatter. The embedding's g
    // and the head's f once more; the loss: M (B*S values) and Z with the target
    // logit (2*B*S); with SP, once per step, the LayerNorms' partial gradients
    // (2 * C per LayerNorm) in one all-reduce.
    const auto cfg = config(true);
    const std::int64_t L = cfg.n_layer, tokens = kBatch * kSeq, activation = tokens * cfg.n_embd * 8,
                       loss = 3 * tokens * 8;
    for (bool sp : {false, true}) {
      INFO((sp ? "sp" : "no sp"));
      parallel::TensorParallel<double> e(cfg, *two, parallel::TensorParallelPlan{.tp = 2, .sequence_parallel = sp},
                                         Generator(7));
      const auto b = make_batch(5, cfg.vocab_size);
      e.group().reset_counters();
      e.forward_backward(b.ids, b.targets);
      const std::int64_t regions = sp ? 10 * L + 5 : 4 * L + 2;
      CHECK(e.group().bytes() == regions * activation + loss);
      CHECK(e.group().calls() == regions + 2);
      e.group().reset_counters();
      e.finish_gradient_sync();
      CHECK(e.group().bytes() == (sp ? (2 * L + 1) * 2 * cfg.n_embd * 8 : 0));
      e.group().reset_counters();
      e.eval_loss(b.ids, b.targets);  // forward only
      CHECK(e.group().bytes() == (sp ? 4 * L + 2 : 2 * L + 1) * activation + loss);
      if (sp)  // a sequence that tp does not cut into equal slices is refused on every rank
        CHECK_THROWS_WITH(e.eval_loss(b.ids.view(0, {1, 7}).clone(), b.targets.view(0, {1, 7}).clone()),
                          Catch::Contains("[ptrain.tp.sequence]"));
    }
  }
  world().barrier();
}

TEST_CASE("A block keeps the activations of the memory formula, divided by tp under sequence parallelism", "[tp]") {
  auto two = first_ranks(2);
  if (two) {
    // docs/tensor_parallel.md: a block keeps b*s*h*(4 + 12/t) + 4*b*s + a*b*s^2/t
    // elements for backward (its output included, as the next block's input);
    // with sequence parallelism every term is divided by t.
    const auto cfg = config(false);
    const std::int64_t b = kBatch, s = kSeq, h = cfg.n_embd, a = cfg.n_head, t = 2;
    for (bool sp : {false, true}) {
      INFO((sp ? "sp" : "no sp"));
      parallel::TensorParallel<double> e(cfg, *two, parallel::TensorParallelPlan{.tp = 2, .sequence_parallel = sp},
                                         Generator(7));
      Generator g(3);
      auto x = Tensor<double>::empty({b, sp ? s / t : s, h});
      ops::normal_(x, 0.0, 1.0, g);
      nn::Cache<double> cache;
      const std::int64_t before = memory_stats().live_bytes;
      auto y = e.model().units()[1]->forward(x, cache);  // block h.0
      const std::int64_t kept = memory_stats().live_bytes - before;
      const std::int64_t elements = sp ? (16 * b * s * h + 4 * b * s + a * b * s * s) / t
                                       : b * s * h * 4 + 12 * b * s * h / t + 4 * b * s + a * b * s * s / t;
      CHECK(kept == elements * 8);
    }
  }
  world().barrier();
}

TEST_CASE("A checkpoint saved at tp 2 resumes at tp 1, tp 4 and in one process", "[tp][ckpt]") {
  const int n = world().size();
  const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_tp_ckpt_");
  const auto cfg = config(false);
  Reference<double> ref(cfg);
  ref.train(kSteps);
  if (auto two = first_ranks(2)) {
    parallel::TensorParallel<double> e(cfg, *two, parallel::TensorParallelPlan{.tp = 2}, Generator(7));
    optim::AdamW<double> opt(e.parameters(), kAdam);
    for (std::int64_t s = 0; s < kSteps - 1; ++s) step(e, opt, make_batch(100 + static_cast<std::uint64_t>(s), cfg.vocab_size));
    if (two->rank() == 0) std::filesystem::remove_all(dir);
    two->barrier();
    ckpt::CheckpointManager mgr(dir, two);
    ckpt::save(mgr, kSteps - 1, e, &opt, {});
  }
  world().barrier();
  // The last step after loading, in each layout, ends at the reference.
  auto resume = [&](parallel::Engine<double>& e, auto& check) {
    optim::AdamW<double> opt(e.parameters(), kAdam);
    ckpt::CheckpointManager mgr(dir, &e.communicator());
    const auto state = ckpt::load(mgr, mgr.latest().path, e, &opt);
    CHECK(state.step == kSteps - 1);
    CHECK(opt.steps() == kSteps - 1);
    const auto [loss, norm] = step(e, opt, make_batch(100 + kSteps - 1, cfg.vocab_size));
    CHECK(loss == Approx(ref.history.back().first).epsilon(1e-9));
    check();
  };
  {
    dist::SelfCommunicator self;
    parallel::TensorParallel<double> one(cfg, self, parallel::TensorParallelPlan{.tp = 1}, Generator(1));
    auto check = [&] { CHECK(max_rel_error(one, *ref.model) < 1e-9); };
    INFO("tp 1");
    resume(one, check);
    // The plain model reads it too (full names and shapes).
    auto plain = std::make_shared<nn::GPT<double>>(cfg, *std::make_unique<Generator>(1));
    parallel::Local<double> local(*plain);
    auto none = [] {};
    resume(local, none);
  }
  if (n >= 4)
    if (auto four = first_ranks(4)) {
      parallel::TensorParallel<double> e(cfg, *four, parallel::TensorParallelPlan{.tp = 4}, Generator(1));
      auto check = [&] { CHECK(max_rel_error(e, *ref.model) < 1e-9); };
      INFO("tp 4");
      resume(e, check);
    }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("Bad tensor-parallel plans end every rank with the reason", "[tp][errors]") {
  auto two = first_ranks(2);
  if (two) {
    const auto cfg = config(true);
    // Different plans on the two ranks: both throw, neither hangs.
    CHECK_THROWS_WITH(parallel::TensorParallel<float>(cfg, *two, parallel::TensorParallelPlan{.tp = two->rank() + 1}),
                      Catch::Contains("[ptrain.tp.plan]"));
    CHECK_THROWS_WITH(parallel::TensorParallel<float>(cfg, *two, parallel::TensorParallelPlan{.tp = 3}),
                      Catch::Contains("[ptrain.tp.world]"));
    auto three_heads = cfg;
    three_heads.n_head = 3;
    three_heads.n_embd = 6;
    CHECK_THROWS_WITH(parallel::TensorParallel<float>(three_heads, *two, parallel::TensorParallelPlan{.tp = 2}),
                      Catch::Contains("[ptrain.tp.heads]"));
    // FSDP x TP has no pipeline (Note [FSDP x TP]).
    CHECK_THROWS_WITH(parallel::TensorParallel<float>(config(false), *two,
                                                      parallel::TensorParallelPlan{.tp = 1, .pp = 2, .fsdp = parallel::FSDPOptions{}}),
                      Catch::Contains("[ptrain.tp.fsdp_pipeline]"));
    // A target outside the vocabulary is refused on every rank (each checks all targets).
    parallel::TensorParallel<float> e(cfg, *two, parallel::TensorParallelPlan{.tp = 2});
    auto b = make_batch(3, cfg.vocab_size);
    b.targets.data()[5] = static_cast<std::int32_t>(cfg.vocab_size);
    CHECK_THROWS_WITH(e.forward_backward(b.ids, b.targets), Catch::Contains("[ptrain.tp.target]"));
  }
  world().barrier();
}

// FSDP x TP (Note [FSDP x TP]): dp 2 x tp 2, each tp shard sharded again over the two
// replicas. Float runs AdamW here: the reference differs only in the order of the
// same sums as the plain dp 2 x tp 2 layout, and 2e-4 bounds AdamW's amplification
// of their last bits over 3 steps on this model (measured: GPT 2.3e-5, Llama 1.3e-6).
constexpr double kFloatAdamTol = 2e-4;
parallel::TensorParallelPlan fsdp_plan(parallel::ShardingStrategy s = parallel::ShardingStrategy::FullShard,
                                       bool sp = false) {
  return {.tp = 2, .sequence_parallel = sp, .fsdp = parallel::FSDPOptions{.strategy = s}};
}

TEST_CASE("FSDP x TP trains GPT and Llama like one process (dp 2 x tp 2, SP off and on)", "[tp][fsdp]") {
  if (world().size() >= 4)
    if (auto four = first_ranks(4)) {
      for (bool tied : {true, false}) {
        check_against_reference<double>(*four, fsdp_plan(), tied, 1e-9);
        check_against_reference<float>(*four, fsdp_plan(), tied, kFloatAdamTol);
        check_against_reference<double, nn::Llama>(*four, fsdp_plan(), tied, 1e-9);
        check_against_reference<float, nn::Llama>(*four, fsdp_plan(), tied, kFloatAdamTol);
        // Sequence parallelism: the norms' partial gradients summed over tp after FSDP's reduction.
        check_against_reference<double>(*four, fsdp_plan(parallel::ShardingStrategy::FullShard, true), tied, 1e-9);
        check_against_reference<double, nn::Llama>(*four, fsdp_plan(parallel::ShardingStrategy::FullShard, true), tied,
                                                   1e-9);
      }
      // The other strategies only see the data-parallel group.
      for (auto s : {parallel::ShardingStrategy::ShardGradOp, parallel::ShardingStrategy::ShardOptimizer,
                     parallel::ShardingStrategy::NoShard})
        check_against_reference<double>(*four, fsdp_plan(s), false, 1e-9);
    }
  world().barrier();
}

TEST_CASE("An FSDP x TP checkpoint loads into one process, into TP alone and back", "[tp][fsdp][ckpt]") {
  if (world().size() < 4) return;
  const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_fsdp_tp_ckpt_");
  const auto cfg = config(true);
  Reference<double> ref(cfg);
  ref.train(kSteps);
  std::vector<std::pair<std::string, Tensor<double>>> saved;  // the full values saved, on the ranks that saved
  if (auto four = first_ranks(4)) {
    parallel::TensorParallel<double> e(cfg, *four, fsdp_plan(), Generator(7));
    optim::AdamW<double> opt(e.parameters(), kAdam);
    for (std::int64_t s = 0; s < kSteps - 1; ++s) step(e, opt, make_batch(100 + static_cast<std::uint64_t>(s), cfg.vocab_size));
    if (four->rank() == 0) std::filesystem::remove_all(dir);
    four->barrier();
    ckpt::CheckpointManager mgr(dir, four);
    ckpt::save(mgr, kSteps - 1, e, &opt, {});
    saved = full_parameters(e);
  }
  world().barrier();
  // Loaded values equal the saved ones bit for bit; the last step ends at the reference.
  auto same_as_saved = [&](const std::vector<std::pair<std::string, Tensor<double>>>& loaded) {
    if (saved.empty()) return;
    CHECK(loaded.size() == saved.size());
    for (const auto& [name, value] : loaded) {
      auto it = std::find_if(saved.begin(), saved.end(), [&](auto& p) { return p.first == name; });
      REQUIRE(it != saved.end());
      CHECK(value.to_vector() == it->second.to_vector());
    }
  };
  auto resume = [&](parallel::Engine<double>& e, auto loaded) {
    optim::AdamW<double> opt(e.parameters(), kAdam);
    ckpt::CheckpointManager mgr(dir, &e.communicator());
    const auto state = ckpt::load(mgr, mgr.latest().path, e, &opt);
    CHECK(state.step == kSteps - 1);
    same_as_saved(loaded());
    const auto [loss, norm] = step(e, opt, make_batch(100 + kSteps - 1, cfg.vocab_size));
    CHECK(loss == Approx(ref.history.back().first).epsilon(1e-9));
    CHECK(norm == Approx(ref.history.back().second).epsilon(1e-9));
  };
  {
    INFO("one process");
    dist::SelfCommunicator self;
    auto plain = std::make_shared<nn::GPT<double>>(cfg, *std::make_unique<Generator>(1));
    parallel::Local<double> local(*plain);
    resume(local, [&] { return named_values(*plain); });
    CHECK(max_rel_error(named_values(*plain), *ref.model) < 1e-9);
  }
  if (auto two = first_ranks(2)) {
    INFO("tp 2 without FSDP");
    parallel::TensorParallel<double> e(cfg, *two, parallel::TensorParallelPlan{.tp = 2}, Generator(1));
    resume(e, [&] { return full_parameters(e); });
    CHECK(max_rel_error(e, *ref.model) < 1e-9);
  }
  world().barrier();
  if (auto four = first_ranks(4)) {
    INFO("FSDP x TP again");
    parallel::TensorParallel<double> e(cfg, *four, fsdp_plan(), Generator(1));
    resume(e, [&] { return full_parameters(e); });
    CHECK(max_rel_error(e, *ref.model) < 1e-9);
  }
  world().barrier();
  if (world().rank() == 0) std::filesystem::remove_all(dir);
}

// Parameters, gradients and AdamW's two moments, after a step: 4 float buffers of the
// local elements. TP alone's flat buffer starts each of its P tensors' elements at a
// multiple of 16; FSDP x TP pads each unit's elements to a multiple of dp = 2 and keeps
// half of them.
TEST_CASE("FSDP x TP keeps 1/dp of TP alone's parameter, gradient and AdamW bytes", "[tp][fsdp][memory]") {
  if (world().size() < 4) return;
  if (auto four = first_ranks(4)) {
    const auto cfg = config(false);
    std::int64_t tp_flat = 0, tp_elements = 0, fsdp_padded = 0;
    auto persistent = [&](const parallel::TensorParallelPlan& plan) {
      const auto before = memory_stats().live_bytes;
      parallel::TensorParallel<float> e(cfg, *four, plan, Generator(7));
      optim::AdamW<float> opt(e.parameters(), kAdam);
      step(e, opt, make_batch(100, cfg.vocab_size));
      if (auto* f = e.fsdp()) {
        for (std::size_t g = 0; g < f->num_groups(); ++g) fsdp_padded += f->group_padded(g);
      } else {
        tp_flat = e.parameters().numel();
        for (const auto& en : e.parameters().entries()) tp_elements += en.numel();
      }
      return memory_stats().live_bytes - before;
    };
    const auto tp_bytes = persistent({.tp = 2});
    const auto fsdp_bytes = persistent(fsdp_plan());
    INFO("TP alone " << tp_bytes << " bytes, FSDP x TP " << fsdp_bytes << " bytes");
    CHECK(tp_bytes == 4 * 4 * tp_flat);
    CHECK(fsdp_bytes == 4 * 4 * fsdp_padded / 2);
    const auto units = static_cast<std::int64_t>(cfg.n_layer + 2);
    CHECK(fsdp_padded - tp_elements >= 0);
    CHECK(fsdp_padded - tp_elements < units);  // < dp - 1 per unit
    CHECK(std::abs(2 * fsdp_bytes - tp_bytes) < tp_bytes / 100);  // half, up to TP alone's alignment gaps
  }
  world().barrier();
}

}  // namespace test_tensor_parallel
