// DDP, FSDP, the pipeline, context parallelism's ring attention and the context-parallel
// engine (alone and inside tensor parallelism) on "device" tensors over a
// StagedCommunicator (dist/staged_communicator.hpp), without a GPU: a stand-in cuda:0
// whose memory is host memory the communicator must still stage (the backend says it
// is not host memory) and whose kernel table holds the CPU kernels. The same engine (or
// ring) on CPU tensors over the plain world runs the same kernels and the same host
// collectives, so every gradient norm, loss, parameter and attention output must come
// out the same bits: staging may move bytes, never change them. tests/gpu/test_staged.cpp
// runs these engines on a real GPU.

#include <catch2/catch.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <variant>

#include <ptrain/dist/process_group.hpp>
#include <ptrain/dist/self_communicator.hpp>
#include <ptrain/dist/staged_communicator.hpp>
#include <ptrain/nn/models/mlp.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/parallel/context_parallel.hpp>
#include <ptrain/parallel/cp_engine.hpp>
#include <ptrain/parallel/make_engine.hpp>

#include "dist/host_blocks.hpp"
#include "dist/world.hpp"

namespace test_staged_engines {

using namespace ptrain;
using ptrain::testing::world;

namespace {

const Device kGpu = Device::cuda(0);

// cuda:0 as host memory that only this backend's allocator hands out.
class HostGpu final : public ptrain::detail::DeviceBackend {
 public:


  Allocator& allocator(int) override { return blocks; }
  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    if (dst_dev.is_cpu() && src_dev.is_cuda()) ++to_host;
    if (bytes) std::memmove(dst, src, bytes);
  }
  void memset_zero(void* dst, Device, std::size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
  int device_count() override { return 1; }
  bool is_host_pointer(const void* p) override { return !blocks.holds(p); }

  ptrain_test::HostBlocks blocks;
  std::atomic<long> to_host{0};
};

HostGpu& gpu() {
  static HostGpu* g = new HostGpu;  // never destroyed: staging pools refer to it
  return *g;
}

// The CPU kernels as the CUDA table of double (the kernels these engines, GPT and Llama reach).
template <class T>
void fill_with_cpu_kernels(kernels::CudaKernels<T>& k) {
  namespace kc = kernels::cpu;
  k.token_ids = &kc::token_ids<T>;
  k.embedding_forward = &kc::embedding_forward<T>;
  k.embedding_backward = &kc::embedding_backward<T>;
  k.layer_norm_forward = &kc::layer_norm_forward<T>;
  k.layer_norm_backward = &kc::layer_norm_backward<T>;
  k.rms_norm_forward = &kc::rms_norm_forward<T>;
  k.rms_norm_backward = &kc::rms_norm_backward<T>;
  k.gelu_forward = &kc::gelu_forward<T>;
  k.gelu_backward = &kc::gelu_backward<T>;
  k.swiglu_forward = &kc::swiglu_forward<T>;
  k.swiglu_backward = &kc::swiglu_backward<T>;
  k.rotary_apply = &kc::rotary_apply<T>;
  k.copy_strided_rows = &kc::copy_strided_rows<T>;
  k.linear_dgelu_epilogue = &kc::linear_dgelu_epilogue<T>;
  k.residual_layer_norm_forward = &kc::residual_layer_norm_forward<T>;
  k.residual_layer_norm_backward = &kc::residual_layer_norm_backward<T>;
  k.residual_rms_norm_forward = &kc::residual_rms_norm_forward<T>;
  k.residual_rms_norm_backward = &kc::residual_rms_norm_backward<T>;
  k.vocab_parallel_embedding_forward = &kc::vocab_parallel_embedding_forward<T>;
  k.vocab_parallel_embedding_backward = &kc::vocab_parallel_embedding_backward<T>;
  k.vocab_parallel_row_max = &kc::vocab_parallel_row_max<T>;
  k.vocab_parallel_row_sums = &kc::vocab_parallel_row_sums<T>;
  k.vocab_parallel_loss = &kc::vocab_parallel_loss<T>;
  k.vocab_parallel_loss_backward = &kc::vocab_parallel_loss_backward<T>;
  k.gemm = &kc::gemm<T>;
  k.linear_epilogue = &kc::linear_epilogue<T>;
  k.linear_weight_grad_epilogue = &kc::linear_weight_grad_epilogue<T>;
  k.bias_add = &kc::bias_add<T>;
  k.bias_grad = &kc::bias_grad<T>;
  k.relu_forward = &kc::relu_forward<T>;
  k.relu_backward = &kc::relu_backward<T>;
  k.axpy = &kc::axpy<T>;
  k.scale = &kc::scale<T>;
  k.sum = &kc::sum<T>;
  k.sum_squares = &kc::sum_squares<T>;
  k.softmax_rows = &kc::softmax_rows<T>;
  k.cross_entropy_forward = &kc::cross_entropy_forward<T>;
  k.cross_entropy_backward = &kc::cross_entropy_backward<T>;
  k.adamw_update = &kc::adamw_update<T>;
  k.ring_attention_block_forward = &kc::ring_attention_block_forward<T>;
  k.ring_attention_block_backward = &kc::ring_attention_block_backward<T>;
}

// Installs the stand-in backend and table for a scope, with the verification gate
// open (PTRAIN_UNVERIFIED_CUDA=1); restores all three afterwards.
struct FakeCuda {
  kernels::CudaKernelTable table;
  std::optional<std::string> gate;
  FakeCuda() {
    fill_with_cpu_kernels(table.f64);
    table.i32.token_ids = &kernels::cpu::token_ids<std::int32_t>;
    if (const char* v = std::getenv("PTRAIN_UNVERIFIED_CUDA")) gate = v;
    ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
    kernels::detail::cuda_kernel_table_slot() = &table;
    ptrain::detail::cuda_backend_slot() = &gpu();
  }
  ~FakeCuda() {
    kernels::detail::cuda_kernel_table_slot() = nullptr;
    ptrain::detail::cuda_backend_slot() = nullptr;
    if (gate) ::setenv("PTRAIN_UNVERIFIED_CUDA", gate->c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
};

using Real = double;
constexpr std::int64_t kIn = 7, kOut = 5, kRowsPerRank = 4, kSteps = 3;
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};

std::shared_ptr<nn::MLP<Real>> make_mlp(Device d) {
  Generator g(3);
  auto m = std::make_shared<nn::MLP<Real>>(kIn, std::vector<std::int64_t>{6, 9}, kOut, nn::Activation::ReLU, g);
  m->to(d);
  return m;
}

// kSteps clipped AdamW steps on this rank's data-parallel shard; the norms, then the parameters.
std::pair<std::vector<double>, std::vector<Real>> train(parallel::Engine<Real>& e, Device d, int world_size) {
  optim::AdamW<Real> opt(e.parameters(), kAdam);
  std::vector<double> norms;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const std::int64_t rows = kRowsPerRank * world_size;
    Generator g(100 + static_cast<std::uint64_t>(s));
    auto x = Tensor<Real>::empty({rows, kIn});
    auto y = Tensor<std::int32_t>::empty({rows});
    for (std::int64_t i = 0; i < rows * kIn; ++i) x.data()[i] = static_cast<Real>(g.uniform() * 2 - 1);
    for (std::int64_t i = 0; i < rows; ++i) y.data()[i] = static_cast<std::int32_t>(g.below(kOut));
    dist::Communicator* dp = e.data_parallel_group();
    const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, mine = rows / n;
    e.zero_grad();
    e.forward_backward(x.narrow(r * mine, mine).to(d), y.narrow(r * mine, mine).to(d));
    norms.push_back(e.clip_grad_norm_(0.05));
    e.step(opt);
  }
  return {norms, e.parameters().values().to_vector()};
}

}  // namespace

TEST_CASE("Engines on staged device tensors equal the same engines on CPU tensors bit for bit", "[staged]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  using S = parallel::ShardingStrategy;
  std::vector<std::pair<std::string, parallel::Plan<Real>>> plans = {
      {"ddp", parallel::DDPOptions{.first_bucket_bytes = 64}},
      {"fsdp full_shard", parallel::FSDPOptions{.strategy = S::FullShard}},
      {"fsdp hybrid", parallel::FSDPOptions{.strategy = S::Hybrid, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n}},
  };
  if (n % 2 == 0)
    plans.push_back({"pipeline", parallel::PipelinePlan<Real>{.stages = 2, .unit_costs = {1, 0, 1, 0, 1},
                                                              .options = {.micro_batches = 2}}});
  FakeCuda fake;
  dist::StagedCommunicator staged(comm.split(0, r), kGpu);
  for (const auto& [name, plan] : plans) {
    INFO(name << " on " << n << " ranks, " << comm.backend());
    auto cpu_engine = parallel::make_engine<Real>(make_mlp(Device::cpu()), comm, plan);
    const auto want = train(*cpu_engine, Device::cpu(), n);
    const long copies = gpu().to_host;
    const auto calls = staged.staging_stats().staged_calls;
    auto dev_engine = parallel::make_engine<Real>(make_mlp(kGpu), staged, plan);
    CHECK(dev_engine->parameters().values().device() == kGpu);
    const auto got = train(*dev_engine, kGpu, n);
    CHECK(got.first == want.first);
    CHECK(got.second == want.second);
    CHECK(want.first.size() == static_cast<std::size_t>(kSteps));
    if (n > 1) CHECK(staged.staging_stats().staged_calls > calls);  // collectives moved "device" memory
    CHECK(gpu().to_host > copies);
  }
  // The plain world refuses the same device model, naming the staged way out.
  CHECK_THROWS_WITH(parallel::make_engine<Real>(make_mlp(kGpu), comm, parallel::Plan<Real>{parallel::DDPOptions{}}),
                    Catch::Contains("[ptrain.comm.device]") && Catch::Contains("staged through host memory"));
}

TEST_CASE("ring and all-gather attention on staged device tensors equal the CPU's bit for bit", "[staged][cp]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  const std::int64_t B = 2, S = 2 * n * 3, H = 4, Hkv = 2, D = 4, window = 5;
  auto random = [](const Shape& shape, std::uint64_t seed) {
    Generator g(seed);
    auto t = Tensor<Real>::empty(shape);
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data()[i] = static_cast<Real>(g.uniform() * 2 - 1);
    return t;
  };
  // Documents start at 0 and S / 2 - 1 of every row (global positions).
  auto starts_full = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t i = 0; i < B * S; ++i)
    starts_full.data()[i] = i % S < S / 2 - 1 ? 0 : static_cast<std::int32_t>(S / 2 - 1);
  FakeCuda fake;
  dist::StagedCommunicator staged(comm.split(0, r), kGpu);
  for (auto exchange : {parallel::KVExchange::Ring, parallel::KVExchange::AllGather}) {
    INFO((exchange == parallel::KVExchange::Ring ? "ring" : "all-gather") << " on " << n << " ranks, "
                                                                          << comm.backend());
    parallel::ContextParallelGroup cpu_g(&comm, exchange), dev_g(&staged, exchange);
    const auto q = cpu_g.shard(random({B, S, H, D}, 1)), k = cpu_g.shard(random({B, S, Hkv, D}, 2)),
               v = cpu_g.shard(random({B, S, Hkv, D}, 3)), dy = cpu_g.shard(random({B, S, H, D}, 4));
    const auto starts = cpu_g.shard(starts_full);
    parallel::RingSaved<Real> cs, ds;
    const auto y_cpu = parallel::context_attention(cpu_g, q, k, v, starts, window, cs);
    Tensor<Real> dq_cpu, dk_cpu, dv_cpu;
    parallel::context_attention_backward(cpu_g, q, k, v, cs, dy, dq_cpu, dk_cpu, dv_cpu);
    const auto gq = q.to(kGpu), gk = k.to(kGpu), gv = v.to(kGpu), gdy = dy.to(kGpu);
    const auto y = parallel::context_attention(dev_g, gq, gk, gv, starts.to(kGpu), window, ds);
    Tensor<Real> dq, dk, dv;
    parallel::context_attention_backward(dev_g, gq, gk, gv, ds, gdy, dq, dk, dv);
    CHECK(y.device() == kGpu);
    CHECK(ds.lse.device() == kGpu);
    CHECK(dk.device() == kGpu);
    CHECK(y.to_vector() == y_cpu.to_vector());
    CHECK(ds.lse.to_vector() == cs.lse.to_vector());
    CHECK(dq.to_vector() == dq_cpu.to_vector());
    CHECK(dk.to_vector() == dk_cpu.to_vector());
    CHECK(dv.to_vector() == dv_cpu.to_vector());
    comm.barrier();  // every rank is done with this exchange's transfers before the next one's
  }
  // The blocks of device tensors come from the kernel table: without its entry the call
  // is refused (a group of one, so that no transfer is left open).
  fake.table.f64.ring_attention_block_forward = nullptr;
  parallel::ContextParallelGroup one(nullptr);
  parallel::RingSaved<Real> saved;
  const auto t = Tensor<Real>::zeros({B, 6, H, D}, kGpu), kv = Tensor<Real>::zeros({B, 6, Hkv, D}, kGpu);
  CHECK_THROWS_WITH(parallel::ring_attention(one, t, kv, kv, Tensor<std::int32_t>(), 0, saved),
                    Catch::Contains("[ptrain.cuda.unsupported] ring_attention_block_forward"));
  // A communicator that cannot move device memory refuses device tensors.
  if (n > 1) {
    parallel::ContextParallelGroup plain(&comm);
    CHECK_THROWS_WITH(parallel::ring_attention(plain, t, kv, kv, Tensor<std::int32_t>(), 0, saved),
                      Catch::Contains("[ptrain.comm.device]"));
  }
}

