// The fused classifier (fused_classifier.cuh) and AdamW in one launch
// (adamw_ranges.cuh) through ops:: and optim::, against the CPU kernels in
// double from the same inputs.
//
// Compiled by g++ like a user's .cpp; the kernels are gated (Note [The
// verification gate]) and each TEST_CASE first requires that the gate lets
// them run (PTRAIN_UNVERIFIED_CUDA=1, as tools/gpu/run.sh sets for its test
// phase): otherwise the ops would take the verified kernels and the test would
// not see the new ones. Tags: [cuda:<name>] per gated name, and [fused].
// Inputs are random (seed printed on failure; PTRAIN_TEST_SEED repeats a run)
// and are values of the element type, so the double reference reads what the
// kernel reads. Error measure: rel_err (gpu_util.hpp), max |gpu - ref| / max
// |ref| over an output. Bounds: float 1e-5 (a few ulp per element, float sums
// over a row of up to 50257 exponentials), double 1e-12, and for bf16 outputs
// 1e-2 (the gradient and the bf16 parameter copy are rounded once to 8
// significant bits, 2^-9 relative, after float arithmetic). Scalars computed in
// float from bf16 inputs (the loss, the fp32 master weights and moments) keep
// the float bound.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda_table.hpp"
#include "ptrain/kernels/stochastic_round.hpp"
#include "ptrain/ops/loss.hpp"
#include "ptrain/ops/optimizer.hpp"
#include "ptrain/optim/adamw.hpp"

namespace test_fused_kernels {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

/// The bound for values computed in acc_t<T> (float for bf16).
template <class T>
constexpr double acc_tol() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}

/// The gated kernel must be the one that runs, not the verified path beside it.
template <class T, class Fn>
void require_enabled(Fn kernels::CudaKernels<T>::*fn, const char* name) {
  INFO(name << " is gated: run with PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh does)");
  REQUIRE(kernels::cuda_kernel_usable(fn, name));
}

double rel(double got, double want) { return std::abs(got - want) / std::max(std::abs(want), 1e-300); }

}  // namespace

TEMPLATE_TEST_CASE("cuda: fused classifier, loss on the device and dlogits in place",
                   "[gpu][fused][cuda:fused_classifier]", float, double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  require_enabled(&kernels::CudaKernels<T>::fused_classifier, "fused_classifier");
  // A warp per row, GPT-2's vocabulary, a width that is no multiple of 32, more rows than a grid.
  const std::vector<std::pair<std::int64_t, std::int64_t>> dims{{7, 5}, {33, 50257}, {100, 1000}, {70000, 3}};
  for (auto [rows, cols] : dims) {
    for (double eps : {0.0, 0.1}) {
      INFO("rows " << rows << " cols " << cols << " label smoothing " << eps);
      const Shape shape{rows, cols};
      const auto x = uniform<T>(rows * cols, -8, 8);
      std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
      for (std::size_t r = 0; r < t.size(); ++r)
        t[r] = r % 5 == 3 ? -100 : static_cast<std::int32_t>(rng().uniform() * static_cast<double>(cols));
      const auto tc = Tensor<std::int32_t>::from(t, {rows});
      const double dloss = 0.5, weight = 0.25;

      auto d_ref = ref(x, shape);
      ops::DeviceLoss loss_ref;
      ops::fused_classifier_(d_ref, tc, loss_ref, dloss, -100, eps, weight);

      auto d = gpu(x, shape);
      const auto tg = tc.to(kGpu);
      ops::DeviceLoss loss;
      ops::fused_classifier_(d, tg, loss, static_cast<A>(dloss), -100, eps, weight);
      INFO("seed " << test_seed());
      CHECK(loss.device() == kGpu);
      const double err = rel_err(d.to_vector(), d_ref.to_vector());
      INFO("dlogits: relative error " << err);
      CHECK(err <= tol<T>());
      INFO("loss " << loss.sum() << " reference " << loss_ref.sum());
      CHECK(rel(loss.sum(), loss_ref.sum()) <= acc_tol<T>());
      CHECK(loss.weight() == weight);

      // A second batch accumulates; the same inputs give the same bits (fixed summation order).
      const double first = loss.sum();
      auto d2 = gpu(x, shape);
      ops::fused_classifier_(d2, tg, loss, static_cast<A>(dloss), -100, eps, weight);
      CHECK(loss.sum() == 2 * first);
      CHECK(loss.mean() == first / weight);
      loss.reset();
      CHECK(loss.sum() == 0.0);
    }
  }
}

TEST_CASE("cuda: fused classifier reports targets out of range when the loss is read",
          "[gpu][fused][cuda:fused_classifier]") {
  require_enabled(&kernels::CudaKernels<float>::fused_classifier, "fused_classifier");
  const std::int64_t rows = 3, cols = 10;
  auto d = gpu(uniform<float>(rows * cols, -1, 1), {rows, cols});
  const auto t = Tensor<std::int32_t>::from({1, 12, 4}, {rows}).to(kGpu);
  ops::DeviceLoss loss;
  ops::fused_classifier_(d, t, loss);  // queued: nothing is read yet
  CHECK_THROWS_WITH(loss.sum(), Catch::Contains("[ptrain.cross_entropy]") && Catch::Contains("1 target(s)"));
  const auto g = d.to_vector();
  for (std::int64_t c = 0; c < cols; ++c) CHECK(g[cols + c] == 0.0f);  // the row got no gradient
}

