// Step time and per-rank memory of each FSDP strategy against DDP on the same
// GPT (one JSON line per strategy from rank 0). Launch with mpirun or ptrun:
//   mpirun -np 2 build/benchmarks/fsdp_bench
// Memory comes from the allocator counters: persistent = bytes live after the
// wrapper and optimizer are built (the model's own tensors are released into
// the wrapper), peak = the most live during a step.

#include <cstdio>

#include "bench_util.hpp"
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <ptrain/nn/models/gpt.hpp>
#include <ptrain/parallel/fsdp.hpp>
#include <ptrain/ptrain.hpp>

using namespace ptrain;

namespace {

struct Setup {
  nn::GPTConfig cfg;
  std::int64_t batch, seq;
  int steps, warmup;
};

struct Result {
  double step_ms;
  std::int64_t persistent, peak;
};

template <class Make>
Result measure(const Setup& s, dist::Communicator& comm, Make&& make) {
  const auto base = memory_stats().live_bytes;
  Generator g(1);
  nn::GPT<float> model(s.cfg, g);
  auto runner = make(model);
  const std::int64_t persistent = memory_stats().live_bytes - base;
  Generator dg(100 + static_cast<std::uint64_t>(comm.rank()));
  auto ids = Tensor<float>::empty({s.batch, s.seq});
  auto targets = Tensor<std::int32_t>::empty({s.batch * s.seq});
  for (std::int64_t i = 0; i < ids.numel(); ++i) {
    ids.data()[i] = static_cast<float>(dg.below(static_cast<std::uint64_t>(s.cfg.vocab_size)));
    targets.data()[i] = static_cast<std::int32_t>(dg.below(static_cast<std::uint64_t>(s.cfg.vocab_size)));
  }
  comm.barrier();
  reset_peak_memory();
  auto times = bench::time_runs(s.warmup, s.steps, [&] { runner->step(ids, targets); });
  double ms = bench::median(times);
  comm.all_reduce(&ms, 1, DType::F64, dist::ReduceOp::Max);
  return {ms, persistent, memory_stats().peak_bytes - base};
}

// One training step through the Engine contract, the same for DDP and FSDP.
template <class E>
struct Runner {
  E engine;
  optim::AdamW<float> opt;
  template <class... Args>
  explicit Runner(Args&&... args) : engine(std::forward<Args>(args)...), opt(engine.parameters(), {}) {}
  void step(const Tensor<float>& ids, const Tensor<std::int32_t>& t) {
    engine.zero_grad();
    engine.forward_backward(ids, t);
    engine.step(opt);
  }
};
using DDPRunner = Runner<parallel::DDP<float>>;
using FSDPRunner = Runner<parallel::FSDP<float>>;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"FSDP strategies against DDP: step time and memory per rank"};
  Setup s{.cfg = {.vocab_size = 256, .block_size = 128, .n_layer = 6, .n_head = 4, .n_embd = 256,
                  .tie_weights = false},
          .batch = 4, .seq = 128, .steps = 10, .warmup = 2};
  app.add_option("--layers", s.cfg.n_layer);
  app.add_option("--width", s.cfg.n_embd);
  app.add_option("--batch", s.batch, "sequences per rank");
  app.add_option("--seq", s.seq);
  app.add_option("--steps", s.steps);
  CLI11_PARSE(app, argc, argv);
  s.cfg.block_size = std::max(s.cfg.block_size, s.seq);

  auto comm = dist::init_process_group();
  const int n = comm->size();
  auto report = [&](const std::string& name, const Result& r, double ddp_ms) {
    if (comm->rank() != 0) return;
    nlohmann::json j = {{"bench", "fsdp"},          {"strategy", name},
                        {"ranks", n},               {"parameters", s.cfg.num_parameters()},
                        {"step_ms_median", r.step_ms}, {"vs_ddp", r.step_ms / ddp_ms},
                        {"persistent_bytes", r.persistent}, {"peak_bytes", r.peak},
                        {"tokens_per_s", 1000.0 * static_cast<double>(s.batch * s.seq * n) / r.step_ms}};
    std::printf("%s\n", j.dump().c_str());
  };
  const Result ddp = measure(s, *comm, [&](nn::GPT<float>& m) { return std::make_unique<DDPRunner>(m, *comm); });
  report("ddp", ddp, ddp.step_ms);
  using parallel::ShardingStrategy;
  for (auto st : {ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::ShardOptimizer,
                  ShardingStrategy::NoShard, ShardingStrategy::Hybrid}) {
    parallel::FSDPOptions o{.strategy = st, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n};
    const Result r = measure(s, *comm, [&](nn::GPT<float>& m) { return std::make_unique<FSDPRunner>(m.units(), *comm, o); });
    report(parallel::strategy_name(st), r, ddp.step_ms);
  }
}
