// The row kernels that read a row once (layer_norm.cuh, softmax.cuh): LayerNorm
// forward and backward, the residual add fused with LayerNorm, softmax with an
// online max and sum for wide rows, and softmax's backward, against the CPU
// kernels in double from the same inputs.
//
// Compiled by g++ like a user's .cpp. The kernels are gated (Note [The
// verification gate]): each TEST_CASE takes its kernel from the table through
// kernels::cuda_kernel, which throws [ptrain.cuda.unverified] unless
// PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh sets it for its test phase), so a
// test never passes on the verified kernel beside it. Tags: [cuda:<name>] per
// gated name, and [rows].
//
// Widths: 1, odd ones, GPT-2's 768, the largest that stays in registers (8192),
// one past it (8193, the fallback) and GPT-2's padded vocabulary (50304); row
// counts above 512 so that a backward block owns several rows. Inputs are values
// of the element type, so the double reference reads what the kernel reads.
//
// Error measure: rel_err (gpu_util.hpp), max |gpu - ref| / max |ref| over an
// output. Bounds, from the arithmetic:
//  - outputs in T (y, dx, dh, softmax): tol<T>(): float 1e-5 (each element a few
//    ulp after float sums of at most 50304 terms, 16 per thread and a tree over
//    512 threads: (16 + 9) 2^-24 = 1.5e-6 relative on a sum, or 2^-24 per
//    element and about 100 terms per thread in the online softmax: 6e-6), double
//    1e-12, bf16 1e-2 (rounded once to 8 significant bits, 2^-9, after float
//    arithmetic);
//  - mean and rstd (acc_t<T>): 1e-5 for float and bf16 (float sums as above),
//    1e-12 for double;
//  - dgamma and dbeta: float 1e-4, a sum over up to 1030 rows, each block's rows
//    then 512 partials in order: first-order error (n_block + 512) 2^-24 times
//    sum |term|, where sum |term| / |sum| ~ sqrt(rows) for random signs, about
//    1e-3 in the worst case and 1e-6 typically (errors of random sign); the
//    bound sits between. bf16: 1e-2 (rounded once); double 1e-12.
// The residual forms' h = x + residual is compared bit for bit with the CPU
// kernel's (one float add of two values of T, rounded once, on both sides).

#include <catch2/catch.hpp>

#include <cstring>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"
#include "ptrain/kernels/cpu/layer_norm.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"
#include "ptrain/kernels/cuda_table.hpp"

