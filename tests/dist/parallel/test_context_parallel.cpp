// Context parallelism (parallel/context_parallel.hpp, parallel/cp_engine.hpp): the
// ring (and all-gather) attention alone against the one-process grouped-query attention
// (forward and backward, GQA, packed documents, a sliding window, chunks of odd length), and GPT
// and Llama trained with the sequence split over cp ranks (cp = the world, and the dp x cp
// layouts the world allows) against one process on the global batch, in double and float
// over several AdamW steps, replicated and with FSDP over the dp x cp ranks; checkpoints
// saved at cp 2 resumed at other layouts; attention's bytes against the memory formula, and
// FSDP's 1/world of the parameters, gradients and optimizer state; context parallelism inside
// tensor parallelism (TensorParallelPlan::cp: cp 2 x tp 2, dp 2 x cp 2 x tp 2), with and without
// FSDP, against one process, and its checkpoints in one process and another layout. Every rank
// runs every case in the same order; checks use CHECK so no rank skips collectives.
#include <catch2/catch.hpp>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <vector>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/forwarding_communicator.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/ops/gqa_attention.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/fsdp.hpp>
#include <ptrain/parallel/local.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_context_parallel {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// In double the ring merges the blocks in another order than one process sums its
// keys (~1e-15 relative); a wrong mask, position or missing block moves values by
// far more than 1e-9.
constexpr double kTol = 1e-9;
constexpr std::int32_t kDocument = 0;  // the token that starts each packed document

template <class T>
double max_rel_diff(const Tensor<T>& got, const Tensor<T>& want) {
  REQUIRE(got.numel() == want.numel());
  double diff = 0, scale = 1e-300;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got.data()[i]) - static_cast<double>(want.data()[i])));
    scale = std::max(scale, std::abs(static_cast<double>(want.data()[i])));
  }
  return diff / scale;
}

Tensor<double> randn(const Shape& shape, std::uint64_t seed) {
  Generator g(seed);
  auto t = Tensor<double>::empty(shape);
  ops::normal_(t, 0.0, 1.0, g);
  return t;
}

// Token ids [B, S] with kDocument starting a document now and then (never at 0 for row 1).
Tensor<std::int32_t> packed_ids(std::int64_t B, std::int64_t S, std::int32_t vocab, std::uint64_t seed) {
  Generator g(seed);
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i)
    ids.data()[i] =
        g.below(5) == 0 ? kDocument : static_cast<std::int32_t>(1 + g.below(static_cast<std::uint64_t>(vocab - 1)));
  return ids;
}

// The (dp, cp) layouts that the world allows: cp = the world, and dp x cp with cp 2 and
// cp 4 where they divide it (4 ranks: dp 2 x cp 2; 8 ranks: dp 2 x cp 4, dp 4 x cp 2).
std::vector<std::pair<int, int>> layouts(int n) {
  std::vector<std::pair<int, int>> out = {{1, n}};
  for (int cp : {4, 2})
    if (cp < n && n % cp == 0) out.push_back({n / cp, cp});
  return out;
}

// The first n ranks of the world as a group (nullptr on the others); collective.
dist::Communicator* first_ranks(int n) {
  static std::map<int, std::unique_ptr<dist::Communicator>> groups;
  auto& w = world();
  if (!groups.count(n)) groups[n] = w.split(w.rank() < n ? 0 : -1, w.rank());
  return groups[n].get();
}

}  // namespace

TEST_CASE("ring and all-gather attention equal one process's attention, forward and backward", "[cp]") {
  auto& comm = world();
  const int cp = comm.size();
  struct Case {
    std::int64_t chunk, H, Hkv, D;
    bool documents;
    std::int64_t window;
  };
  const std::vector<Case> cases = {{3, 4, 2, 4, false, 0}, {5, 2, 1, 6, true, 0}, {3, 4, 4, 2, true, 0},
                                   {3, 4, 2, 4, false, 4}};
  for (const Case& c : cases) {
    const std::int64_t B = 2, S = 2 * cp * c.chunk;
    auto q = randn({B, S, c.H, c.D}, 1), k = randn({B, S, c.Hkv, c.D}, 2), v = randn({B, S, c.Hkv, c.D}, 3),
         dy = randn({B, S, c.H, c.D}, 4);
    Tensor<std::int32_t> starts;
    if (c.documents) starts = nn::document_starts(packed_ids(B, S, 7, 5), kDocument);
    // One process on the whole sequence.
    ops::GqaSaved<double> ref_saved;
    auto y_ref = ops::gqa_attention(q, k, v, ref_saved, starts, c.window);
    Tensor<double> dq_ref, dk_ref, dv_ref;
    ops::gqa_attention_backward(q, k, v, ref_saved, dy, dq_ref, dk_ref, dv_ref);
    for (auto exchange : {parallel::KVExchange::Ring, parallel::KVExchange::AllGather}) {
      INFO("chunk " << c.chunk << ", H " << c.H << ", Hkv " << c.Hkv << ", documents " << c.documents
                    << ", window " << c.window << ", cp " << cp
                    << (exchange == parallel::KVExchange::Ring ? ", ring" : ", all-gather"));
      // This rank's slice.
      parallel::ContextParallelGroup g(&comm, exchange);
      parallel::RingSaved<double> saved;
      auto y = parallel::context_attention(g, g.shard(q), g.shard(k), g.shard(v),
                                           starts.defined() ? g.shard(starts) : starts, c.window, saved);
      Tensor<double> dq, dk, dv;
      parallel::context_attention_backward(g, g.shard(q), g.shard(k), g.shard(v), saved, g.shard(dy), dq, dk, dv);
      CHECK(max_rel_diff(y, g.shard(y_ref)) < kTol);
      CHECK(max_rel_diff(g.gather(y), y_ref) < kTol);
      CHECK(max_rel_diff(dq, g.shard(dq_ref)) < kTol);
      CHECK(max_rel_diff(dk, g.shard(dk_ref)) < kTol);
      CHECK(max_rel_diff(dv, g.shard(dv_ref)) < kTol);
    }
  }
}