namespace {

constexpr std::int32_t kDocument = 1;  // Llama's document token

template <class M>
std::shared_ptr<M> on(std::shared_ptr<M> m, Device d) {
  m->to(d);
  return m;
}

// kSteps clipped AdamW steps of the engine of `plan` (context parallelism) over `model` on `comm`,
// each replica on its 2 rows of a random global batch (ids and targets on d, some targets
// ignored, a document token in every row); the losses and norms, then the parameters.
template <class M>
std::pair<std::vector<double>, std::vector<Real>> train_cp(const std::shared_ptr<M>& model, dist::Communicator& comm,
                                                           const parallel::Plan<Real>& plan, Device d,
                                                           std::int32_t vocab, std::int64_t S) {
  auto e = parallel::make_engine<Real>(model, comm, plan);
  CHECK(e->parameters().values().device() == d);
  optim::AdamW<Real> opt(e->parameters(), kAdam);
  const int replica = e->data_parallel_group()->rank();
  std::vector<double> seen;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    Generator g(400 + static_cast<std::uint64_t>(s) * 10 + static_cast<std::uint64_t>(replica));
    auto ids = Tensor<std::int32_t>::empty({2, S}), targets = Tensor<std::int32_t>::empty({2 * S});
    for (std::int64_t i = 0; i < 2 * S; ++i) {
      ids.data()[i] = i % S == S / 2 ? kDocument : static_cast<std::int32_t>(g.below(vocab));
      targets.data()[i] = i % 5 == 2 ? -100 : static_cast<std::int32_t>(g.below(vocab));
    }
    e->zero_grad();
    seen.push_back(e->forward_backward(ids.to(d), targets.to(d)));
    seen.push_back(e->clip_grad_norm_(0.5));
    e->step(opt);
  }
  auto values = e->parameters().values().to_vector();
  comm.barrier();  // Note [Group teardown]
  return {seen, values};
}

}  // namespace