namespace test_row_kernels {

using namespace ptrain;
using namespace ptrain::testing;
namespace cpu = ptrain::kernels::cpu;

namespace {

template <class T>
constexpr double acc_tol() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}
template <class T>
constexpr double param_grad_tol() {
  return std::is_same_v<T, bf16> ? 1e-2 : std::is_same_v<T, float> ? 1e-4 : 1e-12;
}

/// The gated kernel `fn` for T from the table (throws [ptrain.cuda.unverified] while gated).
template <class T, class Fn>
Fn gated(Fn kernels::CudaKernels<T>::*fn, const char* name) {
  INFO(name << " is gated: run with PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh does)");
  return kernels::cuda_kernel<T>(fn, name);
}

template <class T>
Tensor<T> gpu(const std::vector<T>& v) {
  return Tensor<T>::from(v, {static_cast<std::int64_t>(v.size())}).to(kGpu);
}
/// An output on the GPU that starts as NaN, so an element the kernel forgets fails.
template <class T>
Tensor<T> gpu_nan(std::int64_t n) {
  return gpu(std::vector<T>(static_cast<std::size_t>(n), nan_of<T>()));
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// rows, width
const std::vector<std::pair<std::int64_t, std::int64_t>> kLayerNormDims{
    {5, 1}, {9, 7}, {1030, 33}, {600, 768}, {37, 1000}, {13, 4097}, {6, 8192}, {4, 8193}, {3, 50304}};
const std::vector<std::pair<std::int64_t, std::int64_t>> kSoftmaxDims{
    {5, 1}, {9, 7}, {300, 1024}, {37, 1000}, {13, 4097}, {6, 8192}, {4, 8193}, {3, 50304}};

/// LayerNorm forward, plain (residual empty) or residual, against the CPU in double.
template <class T>
void check_forward(bool residual_form) {
  using A = acc_t<T>;
  auto fwd = gated(&kernels::CudaKernels<T>::layer_norm_forward_one_read, "layer_norm_forward_one_read");
  auto rfwd = residual_form ? gated(&kernels::CudaKernels<T>::residual_layer_norm_forward, "residual_layer_norm_forward")
                            : nullptr;
  const A eps = A(1e-5);
  for (auto [rows, d] : kLayerNormDims) {
    INFO("rows " << rows << " width " << d << " seed " << test_seed());
    const std::int64_t n = rows * d;
    // An offset mean (|mean| > std) where a one-pass variance would lose digits.
    const auto x = uniform<T>(n, 1, 5), res = uniform<T>(n, -2, 2);
    const auto gamma = uniform<T>(d, 0.5, 1.5), beta = uniform<T>(d, -0.5, 0.5);
    // The normalised input: x, or h = x + residual as the CPU kernel rounds it.
    std::vector<T> h_cpu = x;
    if (residual_form) {
      std::vector<T> y_cpu(static_cast<std::size_t>(n));
      std::vector<A> m_cpu(static_cast<std::size_t>(rows)), s_cpu(static_cast<std::size_t>(rows));
      cpu::residual_layer_norm_forward(rows, d, x.data(), res.data(), gamma.data(), beta.data(), eps, h_cpu.data(),
                                       y_cpu.data(), m_cpu.data(), s_cpu.data());
    }
    std::vector<double> y_ref(static_cast<std::size_t>(n)), m_ref(static_cast<std::size_t>(rows)),
        s_ref(static_cast<std::size_t>(rows));
    const auto hd = to_double(h_cpu), gd = to_double(gamma), bd = to_double(beta);
    cpu::layer_norm_forward<double>(rows, d, hd.data(), gd.data(), bd.data(), 1e-5, y_ref.data(), m_ref.data(),
                                    s_ref.data());

    const auto xg = gpu(x), rg = gpu(res), gg = gpu(gamma), bg = gpu(beta);
    auto y = gpu_nan<T>(n), h = gpu_nan<T>(n);
    auto mean = gpu_nan<A>(rows), rstd = gpu_nan<A>(rows);
    if (residual_form)
      rfwd(rows, d, xg.data(), rg.data(), gg.data(), bg.data(), eps, h.data(), y.data(), mean.data(), rstd.data());
    else
      fwd(rows, d, xg.data(), gg.data(), bg.data(), eps, y.data(), mean.data(), rstd.data());
    if (residual_form) CHECK(same_bits(h.to_vector(), h_cpu));
    const double ey = rel_err(y.to_vector(), y_ref), em = rel_err(mean.to_vector(), m_ref),
                 es = rel_err(rstd.to_vector(), s_ref);
    INFO("y " << ey << " mean " << em << " rstd " << es);
    CHECK(ey <= tol<T>());
    CHECK(em <= acc_tol<T>());
    CHECK(es <= acc_tol<T>());
  }
}

/// LayerNorm backward, plain or residual (dh = dx + dresidual), against the CPU in double;
/// dgamma and dbeta accumulate onto random values and come out the same bits twice.
template <class T>
void check_backward(bool residual_form) {
  using A = acc_t<T>;
  auto bwd = gated(&kernels::CudaKernels<T>::layer_norm_backward_one_read, "layer_norm_backward_one_read");
  auto rbwd = residual_form
                  ? gated(&kernels::CudaKernels<T>::residual_layer_norm_backward, "residual_layer_norm_backward")
                  : nullptr;
  for (auto [rows, d] : kLayerNormDims) {
    INFO("rows " << rows << " width " << d << " seed " << test_seed());
    const std::int64_t n = rows * d;
    const auto x = uniform<T>(n, 1, 5), dy = uniform<T>(n, -1, 1), dres = uniform<T>(n, -1, 1);
    const auto gamma = uniform<T>(d, 0.5, 1.5), dg0 = uniform<T>(d, -1, 1), db0 = uniform<T>(d, -1, 1);
    // The statistics in double, rounded to acc_t<T> for the kernel; the reference uses the rounded ones.
    std::vector<double> y(static_cast<std::size_t>(n)), m(static_cast<std::size_t>(rows)),
        s(static_cast<std::size_t>(rows));
    const auto xd = to_double(x), gd = to_double(gamma), zeros = std::vector<double>(static_cast<std::size_t>(d), 0.0);
    cpu::layer_norm_forward<double>(rows, d, xd.data(), gd.data(), zeros.data(), 1e-5, y.data(), m.data(), s.data());
    std::vector<A> ma(m.begin(), m.end()), sa(s.begin(), s.end());
    const auto md = to_double(ma), sd = to_double(sa), dyd = to_double(dy), dresd = to_double(dres);
    std::vector<double> dx_ref(static_cast<std::size_t>(n)), dg_ref = to_double(dg0), db_ref = to_double(db0);
    cpu::layer_norm_backward<double>(rows, d, xd.data(), md.data(), sd.data(), gd.data(), dyd.data(), dx_ref.data(),
                                     dg_ref.data(), db_ref.data());
    if (residual_form)
      for (std::size_t i = 0; i < dx_ref.size(); ++i) dx_ref[i] += dresd[i];

    const auto xg = gpu(x), dyg = gpu(dy), dresg = gpu(dres), gg = gpu(gamma), mg = gpu(ma), sg = gpu(sa);
    std::vector<T> first_dg, first_db;
    for (int run = 0; run < 2; ++run) {
      auto dx = gpu_nan<T>(n), dg = gpu(dg0), db = gpu(db0);
      if (residual_form)
        rbwd(rows, d, xg.data(), mg.data(), sg.data(), gg.data(), dyg.data(), dresg.data(), dx.data(), dg.data(),
             db.data());
      else
        bwd(rows, d, xg.data(), mg.data(), sg.data(), gg.data(), dyg.data(), dx.data(), dg.data(), db.data());
      const double edx = rel_err(dx.to_vector(), dx_ref), edg = rel_err(dg.to_vector(), dg_ref),
                   edb = rel_err(db.to_vector(), db_ref);
      INFO("run " << run << " dx " << edx << " dgamma " << edg << " dbeta " << edb);
      CHECK(edx <= tol<T>());
      CHECK(edg <= param_grad_tol<T>());
      CHECK(edb <= param_grad_tol<T>());
      if (run == 0) {
        first_dg = dg.to_vector();
        first_db = db.to_vector();
      } else {  // no atomics: the same bits on every run
        CHECK(same_bits(dg.to_vector(), first_dg));
        CHECK(same_bits(db.to_vector(), first_db));
      }
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("cuda: layer_norm_forward_one_read against the CPU", "[gpu][rows][cuda:layer_norm_forward_one_read]",
                   float, double, bf16) {
  check_forward<TestType>(false);
}

TEMPLATE_TEST_CASE("cuda: residual_layer_norm_forward writes h = x + residual and layer_norm(h)",
                   "[gpu][rows][cuda:residual_layer_norm_forward]", float, double, bf16) {
  check_forward<TestType>(true);
}

TEMPLATE_TEST_CASE("cuda: layer_norm_backward_one_read against the CPU, deterministic dgamma and dbeta",
                   "[gpu][rows][cuda:layer_norm_backward_one_read]", float, double, bf16) {
  check_backward<TestType>(false);
}

TEMPLATE_TEST_CASE("cuda: residual_layer_norm_backward adds the residual stream's gradient",
                   "[gpu][rows][cuda:residual_layer_norm_backward]", float, double, bf16) {
  check_backward<TestType>(true);
}

TEMPLATE_TEST_CASE("cuda: softmax_rows_one_read, in registers and with the online max for wide rows",
                   "[gpu][rows][cuda:softmax_rows_one_read]", float, double, bf16) {
  using T = TestType;
  auto fn = gated(&kernels::CudaKernels<T>::softmax_rows_one_read, "softmax_rows_one_read");
  for (auto [rows, cols] : kSoftmaxDims) {
    INFO("rows " << rows << " cols " << cols << " seed " << test_seed());
    const std::int64_t n = rows * cols;
    // Wide range: a thread's running max grows several times along a wide row.
    auto x = uniform<T>(n, -8, 8);
    x[static_cast<std::size_t>(n - 1)] = T(30);  // a late, large maximum in the last row
    std::vector<double> y_ref(static_cast<std::size_t>(n));
    const auto xd = to_double(x);
    cpu::softmax_rows<double>(rows, cols, xd.data(), y_ref.data());
    const auto xg = gpu(x);
    auto y = gpu_nan<T>(n);
    fn(rows, cols, xg.data(), y.data());
    const double e = rel_err(y.to_vector(), y_ref);
    INFO("relative error " << e);
    CHECK(e <= tol<T>());
    // Each row on its own: a row of small values is not hidden by another's large ones.
    const auto yv = y.to_vector();
    const std::vector<T> row0(yv.begin(), yv.begin() + cols);
    const std::vector<double> ref0(y_ref.begin(), y_ref.begin() + cols);
    CHECK(rel_err(row0, ref0) <= tol<T>());
  }
}

TEMPLATE_TEST_CASE("cuda: softmax_rows_backward_one_read against the CPU",
                   "[gpu][rows][cuda:softmax_rows_backward_one_read]", float, double, bf16) {
  using T = TestType;
  auto fn = gated(&kernels::CudaKernels<T>::softmax_rows_backward_one_read, "softmax_rows_backward_one_read");
  for (auto [rows, cols] : kSoftmaxDims) {
    INFO("rows " << rows << " cols " << cols << " seed " << test_seed());
    const std::int64_t n = rows * cols;
    // y like a softmax output (a row sums to about 1), so sum(y dy) stays of the order of dy.
    const auto y = uniform<T>(n, 0, 2.0 / static_cast<double>(cols)), dy = uniform<T>(n, -1, 1);
    std::vector<double> dx_ref(static_cast<std::size_t>(n));
    const auto yd = to_double(y), dyd = to_double(dy);
    cpu::softmax_rows_backward<double>(rows, cols, yd.data(), dyd.data(), dx_ref.data());
    const auto yg = gpu(y), dyg = gpu(dy);
    auto dx = gpu_nan<T>(n);
    fn(rows, cols, yg.data(), dyg.data(), dx.data());
    const double e = rel_err(dx.to_vector(), dx_ref);
    INFO("relative error " << e);
    CHECK(e <= tol<T>());
  }
}

}  // namespace test_row_kernels