// Note [Group teardown]
// A rank that destroys a group (a split, a mesh, an engine's mesh) closes its
// connections; one that does so while a slower rank still connects to that group or
// reads from it ends that rank with a connection error (Gloo). Each case that makes
// groups ends with a barrier on them or on the world before they go.

namespace {
// Counts the bytes this rank sends point to point.
class CountingSends : public dist::ForwardingCommunicator {
 public:
  explicit CountingSends(std::unique_ptr<dist::Communicator> c) : ForwardingCommunicator(std::move(c)) {}
  std::shared_ptr<dist::Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    sent += static_cast<std::int64_t>(count * dtype_size(dt));
    return ForwardingCommunicator::send_async(buf, count, dt, peer, tag);
  }
  std::int64_t sent = 0;
};
}  // namespace

TEST_CASE("the ring sends the bytes of docs/context_parallel.md's traffic formula", "[cp]") {
  CountingSends comm(world().split(0, world().rank()));
  parallel::ContextParallelGroup g(&comm);
  const std::int64_t cp = g.size(), B = 2, S = 2 * cp * 3, H = 4, Hkv = 2, D = 4, block = B * (S / cp) * Hkv * D * 8;
  auto q = g.shard(randn({B, S, H, D}, 21)), k = g.shard(randn({B, S, Hkv, D}, 22)),
       v = g.shard(randn({B, S, Hkv, D}, 23)), dy = g.shard(randn({B, S, H, D}, 24));
  parallel::RingSaved<double> saved;
  parallel::ring_attention(g, q, k, v, Tensor<std::int32_t>(), 0, saved);
  CHECK(comm.sent == 2 * (cp - 1) * block);  // cp - 1 blocks of K and V
  comm.sent = 0;
  Tensor<double> dq, dk, dv;
  parallel::ring_attention_backward(g, q, k, v, saved, dy, dq, dk, dv);
  CHECK(comm.sent == (cp > 1 ? 2 * (2 * cp - 1) * block : 0));  // those again, and cp blocks of dK and dV
  comm.barrier();  // Note [Group teardown]
}

TEST_CASE("ring attention in float equals one process's within float rounding", "[cp]") {
  auto& comm = world();
  parallel::ContextParallelGroup g(&comm);
  const std::int64_t B = 2, S = 2 * g.size() * 5, H = 4, Hkv = 2, D = 8;
  auto as_float = [](const Tensor<double>& t) {
    auto f = Tensor<float>::empty(t.shape());
    for (std::int64_t i = 0; i < t.numel(); ++i) f.data()[i] = static_cast<float>(t.data()[i]);
    return f;
  };
  auto q = as_float(randn({B, S, H, D}, 11)), k = as_float(randn({B, S, Hkv, D}, 12)),
       v = as_float(randn({B, S, Hkv, D}, 13)), dy = as_float(randn({B, S, H, D}, 14));
  const auto starts = nn::document_starts(packed_ids(B, S, 7, 15), kDocument);
  ops::GqaSaved<float> ref_saved;
  auto y_ref = ops::gqa_attention(q, k, v, ref_saved, starts);
  Tensor<float> dq_ref, dk_ref, dv_ref;
  ops::gqa_attention_backward(q, k, v, ref_saved, dy, dq_ref, dk_ref, dv_ref);
  parallel::RingSaved<float> saved;
  auto y = parallel::ring_attention(g, g.shard(q), g.shard(k), g.shard(v), g.shard(starts), 0, saved);
  Tensor<float> dq, dk, dv;
  parallel::ring_attention_backward(g, g.shard(q), g.shard(k), g.shard(v), saved, g.shard(dy), dq, dk, dv);
  constexpr double kAttentionTol = 2e-5;  // a float's rounding over sums of ~S terms, not a missing block (~1e-1)
  CHECK(max_rel_diff(y, g.shard(y_ref)) < kAttentionTol);
  CHECK(max_rel_diff(dq, g.shard(dq_ref)) < kAttentionTol);
  CHECK(max_rel_diff(dk, g.shard(dk_ref)) < kAttentionTol);
  CHECK(max_rel_diff(dv, g.shard(dv_ref)) < kAttentionTol);
}

TEST_CASE("a dp x cp mesh numbers ranks with the cp ranks of a replica consecutive", "[cp]") {
  auto& comm = world();
  for (auto [dp, cp] : layouts(comm.size())) {
    const parallel::MeshShape shape{.dp = dp, .cp = cp};
    parallel::Mesh mesh(comm, shape);
    CHECK(mesh.cp_rank() == comm.rank() % shape.cp);
    CHECK(mesh.replica() == comm.rank() / shape.cp);
    CHECK(mesh.world_rank(mesh.replica(), mesh.stage(), 0, mesh.cp_rank()) == comm.rank());
    REQUIRE((shape.cp == 1 || mesh.context_group() != nullptr));
    if (mesh.context_group()) CHECK(mesh.context_group()->rank() == mesh.cp_rank());
    CHECK(mesh.data_group().size() == shape.dp);
    CHECK(mesh.tensor_group().size() == 1);
    comm.barrier();  // Note [Group teardown]
  }
}

