// The mixture-of-experts CUDA kernels (kernels/cuda/moe.cuh) through ops::, against
// the same ops on the CPU in double from the same inputs, and nn::MoE on cuda:0
// against the same layer on the CPU. Compiled by g++ like a user's .cpp; the
// kernels are gated (Note [The verification gate]): run with
// PTRAIN_UNVERIFIED_CUDA=1, as tools/gpu/run.sh does. Inputs are values of the
// element type, so the reference sees exactly what the kernel reads; the routing
// (which experts, the permutation) compares exactly, since both devices compare
// the same logits. Bounds: tol<T>() (gpu_util.hpp) for the kernels; the layer in
// float within 1e-4 (sums in another order through three GEMMs). With the gate open
// the layer's expert GEMMs are grouped_gemm's (ops::grouped_matmul_into).
#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/nn/moe.hpp"

namespace test_moe_gpu {

using namespace ptrain;
using namespace ptrain::testing;
using kernels::MoeScore;

namespace {

// got against the reference want within tol<T>(); what names got in the report.
template <class T, class G, class W>
void check_near(const char* what, const Tensor<G>& got, const Tensor<W>& want) {
  INFO("seed " << test_seed());
  const double err = rel_err(got.to_vector(), want.to_vector());
  INFO(what << ": relative error " << err);
  CHECK(err <= tol<T>());
}

std::vector<std::int32_t> random_experts(std::int64_t n, std::int64_t k, std::int64_t E) {
  std::vector<std::int32_t> v(static_cast<std::size_t>(n * k));
  for (auto& e : v) e = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(E)));
  return v;
}

}  // namespace

TEMPLATE_TEST_CASE("cuda: moe route and its backward", "[gpu][moe_gpu][cuda:moe_route][cuda:moe_route_backward]",
                   float, double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  for (auto [n, E, k] : std::vector<std::array<std::int64_t, 3>>{{1, 4, 1}, {1000, 8, 2}, {333, 64, 6}}) {
    for (auto kind : {MoeScore::Softmax, MoeScore::Sigmoid})
      for (bool renorm : {true, false}) {
        INFO("n " << n << " E " << E << " k " << k << " sigmoid " << (kind == MoeScore::Sigmoid) << " renorm "
                  << renorm);
        const auto logits = uniform<T>(n * E, -3, 3), dw = uniform<T>(n * k, -1, 1);
        const auto aux = uniform<A>(E, 0, 0.1);
        const auto r_ref = ops::moe_route(ref(logits, {n, E}), k, kind, renorm, 1.5);
        const auto r = ops::moe_route(gpu(logits, {n, E}), k, kind, renorm, 1.5);
        CHECK(r.experts.to_vector() == r_ref.experts.to_vector());
        check_near<T>("r.weights", r.weights, r_ref.weights);
        check_near<T>("r.probs", r.probs, r_ref.probs);
        check_near<T>("r.lse", r.lse, r_ref.lse);
        const auto d_ref = ops::moe_route_backward(ref(logits, {n, E}), r_ref, ref(dw, {n, k}), kind, renorm, 1.5,
                                                   ref(aux, {E}), 0.01);
        const auto d = ops::moe_route_backward(gpu(logits, {n, E}), r, gpu(dw, {n, k}), kind, renorm, 1.5,
                                               gpu(aux, {E}), 0.01);
        check_near<T>("d", d, d_ref);
      }
  }
}

TEST_CASE("cuda: moe permutation plan", "[gpu][moe_gpu][cuda:moe_permute_plan]") {
  for (auto [n, k, E] : std::vector<std::array<std::int64_t, 3>>{{1, 1, 1}, {7, 2, 3}, {4096, 2, 8}, {50000, 6, 160}})
    for (std::int64_t capacity : {std::int64_t(0), std::int64_t(1), n * k / E + 1}) {
      INFO("n " << n << " k " << k << " E " << E << " capacity " << capacity);
      const auto experts = random_experts(n, k, E);
      const auto want = ops::moe_permute_plan(Tensor<std::int32_t>::from(experts, {n, k}), E, capacity);
      const auto got = ops::moe_permute_plan(gpu(experts, {n, k}), E, capacity);
      CHECK(got.routed == want.routed);
      CHECK(got.offsets == want.offsets);
      CHECK(got.pos.to_vector() == want.pos.to_vector());
      CHECK(got.token_of.to_vector() == want.token_of.to_vector());
    }
  auto bad = random_experts(5, 2, 4);
  bad[3] = 9;
  CHECK_THROWS_WITH(ops::moe_permute_plan(gpu(bad, {5, 2}), 4, 0), Catch::Matchers::Contains("[ptrain.moe.experts]"));
}