TEST_CASE("the context-parallel engine on staged device tensors equals it on CPU tensors bit for bit",
          "[staged][cp]") {
  auto& comm = world();
  const int n = comm.size(), r = comm.rank();
  using CP = parallel::ContextParallelPlan;
  using TP = parallel::TensorParallelPlan;
  struct Case {
    std::string name;
    int cp;
    parallel::Plan<Real> cpu, dev;  // the engine on the CPU, on the device (the same but TP's .device)
  };
  std::vector<Case> cases = {{"cp all", n, CP{.cp = n}, CP{.cp = n}},
                             {"cp all, FSDP", n, CP{.cp = n, .fsdp = true}, CP{.cp = n, .fsdp = true}}};
  if (n == 4) cases.push_back({"dp 2 x cp 2", 2, CP{.cp = 2}, CP{.cp = 2}});
  // Inside tensor parallelism: tp n / 2 x cp 2, the shards moved to the device by the plan
  // (tp at most 2: it must divide the models' 2 heads).
  if (n == 2 || n == 4)
    cases.push_back({"cp 2 x tp n / 2", 2, TP{.tp = n / 2, .cp = 2}, TP{.tp = n / 2, .device = kGpu, .cp = 2}});
  FakeCuda fake;
  dist::StagedCommunicator staged(comm.split(0, r), kGpu);
  for (const auto& c : cases) {
    INFO(c.name << " on " << n << " ranks, " << comm.backend());
    const std::int64_t S = 2 * c.cp * 3;
    // The model on d: the engine's device, or the CPU where the plan moves the shards.
    const Device built = std::holds_alternative<TP>(c.dev) ? Device::cpu() : kGpu;
    auto compare = [&](auto make, std::int32_t vocab) {
      const auto want = train_cp(make(Device::cpu()), comm, c.cpu, Device::cpu(), vocab, S);
      const long copies = gpu().to_host;
      const auto got = train_cp(make(built), staged, c.dev, kGpu, vocab, S);
      CHECK(got.first == want.first);
      CHECK(got.second == want.second);
      CHECK(gpu().to_host > copies);
    };
    const nn::GPTConfig gpt{.vocab_size = 13, .block_size = S, .n_layer = 2, .n_head = 2, .n_embd = 8};
    const nn::LlamaConfig llama{.vocab_size = 17, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 16,
                                .intermediate_size = 24, .document_token = kDocument};
    {
      INFO("GPT");
      compare([&](Device d) { Generator g(3); return on(std::make_shared<nn::GPT<Real>>(gpt, g), d); }, 13);
    }
    {
      INFO("Llama on packed documents");
      compare([&](Device d) { Generator g(5); return on(std::make_shared<nn::Llama<Real>>(llama, g), d); }, 17);
    }
  }
  // The copies of the packed qkv come from the kernel table, like the ring's blocks (a group of one).
  dist::SelfCommunicator self;
  Generator g(5);
  auto small = std::make_shared<nn::GPT<Real>>(nn::GPTConfig{.vocab_size = 13, .block_size = 12, .n_layer = 1,
                                                             .n_head = 2, .n_embd = 8}, g);
  small->to(kGpu);
  parallel::ContextParallel<Real> one(*small, self, parallel::ContextParallelPlan{.cp = 1});
  auto ids = Tensor<std::int32_t>::zeros({1, 6}, kGpu), targets = Tensor<std::int32_t>::zeros({6}, kGpu);
  fake.table.f64.copy_strided_rows = nullptr;
  CHECK_THROWS_WITH(one.forward_backward(ids, targets),
                    Catch::Contains("[ptrain.cuda.unsupported] copy_strided_rows"));
  fake.table.f64.copy_strided_rows = &kernels::cpu::copy_strided_rows<Real>;
  // The engine on a device is gated with its kernels (the ring's, copy_strided_rows).
  ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  CHECK_THROWS_WITH(one.forward_backward(ids, targets), Catch::Contains("[ptrain.cuda.unverified]"));
  ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1);
  // A communicator that cannot move device memory is refused when the engine is built.
  if (n > 1)
    CHECK_THROWS_WITH(parallel::ContextParallel<Real>(*small, comm, parallel::ContextParallelPlan{.cp = n}),
                      Catch::Contains("[ptrain.comm.device]") && Catch::Contains("context parallelism"));
}

}  // namespace test_staged_engines