TEST_CASE("context parallelism refuses a sequence that does not divide into 2 cp chunks", "[cp]") {
  auto& comm = world();
  parallel::ContextParallelGroup g(&comm);
  const std::int64_t S = 2 * g.size() * 3 + 1;
  CHECK_THROWS_WITH(g.chunk(S), Catch::Contains("[ptrain.cp.length]"));
  // The positions of this rank's tokens: chunks r and 2 cp - 1 - r of 3 tokens.
  const auto pos = g.positions(S - 1).to_vector();
  const int r = g.rank(), last = 2 * g.size() - 1 - r;
  CHECK(pos == std::vector<std::int32_t>{3 * r, 3 * r + 1, 3 * r + 2, 3 * last, 3 * last + 1, 3 * last + 2});
  nn::LlamaConfig cfg{.vocab_size = 11, .n_layer = 1, .n_head = 2, .n_kv_head = 1, .n_embd = 8,
                      .intermediate_size = 8};
  Generator gen(1);
  auto engine = parallel::make_engine<double>(std::make_shared<nn::Llama<double>>(cfg, gen), comm,
                                              parallel::ContextParallelPlan{.cp = comm.size()});
  auto ids = Tensor<std::int32_t>::zeros({1, S});
  CHECK_THROWS_WITH(engine->forward_backward(ids, Tensor<std::int32_t>::zeros({S})),
                    Catch::Contains("[ptrain.cp.length]"));
  comm.barrier();  // Note [Group teardown]
  engine.reset();
  if (comm.size() > 1) {
    // Rank 0 asks for another cp degree than the others: every rank ends with the reason, none hangs.
    const parallel::ContextParallelPlan mine{.cp = comm.rank() == 0 ? comm.size() : 1};
    CHECK_THROWS_WITH(parallel::make_engine<double>(std::make_shared<nn::Llama<double>>(cfg, gen), comm, mine),
                      Catch::Contains("[ptrain.cp.plan]"));
  }
}

namespace {

const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
constexpr std::int64_t kSteps = 3;
// In float, a float's rounding carried through kSteps AdamW steps (~1e-6 relative per
// step, more where a gradient is near zero); a wrong mask or position moves values by
// ~1e-2 after one step.
constexpr double kFloatTol = 2e-4;

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch make_batch(std::int64_t rows, std::int64_t S, std::int32_t vocab, std::uint64_t seed) {
  Generator g(seed);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(rows * S));
  for (auto& t : targets) t = static_cast<std::int32_t>(g.below(vocab));
  // An ignored target in each row (the replicas then count as many tokens, so that averaging
  // their means gives the global mean): the loss is the mean over the counted tokens.
  for (std::int64_t r = 0; r < rows; ++r) targets[static_cast<std::size_t>(r * S + 1 + r % 4)] = -100;
  return {packed_ids(rows, S, vocab, seed), Tensor<std::int32_t>::from(targets, {rows * S})};
}

// One process trained on the global batches of steps 0 .. steps - 1.
template <class T>
struct OneProcess {
  template <class MakeModel>
  OneProcess(MakeModel make, std::int64_t rows, std::int64_t S, std::int32_t vocab, std::int64_t steps)
      : model(make()), params(*model) {
    optim::AdamW<T> opt(params, kAdam);
    for (std::int64_t s = 0; s < steps; ++s) {
      const Batch b = make_batch(rows, S, vocab, 300 + static_cast<std::uint64_t>(s));
      nn::CrossEntropyLoss<T> ce;
      nn::Cache<T> c, lc;
      params.zero_grad();
      auto logits = model->forward_tokens(b.ids, c);
      loss.push_back(ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc));
      model->backward(ce.backward(lc).reshape(logits.shape()), c);
      opt.step();
    }
  }
  // Every trainable parameter of `e` by name within tol of this model's, and the frozen ones bit for bit.
  void check_parameters(parallel::Engine<T>& e, double tol) {
    std::map<std::string, Tensor<T>> ref;
    for (const auto& p : params.entries()) ref[p.name] = p.param->value;
    if (auto* tp = dynamic_cast<parallel::TensorParallel<T>*>(&e)) {  // gathered over FSDP and tp (collective), by name
      std::vector<std::pair<std::string, Tensor<T>>> full;
      if (auto* f = tp->fsdp())
        for (auto& [name, shard] : f->full_parameters()) full.emplace_back(name, shard);
      else
        for (const auto& p : e.parameters().entries()) full.emplace_back(p.name, p.param->value);
      REQUIRE(full.size() == ref.size());
      for (const auto& [name, shard] : full) {
        INFO(name);
        REQUIRE(ref.count(name) == 1);
        CHECK(max_rel_diff(parallel::detail::gather_full(shard, tp->spec_of(name), tp->group()), ref[name]) < tol);
      }
      return;
    }
    if (auto* fsdp = dynamic_cast<parallel::FSDP<T>*>(&e.local_module())) {  // gathered (collective), by name
      for (const auto& p : params.frozen_entries()) ref[p.name] = p.param->value;
      const auto full = fsdp->full_parameters();
      REQUIRE(full.size() == ref.size());
      for (const auto& [name, value] : full) {
        INFO(name);
        REQUIRE(ref.count(name) == 1);
        CHECK(max_rel_diff(value, ref[name]) < tol);
      }
      return;
    }
    REQUIRE(e.parameters().entries().size() == ref.size());
    for (const auto& p : e.parameters().entries()) {
      INFO(p.name);
      REQUIRE(ref.count(p.name) == 1);
      CHECK(max_rel_diff(p.param->value, ref[p.name]) < tol);
    }
    // Frozen parameters (Note [Frozen parameters] in nn/flat_parameters.hpp): unchanged, bit for bit.
    REQUIRE(e.parameters().frozen_entries().size() == params.frozen_entries().size());
    for (std::size_t i = 0; i < params.frozen_entries().size(); ++i) {
      const auto& got = e.parameters().frozen_entries()[i];
      const auto& want = params.frozen_entries()[i];
      INFO(got.name);
      CHECK(got.name == want.name);
      CHECK(got.param->value.to_vector() == want.param->value.to_vector());
    }
  }
  std::shared_ptr<nn::Module<T>> model;
  nn::FlatParameters<T> params;
  std::vector<double> loss;
};

