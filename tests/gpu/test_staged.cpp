// The staged communicator (dist/staged_communicator.hpp) on a real GPU, gated as
// "staged_communicator" (Note [The verification gate]):
//   * one process: the CUDA backend's pointer test and pinned memory, and device
//     buffers through a world of one, ordered with work on a non-blocking current
//     stream (the input produced by a kernel still queued, the result read by the
//     next kernel);
//   * with Gloo in the build, 2 and 4 ranks of this binary on cuda:0 (init_process_group
//     picks Gloo, staged, because the ranks outnumber the GPUs): collectives on device
//     buffers (all-to-alls included) equal the same collectives on host buffers
//     bitwise, and DDP, FSDP (full shard, shard_grad_op, hybrid), a 2-stage pipeline
//     and tensor parallelism of a GPT train like one process on the GPU on the global
//     batch (gradient norms and losses of 3 clipped AdamW steps in double, as
//     tests/dist/parallel/test_engine.cpp and test_tensor_parallel.cpp check on the CPU),
//     and context parallelism (cp = world) of a Llama on packed documents trains like the
//     Local engine on the whole sequences (float: the ring's CUDA kernels have no double).
// The ranks run the hidden case [.staged_rank], each with its output in a file that
// the parent prints when a rank fails.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/spawn_util.hpp"
#include "gpu_util.hpp"
#include "ptrain/dist/process_group.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/dist/staged_communicator.hpp"
#include "ptrain/kernels/cuda/stream.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/llama.hpp"
#include "ptrain/nn/models/mlp.hpp"
#include "ptrain/ops/activation.hpp"
#include "ptrain/optim/adamw.hpp"
#include "ptrain/parallel/make_engine.hpp"

extern char** environ;

namespace test_staged {

using namespace ptrain;
using namespace ptrain::testing;

TEST_CASE("staged: device buffers through pinned host memory, ordered with the current stream",
          "[gpu][cuda:staged_communicator]") {
  auto& backend = ptrain::detail::cuda_backend();
  CHECK(backend.device_count() >= 1);
  std::vector<float> host(16);
  const auto dev = Tensor<float>::zeros({16}, kGpu);
  CHECK(backend.is_host_pointer(host.data()));
  CHECK_FALSE(backend.is_host_pointer(dev.data()));
  void* pinned = backend.allocate_pinned_host(4096);
  REQUIRE(pinned != nullptr);
  CHECK(backend.is_host_pointer(pinned));
  backend.free_pinned_host(pinned);

  dist::StagedCommunicator c(std::make_unique<dist::SelfCommunicator>(), kGpu);
  CHECK(c.serves(kGpu));
  CHECK_FALSE(c.serves(Device::cuda(1)));
  // A non-blocking stream is not ordered with the default stream the host copies of other
  // threads use: only the staging's own waits order the copies with these kernels.
  kernels::cuda::Stream stream(0);
  kernels::cuda::StreamGuard guard(stream);
  const std::int64_t n = std::int64_t{1} << 22;  // 16 MiB: kernels long enough for a missing wait to show
  const auto x = Tensor<float>::from(uniform<float>(n, -2, 2), {n}).to(kGpu);
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    const auto y = ops::gelu(x);  // still queued when the staging copies it out
    auto z = Tensor<float>::empty({n}, kGpu);
    c.all_reduce(y.data(), z.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Sum);
    const auto got = ops::gelu(z).to_vector();  // queued right after the copy back
    CHECK(got == ops::gelu(y).to_vector());
    // In place and asynchronous, then broadcast and all_gather (copies in a world of one).
    auto w = ops::gelu(x);
    c.all_reduce_async(w.data(), w.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Max)->wait();
    CHECK(w.to_vector() == y.to_vector());
    auto b = ops::gelu(x);
    c.broadcast(b.data(), static_cast<std::size_t>(n), DType::F32, 0);
    CHECK(b.to_vector() == y.to_vector());
    auto g = Tensor<float>::empty({n}, kGpu);
    c.all_gather(y.data(), g.data(), static_cast<std::size_t>(n), DType::F32);
    CHECK(g.to_vector() == y.to_vector());
  }
  const dist::StagingStats s = c.staging_stats();
  CHECK(s.blocks >= 1);
  CHECK(s.pinned_blocks == s.blocks);  // the CUDA backend gives page-locked memory
  CHECK(s.staged_calls == 12);
}

#ifdef PTRAIN_GLOO