TEMPLATE_TEST_CASE("cuda: moe gather, combine and their backwards",
                   "[gpu][moe_gpu][cuda:moe_gather][cuda:moe_gather_backward][cuda:moe_combine]"
                   "[cuda:moe_combine_backward][cuda:moe_permute_plan]",
                   float, double, bf16) {
  using T = TestType;
  for (auto [n, k, E, c] : std::vector<std::array<std::int64_t, 4>>{{5, 1, 2, 3}, {600, 2, 8, 100}, {257, 4, 16, 37}})
    for (std::int64_t capacity : {std::int64_t(0), n * k / E}) {
      INFO("n " << n << " k " << k << " E " << E << " c " << c << " capacity " << capacity);
      const auto experts = random_experts(n, k, E);
      const auto plan_ref = ops::moe_permute_plan(Tensor<std::int32_t>::from(experts, {n, k}), E, capacity);
      const auto plan = ops::moe_permute_plan(gpu(experts, {n, k}), E, capacity);
      const std::int64_t m = plan.rows();
      const auto x = uniform<T>(n * c, -2, 2), w = uniform<T>(n * k, 0, 1), dy = uniform<T>(n * c, -1, 1);
      const auto yp = uniform<T>(m * c, -2, 2), dxp = uniform<T>(m * c, -1, 1);
      check_near<T>("moe_gather", ops::moe_gather(gpu(x, {n, c}), plan), ops::moe_gather(ref(x, {n, c}), plan_ref));
      check_near<T>("moe_gather_backward", ops::moe_gather_backward(gpu(dxp, {m, c}), plan),
                    ops::moe_gather_backward(ref(dxp, {m, c}), plan_ref));
      check_near<T>("moe_combine", ops::moe_combine(gpu(yp, {m, c}), plan.pos, gpu(w, {n, k})),
                    ops::moe_combine(ref(yp, {m, c}), plan_ref.pos, ref(w, {n, k})));
      Tensor<T> dyp, dw;
      Tensor<double> dyp_ref, dw_ref;
      ops::moe_combine_backward(gpu(yp, {m, c}), plan.pos, gpu(w, {n, k}), gpu(dy, {n, c}), dyp, dw);
      ops::moe_combine_backward(ref(yp, {m, c}), plan_ref.pos, ref(w, {n, k}), ref(dy, {n, c}), dyp_ref, dw_ref);
      check_near<T>("dyp", dyp, dyp_ref);
      check_near<T>("dw", dw, dw_ref);
      // Without a plan: row t scaled by w[t] (k = 1), as the gated shared expert uses it.
      const auto w1 = uniform<T>(n, 0, 1);
      check_near<T>("moe_combine without a plan", ops::moe_combine(gpu(x, {n, c}), Tensor<std::int32_t>(), gpu(w1, {n, 1})),
                    ops::moe_combine(ref(x, {n, c}), Tensor<std::int32_t>(), ref(w1, {n, 1})));
    }
}