TEMPLATE_TEST_CASE("cuda: adamw_update_ranges in one launch with device clipping",
                   "[gpu][fused][cuda:adamw_update_ranges][cuda:sum_squares_to]", float, double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  require_enabled(&kernels::CudaKernels<T>::adamw_update_ranges, "adamw_update_ranges");
  require_enabled(&kernels::CudaKernels<T>::sum_squares_to, "sum_squares_to");
  const std::int64_t n = 1000003;  // no multiple of the block; ranges of 1, many and one block's elements
  const std::vector<std::int64_t> ends{1, 1000, 500000, 500256, n};
  const std::vector<std::uint8_t> flags{1, 0, 1, 0, 1};
  const auto p0 = uniform<A>(n, -1, 1), m0 = uniform<A>(n, -0.1, 0.1), v0 = uniform<A>(n, 0.001, 0.01);
  const auto g = uniform<T>(n, -2, 2);
  const Shape s{n};
  for (double max_norm : {0.0, 1e30, 50.0}) {
    for (bool stochastic : {false, true}) {
      if (stochastic && !std::is_same_v<T, bf16>) continue;
      INFO("max_norm " << max_norm << " stochastic " << stochastic << " seed " << test_seed());
      kernels::AdamWStep st;
      st.lr = 0.01;
      st.weight_decay = 0.1;
      st.step = 7;
      st.stochastic_rounding = stochastic;
      st.seed = 1234;
      st.max_norm = max_norm;

      // Reference: the CPU kernel in double.
      auto pr = ref(p0, s), mr = ref(m0, s), vr = ref(v0, s);
      const auto gr = ref(g, s);
      const auto ends_c = Tensor<std::int64_t>::from(ends, {5});
      const auto flags_c = Tensor<std::uint8_t>::from(flags, {5});
      auto sq_r = Tensor<double>::zeros({1});
      kernels::AdamWStep st_r = st;
      if (max_norm > 0) {
        ops::sum_squares_into(gr, sq_r);
        st_r.grad_sumsq = sq_r.data();
      }
      ops::adamw_update_ranges_<double>(pr, gr, mr, vr, nullptr, ends_c, flags_c, st_r);

      auto p = gpu(p0, s), m = gpu(m0, s), v = gpu(v0, s);
      const auto gg = gpu(g, s);
      auto sq = Tensor<double>::zeros({1}, kGpu);
      Tensor<bf16> param;
      if constexpr (std::is_same_v<T, bf16>) param = Tensor<bf16>::zeros(s, kGpu);
      kernels::AdamWStep st_g = st;
      if (max_norm > 0) {
        ops::sum_squares_into(gg, sq);
        st_g.grad_sumsq = sq.data();
      }
      ops::adamw_update_ranges_<T>(p, gg, m, v, param.defined() ? &param : nullptr, ends_c.to(kGpu),
                                   flags_c.to(kGpu), st_g);
      if (max_norm > 0) CHECK(rel(sq.to_vector()[0], sq_r.data()[0]) <= acc_tol<T>());
      CHECK(rel_err(p.to_vector(), pr.to_vector()) <= acc_tol<T>());
      CHECK(rel_err(m.to_vector(), mr.to_vector()) <= acc_tol<T>());
      CHECK(rel_err(v.to_vector(), vr.to_vector()) <= acc_tol<T>());
      if constexpr (std::is_same_v<T, bf16>) {
        const auto master = p.to_vector();
        const auto pb = param.to_vector();
        CHECK(rel_err(pb, pr.to_vector()) <= tol<T>());
        // The rounding of the GPU's own master values: the same bits as the host's.
        std::size_t mismatched = 0;
        for (std::size_t i = 0; i < master.size(); ++i) {
          const bf16 want = stochastic ? kernels::bf16_round_stochastic(master[i], st.seed, 7, i) : bf16(master[i]);
          mismatched += pb[i].bits != want.bits;
        }
        CHECK(mismatched == 0);
      }
    }
  }
}

TEST_CASE("cuda: optim::AdamW steps in one launch with device clipping", "[gpu][fused][cuda:adamw_update_ranges]"
          "[cuda:sum_squares_to]") {
  require_enabled(&kernels::CudaKernels<float>::adamw_update_ranges, "adamw_update_ranges");
  require_enabled(&kernels::CudaKernels<float>::sum_squares_to, "sum_squares_to");
  const std::int64_t nw = 4096, nb = 64, n = nw + nb;
  const auto p0 = uniform<float>(n, -1, 1);
  auto run = [&](auto values, auto grads, Device d) {
    using V = typename decltype(values)::value_type;
    using E = nn::FlatEntry<V>;
    auto pv = Tensor<V>::from(values, {n}).to(d), gv = Tensor<V>::from(grads, {n}).to(d);
    optim::AdamW<V> opt(pv, gv, std::vector<E>{{"w", 0, Shape{nw}, nullptr}, {"bias", nw, Shape{nb}, nullptr}},
                        {.lr = 0.01, .weight_decay = 0.1, .max_grad_norm = 1.0},
                        [](const std::string& name) { return name != "bias"; });
    for (int s = 0; s < 3; ++s) opt.step();
    return pv.to_vector();
  };
  const auto gf = uniform<float>(n, -1, 1);
  const auto got = run(p0, gf, kGpu);
  const auto want = run(to_double(p0), to_double(gf), Device::cpu());
  INFO("seed " << test_seed());
  CHECK(rel_err(got, want) <= 1e-5);
}

}  // namespace test_fused_kernels