namespace {

// The world of a rank of the multi-rank check: Gloo, staged, chosen by "auto" because the
// ranks outnumber the GPUs (forced where the machine has a GPU per rank: all use cuda:0).
std::unique_ptr<dist::Communicator> staged_world() {
  dist::ProcessGroupOptions o;
  o.device = kGpu;
  const int ranks = dist::detect_launch_env().local_world_size;
  o.backend = kernels::cuda::device_count() < ranks ? "auto" : "gloo";
  o.check_collectives = false;
  o.flight_recorder = false;
  return dist::init_process_group(o);
}

// Device copy of host values.
template <class T>
Tensor<T> on_gpu(const std::vector<T>& v) {
  return Tensor<T>::from(v, {static_cast<std::int64_t>(v.size())}).to(kGpu);
}

// Collectives on device buffers against the same collectives on host buffers, bitwise.
void check_collectives(dist::Communicator& c) {
  const int P = c.size(), r = c.rank();
  for (std::size_t n : {std::size_t{1}, std::size_t{1031}, std::size_t{1} << 20}) {
    INFO("collectives, n = " << n);
    std::vector<float> mine(n), big(n * P);
    for (std::size_t i = 0; i < n; ++i) mine[i] = static_cast<float>((r * 37 + i * 11) % 23) - 11.0f + 0.25f * r;
    for (std::size_t i = 0; i < n * P; ++i) big[i] = static_cast<float>((r * 13 + i * 7) % 19) - 9.0f;
    for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Avg, dist::ReduceOp::Max}) {
      auto host = mine;
      auto dev = on_gpu(mine);
      c.all_reduce(host.data(), n, DType::F32, op);
      c.all_reduce(dev.data(), n, DType::F32, op);
      CHECK(dev.to_vector() == host);
    }
    {
      std::vector<float> host(n);
      auto dev_in = on_gpu(big);
      auto dev_out = Tensor<float>::empty({static_cast<std::int64_t>(n)}, kGpu);
      c.reduce_scatter(big.data(), host.data(), n, DType::F32, dist::ReduceOp::Sum);
      c.reduce_scatter(dev_in.data(), dev_out.data(), n, DType::F32, dist::ReduceOp::Sum);
      CHECK(dev_out.to_vector() == host);
    }
    {
      std::vector<float> host(n * P);
      auto dev_in = on_gpu(mine);
      auto dev_out = Tensor<float>::empty({static_cast<std::int64_t>(n * P)}, kGpu);
      c.all_gather(mine.data(), host.data(), n, DType::F32);
      c.all_gather_async(dev_in.data(), dev_out.data(), n, DType::F32)->wait();
      CHECK(dev_out.to_vector() == host);
    }
    {
      auto host = mine;
      auto dev = on_gpu(mine);
      c.broadcast(host.data(), n, DType::F32, P - 1);
      c.broadcast(dev.data(), n, DType::F32, P - 1);
      CHECK(dev.to_vector() == host);
    }
    {
      std::vector<float> host(n * P);
      auto dev_in = on_gpu(big);
      auto dev_out = Tensor<float>::empty({static_cast<std::int64_t>(n * P)}, kGpu);
      c.all_to_all(big.data(), host.data(), n, DType::F32);
      c.all_to_all_async(dev_in.data(), dev_out.data(), n, DType::F32)->wait();
      CHECK(dev_out.to_vector() == host);
      // Variable blocks: rank q gets (r + q) % 3 * n / 2 elements, none from the last rank.
      std::vector<std::size_t> sc, rc;
      for (int q = 0; q < P; ++q) {
        sc.push_back(r == P - 1 ? 0 : static_cast<std::size_t>((r + q) % 3) * n / 2);
        rc.push_back(q == P - 1 ? 0 : static_cast<std::size_t>((q + r) % 3) * n / 2);
      }
      std::size_t rt = 0;
      for (std::size_t v : rc) rt += v;
      std::vector<float> vhost(rt);
      auto vdev = Tensor<float>::empty({static_cast<std::int64_t>(rt)}, kGpu);
      c.all_to_all_v(big.data(), sc.data(), vhost.data(), rc.data(), DType::F32);
      c.all_to_all_v(dev_in.data(), sc.data(), vdev.data(), rc.data(), DType::F32);
      CHECK(vdev.to_vector() == vhost);
    }
    {
      // A ring: every rank sends to the next and receives from the previous.
      const int next = (r + 1) % P, prev = (r + P - 1) % P;
      auto send = on_gpu(mine);
      auto recv = Tensor<float>::empty({static_cast<std::int64_t>(n)}, kGpu);
      std::vector<float> host(n);
      auto s1 = c.send_async(mine.data(), n, DType::F32, next, 1);
      c.recv(host.data(), n, DType::F32, prev, 1);
      s1->wait();
      auto s2 = c.send_async(send.data(), n, DType::F32, next, 2);
      auto r2 = c.recv_async(recv.data(), n, DType::F32, prev, 2);
      r2->wait();
      s2->wait();
      CHECK(recv.to_vector() == host);
    }
  }
}

