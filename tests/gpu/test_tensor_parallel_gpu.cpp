// Tensor parallelism on the GPU: the vocabulary-parallel ops (ops/vocab_parallel.hpp,
// kernels/cuda/vocab_parallel.cuh) on cuda against the CPU kernels, the
// vocabulary-parallel units over a one-rank group whose communicator serves
// cuda:0 (dist::SelfCommunicator), and a tensor-parallel GPT step at tp = 1 on
// cuda against the same step on the CPU. Compiled by g++ like a user's .cpp (the
// kernel table that ptrain::cuda's CUDA source fills). One GPU has one rank, so
// the collectives between the ranks (and sequence parallelism, which needs
// tp >= 2) are not exercised here: the [tp] tests of tests/dist cover them on the
// CPU. The vocab_parallel_* kernels are on the verification gate; these tests
// are their verification, so each sets PTRAIN_UNVERIFIED_CUDA=1 for its own scope.
//
// Bounds (test_kernels.cu's header): float 1e-5 norm-wise relative against the
// CPU float kernel (the row sums of exp and the scatter-add run in another
// order); bf16 against the CPU kernel run in float on the same bf16 values (what
// the GPU kernel computes), 4e-3: the GPU rounds its float result to bf16 once
// (2^-9 relative), plus float order differences. The row max is exact. The GPT
// step: 1e-4 (cuBLAS's and the CPU GEMM's summation orders through two blocks and
// one SGD step, the bound of the plain CUDA GPT step in test_nccl.cpp scaled for
// the vocabulary-parallel loss's float statistics).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/kernels/cuda_table.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/ops/vocab_parallel.hpp"
#include "ptrain/optim/sgd.hpp"
#include "ptrain/parallel/tensor_parallel.hpp"
#include "gpu/gpu_util.hpp"

