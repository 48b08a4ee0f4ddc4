// ckpt::full_state_dict and ckpt::gather_full_model (ckpt/full_state_dict.hpp) in every
// layout the library offers on the CPU: an engine built from a model of seed 5 takes
// one AdamW step on its ranks' slices of a global batch; rank 0 then gathers the whole
// model into a model of another seed and must hold (a) the checkpoint of the same
// engine read back in one process, bit for bit, and (b) one process's step on the
// global batch, within 1e-9 in double. The other ranks' models stay as built; a model
// that lacks a name or has another shape ends every rank with [ptrain.ckpt.gather].
// Built into ptrain_parallel (tests/dist/ckpt/CMakeLists.txt), which runs under
// mpirun at 2, 3 and 4 ranks and under ptrun (Gloo) at 2 and 3; each layout runs
// where the world size allows it. Every rank runs every case in the same order.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/ckpt/full_state_dict.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_gather {

using namespace ptrain;
using ptrain::testing::world;

namespace {

using Real = double;
constexpr double kTol = 1e-9;  // the engines add gradients in other orders than one process
constexpr std::int64_t kBatch = 12, kSeq = 8;  // 12 rows: 1, 2, 3 and 4 replicas split them
const optim::AdamWOptions kAdam{.lr = 0.02, .eps = 1e-8, .weight_decay = 0.1};

// A tiny GPT (tied or untied head; a pipeline needs it untied) with its position
// embedding frozen, and a tiny Mixtral-shaped Llama (4 experts, top 2, dropless,
// no auxiliary losses, so any split of the batch trains like one process).
nn::GPTConfig gpt_config(bool tied) {
  return {.vocab_size = 11, .block_size = kSeq, .n_layer = 2, .n_head = 4, .n_embd = 16, .tie_weights = tied};
}
nn::LlamaConfig moe_config() {
  nn::LlamaConfig c{.vocab_size = 11, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                    .intermediate_size = 24, .max_seq_len = kSeq};
  c.num_experts = 4;
  c.top_k = 2;
  c.moe_intermediate_size = 12;
  return c;
}

struct Model {
  std::string kind;  // "gpt", "gpt untied", "moe"
  std::shared_ptr<nn::Module<Real>> make(std::uint64_t seed) const {
    Generator g(seed);
    if (kind == "moe") return std::make_shared<nn::Llama<Real>>(moe_config(), g);
    auto m = std::make_shared<nn::GPT<Real>>(gpt_config(kind == "gpt"), g);
    for (auto& p : m->named_parameters())
      if (p.name == "wpe.weight") p.param->set_requires_grad(false);
    return m;
  }
};

// The engine of `plan` on `model` (made by m.make()).
std::unique_ptr<parallel::Engine<Real>> build(const Model& m, const std::shared_ptr<nn::Module<Real>>& model,
                                              dist::Communicator& comm, const parallel::Plan<Real>& plan) {
  if (m.kind == "moe")
    return parallel::make_engine<Real>(std::static_pointer_cast<nn::Llama<Real>>(model), comm, plan);
  return parallel::make_engine<Real>(std::static_pointer_cast<nn::GPT<Real>>(model), comm, plan);
}

struct Batch {
  Tensor<std::int32_t> ids, targets;
};
Batch global_batch() {
  Generator g(42);
  Batch b{Tensor<std::int32_t>::empty({kBatch, kSeq}), Tensor<std::int32_t>::empty({kBatch, kSeq})};
  for (std::int64_t i = 0; i < kBatch * kSeq; ++i) {
    b.ids.data()[i] = static_cast<std::int32_t>(g.below(11));
    b.targets.data()[i] = static_cast<std::int32_t>(g.below(11));
  }
  return b;
}

// One AdamW step of `e` on its data-parallel slice of the global batch.
void train_step(parallel::Engine<Real>& e, optim::Optimizer<Real>& opt) {
  const Batch b = global_batch();
  dist::Communicator* dp = e.data_parallel_group();
  const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, rows = kBatch / n;
  e.zero_grad();
  e.forward_backward(b.ids.narrow(r * rows, rows), b.targets.narrow(r * rows, rows));
  e.step(opt);
}

// Name -> values of every parameter and buffer of `m`.
std::map<std::string, std::vector<Real>> values_of(nn::Module<Real>& m) {
  std::map<std::string, std::vector<Real>> out;
  for (auto& p : m.named_parameters()) out[p.name] = p.param->value.to_vector();
  for (auto& b : m.named_buffers()) out[b.name] = b.buffer->to_vector();
  return out;
}

// max |a - b| / max |b| over all tensors (a and b with the same names and sizes).
double max_rel_error(const std::map<std::string, std::vector<Real>>& a,
                     const std::map<std::string, std::vector<Real>>& b) {
  double diff = 0, scale = 0;
  REQUIRE(a.size() == b.size());
  for (const auto& [name, vb] : b) {
    const auto& va = a.at(name);
    REQUIRE(va.size() == vb.size());
    for (std::size_t i = 0; i < vb.size(); ++i) {
      diff = std::max(diff, std::abs(va[i] - vb[i]));
      scale = std::max(scale, std::abs(vb[i]));
    }
  }
  return diff / scale;
}

// One process: the model of seed 5, one step on the whole global batch.
std::map<std::string, std::vector<Real>> one_process(const Model& m) {
  dist::SelfCommunicator self;
  auto e = build(m, m.make(5), self, parallel::LocalOptions{});
  optim::AdamW<Real> opt(e->parameters(), kAdam);
  train_step(*e, opt);
  return values_of(e->local_module());
}

struct Layout {
  std::string name;
  Model model;
  parallel::Plan<Real> plan;
};

// Every layout that fits a world of n ranks.
std::vector<Layout> layouts(int n) {
  using S = parallel::ShardingStrategy;
  const Model gpt{"gpt"}, untied{"gpt untied"}, moe{"moe"};
  const int pp = n % 2 == 0 ? 2 : n;
  std::vector<Layout> l = {
      {"local", gpt, parallel::LocalOptions{}},
      {"ddp", gpt, parallel::DDPOptions{}},
      {"fsdp full_shard", gpt, parallel::FSDPOptions{.strategy = S::FullShard}},
      {"fsdp shard_grad_op", gpt, parallel::FSDPOptions{.strategy = S::ShardGradOp}},
      {"pipeline 1f1b", untied, parallel::PipelinePlan<Real>{.stages = pp, .options = {.micro_batches = 2}}},
  };
  if (n % 2 != 0) return l;
  l.push_back({"ddp ep 2", moe, parallel::DDPOptions{.expert_parallel = 2}});
  l.push_back({"fsdp ep 2", moe, parallel::FSDPOptions{.expert_parallel = 2}});
  l.push_back({"tp 2", gpt, parallel::TensorParallelPlan{.tp = 2}});
  l.push_back({"tp 2 sequence parallel", gpt, parallel::TensorParallelPlan{.tp = 2, .sequence_parallel = true}});
  l.push_back({"tp 2 ep 2", moe, parallel::TensorParallelPlan{.tp = 2, .expert_parallel = 2}});
  if (n % 4 != 0) return l;
  l.push_back({"pipeline interleaved, dp 2", untied,
               parallel::PipelinePlan<Real>{
                   .stages = 2,
                   .options = {.schedule = parallel::Schedule::Interleaved, .micro_batches = 2, .virtual_stages = 2}}});
  l.push_back({"tp 2 x pp 2", untied, parallel::TensorParallelPlan{.tp = 2, .pp = 2, .micro_batches = 2}});
  l.push_back({"fsdp x tp 2", gpt, parallel::TensorParallelPlan{.tp = 2, .fsdp = parallel::FSDPOptions{}}});
  l.push_back({"cp 2 x tp 2", gpt, parallel::TensorParallelPlan{.tp = 2, .cp = 2}});
  return l;
}

}  // namespace