using Real = double;
constexpr double kTol = 1e-9;  // double, AdamW: see test_engine.cpp's kTol
constexpr double kClip = 0.05;
const optim::AdamWOptions kAdam{.lr = 0.01, .eps = 1e-6, .weight_decay = 0.1};
constexpr std::int64_t kRowsPerRank = 4, kSteps = 3, kIn = 7, kOut = 5;

std::shared_ptr<nn::MLP<Real>> make_mlp() {
  Generator g(3);
  auto m = std::make_shared<nn::MLP<Real>>(kIn, std::vector<std::int64_t>{6, 9}, kOut, nn::Activation::ReLU, g);
  m->to(kGpu);
  return m;
}

struct Batch {
  Tensor<Real> x;
  Tensor<std::int32_t> y;
};
Batch make_batch(std::int64_t rows, std::uint64_t seed) {
  Generator g(seed);
  std::vector<Real> x(static_cast<std::size_t>(rows * kIn));
  std::vector<std::int32_t> y(static_cast<std::size_t>(rows));
  for (auto& v : x) v = static_cast<Real>(g.uniform() * 2 - 1);
  for (auto& v : y) v = static_cast<std::int32_t>(g.below(kOut));
  return {Tensor<Real>::from(x, {rows, kIn}).to(kGpu), Tensor<std::int32_t>::from(y, {rows}).to(kGpu)};
}

// kSteps clipped AdamW steps of `e` on its data-parallel shard of the global batch; the norms.
std::vector<double> train(parallel::Engine<Real>& e, int world_size) {
  optim::AdamW<Real> opt(e.parameters(), kAdam);
  std::vector<double> norms;
  for (std::int64_t s = 0; s < kSteps; ++s) {
    const Batch global = make_batch(kRowsPerRank * world_size, 100 + static_cast<std::uint64_t>(s));
    dist::Communicator* dp = e.data_parallel_group();
    const std::int64_t n = dp ? dp->size() : 1, r = dp ? dp->rank() : 0, rows = global.x.size(0) / n;
    e.zero_grad();
    e.forward_backward(global.x.narrow(r * rows, rows), global.y.narrow(r * rows, rows));
    norms.push_back(e.clip_grad_norm_(kClip));
    e.step(opt);
  }
  return norms;
}

void check_engines(dist::Communicator& world) {
  const int n = world.size();
  dist::SelfCommunicator self(kGpu);
  auto ref_engine = parallel::make_engine<Real>(make_mlp(), self, parallel::LocalOptions{});
  const auto ref = train(*ref_engine, n);
  using S = parallel::ShardingStrategy;
  const std::vector<std::pair<std::string, parallel::Plan<Real>>> plans = {
      {"ddp", parallel::DDPOptions{.first_bucket_bytes = 64}},
      {"fsdp full_shard", parallel::FSDPOptions{.strategy = S::FullShard}},
      {"fsdp shard_grad_op", parallel::FSDPOptions{.strategy = S::ShardGradOp}},
      {"fsdp hybrid", parallel::FSDPOptions{.strategy = S::Hybrid, .hybrid_shard_size = n % 2 == 0 ? n / 2 : n}},
      {"pipeline", parallel::PipelinePlan<Real>{.stages = 2, .unit_costs = {1, 0, 1, 0, 1},
                                                .options = {.micro_batches = 2}}},
  };
  for (const auto& [name, plan] : plans) {
    INFO(name << " on " << n << " ranks sharing cuda:0");
    auto engine = parallel::make_engine<Real>(make_mlp(), world, plan);
    CHECK(engine->parameters().values().device() == kGpu);
    const auto norms = train(*engine, n);
    for (std::size_t s = 0; s < norms.size(); ++s) CHECK(norms[s] == Approx(ref[s]).epsilon(kTol));
  }
}

