// LoRA on a Llama under every engine equals one process: the same adapters after
// several AdamW steps (with weight decay) on W ranks, each taking its rows of the
// global batch, as one process on the whole batch; the frozen base unchanged bit for
// bit; the checkpoint of each engine loads into one process under the same names.
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <ptrain/ckpt/engine_checkpoint.hpp>
#include <ptrain/nn/lora.hpp>
#include <ptrain/nn/models/llama.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/world.hpp"

namespace test_lora {

using namespace ptrain;
using ptrain::testing::world;

namespace {

constexpr std::int64_t kRows = 2, kSeq = 8, kVocab = 29, kSteps = 4;

const nn::LoraConfig kLora{.r = 4, .alpha = 8,
                           .target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"}};

// The same Llama with the same adapters on every rank; B drawn too, so that A trains from the first step.
template <class T>
std::shared_ptr<nn::Llama<T>> lora_llama() {
  nn::LlamaConfig cfg{.vocab_size = kVocab, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                      .intermediate_size = 24, .max_seq_len = 16};
  cfg.init_std = 0.3;
  Generator g(3);
  auto model = std::make_shared<nn::Llama<T>>(cfg, g);
  nn::apply_lora(*model, kLora, g);
  Generator gb(4);
  for (auto& p : model->named_parameters())
    if (p.name.find(".lora_B.") != std::string::npos) ops::uniform_(p.param->value, -0.2, 0.2, gb);
  return model;
}

// Rows [first, first + n) of the global batch of step s: ids and next-token targets.
std::pair<Tensor<std::int32_t>, Tensor<std::int32_t>> rows(std::int64_t s, std::int64_t first, std::int64_t n) {
  auto ids = Tensor<std::int32_t>::empty({n, kSeq});
  auto targets = Tensor<std::int32_t>::empty({n, kSeq});
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t i = 0; i < kSeq; ++i) {
      const std::int64_t k = (s * 131 + (first + r) * 17 + i * 7) % kVocab;
      ids.data()[r * kSeq + i] = static_cast<std::int32_t>(k);
      targets.data()[r * kSeq + i] = static_cast<std::int32_t>((k * 5 + 3) % kVocab);
    }
  return {ids, targets};
}

template <class T>
void train(parallel::Engine<T>& engine, std::int64_t first, std::int64_t n) {
  optim::AdamW<T> opt(engine.parameters(), {.lr = 0.02, .weight_decay = 0.1});
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const auto [ids, targets] = rows(s, first, n);
    engine.zero_grad();
    engine.forward_backward(ids, targets, 1.0);
    engine.step(opt);
  }
}

// Every parameter by name, through a checkpoint of `engine` loaded into a fresh LoRA Llama in one process.
template <class T>
std::map<std::string, std::vector<T>> saved(parallel::Engine<T>& engine, const std::filesystem::path& dir) {
  auto& comm = engine.communicator();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
  comm.barrier();
  {
    ckpt::CheckpointManager mgr(dir, &comm);
    ckpt::save(mgr, 0, engine, static_cast<optim::Optimizer<T>*>(nullptr));
  }
  comm.barrier();
  auto back = lora_llama<T>();
  for (auto& p : back->named_parameters()) p.param->value.zero_();
  nn::FlatParameters<T> flat(*back);
  ckpt::CheckpointManager reader(dir);
  reader.load(reader.latest().path, flat);
  std::map<std::string, std::vector<T>> out;
  for (auto& p : back->named_parameters()) out[p.name] = p.param->value.to_vector();
  return out;
}

template <class T>
void check_engines(double tol) {
  auto& comm = world();
  const int n = comm.size();
  const auto dir = ptrain::testing::shared_tmp_dir(comm, "ptrain_lora_");
  dist::SelfCommunicator self;
  auto one_model = lora_llama<T>();
  std::map<std::string, std::vector<T>> base;
  for (auto& p : one_model->named_parameters())
    if (!p.param->requires_grad) base[p.name] = p.param->value.to_vector();
  auto one = parallel::make_engine<T>(one_model, self, parallel::LocalOptions{});
  train(*one, 0, kRows * n);
  const auto want = saved(*one, dir / ("one" + std::to_string(comm.rank())));

  std::vector<std::pair<std::string, parallel::Plan<T>>> plans = {{"ddp", parallel::DDPOptions{}}};
  for (auto s : {parallel::ShardingStrategy::FullShard, parallel::ShardingStrategy::ShardGradOp,
                 parallel::ShardingStrategy::ShardOptimizer, parallel::ShardingStrategy::NoShard,
                 parallel::ShardingStrategy::Hybrid})
    plans.emplace_back(std::string("fsdp ") + parallel::strategy_name(s),
                       parallel::FSDPOptions{.strategy = s, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n});
  if (n % 2 == 0) plans.emplace_back("pipeline", parallel::PipelinePlan<T>{.stages = 2});
  for (const auto& [name, plan] : plans) {
    INFO(name << " on " << n << " ranks");
    auto engine = parallel::make_engine<T>(lora_llama<T>(), comm, plan);
    const int replicas = engine->data_parallel_group() ? engine->data_parallel_group()->size() : 1;
    const int replica = engine->data_parallel_group() ? engine->data_parallel_group()->rank() : 0;
    const std::int64_t per = kRows * n / replicas;
    train(*engine, replica * per, per);
    const auto got = saved(*engine, dir / name);
    REQUIRE(got.size() == want.size());
    double err = 0, scale = 0;
    int adapters = 0;
    for (const auto& [pname, w] : want) {
      const auto& g = got.at(pname);
      REQUIRE(g.size() == w.size());
      if (base.count(pname)) {
        CHECK(g == base.at(pname));  // the frozen base, bit for bit
        continue;
      }
      ++adapters;
      for (std::size_t i = 0; i < w.size(); ++i) {
        err = std::max(err, std::abs(double(g[i]) - double(w[i])));
        scale = std::max(scale, std::abs(double(w[i])));
      }
    }
    CHECK(adapters == 2 * 7 * 2);
    INFO("largest adapter difference " << err << " of " << scale);
    CHECK(err <= tol * scale);
  }
}

}  // namespace

TEST_CASE("LoRA on a Llama under DDP, FSDP (every strategy) and the pipeline equals one process",
          "[lora][frozen]") {
  check_engines<double>(1e-9);
  check_engines<float>(2e-4);
}

}  // namespace test_lora