TEST_CASE("gather_full_model brings every layout's trained model to rank 0", "[ckpt][gather]") {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_gather_");
  std::map<std::string, std::map<std::string, std::vector<Real>>> reference;
  for (const auto& layout : layouts(n)) {
    INFO(layout.name << " on " << n << " ranks, " << comm.backend());
    const Model& m = layout.model;
    if (!reference.count(m.kind)) reference[m.kind] = one_process(m);
    const auto own = m.make(5);
    auto engine = build(m, own, comm, layout.plan);
    optim::AdamW<Real> opt(engine->parameters(), kAdam);
    train_step(*engine, opt);
    dist::Communicator& ec = engine->communicator();  // a Local engine: a world of one per rank

    // The checkpoint of the same engine, read back in one process.
    const auto where = ec.size() == n ? dir / layout.name : dir / (layout.name + std::to_string(comm.rank()));
    if (ec.rank() == 0) std::filesystem::remove_all(where);
    comm.barrier();
    ckpt::CheckpointManager mgr(where, &ec);
    ckpt::save(mgr, 1, *engine, &opt);
    auto from_ckpt = m.make(99);
    if (ec.rank() == 0) {
      nn::FlatParameters<Real> params(*from_ckpt);
      ckpt::CheckpointManager reader(where);
      reader.load(reader.latest().path, params);
    }

    auto got = m.make(77);
    const auto before = values_of(*got);
    ckpt::gather_full_model(*engine, *got);
    if (ec.rank() == 0) {
      const auto v = values_of(*got);
      CHECK(v == values_of(*from_ckpt));                       // bitwise
      CHECK(max_rel_error(v, reference.at(m.kind)) < kTol);  // one process on the global batch
    } else {
      CHECK(values_of(*got) == before);
    }

    // The engine's own model, whose tensors FSDP released: rank 0's gets new ones (with
    // expert parallelism the model keeps only its rank's experts: not a whole model).
    if (engine->mode() == parallel::Mode::FSDP && m.kind != "moe") {
      ckpt::gather_full_model(*engine, *own);
      if (ec.rank() == 0) CHECK(values_of(*own) == values_of(*from_ckpt));
    }

    // full_state_dict: the same tensors, by name, on the root only; here root 1 where there is one.
    const int root = ec.size() > 1 ? 1 : 0;
    const auto full = ckpt::full_state_dict(*engine, root);
    if (ec.rank() == root) {
      std::map<std::string, std::vector<Real>> v;
      for (const auto& [name, t] : full) {
        CHECK(t.device().is_cpu());
        v[name] = t.to_vector();
      }
      CHECK(max_rel_error(v, reference.at(m.kind)) < kTol);
    } else {
      CHECK(full.empty());
    }
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("gather_full_model refuses a model that differs, on every rank, and changes nothing", "[ckpt][gather]") {
  auto& comm = world();
  const int n = comm.size();
  for (const auto& layout : layouts(n)) {
    if (layout.name != "fsdp full_shard" && layout.name != "pipeline 1f1b" && layout.name != "tp 2") continue;
    INFO(layout.name << " on " << n << " ranks");
    auto engine = build(layout.model, layout.model.make(5), comm, layout.plan);
    const bool tied = layout.model.kind == "gpt";
    // A name on one side only: the head tied where the engine's is not, or the reverse.
    auto other_head = Model{tied ? "gpt untied" : "gpt"}.make(77);
    // The same names with other shapes.
    Generator g(77);
    nn::GPTConfig wide = gpt_config(tied);
    wide.n_embd = 8;
    auto other_shape = std::make_shared<nn::GPT<Real>>(wide, g);
    for (nn::Module<Real>* bad : {static_cast<nn::Module<Real>*>(other_head.get()),
                                  static_cast<nn::Module<Real>*>(other_shape.get())}) {
      const auto before = values_of(*bad);
      CHECK_THROWS_WITH(ckpt::gather_full_model(*engine, *bad), Catch::Contains("[ptrain.ckpt.gather]"));
      CHECK(values_of(*bad) == before);
    }
  }
  comm.barrier();
}

}  // namespace test_gather