// Tensor parallelism of a GPT (tp = world) against nn::GPT alone, both on cuda:0.
void check_tensor_parallel(dist::Communicator& world) {
  const int n = world.size();
  const nn::GPTConfig cfg{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 4, .n_embd = 16};
  constexpr std::int64_t B = 4, S = 8;
  auto make_gpt = [&] {
    Generator g(7);
    auto m = std::make_shared<nn::GPT<Real>>(cfg, g);
    m->to(kGpu);
    return m;
  };
  auto batch = [&](std::uint64_t seed) {
    Generator g(seed);
    std::vector<std::int32_t> ids(B * S), targets(B * S);
    for (auto& v : ids) v = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(cfg.vocab_size)));
    for (auto& v : targets) v = static_cast<std::int32_t>(g.below(static_cast<std::uint64_t>(cfg.vocab_size)));
    return std::pair{Tensor<std::int32_t>::from(ids, {B, S}).to(kGpu), Tensor<std::int32_t>::from(targets, {B, S}).to(kGpu)};
  };
  auto run = [&](parallel::Engine<Real>& e) {
    optim::AdamW<Real> opt(e.parameters(), kAdam);
    std::vector<std::pair<double, double>> out;
    for (std::int64_t s = 0; s < kSteps; ++s) {
      const auto [ids, targets] = batch(100 + static_cast<std::uint64_t>(s));
      e.zero_grad();
      const double loss = e.average(e.forward_backward(ids, targets));
      out.emplace_back(loss, e.clip_grad_norm_(kClip));
      e.step(opt);
    }
    return out;
  };
  dist::SelfCommunicator self(kGpu);
  auto ref_engine = parallel::make_engine<Real>(make_gpt(), self, parallel::LocalOptions{});
  const auto ref = run(*ref_engine);
  INFO("tensor parallel GPT, tp " << n << " on cuda:0");
  auto engine = parallel::make_engine<Real>(make_gpt(), world, parallel::TensorParallelPlan{.tp = n});
  const auto got = run(*engine);
  for (std::size_t s = 0; s < got.size(); ++s) {
    CHECK(got[s].first == Approx(ref[s].first).epsilon(kTol));
    CHECK(got[s].second == Approx(ref[s].second).epsilon(kTol));
  }
}

// Context parallelism of a Llama on packed documents (cp = world, the ring's gated kernels
// and device transfers staged through Gloo) against the Local engine on the whole
// sequences, both on cuda:0 in float: losses and gradient norms of 3 clipped AdamW steps
// within 1e-4 (float sums in another order: the ring's blocks against whole-sequence
// attention). AdamW with eps = 1 and no decay: each step is about lr times the gradient,
// so a near-zero gradient whose last bits differ moves its parameter alike on both sides.
void check_context_parallel(dist::Communicator& world) {
  const int n = world.size();
  const nn::LlamaConfig cfg{.vocab_size = 19, .n_layer = 2, .n_head = 4, .n_kv_head = 2, .n_embd = 32,
                            .intermediate_size = 48, .max_seq_len = 32, .document_token = 1};
  constexpr std::int64_t B = 2, S = 32;
  auto make = [&] {
    Generator g(9);
    auto m = std::make_shared<nn::Llama<float>>(cfg, g);
    m->to(kGpu);
    return m;
  };
  auto run = [&](parallel::Engine<float>& e) {
    optim::AdamW<float> opt(e.parameters(), {.lr = 0.1, .eps = 1, .weight_decay = 0});
    std::vector<std::pair<double, double>> out;
    for (std::int64_t s = 0; s < kSteps; ++s) {
      Generator g(200 + static_cast<std::uint64_t>(s));
      std::vector<std::int32_t> ids(B * S), targets(B * S);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        ids[i] = i % S == 13 ? cfg.document_token : static_cast<std::int32_t>(g.below(19));
        targets[i] = i % 5 == 2 ? -100 : static_cast<std::int32_t>(g.below(19));
      }
      e.zero_grad();
      const double loss = e.forward_backward(Tensor<std::int32_t>::from(ids, {B, S}).to(kGpu),
                                             Tensor<std::int32_t>::from(targets, {B * S}).to(kGpu));
      out.emplace_back(loss, e.clip_grad_norm_(kClip));
      e.step(opt);
    }
    return out;
  };
  dist::SelfCommunicator self(kGpu);
  auto ref_engine = parallel::make_engine<float>(make(), self, parallel::LocalOptions{});
  const auto ref = run(*ref_engine);
  INFO("context parallel Llama, cp " << n << " on cuda:0");
  auto engine = parallel::make_engine<float>(make(), world, parallel::ContextParallelPlan{.cp = n});
  CHECK(engine->parameters().values().device() == kGpu);
  const auto got = run(*engine);
  for (std::size_t s = 0; s < got.size(); ++s) {
    INFO("step " << s);
    CHECK(got[s].first == Approx(ref[s].first).epsilon(1e-4));
    CHECK(got[s].second == Approx(ref[s].second).epsilon(1e-4));
  }
}