// Step s of engine `e` on its replica's rows of the global batch; returns the global mean loss.
template <class T>
double train_step(parallel::Engine<T>& e, optim::AdamW<T>& opt, std::int64_t rows, std::int64_t S,
                  std::int32_t vocab, std::int64_t s) {
  dist::Communicator* dpg = e.data_parallel_group();
  const std::int64_t dp = dpg ? dpg->size() : 1, mine = rows / dp, r = dpg ? dpg->rank() : 0;
  const Batch b = make_batch(rows, S, vocab, 300 + static_cast<std::uint64_t>(s));
  e.zero_grad();
  const double loss =
      e.average(e.forward_backward(b.ids.narrow(r * mine, mine), b.targets.narrow(r * mine * S, mine * S)));
  e.step(opt);
  return loss;
}

// Trains `make()` for kSteps AdamW steps on the global batches: one process, then the
// engine of `plan` on this replica's rows; compares every parameter by name and the losses.
template <class T, class MakeModel>
void check_like_one_process(MakeModel make, const parallel::Plan<T>& plan, int dp, std::int64_t S,
                            std::int32_t vocab, double tol) {
  const std::int64_t rows = 2 * dp;
  OneProcess<T> ref(make, rows, S, vocab, kSteps);
  auto engine = parallel::make_engine<T>(make(), world(), plan);
  optim::AdamW<T> opt(engine->parameters(), kAdam);
  REQUIRE(engine->data_parallel_group()->size() == dp);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const double loss = train_step(*engine, opt, rows, S, vocab, s), want = ref.loss[static_cast<std::size_t>(s)];
    CHECK(std::abs(loss - want) < tol * want);
  }
  ref.check_parameters(*engine, tol);
  world().barrier();  // Note [Group teardown]
}

nn::GPTConfig gpt_config(std::int64_t S) {
  return {.vocab_size = 13, .block_size = S, .n_layer = 2, .n_head = 2, .n_embd = 8};
}
nn::LlamaConfig llama_config(std::int64_t layers) {
  return {.vocab_size = 17, .n_layer = layers, .n_head = 4, .n_kv_head = 2, .n_embd = 16, .intermediate_size = 24,
          .document_token = kDocument};
}

// GPT and Llama in T at each layout the world allows, against one process within tol.
// The parameters, gradients and AdamW state sharded over the dp x cp ranks too (fsdp).
template <class T>
void check_models(double tol) {
  for (auto [dp, cp] : layouts(world().size())) {
    INFO("dp " << dp << " x cp " << cp << (std::is_same_v<T, float> ? ", float" : ", double"));
    const std::int64_t S = 2 * cp * 3;  // chunks of 3 tokens
    for (bool fsdp : {false, true}) {
      INFO((fsdp ? "with FSDP over the dp x cp ranks" : "replicated"));
      {
        INFO("GPT (tied) with recomputed blocks");
        auto cfg = gpt_config(S);
        cfg.recompute = true;
        check_like_one_process<T>([cfg] { Generator g(3); return std::make_shared<nn::GPT<T>>(cfg, g); },
                                  parallel::ContextParallelPlan{.cp = cp, .fsdp = fsdp}, dp, S, 13, tol);
      }
      {
        INFO("Llama (GQA 4 / 2 heads) on packed documents");
        const auto cfg = llama_config(2);
        check_like_one_process<T>([cfg] { Generator g(5); return std::make_shared<nn::Llama<T>>(cfg, g); },
                                  parallel::ContextParallelPlan{.cp = cp, .fsdp = fsdp}, dp, S, 17, tol);
      }
    }
    if (!std::is_same_v<T, double>) continue;  // float: the rounding of the two above is enough
    {
      INFO("GPT (tied) with its embeddings and first block frozen");
      const auto cfg = gpt_config(S);
      check_like_one_process<T>(
          [cfg] {
            Generator g(3);
            auto m = std::make_shared<nn::GPT<T>>(cfg, g);
            for (auto& p : m->named_parameters())
              if (p.name.rfind("embed.", 0) == 0 || p.name.rfind("h.0.", 0) == 0) p.param->set_requires_grad(false);
            return m;
          },
          parallel::ContextParallelPlan{.cp = cp}, dp, S, 13, tol);
    }
    {
      INFO("Llama with the keys and values all-gathered");
      const auto cfg = llama_config(1);
      check_like_one_process<T>([cfg] { Generator g(7); return std::make_shared<nn::Llama<T>>(cfg, g); },
                                parallel::ContextParallelPlan{.cp = cp, .kv_exchange = parallel::KVExchange::AllGather},
                                dp, S, 17, tol);
    }
  }
}

}  // namespace

