// Context parallelism (parallel/context_parallel.hpp, parallel/cp_engine.hpp): the
// ring (and all-gather) attention alone against the one-process grouped-query attention
// (forward and backward, GQA, packed documents, a sliding window, chunks of odd length), and GPT
// and Llama trained with the sequence split over cp ranks (cp = the world, and
// dp 2 x cp 2 on 4 ranks) against one process on the global batch, in double over
// several AdamW steps. Every rank runs every case in the same order; checks use CHECK
// so no rank skips collectives.
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <vector>
#include <ptrain/dist/forwarding_communicator.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/ops/gqa_attention.hpp>
#include <ptrain/optim/adamw.hpp>
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

double max_rel_diff(const Tensor<double>& got, const Tensor<double>& want) {
  REQUIRE(got.numel() == want.numel());
  double diff = 0, scale = 1e-300;
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    diff = std::max(diff, std::abs(got.data()[i] - want.data()[i]));
    scale = std::max(scale, std::abs(want.data()[i]));
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
  auto rel = [](const Tensor<float>& got, const Tensor<float>& want) {
    double diff = 0, scale = 1e-30;
    for (std::int64_t i = 0; i < got.numel(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(got.data()[i]) - want.data()[i]));
      scale = std::max(scale, std::abs(static_cast<double>(want.data()[i])));
    }
    return diff / scale;
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
  constexpr double kFloatTol = 2e-5;  // a float's rounding over sums of ~S terms, not a missing block (~1e-1)
  CHECK(rel(y, g.shard(y_ref)) < kFloatTol);
  CHECK(rel(dq, g.shard(dq_ref)) < kFloatTol);
  CHECK(rel(dk, g.shard(dk_ref)) < kFloatTol);
  CHECK(rel(dv, g.shard(dv_ref)) < kFloatTol);
}

TEST_CASE("a dp x cp mesh numbers ranks with the cp ranks of a replica consecutive", "[cp]") {
  auto& comm = world();
  const int n = comm.size();
  std::vector<parallel::MeshShape> shapes = {{.dp = 1, .cp = n}};
  if (n == 4) shapes.push_back({.dp = 2, .cp = 2});
  for (const auto& shape : shapes) {
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

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch make_batch(std::int64_t rows, std::int64_t S, std::int32_t vocab, std::uint64_t seed) {
  Generator g(seed);
  Batch b{packed_ids(rows, S, vocab, seed), Tensor<std::int32_t>::empty({rows * S})};
  for (std::int64_t i = 0; i < rows * S; ++i) b.targets.data()[i] = static_cast<std::int32_t>(g.below(vocab));
  // An ignored target in each half of the rows (the replicas of dp 2 then count as many tokens, so
  // that averaging their means gives the global mean): the loss is the mean over the counted tokens.
  b.targets.data()[1] = b.targets.data()[rows / 2 * S + 4] = -100;
  return b;
}

// Trains `make()` for kSteps AdamW steps on the global batches: one process, then the
// engine of `plan` on this replica's rows; compares every parameter by name and the losses.
template <class MakeModel>
void check_like_one_process(MakeModel make, const parallel::Plan<double>& plan, int dp, std::int64_t S,
                            std::int32_t vocab) {
  const std::int64_t rows = 2 * dp;
  auto ref_model = make();
  nn::FlatParameters<double> ref_params(*ref_model);
  optim::AdamW<double> ref_opt(ref_params, kAdam);
  std::vector<double> ref_loss;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const Batch b = make_batch(rows, S, vocab, 300 + static_cast<std::uint64_t>(s));
    nn::CrossEntropyLoss<double> ce;
    nn::Cache<double> c, lc;
    ref_params.zero_grad();
    auto logits = ref_model->forward_tokens(b.ids, c);
    ref_loss.push_back(ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc));
    ref_model->backward(ce.backward(lc).reshape(logits.shape()), c);
    ref_opt.step();
  }
  auto engine = parallel::make_engine<double>(make(), world(), plan);
  optim::AdamW<double> opt(engine->parameters(), kAdam);
  dist::Communicator* dpg = engine->data_parallel_group();
  REQUIRE(dpg->size() == dp);
  const std::int64_t mine = rows / dp, r = dpg->rank();
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const Batch b = make_batch(rows, S, vocab, 300 + static_cast<std::uint64_t>(s));
    engine->zero_grad();
    const double loss = engine->average(
        engine->forward_backward(b.ids.narrow(r * mine, mine), b.targets.narrow(r * mine * S, mine * S)));
    engine->step(opt);
    if (dp == 1) CHECK(std::abs(loss - ref_loss[static_cast<std::size_t>(s)]) < kTol);
  }
  std::map<std::string, Tensor<double>> ref;
  for (const auto& e : ref_params.entries()) ref[e.name] = e.param->value;
  REQUIRE(engine->parameters().entries().size() == ref.size());
  for (const auto& e : engine->parameters().entries()) {
    INFO(e.name);
    REQUIRE(ref.count(e.name) == 1);
    CHECK(max_rel_diff(e.param->value, ref[e.name]) < kTol);
  }
  // Frozen parameters (Note [Frozen parameters] in nn/flat_parameters.hpp): unchanged, bit for bit.
  REQUIRE(engine->parameters().frozen_entries().size() == ref_params.frozen_entries().size());
  for (std::size_t i = 0; i < ref_params.frozen_entries().size(); ++i) {
    const auto& got = engine->parameters().frozen_entries()[i];
    const auto& want = ref_params.frozen_entries()[i];
    INFO(got.name);
    CHECK(got.name == want.name);
    CHECK(got.param->value.to_vector() == want.param->value.to_vector());
  }
  world().barrier();  // Note [Group teardown]
}

}  // namespace