// Starts `n` ranks of this binary running [.staged_rank] on 127.0.0.1, rank r's output
// in dir/rank<r>.log; waits up to timeout_s and returns their exit codes (-9: killed at the timeout).
std::vector<int> run_ranks(int n, const std::filesystem::path& dir, int timeout_s) {
  std::filesystem::create_directories(dir);
  const std::string exe = self_exe(), port = std::to_string(free_port());
  // Launcher variables of this process (mpirun, Slurm, torchrun) would override the ones given here.
  const std::vector<std::string> drop = {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=", "LOCAL_WORLD_SIZE=", "MASTER_ADDR=",
                                         "MASTER_PORT=", "GROUP_RANK=", "ROLE_RANK=", "OMPI_", "PMI_", "PMIX_",
                                         "SLURM_", "PTRAIN_BACKEND=", "PTRAIN_DISTRIBUTED_DEBUG=",
                                         "PTRAIN_FLIGHT_RECORDER_DIR=", "PTRAIN_TRACE_DIR="};
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e;
      bool keep = true;
      for (const auto& d : drop) keep = keep && kv.rfind(d, 0) != 0;
      if (keep) env.push_back(kv);
    }
    for (std::string kv : {"RANK=" + std::to_string(r), "LOCAL_RANK=" + std::to_string(r),
                           "WORLD_SIZE=" + std::to_string(n), "LOCAL_WORLD_SIZE=" + std::to_string(n),
                           std::string("MASTER_ADDR=127.0.0.1"), "MASTER_PORT=" + port,
                           std::string("PTRAIN_COMM_TIMEOUT_S=45"), std::string("PTRAIN_UNVERIFIED_CUDA=1")})
      env.push_back(kv);
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    std::string arg0 = exe, arg1 = "[.staged_rank]";
    char* argv[] = {arg0.data(), arg1.data(), nullptr};
    const std::string log = (dir / ("rank" + std::to_string(r) + ".log")).string();
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    REQUIRE(rc == 0);
    pids.push_back(pid);
  }
  std::vector<int> codes(static_cast<std::size_t>(n), -1);
  std::vector<bool> done(static_cast<std::size_t>(n), false);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  for (int left = n; left > 0;) {
    for (int r = 0; r < n; ++r) {
      if (done[r]) continue;
      int status = 0;
      if (::waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        done[r] = true;
        --left;
        codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < n; ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          int status = 0;
          ::waitpid(pids[r], &status, 0);
          codes[r] = -SIGKILL;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return codes;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST_CASE("staged: 2 and 4 ranks sharing one GPU train like one process (DDP, FSDP, pipeline, tensor and "
          "context parallel)",
          "[gpu][multirank][cuda:staged_communicator][cuda:ring_attention_block_forward]"
          "[cuda:ring_attention_block_backward]") {
  for (int n : {2, 4}) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("ptrain_staged_" + std::to_string(::getpid()) + "_np" + std::to_string(n));
    const auto codes = run_ranks(n, dir, 75);
    for (int r = 0; r < n; ++r) {
      const auto log = dir / ("rank" + std::to_string(r) + ".log");
      INFO(n << " ranks: rank " << r << " exited with " << codes[r] << " (-9: killed after 75 s); its output:\n"
             << read_file(log));
      CHECK(codes[r] == 0);
    }
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("staged: one rank of the multi-rank check", "[.staged_rank]") {
  auto world = staged_world();
  REQUIRE(dynamic_cast<dist::StagedCommunicator*>(world.get()) != nullptr);
  CHECK(world->backend() == "gloo");
  CHECK(world->serves(kGpu));
  check_collectives(*world);
  check_engines(*world);
  check_tensor_parallel(*world);
  check_context_parallel(*world);
  world->barrier();
}

#endif  // PTRAIN_GLOO

}  // namespace test_staged