TEST_CASE("GPT and Llama with context parallelism train like one process", "[cp]") {
  check_models<double>(kTol);
}

TEST_CASE("GPT and Llama with context parallelism train like one process in float", "[cp]") {
  check_models<float>(kFloatTol);
}

// The engine's checkpoints are DDP's (rank 0 writes the whole model under the full
// model's names), or with FSDP, FSDP's sharded ones under the same names, so one saved
// at cp 2 (with and without FSDP) loads at any cp and dp, with or without FSDP, and into
// the plain model.
TEST_CASE("a checkpoint saved at cp 2 resumes at cp 1, in one process, at cp 4 and at dp 2 x cp 2", "[cp][ckpt]") {
  for (bool saved_fsdp : {false, true}) {
    INFO((saved_fsdp ? "saved with FSDP" : "saved replicated"));
    const int n = world().size();
    const auto dir = ptrain::testing::shared_tmp_dir(world(), "ptrain_cp_ckpt_");
    const auto cfg = llama_config(2);
    auto make = [cfg] { Generator g(5); return std::make_shared<nn::Llama<double>>(cfg, g); };
    const std::int64_t rows = 2, S = 24;  // chunks of 3 tokens at cp 4
    OneProcess<double> ref(make, rows, S, 17, kSteps);
    if (auto two = first_ranks(2)) {
      auto model = make();
      parallel::ContextParallel<double> e(*model, *two, parallel::ContextParallelPlan{.cp = 2, .fsdp = saved_fsdp});
      optim::AdamW<double> opt(e.parameters(), kAdam);
      for (std::int64_t s = 0; s < kSteps - 1; ++s) train_step(e, opt, rows, S, 17, s);
      if (two->rank() == 0) std::filesystem::remove_all(dir);
      two->barrier();
      ckpt::CheckpointManager mgr(dir, two);
      ckpt::save(mgr, kSteps - 1, e, &opt, {});
    }
    world().barrier();
    // The last step after loading, in each layout, ends at the uninterrupted run.
    auto resume = [&](parallel::Engine<double>& e) {
      optim::AdamW<double> opt(e.parameters(), kAdam);
      ckpt::CheckpointManager mgr(dir, &e.communicator());
      const auto state = ckpt::load(mgr, mgr.latest().path, e, &opt);
      CHECK(state.step == kSteps - 1);
      CHECK(opt.steps() == kSteps - 1);
      const double loss = train_step(e, opt, rows, S, 17, kSteps - 1);
      CHECK(std::abs(loss - ref.loss.back()) < kTol * ref.loss.back());
      ref.check_parameters(e, kTol);
    };
    {
      INFO("cp 1");
      dist::SelfCommunicator self;
      auto model = make();
      parallel::ContextParallel<double> one(*model, self, parallel::ContextParallelPlan{.cp = 1});
      resume(one);
    }
    {
      INFO("the plain model in one process (full tensor names)");
      auto model = make();
      parallel::Local<double> local(*model);
      resume(local);
    }
    if (n >= 4)
      if (auto four = first_ranks(4))
        for (int cp : {4, 2})
          for (bool fsdp : {false, true}) {
            INFO("dp " << 4 / cp << " x cp " << cp << (fsdp ? " with FSDP" : ""));
            auto model = make();
            parallel::ContextParallel<double> e(*model, *four, parallel::ContextParallelPlan{.cp = cp, .fsdp = fsdp});
            resume(e);
            four->barrier();  // Note [Group teardown]
          }
    world().barrier();
    if (world().rank() == 0) std::filesystem::remove_all(dir);
  }
}

namespace {
// Bytes that one context-parallel Llama attention keeps for backward at sequence S over
// the N ranks of `cp` (docs/context_parallel.md, "Memory per rank"), measured with the
// allocator's live-byte counter: its output (the layer's result, not kept) left out.
template <class T>
std::int64_t attention_bytes(dist::Communicator& cp, parallel::KVExchange exchange, std::int64_t B, std::int64_t S) {
  const auto cfg = llama_config(1);
  Generator gen(5);
  auto model = std::make_shared<nn::Llama<T>>(cfg, gen);
  auto batch = std::make_shared<parallel::ContextParallelBatch>(&cp, exchange);
  parallel::ContextParallelGQA<T> attn(model, dynamic_cast<nn::LlamaBlock<T>&>(*model->units()[1]).self_attn(), batch);
  const auto starts = nn::document_starts(packed_ids(B, S, cfg.vocab_size, 41), kDocument);
  batch->starts = batch->group.shard(starts);
  batch->positions = batch->group.shard(nn::document_positions(starts));
  auto x = Tensor<T>::empty({B, S / cp.size(), cfg.n_embd});
  ops::normal_(x, T(0), T(1), gen);
  nn::Cache<T> cache;
  const std::int64_t before = memory_stats().live_bytes;
  const auto y = attn.forward(x, cache);
  return memory_stats().live_bytes - before - static_cast<std::int64_t>(y.nbytes());
}
}  // namespace

