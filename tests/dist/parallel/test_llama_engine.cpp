// nn::Llama through the training contract: in every mode (one process, DDP, FSDP
// with a unit per block, a pipeline, activation checkpointing) a few AdamW steps on
// packed documents give the parameters of one process on the global batch. The
// document masking reads the token ids from the batch context, so this also checks
// that FSDP and the pipeline's stages hand the ids to the layers (Note [Batch context]).
// Every rank runs every case in the same order; checks use CHECK so no rank skips
// collectives.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/dist/process_group.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_llama_engine {

using namespace ptrain;
using ptrain::testing::world;

namespace {

// In double: each engine adds the ranks' or micro-batches' gradients in another order than
// one process, and AdamW (lr / eps = 1e4) turns the float rounding of near-zero gradients
// into parameter differences of ~1e-5 relative that depend on the vector width. In double
// that is ~1e-13: kTol = 1e-9 holds anywhere, and a layer that misses the document mask, a
// lost micro-batch or a missing reduction still moves the parameters by more than 1e-3.
using Real = double;
constexpr double kTol = 1e-9;

constexpr std::int64_t kSeq = 12, kRowsPerRank = 2, kSteps = 3;
constexpr std::int32_t kDocument = 0;  // the token that starts each packed document
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};

nn::LlamaConfig config(bool recompute) {
  return {.vocab_size = 17, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16, .intermediate_size = 24,
          .rope = {.llama3_scaling = ops::Llama3RopeScaling{.original_max_position_embeddings = 8}},
          .document_token = kDocument, .recompute = recompute};
}

std::shared_ptr<nn::Llama<Real>> make_llama(bool recompute = false) {
  Generator g(5);
  return std::make_shared<nn::Llama<Real>>(config(recompute), g);
}

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
// Rows of packed documents: kDocument starts a new one every few tokens.
Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  Batch b{Tensor<std::int32_t>::empty({rows, kSeq}), Tensor<std::int32_t>::empty({rows * kSeq})};
  for (std::int64_t i = 0; i < rows * kSeq; ++i) {
    b.ids.data()[i] = g.below(4) == 0 ? kDocument : static_cast<std::int32_t>(1 + g.below(16));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(17));
  }
  return b;
}

std::vector<std::pair<std::string, parallel::Plan<Real>>> plans() {
  const int n = world().size();
  // 4 units (embed_tokens, layers.0, layers.1, head): 2 stages on an even world.
  std::vector<std::pair<std::string, parallel::Plan<Real>>> p = {
      {"local", parallel::LocalOptions{}},
      {"ddp", parallel::DDPOptions{.first_bucket_bytes = 256}},
      {"fsdp full_shard", parallel::FSDPOptions{.strategy = parallel::ShardingStrategy::FullShard}},
  };
  if (n % 2 == 0)
    p.push_back({"pipeline", parallel::PipelinePlan<Real>{.stages = 2, .options = {.micro_batches = 2}}});
  return p;
}

Batch shard(const Batch& global, parallel::Engine<Real>& e) {
  dist::Communicator* dp = e.data_parallel_group();
  const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, rows = global.ids.size(0) / n;
  return {global.ids.narrow(r * rows, rows), global.targets.narrow(r * rows * kSeq, rows * kSeq)};
}

std::vector<Real> reference(int world_size) {
  auto model = make_llama();
  nn::FlatParameters<Real> params(*model);
  optim::AdamW<Real> opt(params, kAdam);
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const Batch b = make_batch(kRowsPerRank * world_size, 200 + static_cast<std::uint64_t>(s));
    nn::CrossEntropyLoss<Real> ce;
    nn::Cache<Real> c, lc;
    params.zero_grad();
    auto logits = model->forward_tokens(b.ids, c);
    ce.forward(logits.reshape({-1, logits.size(-1)}), b.targets, lc);
    model->backward(ce.backward(lc).reshape(logits.shape()), c);
    opt.step();
  }
  return params.values().to_vector();
}

}  // namespace

TEST_CASE("Llama trains on packed documents like one process in every engine", "[engine][llama]") {
  auto& comm = world();
  const int n = comm.size();
  const std::vector<Real> ref = reference(n);
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_llama_engine_");
  for (bool recompute : {false, true}) {
    for (const auto& [name, plan] : plans()) {
      INFO(name << (recompute ? ", recompute" : "") << ", " << n << " ranks");
      auto engine = parallel::make_engine<Real>(make_llama(recompute), comm, plan);
      optim::AdamW<Real> opt(engine->parameters(), kAdam);
      for (std::int64_t s = 0; s < kSteps; ++s) {
        const Batch mine = shard(make_batch(kRowsPerRank * n, 200 + static_cast<std::uint64_t>(s)), *engine);
        engine->zero_grad();
        engine->forward_backward(mine.ids, mine.targets);
        engine->step(opt);
      }
      // The whole model's parameters, through this mode's checkpoint, against the reference's.
      // A Local engine is a world of one on each rank: each saves into its own folder.
      std::filesystem::path where = dir / (name + (recompute ? "_recompute" : ""));
      if (engine->communicator().size() != n) where += ".rank" + std::to_string(comm.rank());
      if (engine->communicator().rank() == 0) std::filesystem::remove_all(where);
      comm.barrier();
      ckpt::CheckpointManager mgr(where, &engine->communicator());
      ckpt::save(mgr, kSteps, *engine, &opt, {});
      auto whole = make_llama();
      nn::FlatParameters<Real> back(*whole);
      ckpt::CheckpointManager reader(where);
      reader.load(reader.latest().path, back);
      const auto got = back.values().to_vector();
      double diff = 0, scale = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        diff = std::max(diff, std::abs(static_cast<double>(got[i]) - ref[i]));
        scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
      }
      CHECK(diff / scale < kTol);
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace test_llama_engine