TEMPLATE_TEST_CASE("cuda: the experts' grouped GEMM, segments of 0, 1 and many rows",
                   "[gpu][moe_gpu][cuda:grouped_gemm]", float, double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  // While gated the op runs one verified gemm per expert instead: this test needs the gate open.
  REQUIRE(kernels::cuda_kernel_enabled("grouped_gemm"));
  std::vector<std::int64_t> offsets{0};
  for (std::int64_t rows : {0, 1, 37, 0, 300, 5}) offsets.push_back(offsets.back() + rows);
  const std::int64_t E = 6, M = offsets.back();
  // Widths 37 and 29: most segments start off a 16-byte boundary (bf16 takes gemm() for them).
  for (auto [K, N] : std::vector<std::array<std::int64_t, 2>>{{64, 96}, {37, 29}}) {
    INFO("K " << K << " N " << N);
    const auto x = uniform<T>(M * K, -1, 1), dy = uniform<T>(M * N, -1, 1), y0 = uniform<T>(M * N, -1, 1);
    for (bool trans_w : {true, false}) {
      const Shape ws = trans_w ? Shape{N, K} : Shape{K, N};
      std::vector<Tensor<T>> w;
      std::vector<Tensor<double>> w_ref;
      for (std::int64_t e = 0; e < E; ++e) {
        const auto v = uniform<T>(N * K, -1, 1);
        w.push_back(gpu(v, ws));
        w_ref.push_back(ref(v, ws));
      }
      for (double beta : {0.0, 1.0}) {
        INFO("trans_w " << trans_w << " beta " << beta);
        auto y = gpu(y0, {M, N});
        auto y_ref = ref(y0, {M, N});
        ops::grouped_matmul_into(gpu(x, {M, K}), w, offsets, y, trans_w, A(0.5), A(beta));
        ops::grouped_matmul_into(ref(x, {M, K}), w_ref, offsets, y_ref, trans_w, 0.5, beta);
        check_near<T>("y", y, y_ref);
      }
    }
    // Weight gradients, accumulated (beta 1): expert 2 frozen (undefined); experts 0 and 3
    // have no rows and keep their bits.
    std::vector<Tensor<T>> dw;
    std::vector<Tensor<double>> dw_ref;
    std::vector<std::vector<T>> dw0;
    for (std::int64_t e = 0; e < E; ++e) {
      dw0.push_back(uniform<T>(N * K, -1, 1));
      dw.push_back(e == 2 ? Tensor<T>() : gpu(dw0.back(), {N, K}));
      dw_ref.push_back(e == 2 ? Tensor<double>() : ref(dw0.back(), {N, K}));
    }
    ops::grouped_matmul_weight_grad(gpu(dy, {M, N}), gpu(x, {M, K}), offsets, dw);
    ops::grouped_matmul_weight_grad(ref(dy, {M, N}), ref(x, {M, K}), offsets, dw_ref);
    for (std::size_t e : {1, 4, 5}) {
      INFO("expert " << e);
      check_near<T>("dw", dw[e], dw_ref[e]);
    }
    for (std::size_t e : {0, 3}) CHECK(to_double(dw[e].to_vector()) == to_double(dw0[e]));
  }
}

TEST_CASE("cuda: an MoE layer on the GPU equals the CPU's",
          "[gpu][moe_gpu][cuda:moe_route][cuda:moe_route_backward][cuda:moe_permute_plan][cuda:moe_gather]"
          "[cuda:moe_gather_backward][cuda:moe_combine][cuda:moe_combine_backward][cuda:grouped_gemm]") {
  for (double capacity : {0.0, 0.8}) {
    INFO("capacity factor " << capacity);
    nn::MoeConfig c;
    c.n_embd = 64;
    c.num_experts = 8;
    c.top_k = 2;
    c.expert_hidden = 96;
    c.capacity_factor = capacity;
    c.aux_loss_coef = 0.01;
    c.z_loss_coef = 0.001;
    c.shared_hidden = 48;
    c.shared_gate = true;
    Generator g1(5), g2(5);
    nn::MoE<float> cpu(c, g1), dev(c, g2);
    dev.to(kGpu);
    const auto x = uniform<float>(4 * 50 * 64, -1, 1), dy = uniform<float>(4 * 50 * 64, -1, 1);
    nn::Cache<float> cc, gc;
    const auto y_ref = cpu.forward(Tensor<float>::from(x, {4, 50, 64}), cc);
    const auto y = dev.forward(gpu(x, {4, 50, 64}), gc);
    CHECK(dev.stats().tokens_per_expert == cpu.stats().tokens_per_expert);
    CHECK(dev.stats().dropped == cpu.stats().dropped);
    CHECK(dev.stats().loss == Approx(cpu.stats().loss).epsilon(1e-5));
    CHECK(rel_err(y.to_vector(), to_double(y_ref.to_vector())) <= 1e-4);
    const auto dx_ref = cpu.backward(Tensor<float>::from(dy, {4, 50, 64}), cc);
    const auto dx = dev.backward(gpu(dy, {4, 50, 64}), gc);
    CHECK(rel_err(dx.to_vector(), to_double(dx_ref.to_vector())) <= 1e-4);
    check_same_gradients(cpu, dev, 1e-4);
  }
}

}  // namespace test_moe_gpu