TEST_CASE("attention keeps the bytes of docs/context_parallel.md's memory formula", "[cp][memory]") {
  auto& comm = world();
  dist::SelfCommunicator self;
  const auto cfg = llama_config(1);
  const std::int64_t B = 2, S = 2 * comm.size() * 5, H = cfg.n_head, Hkv = cfg.n_kv_head, D = cfg.n_embd / H;
  for (dist::Communicator* cp : {static_cast<dist::Communicator*>(&self), &comm})
    for (auto exchange : {parallel::KVExchange::Ring, parallel::KVExchange::AllGather}) {
      const std::int64_t N = cp->size(), elements = B * S / N * ((2 * H + 2 * Hkv) * D + H);
      INFO("S " << S << ", cp " << N << (exchange == parallel::KVExchange::Ring ? ", ring" : ", all-gather"));
      CHECK(attention_bytes<double>(*cp, exchange, B, S) == 8 * elements);
      CHECK(attention_bytes<float>(*cp, exchange, B, S) == 4 * elements);
    }
  comm.barrier();  // Note [Group teardown]
}

// One sequence, which data parallelism cannot split: one rank's peak is every rank's
// in any data-parallel layout. The allocator has no limit to set: the budget is checked
// against its peak counter (docs/context_parallel.md, "Memory per rank").
TEST_CASE("a sequence over one rank's memory budget trains under cp 2 within it", "[cp][memory]") {
  constexpr std::int64_t kBudget = 1536 * 1024;  // bytes a rank may hold for the whole run
  const auto cfg = llama_config(2);
  const std::int64_t rows = 1, S = 512;  // one sequence: data parallelism cannot split it
  auto make = [cfg] { Generator g(5); return std::make_shared<nn::Llama<double>>(cfg, g); };
  // Peak bytes of building the engine over `cp` and training it two steps; the losses.
  auto peak = [&](dist::Communicator& cp, std::vector<double>& loss) {
    const std::int64_t before = memory_stats().live_bytes;
    reset_peak_memory();
    {
      auto model = make();
      parallel::ContextParallel<double> e(*model, cp, parallel::ContextParallelPlan{.cp = cp.size()});
      optim::AdamW<double> opt(e.parameters(), kAdam);
      for (std::int64_t s = 0; s < 2; ++s) loss.push_back(train_step(e, opt, rows, S, cfg.vocab_size, s));
      cp.barrier();  // Note [Group teardown]
    }
    return memory_stats().peak_bytes - before;
  };
  if (auto two = first_ranks(2)) {
    std::vector<double> one_loss, two_loss;
    dist::SelfCommunicator self;
    const std::int64_t one_rank = peak(self, one_loss), cp2 = peak(*two, two_loss);
    if (two->rank() == 0)
      std::printf("context parallelism, Llama at S = %lld: peak %lld bytes on one rank, %lld per rank at cp 2\n",
                  static_cast<long long>(S), static_cast<long long>(one_rank), static_cast<long long>(cp2));
    CHECK(one_rank > kBudget);  // one rank cannot hold the sequence (2.25 MB measured)
    CHECK(cp2 <= kBudget);      // two ranks can (1.20 MB measured), and train as one would
    for (std::size_t s = 0; s < one_loss.size(); ++s) CHECK(std::abs(two_loss[s] - one_loss[s]) < kTol * one_loss[s]);
  }
  world().barrier();
}

}  // namespace test_context_parallel

namespace test_context_parallel {

// With FSDP every rank keeps 1/world of the parameters, gradients and AdamW state that
// each rank of the replicated engine keeps (allocator live bytes after a step; the
// groups' padding to a multiple of the world aside).
TEST_CASE("with FSDP a rank keeps 1/world of the replicated engine's parameters, gradients and state",
          "[cp][memory]") {
  auto& comm = world();
  const int n = comm.size();
  const auto cfg = llama_config(2);
  const std::int64_t S = 4 * n;
  std::size_t groups = 0;
  auto kept = [&](bool fsdp, std::int64_t& numel) {
    const std::int64_t before = memory_stats().live_bytes;
    Generator g(5);
    auto model = std::make_shared<nn::Llama<double>>(cfg, g);
    std::int64_t bytes = 0;
    {
      parallel::ContextParallel<double> e(*model, comm, parallel::ContextParallelPlan{.cp = n, .fsdp = fsdp});
      optim::AdamW<double> opt(e.parameters(), kAdam);
      train_step(e, opt, 1, S, cfg.vocab_size, 0);
      numel = e.parameters().numel();
      if (auto* f = dynamic_cast<parallel::FSDP<double>*>(&e.local_module())) groups = f->num_groups();
      bytes = memory_stats().live_bytes - before;
      comm.barrier();  // Note [Group teardown]
    }
    return bytes;
  };
  std::int64_t whole = 0, shard = 0;
  const std::int64_t replicated = kept(false, whole), sharded = kept(true, shard);
  if (comm.rank() == 0)
    std::printf("context parallelism at cp %d: %lld bytes kept per rank replicated, %lld with FSDP\n", n,
                static_cast<long long>(replicated), static_cast<long long>(sharded));
  // Parameters, gradients and AdamW's two moments: 4 doubles per element; besides them
  // the same few bytes in both (32 measured: the model's buffers).
  const std::int64_t other = replicated - 4 * 8 * whole;
  CHECK(other >= 0);
  CHECK(other < 8 * whole / 100);
  CHECK(sharded - 4 * 8 * shard == other);
  CHECK(shard * n >= whole);
  CHECK(shard * n < whole + static_cast<std::int64_t>(groups) * n);  // each group padded by less than n
  comm.barrier();
}

}  // namespace test_context_parallel

