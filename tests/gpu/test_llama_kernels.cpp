// The Llama-family CUDA kernels (rms_norm.cuh, rotary.cuh, swiglu.cuh) through
// ops::, against the same ops on the CPU in double from the same inputs.
//
// Compiled by g++ like a user's .cpp: the ops reach the kernels through the
// kernel table that ptrain::cuda's CUDA source fills. The kernels are gated
// (Note [The verification gate]): run with PTRAIN_UNVERIFIED_CUDA=1, as
// tools/gpu/run.sh does. Each TEST_CASE carries [cuda:<name>] for every gated
// name it covers. Inputs are random (seed printed on failure; PTRAIN_TEST_SEED
// repeats a run) and are values of the element type, so the double reference
// sees exactly what the kernel reads. Outputs the ops allocate come from blocks
// filled with NaN just before the call (poison_next: the allocator's exact-size
// cache hands the last freed block of a size to the next request of that size),
// so an element a kernel does not write fails the comparison. Error measure:
// rel_err (gpu_util.hpp), max |gpu - ref| / max |ref| over an output. Bounds:
// float 1e-5 (a few ulp per element plus float sums over a row or a column),
// double 1e-12, bf16 1e-2 (the result is rounded once to 8 significant bits,
// 2^-9 relative, after float arithmetic; residual_rms_norm rounds h to bf16
// before its norm, the reference does not, which stays within the same bound).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/ops/activation.hpp"
#include "ptrain/ops/norm.hpp"
#include "ptrain/ops/rotary.hpp"

namespace test_llama_kernels {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

/// Leaves `count` device blocks of n elements of T, all NaN, at the top of the allocator's
/// exact-size cache: the next `count` allocations of that size on the current stream get them.
template <class T>
void poison_next(std::int64_t n, int count = 1) {
  std::vector<Tensor<T>> blocks;
  for (int i = 0; i < count; ++i)
    blocks.push_back(Tensor<T>::from(std::vector<T>(static_cast<std::size_t>(n), nan_of<T>()), {n}).to(kGpu));
}

template <class T>
std::vector<double> ref_values(const Tensor<T>& t) {
  return to_double(t.to_vector());
}

// got against the reference want within tol<T>(); what names got in the report.
template <class T, class G, class W>
void check_near(const char* what, const Tensor<G>& got, const Tensor<W>& want) {
  INFO("seed " << test_seed());
  const double err = rel_err(got.to_vector(), ref_values(want));
  INFO(what << ": relative error " << err);
  CHECK(err <= tol<T>());
}

using Dims = std::vector<std::pair<std::int64_t, std::int64_t>>;
// Short rows (a warp), long ones (512 threads, several elements each), a width that is
// no multiple of 32, and 600 rows (three row chunks in the column sums of dw).
const Dims kNormDims{{33, 5}, {64, 768}, {7, 2001}, {600, 40}};

}  // namespace

TEMPLATE_TEST_CASE("cuda: rms_norm forward and backward", "[gpu][llama_kernels][cuda:rms_norm_forward][cuda:rms_norm_backward]",
                   float, double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  for (auto [rows, d] : kNormDims) {
    INFO("rows " << rows << " d " << d);
    const Shape shape{rows, d};
    const auto x = uniform<T>(rows * d, -2, 3), w = uniform<T>(d, 0.5, 1.5);
    const auto dy = uniform<T>(rows * d, -1, 1), dw0 = uniform<T>(d, -1, 1);
    const A eps = A(1e-5);

    Tensor<double> rstd_ref;
    const auto xr = ref(x, shape), wr = ref(w, {d});
    const auto y_ref = ops::rms_norm(xr, wr, 1e-5, rstd_ref);
    auto dw_ref = ref(dw0, {d});
    const auto dx_ref = ops::rms_norm_backward(xr, rstd_ref, wr, ref(dy, shape), dw_ref);

    const auto xg = gpu(x, shape), wg = gpu(w, {d}), dyg = gpu(dy, shape);
    auto dwg = gpu(dw0, {d});
    Tensor<A> rstd;
    poison_next<T>(rows * d);
    poison_next<A>(rows);
    const auto y = ops::rms_norm(xg, wg, eps, rstd);
    check_near<T>("y", y, y_ref);
    check_near<T>("rstd", rstd, rstd_ref);
    poison_next<T>(rows * d);
    const auto dx = ops::rms_norm_backward(xg, rstd, wg, dyg, dwg);
    check_near<T>("dx", dx, dx_ref);
    check_near<T>("dwg", dwg, dw_ref);
  }
}