TEST_CASE("GPT and Llama with context parallelism train like one process", "[cp]") {
  auto& comm = world();
  const int n = comm.size();
  std::vector<std::pair<int, int>> layouts = {{1, n}};  // (dp, cp)
  if (n == 4) layouts.push_back({2, 2});
  for (auto [dp, cp] : layouts) {
    INFO("dp " << dp << " x cp " << cp);
    const std::int64_t S = 2 * cp * 3;  // chunks of 3 tokens
    {
      INFO("GPT (tied) with recomputed blocks");
      nn::GPTConfig cfg{.vocab_size = 13, .block_size = S, .n_layer = 2, .n_head = 2, .n_embd = 8,
                        .recompute = true};
      check_like_one_process([cfg] { Generator g(3); return std::make_shared<nn::GPT<double>>(cfg, g); },
                             parallel::ContextParallelPlan{.cp = cp}, dp, S, 13);
    }
    {
      INFO("GPT (tied) with its embeddings and first block frozen");
      nn::GPTConfig cfg{.vocab_size = 13, .block_size = S, .n_layer = 2, .n_head = 2, .n_embd = 8};
      check_like_one_process(
          [cfg] {
            Generator g(3);
            auto m = std::make_shared<nn::GPT<double>>(cfg, g);
            for (auto& p : m->named_parameters())
              if (p.name.rfind("embed.", 0) == 0 || p.name.rfind("h.0.", 0) == 0) p.param->set_requires_grad(false);
            return m;
          },
          parallel::ContextParallelPlan{.cp = cp}, dp, S, 13);
    }
    {
      INFO("Llama (GQA 4 / 2 heads) on packed documents");
      nn::LlamaConfig cfg{.vocab_size = 17, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                          .intermediate_size = 24, .document_token = kDocument};
      check_like_one_process([cfg] { Generator g(5); return std::make_shared<nn::Llama<double>>(cfg, g); },
                             parallel::ContextParallelPlan{.cp = cp}, dp, S, 17);
    }
    {
      INFO("Llama with the keys and values all-gathered");
      nn::LlamaConfig cfg{.vocab_size = 17, .n_layer = 1, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                          .intermediate_size = 24, .document_token = kDocument};
      check_like_one_process([cfg] { Generator g(7); return std::make_shared<nn::Llama<double>>(cfg, g); },
                             parallel::ContextParallelPlan{.cp = cp, .kv_exchange = parallel::KVExchange::AllGather},
                             dp, S, 17);
    }
  }
}

}  // namespace test_context_parallel