namespace test_context_parallel {

// clip_grad_norm_ with FSDP sums the shards' squares over the world: the norm of the
// whole gradient, as the replicated engine (which holds all of it) computes it.
TEST_CASE("with FSDP clip_grad_norm_ clips by the whole gradient's norm", "[cp]") {
  auto& comm = world();
  const int n = comm.size();
  const auto cfg = llama_config(2);
  const std::int64_t S = 4 * n;
  const Batch b = make_batch(1, S, cfg.vocab_size, 300);
  auto norm = [&](bool fsdp) {
    Generator g(5);
    auto model = std::make_shared<nn::Llama<double>>(cfg, g);
    parallel::ContextParallel<double> e(*model, comm, parallel::ContextParallelPlan{.cp = n, .fsdp = fsdp});
    e.zero_grad();
    e.forward_backward(b.ids, b.targets);
    const double before = e.clip_grad_norm_(1e-3), after = e.clip_grad_norm_(1e9);
    const double want = before * 1e-3 / (before + 1e-6);  // clipped to max_norm, as torch's clip_grad_norm_
    CHECK(std::abs(after - want) < kTol * want);
    comm.barrier();  // Note [Group teardown]
    return before;
  };
  const double replicated = norm(false), sharded = norm(true);
  CHECK(replicated > 1e-2);
  CHECK(std::abs(sharded - replicated) < kTol * replicated);
}

}  // namespace test_context_parallel

namespace test_context_parallel {

namespace {
// The (dp, cp, tp) layouts of context parallelism inside tensor parallelism that the world
// allows: cp 2 x tp 2 (x dp 2 at 8 ranks) and cp 4 x tp 2 at 8; cp 2 alone in the
// tensor-parallel engine at 2 ranks.
std::vector<std::array<int, 3>> cp_tp_layouts(int n) {
  if (n == 8) return {{2, 2, 2}, {1, 4, 2}};
  if (n % 4 == 0) return {{n / 4, 2, 2}};
  if (n == 2) return {{1, 2, 1}};
  return {};
}

// TensorParallelPlan{.tp, .cp}, with FSDP over the dp x cp ranks of each tp shard when `fsdp`.
parallel::TensorParallelPlan cp_tp_plan(int tp, int cp, bool fsdp,
                                        parallel::KVExchange kv = parallel::KVExchange::Ring) {
  parallel::TensorParallelPlan plan{.tp = tp, .cp = cp, .kv_exchange = kv};
  if (fsdp) plan.fsdp = parallel::FSDPOptions{};
  return plan;
}

// GPT (tied, recomputed blocks) and Llama (GQA, packed documents) in T at each layout,
// replicated and with FSDP over the dp x cp ranks of each tp shard, against one process.
template <class T>
void check_cp_tp(double tol) {
  for (auto [dp, cp, tp] : cp_tp_layouts(world().size())) {
    const std::int64_t S = 2 * cp * 3;  // chunks of 3 tokens
    for (bool fsdp : {false, true}) {
      INFO("dp " << dp << " x cp " << cp << " x tp " << tp << (fsdp ? ", FSDP" : "")
                 << (std::is_same_v<T, float> ? ", float" : ", double"));
      auto gpt = gpt_config(S);
      gpt.recompute = true;
      check_like_one_process<T>([gpt] { Generator g(3); return std::make_shared<nn::GPT<T>>(gpt, g); },
                                cp_tp_plan(tp, cp, fsdp), dp, S, 13, tol);
      const auto llama = llama_config(2);
      check_like_one_process<T>(
          [llama] { Generator g(5); return std::make_shared<nn::Llama<T>>(llama, g); },
          cp_tp_plan(tp, cp, fsdp, fsdp ? parallel::KVExchange::AllGather : parallel::KVExchange::Ring), dp, S, 17,
          tol);
    }
  }
}
}  // namespace

TEST_CASE("GPT and Llama with context parallelism inside tensor parallelism train like one process", "[cp]") {
  check_cp_tp<double>(kTol);
  check_cp_tp<float>(kFloatTol);
}

// clip_grad_norm_ sums the squares of tp-sharded gradients over tp (and of FSDP's pieces
// over the dp x cp ranks): the norm of one process's gradient on the global batch.
TEST_CASE("with tensor parallelism clip_grad_norm_ clips by one process's gradient norm", "[cp]") {
  const auto cfg = llama_config(2);
  auto make = [cfg] { Generator g(5); return std::make_shared<nn::Llama<double>>(cfg, g); };
  for (auto [dp, cp, tp] : cp_tp_layouts(world().size()))
    for (bool fsdp : {false, true}) {
      INFO("dp " << dp << " x cp " << cp << " x tp " << tp << (fsdp ? ", FSDP" : ""));
      const std::int64_t rows = 2 * dp, S = 2 * cp * 3;
      const Batch b = make_batch(rows, S, cfg.vocab_size, 300);
      auto model = make();
      nn::FlatParameters<double> params(*model);
      nn::CrossEntropyLoss<double> ce;
      nn::Cache<double> c, lc;
      auto logits = model->forward_tokens(b.ids, c);
      ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc);
      model->backward(ce.backward(lc).reshape(logits.shape()), c);
      const double want = std::sqrt(ops::sum_squares(params.grads()));
      auto e = parallel::make_engine<double>(make(), world(), cp_tp_plan(tp, cp, fsdp));
      const std::int64_t r = e->data_parallel_group()->rank();
      e->zero_grad();
      e->forward_backward(b.ids.narrow(2 * r, 2), b.targets.narrow(2 * r * S, 2 * S));
      const double got = e->clip_grad_norm_(1e9);
      CHECK(want > 1e-2);
      CHECK(std::abs(got - want) < kTol * want);
      world().barrier();  // Note [Group teardown]
    }
}