TEMPLATE_TEST_CASE("cuda: residual_rms_norm (residual add fused with the norm), forward and backward",
                   "[gpu][llama_kernels][cuda:residual_rms_norm_forward][cuda:residual_rms_norm_backward]", float,
                   double, bf16) {
  using T = TestType;
  using A = acc_t<T>;
  for (auto [rows, d] : kNormDims) {
    INFO("rows " << rows << " d " << d);
    const Shape shape{rows, d};
    const auto x = uniform<T>(rows * d, -2, 2), res = uniform<T>(rows * d, -1, 2), w = uniform<T>(d, 0.5, 1.5);
    const auto dy = uniform<T>(rows * d, -1, 1), dres = uniform<T>(rows * d, -1, 1), dw0 = uniform<T>(d, -1, 1);
    const A eps = A(1e-5);

    Tensor<double> h_ref, rstd_ref;
    const auto wr = ref(w, {d});
    const auto y_ref = ops::residual_rms_norm(ref(x, shape), ref(res, shape), wr, 1e-5, h_ref, rstd_ref);
    auto dw_ref = ref(dw0, {d});
    const auto dh_ref =
        ops::residual_rms_norm_backward(h_ref, rstd_ref, wr, ref(dy, shape), ref(dres, shape), dw_ref);

    const auto xg = gpu(x, shape), rg = gpu(res, shape), wg = gpu(w, {d});
    const auto dyg = gpu(dy, shape), dresg = gpu(dres, shape);
    auto dwg = gpu(dw0, {d});
    Tensor<T> h;
    Tensor<A> rstd;
    poison_next<T>(rows * d, 2);  // h and y
    poison_next<A>(rows);
    const auto y = ops::residual_rms_norm(xg, rg, wg, eps, h, rstd);
    check_near<T>("h", h, h_ref);
    check_near<T>("y", y, y_ref);
    check_near<T>("rstd", rstd, rstd_ref);
    poison_next<T>(rows * d);
    const auto dh = ops::residual_rms_norm_backward(h, rstd, wg, dyg, dresg, dwg);
    check_near<T>("dh", dh, dh_ref);
    check_near<T>("dwg", dwg, dw_ref);
  }
}

TEMPLATE_TEST_CASE("cuda: rotary forward and backward, plain and Llama 3 scaled, positions [S] and [B, S]",
                   "[gpu][llama_kernels][cuda:rotary_apply]", float, double, bf16) {
  using T = TestType;
  const std::int64_t B = 2, S = 37, H = 3;
  struct Case {
    std::int64_t D;
    ops::RotaryConfig rope;
  };
  // Llama 3.1's scaling at D = 128 and theta 500000 puts frequencies in all three bands
  // (kept, divided by factor, blended); a small original context does so at D = 16 too.
  const std::vector<Case> cases{
      {8, {.theta = 10000.0}},
      {128, {.theta = 500000.0, .llama3_scaling = ops::Llama3RopeScaling{}}},
      {16, {.theta = 100.0, .llama3_scaling = ops::Llama3RopeScaling{4.0, 1.0, 4.0, 16}}},
      {256, {.theta = 10000.0}},
  };
  std::vector<std::int32_t> shared(static_cast<std::size_t>(S)), per_row(static_cast<std::size_t>(B * S));
  for (std::size_t i = 0; i < shared.size(); ++i) shared[i] = static_cast<std::int32_t>(5 + 3 * i);
  for (auto& p : per_row) p = static_cast<std::int32_t>(rng().uniform() * 9000);  // past the original context
  for (const Case& c : cases) {
    for (int layout = 0; layout < 3; ++layout) {  // none (0..S-1), [S], [B, S]
      INFO("D " << c.D << " llama3 " << c.rope.llama3_scaling.has_value() << " positions layout " << layout);
      const Shape shape{B, S, H, c.D};
      const auto x = uniform<T>(B * S * H * c.D, -1, 1), g = uniform<T>(B * S * H * c.D, -1, 1);
      Tensor<std::int32_t> pos_cpu;
      if (layout == 1) pos_cpu = Tensor<std::int32_t>::from(shared, {S});
      if (layout == 2) pos_cpu = Tensor<std::int32_t>::from(per_row, {B, S});
      const Tensor<std::int32_t> pos_gpu = layout ? pos_cpu.to(kGpu) : Tensor<std::int32_t>();

      auto y_ref = ref(x, shape), dx_ref = ref(g, shape);
      ops::rotary_(y_ref, c.rope, pos_cpu);
      ops::rotary_backward_(dx_ref, c.rope, pos_cpu);
      auto y = gpu(x, shape), dx = gpu(g, shape);
      ops::rotary_(y, c.rope, pos_gpu);
      ops::rotary_backward_(dx, c.rope, pos_gpu);
      check_near<T>("y", y, y_ref);
      check_near<T>("dx", dx, dx_ref);
    }
  }
}

TEMPLATE_TEST_CASE("cuda: swiglu forward and backward", "[gpu][llama_kernels][cuda:swiglu_forward][cuda:swiglu_backward]",
                   float, double, bf16) {
  using T = TestType;
  for (std::int64_t n : {1, 1000, 3 * 4096 + 7}) {
    INFO("n " << n);
    const Shape shape{n};
    // gate over [-8, 8]: silu's saturated tails and its minimum near -1.28.
    const auto gate = uniform<T>(n, -8, 8), up = uniform<T>(n, -2, 2), dh = uniform<T>(n, -1, 1);
    const auto h_ref = ops::swiglu(ref(gate, shape), ref(up, shape));
    Tensor<double> dgate_ref, dup_ref;
    ops::swiglu_backward(ref(gate, shape), ref(up, shape), ref(dh, shape), dgate_ref, dup_ref);

    const auto gg = gpu(gate, shape), ug = gpu(up, shape), dhg = gpu(dh, shape);
    poison_next<T>(n);
    const auto h = ops::swiglu(gg, ug);
    check_near<T>("h", h, h_ref);
    Tensor<T> dgate, dup;
    poison_next<T>(n, 2);
    ops::swiglu_backward(gg, ug, dhg, dgate, dup);
    check_near<T>("dgate", dgate, dgate_ref);
    check_near<T>("dup", dup, dup_ref);
  }
}

}  // namespace test_llama_kernels