namespace test_tensor_parallel_gpu {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

// A rank's part of an 11-token vocabulary at tp = 2: rank 1 holds rows [6, 12),
// of which [6, 11) are real and row 11 padding.
constexpr std::int64_t kB = 4, kS = 16, kC = 24, kV = 11, kLo = 6, kLocal = 6, kReal = 5;

template <class T>
Tensor<T> random_tensor(const Shape& shape, double lo, double hi) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return Tensor<T>::from(uniform<T>(n, lo, hi), shape);
}
Tensor<std::int32_t> random_ids(std::int64_t vocab, bool ignore_some) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(kB * kS));
  for (auto& x : v) x = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(vocab)));
  if (ignore_some) v[3] = v[17] = -100;
  return Tensor<std::int32_t>::from(v, {kB, kS});
}
// The CPU reference's element type: float for bf16 (the GPU kernel's arithmetic), else T.
template <class T>
using Ref = acc_t<T>;
template <class T>
Tensor<Ref<T>> widen(const Tensor<T>& t) {
  if constexpr (std::is_same_v<T, Ref<T>>) return t.clone();
  else {
    std::vector<float> v;
    for (const T& x : t.to_vector()) v.push_back(static_cast<float>(x));
    return Tensor<float>::from(v, t.shape());
  }
}
// These tests verify the gated vocab_parallel_* kernels (Note [The verification
// gate]), so they run them whatever the environment says; the variable is restored
// at the end of the test case.
struct AllowGated {
  const char* saved = std::getenv("PTRAIN_UNVERIFIED_CUDA");
  std::string value = saved ? saved : "";
  AllowGated() { ::setenv("PTRAIN_UNVERIFIED_CUDA", "1", 1); }
  ~AllowGated() {
    if (saved) ::setenv("PTRAIN_UNVERIFIED_CUDA", value.c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
  AllowGated(const AllowGated&) = delete;
  AllowGated& operator=(const AllowGated&) = delete;
};

template <class T>
double tol() {
  return std::is_same_v<T, bf16> ? 4e-3 : 1e-5;
}

}  // namespace

TEMPLATE_TEST_CASE("tp gpu: the vocabulary-parallel embedding and its backward on cuda equal the CPU",
                   "[gpu][tp_gpu][cuda:vocab_parallel_embedding_forward][cuda:vocab_parallel_embedding_backward]",
                   float, bf16) {
  using T = TestType;
  INFO("seed " << test_seed());
  AllowGated allow;
  const auto table = random_tensor<T>({kLocal, kC}, -1, 1), pos = random_tensor<T>({kS, kC}, -1, 1);
  const auto dout = random_tensor<T>({kB, kS, kC}, -1, 1);
  const auto ids = random_ids(kV, false);
  for (bool with_pos : {false, true}) {
    INFO((with_pos ? "with positions" : "without positions"));
    // Reference: the CPU kernel on the same values in the GPU kernel's arithmetic.
    const auto ref_out = ops::vocab_parallel_embedding(ids, kLo, widen(table), with_pos ? widen(pos) : Tensor<Ref<T>>());
    auto ref_dtable = widen(table), ref_dpos = widen(pos);  // gradients add into what is there
    ops::vocab_parallel_embedding_backward(ids, kLo, widen(dout), ref_dtable, with_pos ? &ref_dpos : nullptr);

    const auto out = ops::vocab_parallel_embedding(ids.to(kGpu), kLo, table.to(kGpu),
                                                   with_pos ? pos.to(kGpu) : Tensor<T>());
    REQUIRE(out.device() == kGpu);
    CHECK(rel_err(out.to_vector(), to_double(ref_out.to_vector())) <= tol<T>());
    auto dtable = table.to(kGpu), dpos = pos.to(kGpu);
    ops::vocab_parallel_embedding_backward(ids.to(kGpu), kLo, dout.to(kGpu), dtable, with_pos ? &dpos : nullptr);
    CHECK(rel_err(dtable.to_vector(), to_double(ref_dtable.to_vector())) <= tol<T>());
    CHECK(rel_err(dpos.to_vector(), to_double(ref_dpos.to_vector())) <= tol<T>());
    // Deterministic: the same bits on a second run.
    auto again = table.to(kGpu);
    ops::vocab_parallel_embedding_backward(ids.to(kGpu), kLo, dout.to(kGpu), again, with_pos ? &dpos : nullptr);
    CHECK(to_double(again.to_vector()) == to_double(dtable.to_vector()));
  }
}

TEMPLATE_TEST_CASE("tp gpu: the vocabulary-parallel cross-entropy statistics, loss and gradient on cuda equal the CPU",
                   "[gpu][tp_gpu][cuda:vocab_parallel_row_max][cuda:vocab_parallel_row_sums]"
                   "[cuda:vocab_parallel_loss][cuda:vocab_parallel_loss_backward]",
                   float, bf16) {
  using T = TestType;
  INFO("seed " << test_seed());
  AllowGated allow;
  auto logits = random_tensor<T>({kB, kS, kLocal}, -4, 4);
  const auto targets = random_ids(kV, true);
  // Reference in the GPU kernel's arithmetic (float statistics for bf16 either way).
  const auto ref_logits = widen(logits);
  auto ref_stats = ops::vocab_parallel_row_max(ref_logits, kReal);
  auto stats = ops::vocab_parallel_row_max(logits.to(kGpu), kReal);
  REQUIRE(stats.device() == kGpu);
  const std::int64_t N = kB * kS;
  // The max is exact.
  CHECK(to_double(stats.view(0, {N}).to_vector()) == to_double(ref_stats.view(0, {N}).to_vector()));
  ops::vocab_parallel_row_sums(ref_logits, targets, kLo, kReal, -100, ref_stats);
  ops::vocab_parallel_row_sums(logits.to(kGpu), targets.to(kGpu), kLo, kReal, -100, stats);
  CHECK(rel_err(stats.view(N, {N}).to_vector(), to_double(ref_stats.view(N, {N}).to_vector())) <= 1e-5);  // Z
  CHECK(rel_err(stats.view(2 * N, {N}).to_vector(), to_double(ref_stats.view(2 * N, {N}).to_vector())) <= 1e-5);
  std::int64_t valid = 0, ref_valid = 0;
  const double ref_loss = ops::vocab_parallel_loss<Ref<T>>(ref_stats, targets, kV, -100, ref_valid);
  const double loss = ops::vocab_parallel_loss<T>(stats, targets.to(kGpu), kV, -100, valid);
  CHECK(valid == ref_valid);
  CHECK(valid == N - 2);
  CHECK(loss == Approx(ref_loss).epsilon(1e-5));
  const auto ref_d = ops::vocab_parallel_loss_backward(ref_logits, ref_stats, targets, kLo, kReal, ref_valid, 0.5f, -100);
  const auto d = ops::vocab_parallel_loss_backward(logits.to(kGpu), stats, targets.to(kGpu), kLo, kReal, valid,
                                                   static_cast<acc_t<T>>(0.5), -100);
  CHECK(rel_err(d.to_vector(), to_double(ref_d.to_vector())) <= tol<T>());
  // A target outside the vocabulary is reported from the device.
  auto bad = targets.clone();
  bad.data()[9] = static_cast<std::int32_t>(kV);
  CHECK_THROWS_WITH(ops::vocab_parallel_loss<T>(stats, bad.to(kGpu), kV, -100, valid),
                    Catch::Contains("[ptrain.tp.target]") && Catch::Contains("at row 9"));
}

TEMPLATE_TEST_CASE("tp gpu: the vocabulary-parallel units on a one-rank group serving cuda equal the CPU",
                   "[gpu][tp_gpu][cuda:vocab_parallel_embedding_forward][cuda:vocab_parallel_embedding_backward]"
                   "[cuda:vocab_parallel_row_max][cuda:vocab_parallel_row_sums][cuda:vocab_parallel_loss]"
                   "[cuda:vocab_parallel_loss_backward]",
                   float, bf16) {
  using T = TestType;
  INFO("seed " << test_seed());
  AllowGated allow;
  dist::SelfCommunicator gpu_comm(kGpu), cpu_comm;
  REQUIRE(gpu_comm.serves(kGpu));
  parallel::TensorParallelGroup gpu_group(gpu_comm), cpu_group(cpu_comm);
  parallel::VocabParallelEmbedding<Ref<T>> cpu_embed(cpu_group, kV, kS, kC);
  parallel::VocabParallelEmbedding<T> gpu_embed(gpu_group, kV, kS, kC);
  // The same values in both (bf16 values, exact in float, for bf16).
  auto gp = gpu_embed.named_parameters();
  auto cp = cpu_embed.named_parameters();
  REQUIRE(gp.size() == cp.size());
  for (std::size_t i = 0; i < gp.size(); ++i) {
    const auto v = random_tensor<T>(gp[i].param->value.shape(), -1, 1);
    gp[i].param->value.copy_(v);
    cp[i].param->value.copy_(widen(v));
  }
  gpu_embed.to(kGpu);
  const auto ids = random_ids(kV, false), targets = random_ids(kV, true);
  nn::Cache<T> gc;
  nn::Cache<Ref<T>> cc;
  const auto gx = gpu_embed.forward_tokens(ids.to(kGpu), gc);
  const auto cx = cpu_embed.forward_tokens(ids, cc);
  CHECK(rel_err(gx.to_vector(), to_double(cx.to_vector())) <= tol<T>());
  // Logits over the whole vocabulary (one rank: every row real): the embedding's
  // output times the table, on the GPU; the CPU loss reads the same values.
  const auto glogits = ops::linear(gx, gpu_embed.wte().value, Tensor<T>());
  const auto clogits = widen(glogits.to(Device::cpu()));
  parallel::VocabParallelCrossEntropy<T> gce(gpu_group, kV);
  parallel::VocabParallelCrossEntropy<Ref<T>> cce(cpu_group, kV);
  nn::Cache<T> gl;
  nn::Cache<Ref<T>> cl;
  const double gloss = gce.forward(glogits, nn::Targets<T>(targets.to(kGpu)), gl);
  const double closs = cce.forward(clogits, nn::Targets<Ref<T>>(targets), cl);
  CHECK(gloss == Approx(closs).epsilon(1e-5));
  const auto gd = gce.backward(gl, 1);
  const auto cd = cce.backward(cl, 1);
  CHECK(rel_err(gd.to_vector(), to_double(cd.to_vector())) <= tol<T>());
  // The embedding's backward from the same output gradient.
  const auto dy = random_tensor<T>({kB, kS, kC}, -1, 1);
  gpu_embed.backward(dy.to(kGpu), gc);
  cpu_embed.backward(widen(dy), cc);
  gp = gpu_embed.named_parameters();
  cp = cpu_embed.named_parameters();
  for (std::size_t i = 0; i < gp.size(); ++i) {
    INFO(gp[i].name);
    CHECK(rel_err(gp[i].param->grad.to_vector(), to_double(cp[i].param->grad.to_vector())) <= tol<T>());
  }
}

TEST_CASE("tp gpu: a tensor-parallel GPT step at tp 1 on cuda equals the step on the CPU",
          "[gpu][tp_gpu][cuda:vocab_parallel_embedding_forward][cuda:vocab_parallel_embedding_backward]"
          "[cuda:vocab_parallel_row_max][cuda:vocab_parallel_row_sums][cuda:vocab_parallel_loss]"
          "[cuda:vocab_parallel_loss_backward]") {
  INFO("seed " << test_seed());
  AllowGated allow;
  for (bool tied : {true, false}) {
    INFO((tied ? "tied" : "untied"));
    const nn::GPTConfig cfg{.vocab_size = kV, .block_size = kS, .n_layer = 2, .n_head = 4, .n_embd = 32,
                            .tie_weights = tied};
    Generator g1(7), g2(7);
    nn::GPT<float> cpu_model(cfg, g1), gpu_model(cfg, g2);
    gpu_model.to(kGpu);  // the engine builds its units on the device of the model's parameters
    dist::SelfCommunicator cpu_comm, gpu_comm(kGpu);
    parallel::TensorParallel<float> cpu(cpu_model, cpu_comm, parallel::TensorParallelPlan{.tp = 1});
    parallel::TensorParallel<float> gpu(gpu_model, gpu_comm, parallel::TensorParallelPlan{.tp = 1});
    REQUIRE(gpu.parameters().values().device() == kGpu);
    // The full model on the host, the shards on the GPU.
    parallel::TensorParallel<float> placed(cpu_model, gpu_comm, parallel::TensorParallelPlan{.tp = 1, .device = kGpu});
    REQUIRE(placed.parameters().values().device() == kGpu);
    optim::SGD<float> cpu_opt(cpu.parameters(), {.lr = 0.1, .momentum = 0.9});
    optim::SGD<float> gpu_opt(gpu.parameters(), {.lr = 0.1, .momentum = 0.9});
    optim::SGD<float> placed_opt(placed.parameters(), {.lr = 0.1, .momentum = 0.9});
    for (int step = 0; step < 2; ++step) {
      const auto ids = random_ids(kV, false), targets = random_ids(kV, true);
      cpu.zero_grad();
      gpu.zero_grad();
      placed.zero_grad();
      const double cl = cpu.forward_backward(ids, targets);
      const double gl = gpu.forward_backward(ids.to(kGpu), targets.to(kGpu));
      const double pl = placed.forward_backward(ids.to(kGpu), targets.to(kGpu));
      CHECK(gl == Approx(cl).epsilon(1e-5));
      CHECK(pl == Approx(gl).epsilon(1e-6));
      CHECK(rel_err(gpu.parameters().grads().to_vector(), to_double(cpu.parameters().grads().to_vector())) <= 1e-4);
      cpu.step(cpu_opt);
      gpu.step(gpu_opt);
      placed.step(placed_opt);
    }
    const auto want = to_double(cpu.parameters().values().to_vector());
    CHECK(rel_err(gpu.parameters().values().to_vector(), want) <= 1e-4);
    CHECK(rel_err(placed.parameters().values().to_vector(), want) <= 1e-4);
  }
}

}  // namespace test_tensor_parallel_gpu