// TensorParallelPlan::cp writes the TP engine's checkpoints (full tensors under the full
// names, by cp rank 0 and tp rank 0 of replica 0): they load into one process and into
// cp 2 x tp 2 with FSDP (or without, when saved with it).
TEST_CASE("a cp 2 x tp 2 checkpoint resumes in one process and with FSDP toggled", "[cp][ckpt]") {
  if (auto four = world().size() >= 4 ? first_ranks(4) : nullptr)
    for (bool saved_fsdp : {false, true}) {
      INFO((saved_fsdp ? "saved with FSDP" : "saved replicated"));
      const auto dir = ptrain::testing::shared_tmp_dir(*four, "ptrain_cp_tp_ckpt_");
      const auto cfg = llama_config(2);
      auto make = [cfg] { Generator g(5); return std::make_shared<nn::Llama<double>>(cfg, g); };
      const std::int64_t rows = 2, S = 12;
      OneProcess<double> ref(make, rows, S, 17, kSteps);
      {
        auto e = parallel::make_engine<double>(make(), *four, cp_tp_plan(2, 2, saved_fsdp));
        optim::AdamW<double> opt(e->parameters(), kAdam);
        for (std::int64_t s = 0; s < kSteps - 1; ++s) train_step(*e, opt, rows, S, 17, s);
        if (four->rank() == 0) std::filesystem::remove_all(dir);
        four->barrier();
        ckpt::CheckpointManager mgr(dir, four);
        ckpt::save(mgr, kSteps - 1, *e, &opt, {});
        four->barrier();  // Note [Group teardown]
      }
      auto resume = [&](parallel::Engine<double>& e) {
        optim::AdamW<double> opt(e.parameters(), kAdam);
        ckpt::CheckpointManager mgr(dir, &e.communicator());
        CHECK(ckpt::load(mgr, mgr.latest().path, e, &opt).step == kSteps - 1);
        const double loss = train_step(e, opt, rows, S, 17, kSteps - 1);
        CHECK(std::abs(loss - ref.loss.back()) < kTol * ref.loss.back());
        ref.check_parameters(e, kTol);
      };
      {
        INFO("the plain model in one process (full tensor names)");
        auto model = make();
        parallel::Local<double> local(*model);
        resume(local);
      }
      {
        INFO("cp 2 x tp 2, FSDP toggled");
        auto e = parallel::make_engine<double>(make(), *four, cp_tp_plan(2, 2, !saved_fsdp));
        resume(*e);
        four->barrier();  // Note [Group teardown]
      }
      if (four->rank() == 0) std::filesystem::remove_all(dir);
    }
  world().barrier();
}

// Bad TensorParallelPlan::cp combinations end every rank with the reason.
TEST_CASE("context parallelism inside tensor parallelism refuses what it does not combine", "[cp][errors]") {
  auto& comm = world();
  const int n = comm.size();
  Generator gen(1);
  auto llama = std::make_shared<nn::Llama<double>>(llama_config(1), gen);
  CHECK_THROWS_WITH(parallel::make_engine<double>(llama, comm, parallel::TensorParallelPlan{.pp = 2, .cp = 2}),
                    Catch::Contains("[ptrain.cp.pipeline]"));
  CHECK_THROWS_WITH(
      parallel::make_engine<double>(llama, comm, parallel::TensorParallelPlan{.sequence_parallel = true, .cp = 2}),
      Catch::Contains("[ptrain.cp.sequence_parallel]"));
  CHECK_THROWS_WITH(parallel::make_engine<double>(llama, comm, parallel::TensorParallelPlan{.cp = n + 1}),
                    Catch::Contains("[ptrain.tp.world]"));
  auto cfg = gpt_config(8);
  if (n % 2 == 0) {  // a whole sequence longer than block_size, each rank's slice shorter
    auto e = parallel::make_engine<double>(std::make_shared<nn::GPT<double>>(cfg, gen), comm,
                                           parallel::TensorParallelPlan{.cp = 2});
    CHECK_THROWS_WITH(e->forward_backward(Tensor<std::int32_t>::zeros({1, 12}), Tensor<std::int32_t>::zeros({12})),
                      Catch::Contains("[ptrain.embedding.positions]"));
    comm.barrier();  // Note [Group teardown]
  }
  cfg.dropout = 0.1;
  CHECK_THROWS_WITH(parallel::make_engine<double>(std::make_shared<nn::GPT<double>>(cfg, gen), comm,
                                                  parallel::TensorParallelPlan{.cp = 2}),
                    Catch::Contains("[ptrain.cp.dropout]"));
  comm.barrier();
}

}  // namespace test_context_parallel
