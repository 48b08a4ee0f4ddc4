// CUDA kernels against the CPU kernels computed in double.
//
// Every kernel runs on fresh random inputs (seed printed on failure; set
// PTRAIN_TEST_SEED to repeat a run). Outputs start as NaN, so an element a
// kernel forgets to write fails the comparison. Error measure: max |gpu - ref|
// / max |ref| over the output, a norm-wise relative error; per-element relative
// error is meaningless where outputs cancel to ~0 (GELU near x = -3, a
// LayerNorm gradient). Bounds: float 1e-5 (FP32 arithmetic, a few ulp per
// element plus accumulation), double 1e-12, bf16 1e-2 (inputs are bf16 values,
// so the reference sees exactly what the kernel reads; the bf16 result is
// rounded to 8 bits, 2^-9 relative). Discrete results (argmax, dropout masks,
// counts) must match exactly.

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cpu/activation.hpp"
#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/elementwise.hpp"
#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/layer_norm.hpp"
#include "ptrain/kernels/cpu/loss.hpp"
#include "ptrain/kernels/cpu/optimizer.hpp"
#include "ptrain/kernels/cpu/reduce.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"
#include "ptrain/kernels/cuda/all.cuh"
#include "gpu/gpu_util.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/ops/batch_norm.hpp"
#include "ptrain/ops/conv.hpp"
#include "ptrain/ops/linear.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/optim/adamw.hpp"

using namespace ptrain;
namespace kc = ptrain::kernels::cuda;
namespace kp = ptrain::kernels::cpu;
using namespace ptrain::testing;

namespace {

/// Arithmetic type of element type T (float for bf16).
template <class T>
using Acc = kc::acc_t<T>;

/// Puts a kernel switch (set_gemm_epilogues, set_flash_attention) back as it was when
/// the test case leaves, by an exception too, so that later cases take the paths they expect.
struct RestoreSwitch {
  void (*set)(bool);
  bool was;
  ~RestoreSwitch() { set(was); }
};

template <class T>
Tensor<T> on_gpu(const std::vector<T>& v) {
  return Tensor<T>::from(v, {static_cast<std::int64_t>(v.size())}).to(kGpu);
}

/// A device array of n NaNs: any element a kernel does not write stays NaN.
template <class T>
Tensor<T> poisoned(std::int64_t n) {
  return on_gpu(std::vector<T>(static_cast<std::size_t>(n), nan_of<T>()));
}

template <class T>
std::vector<T> host(const Tensor<T>& t) {
  return t.to_vector();
}

using Dims = std::vector<std::pair<std::int64_t, std::int64_t>>;

#define CHECK_CLOSE(got, ref)                         \
  do {                                                \
    INFO("seed " << test_seed());                     \
    const double err_ = rel_err((got), (ref));        \
    INFO("relative error " << err_);                  \
    CHECK(err_ <= tol<TestType>());                   \
  } while (0)

}  // namespace

// ---------------------------------------------------------------- no GPU ----

TEST_CASE("cuda backend registers and fails clearly without a device", "[.][nogpu]") {
  // Both come from ptrain::cuda's CUDA source, not from this file (which only includes the kernels).
  REQUIRE(ptrain::detail::cuda_backend_slot() != nullptr);
  REQUIRE(kernels::cuda_kernels_linked());
  CHECK(kc::device_count() == 0);
  try {
    (void)Tensor<float>::empty({4}, Device::cuda(0));
    FAIL("allocating on cuda:0 without a device did not throw");
  } catch (const CudaError& e) {
    CHECK(std::string(e.what()).find("[ptrain.cuda.device]") != std::string::npos);
  }
}

// The loop of the pointwise kernels (Note [Elementwise loops]) on the host, over
// emulated threads in shuffled order, for float (4 elements a pass) and bf16 (8):
// every element is written by exactly one thread, from the values its inputs had
// before any write, also when the output is one of the inputs.
template <class T>
struct LoopTestOp {  // y = 2 a - b + i
  PTRAIN_HOST_DEVICE T operator()(std::int64_t i, T a, T b) const {
    return T(2.0f * static_cast<float>(a) - static_cast<float>(b) + static_cast<float>(i % 64));
  }
};

TEMPLATE_TEST_CASE("pointwise loop: each element by one thread, in place too, for any grid", "[gpu][nogpu]", float,
                   bf16) {
  using T = TestType;
  std::mt19937 order(7);
  for (std::int64_t n : {0, 1, 3, 8, 9, 255, 1000, 4099})
    for (std::int64_t threads : {1, 3, 32, 256, 1000, 5000}) {
      INFO("n " << n << ", " << threads << " threads");
      const auto a = uniform<T>(n, -1, 1), b = uniform<T>(n, -1, 1);
      std::vector<T> ref(a.size());
      for (std::int64_t i = 0; i < n; ++i) ref[i] = LoopTestOp<T>{}(i, a[i], b[i]);
      std::vector<std::int64_t> ids(static_cast<std::size_t>(threads));
      for (std::int64_t t = 0; t < threads; ++t) ids[t] = t;
      std::shuffle(ids.begin(), ids.end(), order);

      std::vector<int> writers(a.size());
      for (std::int64_t t : ids) {
        std::vector<T> y(a.size(), nan_of<T>());
        kc::detail::pointwise_elements<T, T, 2>(n, t, threads, {{a.data(), b.data()}}, y.data(), LoopTestOp<T>{});
        for (std::size_t i = 0; i < y.size(); ++i) writers[i] += std::isnan(as_double(y[i])) ? 0 : 1;
      }
      CHECK(std::count(writers.begin(), writers.end(), 1) == n);

      std::vector<T> y = b;  // in place: b is input and output
      for (std::int64_t t : ids)
        kc::detail::pointwise_elements<T, T, 2>(n, t, threads, {{a.data(), y.data()}}, y.data(), LoopTestOp<T>{});
      CHECK(rel_err(y, to_double(ref)) == 0);
    }
}

// ------------------------------------------------------------ device, tensor ----

TEST_CASE("cuda: tensor round trip cpu -> cuda -> cpu", "[gpu]") {
  const auto values = uniform<float>(1000, -5, 5);
  auto cpu = Tensor<float>::from(values, {10, 100});
  auto gpu = cpu.to(kGpu);
  CHECK(gpu.device() == kGpu);
  CHECK(gpu.shape() == Shape{10, 100});
  auto back = gpu.to(Device::cpu());
  CHECK(back.device() == Device::cpu());
  CHECK(back.to_vector() == values);

  // device -> device copy, a view along rows, copy_ and zero_.
  auto twin = gpu.clone();
  CHECK(!twin.shares_storage(gpu));
  CHECK(twin.to_vector() == values);
  auto rows = gpu.narrow(3, 2);
  const std::vector<float> expect_rows(values.begin() + 300, values.begin() + 500);
  CHECK(rows.to_vector() == expect_rows);
  auto target = poisoned<float>(200);
  target.copy_(rows);
  CHECK(target.to_vector() == expect_rows);
  target.zero_();
  CHECK(target.to_vector() == std::vector<float>(200, 0.0f));
  CHECK(Tensor<double>::zeros({7, 3}, kGpu).to_vector() == std::vector<double>(21, 0.0));
}

TEST_CASE("cuda: allocator counts the bytes tensors ask for on cuda:0", "[gpu]") {
  auto& alloc = allocator_for(kGpu);
  CHECK(&alloc == &allocator_for(Device::cuda(0)));
  CHECK(&alloc != &allocator_for(Device::cpu()));
  alloc.empty_cache();  // from here every allocation is a fresh cudaMalloc
  const MemoryStats before = memory_stats(kGpu);
  reset_peak_memory(kGpu);
  {
    auto a = Tensor<float>::empty({1000}, kGpu);   // 4000 bytes, a 4032-byte block (64-byte rounding)
    auto b = Tensor<double>::empty({3, 5}, kGpu);  // 120 bytes, a 128-byte block
    const MemoryStats s = memory_stats(kGpu);
    CHECK(s.live_bytes == before.live_bytes + 4120);
    CHECK(s.peak_bytes == before.live_bytes + 4120);
    CHECK(s.allocations == before.allocations + 2);
    CHECK(s.reserved_bytes == before.reserved_bytes + 4032 + 128);
    cudaPointerAttributes attr{};
    REQUIRE(cudaPointerGetAttributes(&attr, a.data()) == cudaSuccess);
    CHECK(attr.type == cudaMemoryTypeDevice);
    CHECK(attr.device == 0);
  }
  const MemoryStats after = memory_stats(kGpu);
  CHECK(after.live_bytes == before.live_bytes);
  CHECK(after.peak_bytes == before.live_bytes + 4120);
  CHECK(after.reserved_bytes == before.reserved_bytes + 4032 + 128);  // kept for reuse
  // The freed 4032-byte block serves the next request of that size: no new cudaMalloc.
  { auto again = Tensor<float>::empty({1008}, kGpu); }
  CHECK(memory_stats(kGpu).reserved_bytes == after.reserved_bytes);
  CHECK(memory_stats(kGpu).allocations == before.allocations + 3);
  alloc.empty_cache();
  CHECK(memory_stats(kGpu).reserved_bytes == before.reserved_bytes);
}

TEST_CASE("cuda: errors name the call and the device", "[gpu]") {
  try {
    PTRAIN_CHECK_CUDA(cudaSetDevice(kc::device_count() + 7));
    FAIL("cudaSetDevice on a missing device did not throw");
  } catch (const CudaError& e) {
    const std::string what = e.what();
    CHECK(what.find("[ptrain.cuda]") != std::string::npos);
    CHECK(what.find("cudaSetDevice") != std::string::npos);
    CHECK(what.find("cudaErrorInvalidDevice") != std::string::npos);
    CHECK(what.find("test_kernels.cu:") != std::string::npos);
  }
  CHECK(cudaGetLastError() == cudaSuccess);  // the failure did not linger as a sticky "last error"
  try {
    PTRAIN_CHECK_CUBLAS(CUBLAS_STATUS_INVALID_VALUE);
    FAIL("a failing cuBLAS status did not throw");
  } catch (const CudaError& e) {
    CHECK(std::string(e.what()).find("CUBLAS_STATUS_INVALID_VALUE") != std::string::npos);
  }
  CHECK_THROWS_AS(Tensor<float>::empty({4}, Device::cuda(kc::device_count())), CudaError);
}

TEST_CASE("cuda: streams, events and the current stream", "[gpu]") {
  CHECK(kc::current_stream() == nullptr);  // the default stream until a guard says otherwise
  kc::Stream stream(0);
  REQUIRE(stream.get() != nullptr);
  const auto values = uniform<float>(1 << 20, -1, 1);
  auto x = on_gpu(values);
  kc::Event start(true), stop(true);
  {
    kc::StreamGuard guard(stream);
    CHECK(kc::current_stream() == stream.get());
    start.record();
    kc::scale<float>(x.numel(), 2.0f, x.data());  // runs on `stream`
    stop.record();
  }
  CHECK(kc::current_stream() == nullptr);
  // The default (legacy) stream would not wait for a non-blocking stream: order it with the event.
  stop.synchronize();
  CHECK(stop.query());
  CHECK(stream.query());
  CHECK(stop.elapsed_ms(start) >= 0.0f);
  std::vector<double> expect(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) expect[i] = 2.0 * values[i];
  const auto got = x.to_vector();
  CHECK(rel_err(got, expect) == 0.0);

  kc::Stream moved = std::move(stream);
  CHECK(stream.get() == nullptr);
  CHECK(moved.get() != nullptr);
  kc::Event e;
  e.record(moved);
  moved.wait(e);
  moved.synchronize();
}

namespace {
__global__ void sleep_kernel(unsigned ms) {
  for (unsigned i = 0; i < ms; ++i) __nanosleep(1000000);
}
}  // namespace

// The allocator and streams (Note [Stream semantics]): a freed block goes back to
// the stream that allocated it, and a block announced with record_stream waits
// until the other stream's work queued before the free has finished.
TEST_CASE("cuda: cached blocks stay on their stream; record_stream holds them for another", "[gpu]") {
  kc::Stream side(0);
  void* first = nullptr;
  {
    auto t = Tensor<float>::empty({4096}, kGpu);  // allocated on the default stream
    first = t.data();
    sleep_kernel<<<1, 1, 0, side.get()>>>(300);  // `side` stays busy for about 0.3 s
    PTRAIN_CHECK_CUDA_LAUNCH();
    kc::record_stream(t, side.get());
  }
  {
    auto u = Tensor<float>::empty({4096}, kGpu);  // `side` still runs: t's block is held back
    CHECK(u.data() != first);
  }
  CHECK(!side.query());  // the check above ran while `side` was busy
  side.synchronize();
  {
    auto a = Tensor<float>::empty({4096}, kGpu), b = Tensor<float>::empty({4096}, kGpu);
    CHECK((a.data() == first || b.data() == first));  // free again, on the default stream
  }
  {
    kc::StreamGuard guard(side);
    auto c = Tensor<float>::empty({4096}, kGpu);  // another stream: none of the default stream's blocks
    CHECK(c.data() != first);
  }
}

// ------------------------------------------------------------------ GEMM ----

namespace {
template <class T>
void check_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, Acc<T> alpha, Acc<T> beta,
                double bound) {
  // Leading dimensions larger than the rows, so strides are exercised.
  const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k;
  const std::int64_t b_rows = tb ? n : k, b_cols = tb ? k : n;
  const std::int64_t lda = a_cols + 3, ldb = b_cols + 5, ldc = n + 2;
  const auto a = uniform<T>(a_rows * lda, -1, 1);
  const auto b = uniform<T>(b_rows * ldb, -1, 1);
  std::vector<T> c0 = uniform<T>(m * ldc, -1, 1);
  const T nan = nan_of<T>();
  if (beta == 0) c0.assign(c0.size(), nan);  // beta = 0 must not read C
  // The padding columns of C are never written by either side.
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = n; j < ldc; ++j) c0[i * ldc + j] = nan;

  auto da = on_gpu(a), db = on_gpu(b), dc = on_gpu(c0);
  kc::gemm<T>(ta, tb, m, n, k, alpha, da.data(), lda, db.data(), ldb, beta, dc.data(), ldc);
  const auto got = host(dc);

  auto ref = to_double(c0);
  const auto ra = to_double(a), rb = to_double(b);
  kp::gemm<double>(ta, tb, m, n, k, alpha, ra.data(), lda, rb.data(), ldb, beta, ref.data(), ldc);

  std::vector<T> got_inner;
  std::vector<double> ref_inner;
  bool padding_untouched = true;
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) {
      got_inner.push_back(got[i * ldc + j]);
      ref_inner.push_back(ref[i * ldc + j]);
    }
    for (std::int64_t j = n; j < ldc; ++j) padding_untouched &= std::isnan(as_double(got[i * ldc + j]));
  }
  INFO("trans_a " << ta << " trans_b " << tb << " m " << m << " n " << n << " k " << k << " beta " << beta
                  << " seed " << test_seed());
  const double err = rel_err(got_inner, ref_inner);
  INFO("relative error " << err);
  CHECK(err <= bound);
  CHECK(padding_untouched);
}
}  // namespace

TEMPLATE_TEST_CASE("cuda: gemm matches the CPU in all transpose cases", "[gpu]", float, double, bf16) {
  using A = Acc<TestType>;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_gemm<TestType>(ta, tb, 37, 53, 29, A(1.5), A(0), tol<TestType>());
      check_gemm<TestType>(ta, tb, 37, 53, 29, A(-0.5), A(0.75), tol<TestType>());
      check_gemm<TestType>(ta, tb, 256, 384, 512, A(1), A(1), tol<TestType>());
    }
  // K = 0: C = beta C (and zeros for beta = 0, whatever C held).
  check_gemm<TestType>(false, false, 9, 11, 0, A(1), A(0), 0.0);
  check_gemm<TestType>(false, true, 9, 11, 0, A(1), A(2), 0.0);
}

// TF32 keeps 10 of float's 23 mantissa bits. Where the conversion truncates
// (tensor cores reading FP32 operands do), every product is biased low by
// about 2^-10, so the error reaches ~1e-3 of |C| on its own: the bound is 2e-3.
// The FP32 test above runs at 1e-5, which TF32 would fail, so it also proves
// that TF32 is off by default.
TEST_CASE("cuda: gemm with TF32 stays within 2e-3", "[gpu]") {
  kc::set_tf32(true);
  CHECK(kc::tf32_enabled());
  check_gemm<float>(false, true, 256, 384, 1024, 1.0f, 0.0f, 2e-3);
  kc::set_tf32(false);
  CHECK(!kc::tf32_enabled());
}

// cuBLASLt with a fused epilogue (Note [cuBLASLt epilogues]): y = x W^T + b and
// y = gelu(x W^T + b) with the pre-activation kept, against the CPU in double.
// The shapes where it applies must take the fused path (the return value); GELU
// is fused for bf16 only, and N = 36 (not a multiple of 8) falls back for it too.
// Through ops:: the result must be right either way.
TEMPLATE_TEST_CASE("cuda: linear_epilogue fuses the bias and GELU into the GEMM", "[gpu]", float, bf16) {
  using T = TestType;
  for (auto [m, n, k] : std::vector<std::array<std::int64_t, 3>>{{64, 96, 40}, {300, 256, 768}, {17, 36, 24}}) {
    const auto x = uniform<T>(m * k, -1, 1), w = uniform<T>(n * k, -1, 1), b = uniform<T>(n, -1, 1);
    auto dx = on_gpu(x), dw = on_gpu(w), db = on_gpu(b);
    const auto rx = to_double(x), rw = to_double(w), rb = to_double(b);
    std::vector<double> rpre(static_cast<std::size_t>(m * n)), ry(rpre.size());
    kp::gemm<double>(false, true, m, n, k, 1.0, rx.data(), k, rw.data(), k, 0.0, rpre.data(), n);
    kp::bias_add<double>(m, n, rpre.data(), rb.data());
    kp::gelu_forward<double>(m * n, rpre.data(), ry.data());
    INFO("m " << m << " n " << n << " k " << k << " seed " << test_seed());
    for (bool gelu : {false, true}) {
      INFO("gelu " << gelu);
      auto y = poisoned<T>(m * n), pre = poisoned<T>(m * n);
      const bool fused =
          kc::linear_epilogue<T>(m, n, k, dx.data(), dw.data(), db.data(), y.data(), pre.data(), gelu);
      CHECK(fused == !(gelu && (std::is_same_v<T, float> || n % 8 != 0)));
      if (!fused) continue;
      CHECK_CLOSE(host(y), gelu ? ry : rpre);
      if (gelu) CHECK_CLOSE(host(pre), rpre);
    }
    // Through ops::, which falls back where the fused form does not apply.
    Tensor<T> pre;
    auto xt = dx.reshape({m, k}), wt = dw.reshape({n, k});
    CHECK_CLOSE(host(ops::linear_gelu(xt, wt, db, pre)), ry);
    CHECK_CLOSE(host(pre), rpre);
    CHECK_CLOSE(host(ops::linear(xt, wt, db)), rpre);
  }
}

// The backward epilogues (Note [cuBLASLt epilogues]) for a layer y = h W^T + b
// whose input h is gelu(pre): the weight gradient with the bias gradient (float,
// bf16) and the gradient through the GELU with the bias gradient of the layer
// before it (bf16 only), against the CPU in double. dW accumulates, so it starts
// from random values; what is written starts as NaN. Where both widths are
// multiples of 8 the bf16 fused path must be taken; through ops:: (which accumulates
// the bias gradients and falls back where the fused forms do not apply) the
// result must be right either way.
TEMPLATE_TEST_CASE("cuda: backward epilogues fuse the bias gradients and the GELU's gradient into the GEMMs", "[gpu]",
                   float, bf16) {
  using T = TestType;
  for (auto [m, n, k] : std::vector<std::array<std::int64_t, 3>>{{64, 96, 40}, {300, 256, 768}, {17, 36, 24}}) {
    const auto h = uniform<T>(m * k, -1, 1), pre = uniform<T>(m * k, -3, 3), w = uniform<T>(n * k, -1, 1),
               dy = uniform<T>(m * n, -1, 1), dw0 = uniform<T>(n * k, -1, 1), db0 = uniform<T>(n, -1, 1),
               dbp0 = uniform<T>(k, -1, 1);
    const auto rh = to_double(h), rpre = to_double(pre), rw = to_double(w), rdy = to_double(dy);
    auto rdw = to_double(dw0);  // dw0 + dy^T h
    kp::gemm<double>(true, false, n, k, m, 1.0, rdy.data(), n, rh.data(), k, 1.0, rdw.data(), k);
    std::vector<double> rdb(static_cast<std::size_t>(n)), rdh(static_cast<std::size_t>(m * k)), rdpre(rdh.size()),
        rdbp(static_cast<std::size_t>(k));
    kp::bias_grad<double>(m, n, rdy.data(), rdb.data());
    kp::gemm<double>(false, false, m, k, n, 1.0, rdy.data(), n, rw.data(), k, 0.0, rdh.data(), k);  // dy W
    kp::gelu_backward<double>(m * k, rpre.data(), rdh.data(), rdpre.data());
    kp::bias_grad<double>(m, k, rdpre.data(), rdbp.data());
    INFO("m " << m << " n " << n << " k " << k << " seed " << test_seed());
    auto dh = on_gpu(h), dpre = on_gpu(pre), dw = on_gpu(w), ddy = on_gpu(dy);
    const bool widths8 = n % 8 == 0 && k % 8 == 0;
    {
      auto gw = on_gpu(dw0), gb = poisoned<T>(n);
      const bool fused = kc::linear_weight_grad_epilogue<T>(m, n, k, ddy.data(), dh.data(), gw.data(), gb.data());
      // Required in bf16 (the mixed-precision path); in float reported only, as
      // cuBLASLt need not offer the bias-gradient epilogue for FP32 GEMMs.
      if (widths8 && std::is_same_v<T, bf16>) CHECK(fused);
      if (widths8 && !fused) WARN("no fused weight-gradient epilogue for this float shape");
      if (fused) {
        CHECK_CLOSE(host(gw), rdw);
        CHECK_CLOSE(host(gb), rdb);
      }
    }
    {
      auto gpre = poisoned<T>(m * k), gb = poisoned<T>(k);
      const bool fused =
          kc::linear_dgelu_epilogue<T>(m, n, k, ddy.data(), dw.data(), dpre.data(), gpre.data(), gb.data());
      if (std::is_same_v<T, float>) CHECK(!fused);
      else if (widths8) CHECK(fused);
      if (fused) {
        CHECK_CLOSE(host(gpre), rdpre);
        CHECK_CLOSE(host(gb), rdbp);
      }
    }
    // Through ops::, accumulating into the bias gradients, with the epilogues on
    // and switched off (then no fused form may run).
    for (std::size_t j = 0; j < rdb.size(); ++j) rdb[j] += as_double(db0[j]);
    for (std::size_t j = 0; j < rdbp.size(); ++j) rdbp[j] += as_double(dbp0[j]);
    auto ht = dh.reshape({m, k}), pt = dpre.reshape({m, k}), wt = dw.reshape({n, k}), dyt = ddy.reshape({m, n});
    const RestoreSwitch restore{kc::set_gemm_epilogues, kc::gemm_epilogues_enabled()};
    for (const bool on : {true, false}) {
      INFO("epilogues " << on);
      kc::set_gemm_epilogues(on);
      auto gw = on_gpu(dw0).reshape({n, k}), gb = on_gpu(db0), gbp = on_gpu(dbp0);
      if (!on) CHECK(!kc::linear_weight_grad_epilogue<T>(m, n, k, ddy.data(), dh.data(), gw.data(), gb.data()));
      CHECK_CLOSE(host(ops::linear_gelu_backward(ht, pt, wt, dyt, gw, &gb, gbp)), rdpre);
      CHECK_CLOSE(host(gw), rdw);
      CHECK_CLOSE(host(gb), rdb);
      CHECK_CLOSE(host(gbp), rdbp);
      auto gw2 = on_gpu(dw0).reshape({n, k}), gb2 = on_gpu(db0);
      CHECK_CLOSE(host(ops::linear_backward(ht, wt, dyt, gw2, &gb2)), rdh);
      CHECK_CLOSE(host(gw2), rdw);
      CHECK_CLOSE(host(gb2), rdb);
    }
  }
}

// ----------------------------------------------------------- elementwise ----

TEMPLATE_TEST_CASE("cuda: bias_add and bias_grad", "[gpu]", float, double, bf16) {
  using T = TestType;
  // 300 and 5000 rows: two and 20 row chunks in bias_grad's column sums.
  for (auto [rows, cols] : Dims{{1, 1}, {67, 10}, {300, 771}, {5000, 64}}) {
    const auto y = uniform<T>(rows * cols, -1, 1), bias = uniform<T>(cols, -1, 1);
    auto dy = on_gpu(y);
    auto db = on_gpu(bias);
    kc::bias_add<T>(rows, cols, dy.data(), db.data());
    auto ref = to_double(y);
    const auto rbias = to_double(bias);
    kp::bias_add<double>(rows, cols, ref.data(), rbias.data());
    CHECK_CLOSE(host(dy), ref);

    // bias_grad accumulates into dbias, so it starts from random values, not NaN.
    auto dgrad = on_gpu(bias);
    auto dyy = on_gpu(y);
    kc::bias_grad<T>(rows, cols, dyy.data(), dgrad.data());
    auto rgrad = to_double(bias);
    const auto ry = to_double(y);
    kp::bias_grad<double>(rows, cols, ry.data(), rgrad.data());
    CHECK_CLOSE(host(dgrad), rgrad);
  }
}

TEMPLATE_TEST_CASE("cuda: relu and gelu, forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  const std::int64_t n = 100003;  // not a multiple of the block size
  auto x = uniform<T>(n, -4, 4);
  x[0] = T(0);  // relu's boundary: x > 0 is false at 0
  const auto g = uniform<T>(n, -1, 1);
  const auto rx = to_double(x), rg = to_double(g);
  auto dx = on_gpu(x), dg = on_gpu(g);
  std::vector<double> ref(static_cast<std::size_t>(n));

  auto out = poisoned<T>(n);
  kc::relu_forward<T>(n, dx.data(), out.data());
  kp::relu_forward<double>(n, rx.data(), ref.data());
  CHECK_CLOSE(host(out), ref);

  out = poisoned<T>(n);
  kc::relu_backward<T>(n, dx.data(), dg.data(), out.data());
  kp::relu_backward<double>(n, rx.data(), rg.data(), ref.data());
  CHECK_CLOSE(host(out), ref);

  out = poisoned<T>(n);
  kc::gelu_forward<T>(n, dx.data(), out.data());
  kp::gelu_forward<double>(n, rx.data(), ref.data());
  CHECK_CLOSE(host(out), ref);

  out = poisoned<T>(n);
  kc::gelu_backward<T>(n, dx.data(), dg.data(), out.data());
  kp::gelu_backward<double>(n, rx.data(), rg.data(), ref.data());
  CHECK_CLOSE(host(out), ref);
}

TEMPLATE_TEST_CASE("cuda: dropout gives the CPU's mask and values exactly", "[gpu]", float, double, bf16) {
  using T = TestType;
  const std::int64_t n = 200001;
  const auto x = uniform<T>(n, 0.5, 1.5);  // never zero, so a zero output means dropped
  const std::uint64_t seed = rng().below(1ull << 62);
  for (std::uint64_t offset : {std::uint64_t{0}, std::uint64_t{12345}, (std::uint64_t{1} << 40) + 7}) {
    for (double p : {0.1, 0.5}) {
      auto dx = on_gpu(x);
      auto out = poisoned<T>(n);
      kc::dropout<T>(n, dx.data(), out.data(), p, seed, offset);
      const auto got = host(out);
      std::vector<double> ref(static_cast<std::size_t>(n));
      const auto rx = to_double(x);
      kp::dropout<double>(n, rx.data(), ref.data(), p, seed, offset);
      std::int64_t mismatches = 0, dropped = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        mismatches += (as_double(got[i]) == 0) != (ref[i] == 0);
        dropped += ref[i] == 0;
      }
      INFO("seed " << seed << " offset " << offset << " p " << p);
      CHECK(mismatches == 0);
      if constexpr (std::is_same_v<T, bf16>) {
        CHECK_CLOSE(got, ref);  // x * scale rounded once
      } else {
        std::vector<T> same(static_cast<std::size_t>(n));
        kp::dropout<T>(n, x.data(), same.data(), p, seed, offset);
        CHECK(got == same);  // the CPU kernel in T: the same bits
      }
      // The mask is not degenerate: the drop rate is p within 5 standard deviations.
      CHECK(std::abs(static_cast<double>(dropped) / n - p) < 5 * std::sqrt(p * (1 - p) / n));
    }
  }
}

TEMPLATE_TEST_CASE("cuda: axpy and scale", "[gpu]", float, double, bf16) {
  using T = TestType;
  const std::int64_t n = 77777;
  const auto x = uniform<T>(n, -1, 1), y = uniform<T>(n, -1, 1);
  auto dx = on_gpu(x), dy = on_gpu(y);
  kc::axpy<T>(n, Acc<T>(-0.75), dx.data(), dy.data());
  auto ref = to_double(y);
  const auto rx = to_double(x);
  kp::axpy<double>(n, -0.75, rx.data(), ref.data());
  CHECK_CLOSE(host(dy), ref);

  kc::scale<T>(n, Acc<T>(3.25), dx.data());
  auto rs = to_double(x);
  kp::scale<double>(n, 3.25, rs.data());
  CHECK_CLOSE(host(dx), rs);
}

// ------------------------------------------------------------ reductions ----

TEMPLATE_TEST_CASE("cuda: sum and sum_squares", "[gpu]", float, double, bf16) {
  using T = TestType;
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{1000}, std::int64_t{1000003}, std::int64_t{5000000}}) {
    const auto x = uniform<T>(n, -0.5, 1.0);
    auto dx = on_gpu(x);
    const auto rx = to_double(x);
    INFO("n " << n << " seed " << test_seed());
    // Both sides add the same values in double, in different orders: each is within
    // (n - 1) u sum|x_i| of the exact sum (u = 2^-53) in any order, while a lost or
    // doubled element moves the result by about 1/n of it.
    double sum_abs = 0;
    for (double v : rx) sum_abs += std::abs(v);
    const double u2n = 2.0 * static_cast<double>(n) * 0x1p-53;
    const double s = kc::sum<T>(n, dx.data()), rs = kp::sum<double>(n, rx.data());
    CHECK(std::abs(s - rs) <= u2n * sum_abs);
    const double q = kc::sum_squares<T>(n, dx.data()), rq = kp::sum_squares<double>(n, rx.data());
    CHECK(std::abs(q - rq) <= u2n * rq);
  }
  CHECK(kc::sum<T>(0, static_cast<const T*>(nullptr)) == 0.0);
}

TEMPLATE_TEST_CASE("cuda: argmax_rows takes the first maximum", "[gpu]", float, double, bf16) {
  using T = TestType;
  for (auto [rows, cols] : Dims{{67, 10}, {5, 3000}, {70000, 3}}) {
    // Few distinct values, so ties are common and "first on ties" is tested.
    auto x = uniform<T>(rows * cols, 0, 4);
    for (auto& v : x) v = T(std::floor(as_double(v)));
    auto dx = on_gpu(x);
    auto out = on_gpu(std::vector<std::int32_t>(static_cast<std::size_t>(rows), -1));
    kc::argmax_rows<T>(rows, cols, dx.data(), out.data());
    std::vector<std::int32_t> ref(static_cast<std::size_t>(rows));
    const auto rx = to_double(x);
    kp::argmax_rows<double>(rows, cols, rx.data(), ref.data());
    INFO("rows " << rows << " cols " << cols);
    CHECK(host(out) == ref);
  }
}

// ------------------------------------------------ softmax, cross-entropy ----

TEMPLATE_TEST_CASE("cuda: softmax_rows forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  for (auto [rows, cols] : Dims{{65, 7}, {33, 1000}, {9, 3001}}) {
    const auto x = uniform<T>(rows * cols, -8, 8);
    auto dx = on_gpu(x);
    auto y = poisoned<T>(rows * cols);
    kc::softmax_rows<T>(rows, cols, dx.data(), y.data());
    const auto rx = to_double(x);
    std::vector<double> ref(rx.size());
    kp::softmax_rows<double>(rows, cols, rx.data(), ref.data());
    CHECK_CLOSE(host(y), ref);

    const auto yy = uniform<T>(rows * cols, 0, 1), g = uniform<T>(rows * cols, -1, 1);
    auto dyy = on_gpu(yy), dg = on_gpu(g);
    auto out = poisoned<T>(rows * cols);
    kc::softmax_rows_backward<T>(rows, cols, dyy.data(), dg.data(), out.data());
    const auto ryy = to_double(yy), rg = to_double(g);
    kp::softmax_rows_backward<double>(rows, cols, ryy.data(), rg.data(), ref.data());
    CHECK_CLOSE(host(out), ref);
  }
}

TEMPLATE_TEST_CASE("cuda: cross_entropy forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  for (auto [rows, cols] : Dims{{97, 10}, {40, 5000}}) {
    const auto logits = uniform<T>(rows * cols, -3, 3);
    std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
    for (auto& t : targets) t = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(cols)));
    targets[1] = -100;  // ignored rows
    targets[static_cast<std::size_t>(rows) - 1] = -100;

    auto dlogits = on_gpu(logits);
    auto dtargets = on_gpu(targets);
    auto lse = poisoned<Acc<T>>(rows);
    std::int64_t valid = -1;
    const double loss = kc::cross_entropy_forward<T>(rows, cols, dlogits.data(), dtargets.data(), lse.data(), valid);

    const auto rl = to_double(logits);
    std::vector<double> rlse(static_cast<std::size_t>(rows));
    std::int64_t rvalid = -1;
    const double rloss = kp::cross_entropy_forward<double>(rows, cols, rl.data(), targets.data(), rlse.data(), rvalid);
    INFO("rows " << rows << " cols " << cols << " seed " << test_seed());
    CHECK(valid == rvalid);
    CHECK(valid == rows - 2);
    CHECK(std::abs(loss - rloss) <= 1e-5 * std::abs(rloss));  // float or double arithmetic on the same inputs
    CHECK_CLOSE(host(lse), rlse);

    // Backward from the GPU's lse, against the CPU in double from the same values.
    const auto glse = host(lse);
    auto grad = poisoned<T>(rows * cols);
    kc::cross_entropy_backward<T>(rows, cols, dlogits.data(), lse.data(), dtargets.data(), valid, Acc<T>(1.3),
                                  grad.data());
    std::vector<double> rgrad(rl.size());
    const auto rglse = to_double(glse);
    kp::cross_entropy_backward<double>(rows, cols, rl.data(), rglse.data(), targets.data(), rvalid, 1.3,
                                       rgrad.data());
    CHECK_CLOSE(host(grad), rgrad);
  }

  // A label outside [0, cols) is reported instead of reading out of bounds.
  std::int64_t valid = 0;
  auto logits = on_gpu(uniform<T>(4 * 5, -1, 1));
  auto bad = on_gpu(std::vector<std::int32_t>{0, 5, 1, -100});
  auto lse = poisoned<Acc<T>>(4);
  CHECK_THROWS_AS(kc::cross_entropy_forward<T>(4, 5, logits.data(), bad.data(), lse.data(), valid), ShapeError);
  CHECK(cudaGetLastError() == cudaSuccess);
}

TEMPLATE_TEST_CASE("cuda: cross_entropy with label smoothing", "[gpu]", float, double, bf16) {
  using T = TestType;
  const std::int64_t rows = 53, cols = 700;
  const auto logits = uniform<T>(rows * cols, -3, 3);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
  for (auto& t : targets) t = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(cols)));
  targets[2] = -100;
  auto dlogits = on_gpu(logits);
  auto dtargets = on_gpu(targets);
  auto lse = poisoned<Acc<T>>(rows);
  std::int64_t valid = -1, rvalid = -1;
  const double loss =
      kc::cross_entropy_forward<T>(rows, cols, dlogits.data(), dtargets.data(), lse.data(), valid, -100, Acc<T>(0.2));
  const auto rl = to_double(logits);
  std::vector<double> rlse(static_cast<std::size_t>(rows));
  const double rloss =
      kp::cross_entropy_forward<double>(rows, cols, rl.data(), targets.data(), rlse.data(), rvalid, -100, 0.2);
  INFO("seed " << test_seed());
  CHECK(valid == rvalid);
  CHECK(std::abs(loss - rloss) <= 1e-5 * std::abs(rloss));
  auto grad = poisoned<T>(rows * cols);
  kc::cross_entropy_backward<T>(rows, cols, dlogits.data(), lse.data(), dtargets.data(), valid, Acc<T>(0.7),
                                grad.data(), -100, Acc<T>(0.2));
  std::vector<double> rgrad(rl.size());
  const auto rglse = to_double(host(lse));
  kp::cross_entropy_backward<double>(rows, cols, rl.data(), rglse.data(), targets.data(), rvalid, 0.7, rgrad.data(),
                                     -100, 0.2);
  CHECK_CLOSE(host(grad), rgrad);
}

TEMPLATE_TEST_CASE("cuda: tanh, sigmoid, silu, leaky relu and log_softmax, forward and backward", "[gpu]", float,
                   double, bf16) {
  using T = TestType;
  using kernels::ActivationKind;
  const std::int64_t n = 100003;
  const auto x = uniform<T>(n, -6, 6), g = uniform<T>(n, -1, 1);
  const auto rx = to_double(x), rg = to_double(g);
  auto dx = on_gpu(x), dg = on_gpu(g);
  std::vector<double> ref(static_cast<std::size_t>(n));
  for (auto k : {ActivationKind::Tanh, ActivationKind::Sigmoid, ActivationKind::SiLU, ActivationKind::LeakyReLU}) {
    INFO("activation " << static_cast<int>(k));
    auto out = poisoned<T>(n);
    kc::activation_forward<T>(n, k, Acc<T>(0.1), dx.data(), out.data());
    kp::activation_forward<double>(n, k, 0.1, rx.data(), ref.data());
    CHECK_CLOSE(host(out), ref);
    out = poisoned<T>(n);
    kc::activation_backward<T>(n, k, Acc<T>(0.1), dx.data(), dg.data(), out.data());
    kp::activation_backward<double>(n, k, 0.1, rx.data(), rg.data(), ref.data());
    CHECK_CLOSE(host(out), ref);
  }
  for (auto [rows, cols] : Dims{{65, 7}, {9, 3001}}) {
    const auto xs = uniform<T>(rows * cols, -8, 8), gs = uniform<T>(rows * cols, -1, 1);
    const auto rxs = to_double(xs), rgs = to_double(gs);
    auto dxs = on_gpu(xs), dgs = on_gpu(gs);
    std::vector<double> r(rxs.size());
    auto y = poisoned<T>(rows * cols);
    kc::log_softmax_rows<T>(rows, cols, dxs.data(), y.data());
    kp::log_softmax_rows<double>(rows, cols, rxs.data(), r.data());
    CHECK_CLOSE(host(y), r);
    const auto yv = host(y);
    const auto ry = to_double(yv);
    auto out = poisoned<T>(rows * cols);
    kc::log_softmax_rows_backward<T>(rows, cols, y.data(), dgs.data(), out.data());
    kp::log_softmax_rows_backward<double>(rows, cols, ry.data(), rgs.data(), r.data());
    CHECK_CLOSE(host(out), r);
  }
}

TEMPLATE_TEST_CASE("cuda: pointwise losses and nll, forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  using kernels::LossKind;
  const std::int64_t rows = 1001, classes = 7, n = rows * classes;
  const auto x = uniform<T>(n, -3, 3), t = uniform<T>(n, 0, 1), w = uniform<T>(classes, 0.5, 2),
             pw = uniform<T>(classes, 0.5, 3), dy = uniform<T>(n, -1, 1);
  const auto rx = to_double(x), rt = to_double(t), rw = to_double(w), rpw = to_double(pw), rdy = to_double(dy);
  auto dx = on_gpu(x), dt = on_gpu(t), dw = on_gpu(w), dpw = on_gpu(pw), ddy = on_gpu(dy);
  std::vector<double> ref(static_cast<std::size_t>(n));
  for (auto k : {LossKind::MSE, LossKind::L1, LossKind::SmoothL1, LossKind::Huber, LossKind::BCEWithLogits}) {
    INFO("loss " << static_cast<int>(k));
    auto out = poisoned<Acc<T>>(n);
    kc::pointwise_loss_forward<T>(n, k, Acc<T>(0.7), dx.data(), dt.data(), dw.data(), classes, dpw.data(), classes,
                                  out.data());
    kp::pointwise_loss_forward<double>(n, k, 0.7, rx.data(), rt.data(), rw.data(), classes, rpw.data(), classes,
                                       ref.data());
    CHECK(rel_err(host(out), ref) <= tol<float>());  // per-element losses are float for bf16
    auto grad = poisoned<T>(n);
    kc::pointwise_loss_backward<T>(n, k, Acc<T>(0.7), dx.data(), dt.data(), dw.data(), classes, dpw.data(), classes,
                                   ddy.data(), Acc<T>(0.3), grad.data());
    kp::pointwise_loss_backward<double>(n, k, 0.7, rx.data(), rt.data(), rw.data(), classes, rpw.data(), classes,
                                        rdy.data(), 0.3, ref.data());
    CHECK_CLOSE(host(grad), ref);
  }
  std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
  for (auto& v : targets) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(classes)));
  targets[3] = -100;
  auto dtargets = on_gpu(targets);
  auto loss = poisoned<Acc<T>>(rows), counted = poisoned<Acc<T>>(rows);
  kc::nll_forward<T>(rows, classes, dx.data(), dtargets.data(), -100, loss.data(), counted.data());
  std::vector<double> rloss(static_cast<std::size_t>(rows)), rcounted(static_cast<std::size_t>(rows));
  kp::nll_forward<double>(rows, classes, rx.data(), targets.data(), -100, rloss.data(), rcounted.data());
  CHECK(rel_err(host(loss), rloss) <= tol<float>());
  CHECK(rel_err(host(counted), rcounted) == 0);
  auto grad = poisoned<T>(n);
  const auto row_dy = std::vector<T>(dy.begin(), dy.begin() + rows);
  auto drow_dy = on_gpu(row_dy);
  kc::nll_backward<T>(rows, classes, dtargets.data(), -100, drow_dy.data(), Acc<T>(0.5), grad.data());
  const auto rrow_dy = to_double(row_dy);
  kp::nll_backward<double>(rows, classes, targets.data(), -100, rrow_dy.data(), 0.5, ref.data());
  CHECK_CLOSE(host(grad), ref);
}

TEST_CASE("cuda: loss and activation modules on cuda tensors equal the CPU's", "[gpu]") {
  const std::int64_t rows = 64, cols = 5;
  const auto x = uniform<double>(rows * cols, -2, 2), y = uniform<double>(rows * cols, 0, 1);
  const auto cx = Tensor<double>::from(x, {rows, cols}), cy = Tensor<double>::from(y, {rows, cols});
  const auto gx = cx.to(kGpu), gy = cy.to(kGpu);
  nn::BCEWithLogitsLoss<double> cpu_loss(nn::Reduction::Mean, {}, Tensor<double>::full({cols}, 2.0));
  nn::BCEWithLogitsLoss<double> gpu_loss(nn::Reduction::Mean, {}, Tensor<double>::full({cols}, 2.0).to(kGpu));
  nn::Cache<double> cc, gc;
  CHECK(gpu_loss.forward(gx, gy, gc) == Approx(cpu_loss.forward(cx, cy, cc)).epsilon(1e-12));
  CHECK(rel_err(host(gpu_loss.backward(gc)), host(cpu_loss.backward(cc))) <= 1e-12);
  nn::NLLLoss<double> nll;
  nn::LogSoftmax<double> lsm;
  std::vector<std::int32_t> t(static_cast<std::size_t>(rows));
  for (auto& v : t) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(cols)));
  const auto ct = Tensor<std::int32_t>::from(t, {rows});
  const double want = nll.forward(lsm.forward(cx, cc), ct, cc);
  CHECK(nll.forward(lsm.forward(gx, gc), ct.to(kGpu), gc) == Approx(want).epsilon(1e-12));
  t[0] = cols;  // outside [0, cols): reported, not read
  CHECK_THROWS_WITH(nll.forward(gx, Tensor<std::int32_t>::from(t, {rows}).to(kGpu), gc),
                    Catch::Contains("[ptrain.loss.nll] a target lies outside"));
}

// ------------------------------------------------------------- LayerNorm ----

TEMPLATE_TEST_CASE("cuda: layer_norm forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  // 600 rows: three row chunks in the column sums of dgamma and dbeta.
  for (auto [rows, d] : Dims{{33, 5}, {64, 768}, {7, 2001}, {600, 40}}) {
    // An offset mean, so a one-pass variance would lose digits and fail.
    auto x = uniform<T>(rows * d, 2, 4);
    const auto gamma = uniform<T>(d, 0.5, 1.5), beta = uniform<T>(d, -0.5, 0.5);
    const Acc<T> eps = Acc<T>(1e-5);
    auto dx = on_gpu(x), dgamma_in = on_gpu(gamma), dbeta_in = on_gpu(beta);
    auto y = poisoned<T>(rows * d);
    auto mean = poisoned<Acc<T>>(rows), rstd = poisoned<Acc<T>>(rows);
    kc::layer_norm_forward<T>(rows, d, dx.data(), dgamma_in.data(), dbeta_in.data(), eps, y.data(), mean.data(),
                              rstd.data());
    const auto rx = to_double(x), rgamma = to_double(gamma), rbeta = to_double(beta);
    std::vector<double> ry(rx.size()), rmean(static_cast<std::size_t>(rows)), rrstd(static_cast<std::size_t>(rows));
    kp::layer_norm_forward<double>(rows, d, rx.data(), rgamma.data(), rbeta.data(), static_cast<double>(eps),
                                   ry.data(), rmean.data(), rrstd.data());
    INFO("rows " << rows << " d " << d);
    CHECK_CLOSE(host(y), ry);
    CHECK_CLOSE(host(mean), rmean);
    CHECK_CLOSE(host(rstd), rrstd);

    // Backward from the GPU's saved statistics; dgamma and dbeta accumulate.
    const auto gmean = host(mean), grstd = host(rstd);
    const auto dy = uniform<T>(rows * d, -1, 1);
    const auto dgamma0 = uniform<T>(d, -1, 1), dbeta0 = uniform<T>(d, -1, 1);
    auto ddy = on_gpu(dy), ddgamma = on_gpu(dgamma0), ddbeta = on_gpu(dbeta0);
    auto ddx = poisoned<T>(rows * d);
    kc::layer_norm_backward<T>(rows, d, dx.data(), mean.data(), rstd.data(), dgamma_in.data(), ddy.data(), ddx.data(),
                               ddgamma.data(), ddbeta.data());
    const auto rdy = to_double(dy), rm = to_double(gmean), rr = to_double(grstd);
    auto rdgamma = to_double(dgamma0), rdbeta = to_double(dbeta0);
    std::vector<double> rdx(rx.size());
    kp::layer_norm_backward<double>(rows, d, rx.data(), rm.data(), rr.data(), rgamma.data(), rdy.data(), rdx.data(),
                                    rdgamma.data(), rdbeta.data());
    CHECK_CLOSE(host(ddx), rdx);
    CHECK_CLOSE(host(ddgamma), rdgamma);
    CHECK_CLOSE(host(ddbeta), rdbeta);
  }
}

// ------------------------------------------------------------ optimizers ----

TEMPLATE_TEST_CASE("cuda: sgd_update in every mode", "[gpu]", float, double) {
  using T = TestType;
  const std::int64_t n = 50001;
  struct Mode {
    double momentum, dampening;
    bool nesterov, first;
  };
  for (const Mode mode : {Mode{0, 0, false, true}, Mode{0.9, 0, false, true}, Mode{0.9, 0.1, false, false},
                          Mode{0.9, 0, true, false}}) {
    const auto p = uniform<T>(n, -1, 1), g = uniform<T>(n, -1, 1), buf = uniform<T>(n, -1, 1);
    auto dp = on_gpu(p), dg = on_gpu(g), dbuf = on_gpu(buf);
    T* buf_ptr = mode.momentum == 0 ? nullptr : dbuf.data();  // null buffer allowed without momentum
    kc::sgd_update<T>(n, dp.data(), dg.data(), buf_ptr, T(0.05), T(mode.momentum), T(mode.dampening), mode.nesterov,
                      T(0.01), mode.first);
    auto rp = to_double(p), rbuf = to_double(buf);
    const auto rg = to_double(g);
    kp::sgd_update<double>(n, rp.data(), rg.data(), mode.momentum == 0 ? nullptr : rbuf.data(), 0.05,
                           mode.momentum, mode.dampening, mode.nesterov, 0.01, mode.first);
    INFO("momentum " << mode.momentum << " nesterov " << mode.nesterov << " first " << mode.first);
    CHECK_CLOSE(host(dp), rp);
    if (mode.momentum != 0) CHECK_CLOSE(host(dbuf), rbuf);
  }
}

TEMPLATE_TEST_CASE("cuda: adamw_update", "[gpu]", float, double) {
  using T = TestType;
  const std::int64_t n = 50001;
  for (std::int64_t step : {std::int64_t{1}, std::int64_t{7}}) {
    const auto p = uniform<T>(n, -1, 1), g = uniform<T>(n, -1, 1);
    const auto m = uniform<T>(n, -0.1, 0.1), v = uniform<T>(n, 0, 0.01);
    auto dp = on_gpu(p), dg = on_gpu(g), dm = on_gpu(m), dv = on_gpu(v);
    kc::adamw_update<T>(n, dp.data(), dg.data(), dm.data(), dv.data(), T(1e-3), T(0.9), T(0.999), T(1e-8), T(0.01),
                        step);
    auto rp = to_double(p), rm = to_double(m), rv = to_double(v);
    const auto rg = to_double(g);
    kp::adamw_update<double>(n, rp.data(), rg.data(), rm.data(), rv.data(), 1e-3, 0.9, 0.999, 1e-8, 0.01, step);
    INFO("step " << step);
    CHECK_CLOSE(host(dp), rp);
    CHECK_CLOSE(host(dm), rm);
    CHECK_CLOSE(host(dv), rv);
  }
}

// ------------------------------------------------------------- embedding ----

TEMPLATE_TEST_CASE("cuda: token_ids, embedding forward and backward", "[gpu]", float, double, bf16) {
  using T = TestType;
  using Id = Acc<T>;  // token ids are never bf16 (not exact above 256)
  const std::int64_t vocab = 50, dim = 37;
  for (auto [batch, seq] : Dims{{1, 1}, {3, 17}, {16, 300}}) {
    const std::int64_t rows = batch * seq, block = seq + 3;
    // 50 ids over up to 4800 rows: most ids repeat, the scatter-add's hard case.
    std::vector<Id> x(static_cast<std::size_t>(rows));
    for (auto& v : x) v = static_cast<Id>(rng().below(static_cast<std::uint64_t>(vocab)));
    x[0] = static_cast<Id>(vocab - 1);
    auto dx = on_gpu(x);
    auto ids = on_gpu(std::vector<std::int32_t>(static_cast<std::size_t>(rows), -7));
    std::vector<std::int32_t> rids(static_cast<std::size_t>(rows));
    REQUIRE(kp::token_ids<Id>(rows, x.data(), vocab, rids.data()) == -1);
    CHECK(kc::token_ids<Id>(rows, dx.data(), vocab, ids.data()) == -1);
    CHECK(host(ids) == rids);

    const auto table = uniform<T>(vocab * dim, -1, 1), pos = uniform<T>(block * dim, -1, 1);
    const auto rtable = to_double(table), rpos = to_double(pos);
    auto dtable = on_gpu(table), dpos = on_gpu(pos);
    for (bool with_pos : {false, true}) {
      auto out = poisoned<T>(rows * dim);
      kc::embedding_forward<T>(rows, dim, ids.data(), dtable.data(), with_pos ? dpos.data() : nullptr, seq,
                               out.data());
      std::vector<double> ref(static_cast<std::size_t>(rows * dim));
      kp::embedding_forward<double>(rows, dim, rids.data(), rtable.data(), with_pos ? rpos.data() : nullptr, seq,
                                    ref.data());
      INFO("rows " << rows << " with positions " << with_pos);
      CHECK_CLOSE(host(out), ref);
    }

    // The gradients accumulate into random values (a tied LM head adds first).
    const auto dout = uniform<T>(rows * dim, -1, 1);
    const auto gtable0 = uniform<T>(vocab * dim, -1, 1), gpos0 = uniform<T>(block * dim, -1, 1);
    const auto rdout = to_double(dout);
    for (bool with_pos : {false, true}) {
      auto ddout = on_gpu(dout), gtable = on_gpu(gtable0), gpos = on_gpu(gpos0);
      kc::embedding_backward<T>(rows, dim, ids.data(), ddout.data(), gtable.data(), with_pos ? gpos.data() : nullptr,
                                seq);
      auto rgtable = to_double(gtable0), rgpos = to_double(gpos0);
      kp::embedding_backward<double>(rows, dim, rids.data(), rdout.data(), rgtable.data(),
                                     with_pos ? rgpos.data() : nullptr, seq);
      const auto got_table = host(gtable), got_pos = host(gpos);
      INFO("rows " << rows << " with positions " << with_pos);
      CHECK_CLOSE(got_table, rgtable);
      CHECK_CLOSE(got_pos, rgpos);  // unchanged without positions
      // Each table and position row adds its rows in the CPU kernel's order, so
      // in T the results are the same bits (Note [Deterministic embedding backward]).
      if constexpr (!std::is_same_v<T, bf16>) {
        auto same_table = gtable0, same_pos = gpos0;
        kp::embedding_backward<T>(rows, dim, rids.data(), dout.data(), same_table.data(),
                                  with_pos ? same_pos.data() : nullptr, seq);
        CHECK(got_table == same_table);
        CHECK(got_pos == same_pos);
      }
    }
  }

  // The first value that is not an id in [0, vocab) is reported, whatever the thread order.
  std::vector<Id> bad(5000, Id(3));
  bad[4000] = Id(-1);
  bad[1234] = Id(2.5);
  bad[3000] = static_cast<Id>(vocab);
  auto dbad = on_gpu(bad);
  auto out = on_gpu(std::vector<std::int32_t>(bad.size(), 0));
  CHECK(kc::token_ids<Id>(5000, dbad.data(), vocab, out.data()) == 1234);
  bad[1234] = nan_of<Id>();
  dbad = on_gpu(bad);
  CHECK(kc::token_ids<Id>(5000, dbad.data(), vocab, out.data()) == 1234);
}

TEST_CASE("cuda: embedding modules take token ids on the device and check them", "[gpu]") {
  Generator gen(5);
  nn::TokenPositionEmbedding<float> tpe(5, 4, 3, 0.0, 0, gen);
  tpe.to(kGpu);
  nn::Cache<float> c;
  auto y = tpe.forward(Tensor<float>::from({1, 2, 3, 0, 4, 4}, {2, 3}).to(kGpu), c);
  CHECK(y.device() == kGpu);
  CHECK(y.shape() == Shape{2, 3, 3});
  CHECK(c.indices.at(0).device() == kGpu);
  c.clear();
  REQUIRE_THROWS_WITH(tpe.forward(Tensor<float>::from({1, 2, 3, 0, 1.5f, 7}, {2, 3}).to(kGpu), c),
                      Catch::Contains("[ptrain.embedding.id]") && Catch::Contains("1.5") &&
                          Catch::Contains("position [1, 1]"));
  CHECK_THROWS_AS(tpe.forward(Tensor<float>::from({-1, 2}, {1, 2}).to(kGpu), c), ShapeError);
  // Ids on the cpu and a table on the gpu are refused, not dereferenced.
  auto cpu_ids = ops::token_ids(Tensor<float>::from({1, 2}, {1, 2}), 5);
  CHECK_THROWS_WITH(ops::embedding(cpu_ids, tpe.wte().weight().value, Tensor<float>()),
                    Catch::Contains("[ptrain.device.mismatch]"));
}

// ------------------------------------------------------------- attention ----

namespace {
// One attention shape: batch, sequence, heads, head width, dropout.
struct AttentionCase {
  std::int64_t B, S, H, D;
  double p;
};
}  // namespace

TEMPLATE_TEST_CASE("cuda: causal attention forward and backward, with and without dropout", "[gpu]", float,
                   double, bf16) {
  using T = TestType;
  // D = 5: head matrices off 16-byte boundaries, the one-GEMM-per-head path.
  for (const AttentionCase cs : std::vector<AttentionCase>{
           {1, 1, 1, 4, 0.0}, {2, 70, 3, 16, 0.0}, {2, 130, 2, 8, 0.2}, {1, 600, 2, 32, 0.1}, {2, 33, 3, 5, 0.1}}) {
    const std::int64_t B = cs.B, S = cs.S, H = cs.H, D = cs.D, C = H * D;
    const double p = cs.p;
    const std::uint64_t seed = rng().below(1ull << 62), offset = rng().below(1ull << 40);
    const auto qkv = uniform<T>(B * S * 3 * C, -1, 1), dy = uniform<T>(B * S * C, -1, 1);
    const auto rqkv = to_double(qkv), rdy = to_double(dy);
    auto dqkv_in = on_gpu(qkv), ddy = on_gpu(dy);
    auto probs = poisoned<T>(B * H * S * S), probs_drop = poisoned<T>(B * H * S * S), y = poisoned<T>(B * S * C);
    kc::causal_attention_forward<T>(B, S, H, D, dqkv_in.data(), static_cast<Acc<T>>(1.0 / std::sqrt(double(D))),
                                    probs.data(), p > 0 ? probs_drop.data() : nullptr, p, seed, offset, y.data());
    std::vector<double> rprobs(static_cast<std::size_t>(B * H * S * S)), rdrop(rprobs.size()),
        ry(static_cast<std::size_t>(B * S * C));
    kp::causal_attention_forward<double>(B, S, H, D, rqkv.data(), 1.0 / std::sqrt(double(D)), rprobs.data(),
                                         p > 0 ? rdrop.data() : nullptr, p, seed, offset, ry.data());
    INFO("B " << B << " S " << S << " H " << H << " D " << D << " p " << p << " seed " << seed);
    const auto gprobs = host(probs), gdrop = host(probs_drop);
    CHECK_CLOSE(host(y), ry);
    CHECK_CLOSE(gprobs, rprobs);
    // Exact zeros above the diagonal, and with dropout the CPU's mask exactly.
    std::int64_t nonzero_above = 0, mask_mismatches = 0;
    for (std::int64_t r = 0; r < B * H * S; ++r)
      for (std::int64_t j = 0; j < S; ++j) {
        const std::size_t e = static_cast<std::size_t>(r * S + j);
        if (j > r % S) nonzero_above += !(as_double(gprobs[e]) == 0) + (p > 0 && !(as_double(gdrop[e]) == 0));
        else if (p > 0) mask_mismatches += (as_double(gdrop[e]) == 0) != (rdrop[e] == 0.0);
      }
    CHECK(nonzero_above == 0);
    CHECK(mask_mismatches == 0);
    if (p > 0) CHECK_CLOSE(gdrop, rdrop);

    // Backward from the GPU's probabilities, against the CPU in double on the same values.
    auto dqkv = poisoned<T>(B * S * 3 * C);
    kc::causal_attention_backward<T>(B, S, H, D, dqkv_in.data(), probs.data(), p > 0 ? probs_drop.data() : nullptr,
                                     p, seed, offset, ddy.data(), static_cast<Acc<T>>(1.0 / std::sqrt(double(D))),
                                     dqkv.data());
    const auto rgprobs = to_double(gprobs), rgdrop = to_double(gdrop);
    std::vector<double> rdqkv(rqkv.size());
    kp::causal_attention_backward<double>(B, S, H, D, rqkv.data(), rgprobs.data(), p > 0 ? rgdrop.data() : nullptr,
                                          p, seed, offset, rdy.data(), 1.0 / std::sqrt(double(D)), rdqkv.data());
    CHECK_CLOSE(host(dqkv), rdqkv);
  }
}

// The fused bf16 attention (Note [Flash attention]) against the CPU kernels in
// double on the same bf16 inputs: output, each row's log-sum-exp (computed here
// in double) and dqkv, with and without dropout; then through ops::, which must
// choose it for bf16 and fall back after set_flash_attention(false).
TEST_CASE("cuda: flash attention matches the CPU in double", "[gpu]") {
  for (const AttentionCase cs : std::vector<AttentionCase>{
           {1, 1, 1, 32, 0.0}, {2, 70, 3, 32, 0.0}, {2, 130, 2, 64, 0.2}, {1, 600, 2, 64, 0.1}, {1, 200, 1, 128, 0.0}}) {
    const std::int64_t B = cs.B, S = cs.S, H = cs.H, D = cs.D, C = H * D;
    const double p = cs.p, scale = 1.0 / std::sqrt(double(D));
    const std::uint64_t seed = rng().below(1ull << 62), offset = rng().below(1ull << 40);
    const auto qkv = uniform<bf16>(B * S * 3 * C, -1, 1), dy = uniform<bf16>(B * S * C, -1, 1);
    const auto rqkv = to_double(qkv), rdy = to_double(dy);
    std::vector<double> rprobs(static_cast<std::size_t>(B * H * S * S)), rdrop(rprobs.size()),
        ry(static_cast<std::size_t>(B * S * C)), rdqkv(rqkv.size()), rlse(static_cast<std::size_t>(B * H * S));
    kp::causal_attention_forward<double>(B, S, H, D, rqkv.data(), scale, rprobs.data(), p > 0 ? rdrop.data() : nullptr,
                                         p, seed, offset, ry.data());
    kp::causal_attention_backward<double>(B, S, H, D, rqkv.data(), rprobs.data(), p > 0 ? rdrop.data() : nullptr, p,
                                          seed, offset, rdy.data(), scale, rdqkv.data());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < S; ++i) {
          std::vector<double> sc;
          for (std::int64_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (std::int64_t d = 0; d < D; ++d)
              dot += rqkv[static_cast<std::size_t>((b * S + i) * 3 * C + h * D + d)] *
                     rqkv[static_cast<std::size_t>((b * S + j) * 3 * C + C + h * D + d)];
            sc.push_back(dot * scale);
          }
          const double mx = *std::max_element(sc.begin(), sc.end());
          double sum = 0;
          for (double v : sc) sum += std::exp(v - mx);
          rlse[static_cast<std::size_t>((b * H + h) * S + i)] = mx + std::log(sum);
        }

    auto dqkv_in = on_gpu(qkv), ddy = on_gpu(dy);
    REQUIRE(kc::flash_attention_supported<bf16>(D, dqkv_in.data()));
    auto y = poisoned<bf16>(B * S * C), dqkv = poisoned<bf16>(B * S * 3 * C);
    auto lse = poisoned<float>(B * H * S);
    kc::flash_attention_forward<bf16>(B, S, H, D, dqkv_in.data(), static_cast<float>(scale), p, seed, offset, y.data(),
                                      lse.data());
    kc::flash_attention_backward<bf16>(B, S, H, D, dqkv_in.data(), y.data(), lse.data(), p, seed, offset, ddy.data(),
                                       static_cast<float>(scale), dqkv.data());
    INFO("B " << B << " S " << S << " H " << H << " D " << D << " p " << p << " seed " << seed);
    CHECK(rel_err(host(y), ry) <= 1e-2);
    // Float arithmetic on the same inputs. A log-sum-exp can sit near 0 (S = 1: one
    // score), where only an absolute bound means something: scale at least 1.
    CHECK(rel_err(host(lse), rlse, 1.0) <= 1e-5);
    CHECK(rel_err(host(dqkv), rdqkv) <= 1e-2);
    // Deterministic: each block owns the dK/dV or dQ rows it writes (no atomics),
    // so a second backward on the same inputs gives the same bits.
    auto dqkv_again = poisoned<bf16>(B * S * 3 * C);
    kc::flash_attention_backward<bf16>(B, S, H, D, dqkv_in.data(), y.data(), lse.data(), p, seed, offset, ddy.data(),
                                       static_cast<float>(scale), dqkv_again.data());
    CHECK(to_double(host(dqkv_again)) == to_double(host(dqkv)));

    // ops:: picks the fused path for bf16, and the materialised one when it is off;
    // a fused forward's backward stays fused after the switch.
    auto q3 = dqkv_in.reshape({B, S, 3 * C});
    ops::AttentionSaved<bf16> fused, plain;
    const auto y_fused = host(ops::causal_attention(q3, H, p, seed, offset, fused));
    CHECK(fused.lse.defined());
    CHECK(!fused.probs.defined());
    const RestoreSwitch restore{kc::set_flash_attention, kc::flash_attention_enabled()};
    kc::set_flash_attention(false);
    const auto y_plain = host(ops::causal_attention(q3, H, p, seed, offset, plain));
    CHECK(!plain.lse.defined());
    CHECK(rel_err(y_fused, ry) <= 1e-2);
    CHECK(rel_err(y_plain, ry) <= 1e-2);
    CHECK(rel_err(host(ops::causal_attention_backward(q3, fused, H, ddy.reshape({B, S, C}))), rdqkv) <= 1e-2);
  }
}

// ----------------------------------------------------- GPT training step ----

namespace {
// One forward + backward of a GPT on `device` (ids and targets are cpu tensors); returns the loss.
template <class T>
double gpt_step(nn::GPT<T>& model, const Tensor<std::int32_t>& ids, const Tensor<std::int32_t>& targets,
                Device device) {
  nn::CrossEntropyLoss<T> loss_fn;
  nn::Cache<T> cache, loss_cache;
  auto logits = model.forward_tokens(ids.to(device), cache);
  REQUIRE(logits.device() == device);
  const double loss = loss_fn.forward(logits, targets.to(device), loss_cache);
  model.backward(loss_fn.backward(loss_cache), cache);
  return loss;
}
}  // namespace

// The whole model on cuda:0 against the same model on the CPU: embedding,
// attention (with its dropout), LayerNorm, GELU, the tied head and the loss,
// in training mode so that every dropout mask must also agree. Both sides run
// in T; they differ only in the order of floating-point additions. In bf16 that
// order also decides which way a value rounds, and the flips add up through
// the model (as against double: tests/unit/nn/test_bf16.cpp), so the bound is
// 5e-2 for gradients and 1e-2 for the loss.
TEMPLATE_TEST_CASE("cuda: a GPT step (2 layers, 2 heads) matches the CPU", "[gpu]", float, double, bf16) {
  using T = TestType;
  const double bound = std::is_same_v<T, bf16> ? 5e-2 : std::is_same_v<T, float> ? 1e-4 : 1e-10;
  const double loss_bound = std::is_same_v<T, bf16> ? 1e-2 : bound;
  nn::GPTConfig cfg;
  cfg.vocab_size = 37;
  cfg.block_size = 24;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 32;
  cfg.dropout = 0.1;
  cfg.dropout_seed = rng().below(1ull << 62);
  for (bool tied : {true, false}) {
    cfg.tie_weights = tied;
    const std::uint64_t init_seed = rng().below(1ull << 62);
    Generator g_cpu(init_seed), g_gpu(init_seed);
    nn::GPT<T> cpu_model(cfg, g_cpu), gpu_model(cfg, g_gpu);
    gpu_model.to(kGpu);

    const std::int64_t B = 3, S = 20;
    std::vector<std::int32_t> x(static_cast<std::size_t>(B * S)), t(x.size());
    for (auto& v : x) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(cfg.vocab_size)));
    for (auto& v : t) v = static_cast<std::int32_t>(rng().below(static_cast<std::uint64_t>(cfg.vocab_size)));
    t[5] = -100;  // an ignored position
    const auto ids = Tensor<std::int32_t>::from(x, {B, S});
    const auto targets = Tensor<std::int32_t>::from(t, {B * S});

    INFO("tied " << tied << " seed " << test_seed());
    // Two steps: the second runs with accumulated gradients and advanced dropout streams.
    for (int step = 0; step < 2; ++step) {
      const double loss_cpu = gpt_step(cpu_model, ids, targets, Device::cpu());
      const double loss_gpu = gpt_step(gpu_model, ids, targets, kGpu);
      INFO("step " << step << " loss cpu " << loss_cpu << " gpu " << loss_gpu);
      CHECK(std::abs(loss_gpu - loss_cpu) <= loss_bound * std::abs(loss_cpu));
    }
    check_same_gradients(cpu_model, gpu_model, bound);
  }
}

// ------------------------------------------------------- mixed precision ----

namespace {
std::vector<bf16> to_bf16(const std::vector<float>& v) {
  std::vector<bf16> out;
  for (float x : v) out.push_back(bf16(x));
  return out;
}
std::vector<double> bf16_to_double(const std::vector<bf16>& v) {
  std::vector<double> out;
  for (bf16 x : v) out.push_back(static_cast<double>(static_cast<float>(x)));
  return out;
}
}  // namespace

// bf16 operands, fp32 accumulation: the reference is the double product of the
// same bf16 values, so the float result differs only by fp32 accumulation
// (1e-5) and the bf16 result also by its final rounding (2^-9 relative, 1e-2 bound).
TEST_CASE("cuda: gemm_bf16 matches the double product of its bf16 inputs", "[gpu]") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (auto [m, n, k] : std::vector<std::array<std::int64_t, 3>>{{37, 53, 29}, {256, 384, 512}}) {
        const auto a = to_bf16(uniform<float>(m * k, -1, 1)), b = to_bf16(uniform<float>(k * n, -1, 1));
        const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
        std::vector<double> ref(static_cast<std::size_t>(m * n), 0.0);
        const auto ad = bf16_to_double(a), bd = bf16_to_double(b);
        kp::gemm<double>(ta, tb, m, n, k, 0.5, ad.data(), lda, bd.data(), ldb, 0.0, ref.data(), n);
        auto da = Tensor<bf16>::from(a, {m * k}).to(kGpu), db = Tensor<bf16>::from(b, {k * n}).to(kGpu);
        auto c32 = poisoned<float>(m * n);
        kc::gemm_bf16<float>(ta, tb, m, n, k, 0.5f, da.data(), lda, db.data(), ldb, 0.0f, c32.data(), n);
        auto c16 = Tensor<bf16>::from(std::vector<bf16>(static_cast<std::size_t>(m * n), bf16(nan)), {m * n}).to(kGpu);
        kc::gemm_bf16<bf16>(ta, tb, m, n, k, 0.5f, da.data(), lda, db.data(), ldb, 0.0f, c16.data(), n);
        INFO("ta " << ta << " tb " << tb << " m " << m << " n " << n << " k " << k << " seed " << test_seed());
        CHECK(rel_err(host(c32), ref) <= 1e-5);
        CHECK(rel_err(bf16_to_double(c16.to_vector()), ref) <= 1e-2);
      }
}

TEST_CASE("cuda: float <-> bf16 casts give the CPU's bits", "[gpu]") {
  auto x = uniform<float>(10007, -1e3, 1e3);
  const float inf = std::numeric_limits<float>::infinity();
  // Specials, and ties that round to even both ways (1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6).
  for (float v : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::quiet_NaN(), 1.0f + 0x1p-8f,
                  1.0f + 3 * 0x1p-8f, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()})
    x.push_back(v);
  const auto n = static_cast<std::int64_t>(x.size());
  auto dx = on_gpu(x);
  auto dy = Tensor<bf16>::empty({n}, kGpu);
  kc::cast<float, bf16>(n, dx.data(), dy.data());
  const auto got = dy.to_vector();
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < x.size(); ++i) mismatches += got[i].bits != bf16(x[i]).bits;
  CHECK(mismatches == 0);
  auto back = poisoned<float>(n);
  kc::cast<bf16, float>(n, dy.data(), back.data());
  const auto b = host(back);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float want = static_cast<float>(got[i]);
    if (std::isnan(want)) CHECK(std::isnan(b[i]));
    else CHECK(b[i] == want);
  }
}

// fp32 master weights and moments against the double update, from a float and
// from a bf16 gradient; the bf16 parameters must be the rounding of the master.
TEST_CASE("cuda: adamw_update_mixed updates fp32 master weights and writes their bf16 copy", "[gpu]") {
  const std::int64_t n = 50001;
  for (bool bf16_grad : {false, true}) {
    const auto p = uniform<float>(n, -1, 1), m = uniform<float>(n, -0.1, 0.1), v = uniform<float>(n, 0, 0.01);
    const auto g16 = to_bf16(uniform<float>(n, -1, 1));
    std::vector<float> g;
    for (bf16 x : g16) g.push_back(static_cast<float>(x));
    auto dp = on_gpu(p), dm = on_gpu(m), dv = on_gpu(v), dg = on_gpu(g);
    auto dg16 = Tensor<bf16>::from(g16, {n}).to(kGpu);
    auto param = Tensor<bf16>::empty({n}, kGpu);
    if (bf16_grad)
      kc::adamw_update_mixed<bf16>(n, dp.data(), dg16.data(), dm.data(), dv.data(), 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                   3, param.data());
    else
      kc::adamw_update_mixed<float>(n, dp.data(), dg.data(), dm.data(), dv.data(), 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f,
                                    3, param.data());
    auto rp = to_double(p), rm = to_double(m), rv = to_double(v);
    const auto rg = to_double(g);
    kp::adamw_update<double>(n, rp.data(), rg.data(), rm.data(), rv.data(), 1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
    INFO("bf16 gradient " << bf16_grad << " seed " << test_seed());
    const auto master = host(dp);
    CHECK(rel_err(master, rp) <= 1e-5);
    CHECK(rel_err(host(dm), rm) <= 1e-5);
    CHECK(rel_err(host(dv), rv) <= 1e-5);
    const auto copy = param.to_vector();
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < master.size(); ++i) mismatches += copy[i].bits != bf16(master[i]).bits;
    CHECK(mismatches == 0);
  }
}

// optim::AdamW<bf16> on cuda:0 (adamw_update_mixed) against the same optimizer
// on the CPU (kernels/cpu/bf16.hpp) from the same bf16 gradients: the fp32
// master weights agree to float rounding and the parameters are their bf16
// rounding on both devices.
TEST_CASE("cuda: AdamW on bf16 parameters steps like the CPU", "[gpu]") {
  const std::int64_t n = 100003;
  const auto values = to_bf16(uniform<float>(n, -1, 1));
  Tensor<bf16> cpu_values = Tensor<bf16>::from(values, {n}), gpu_values = cpu_values.to(kGpu);
  Tensor<bf16> cpu_grads = Tensor<bf16>::zeros({n}), gpu_grads = Tensor<bf16>::zeros({n}, kGpu);
  const optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW<bf16> cpu_opt(cpu_values, cpu_grads, {}, o), gpu_opt(gpu_values, gpu_grads, {}, o);
  for (int step = 0; step < 3; ++step) {
    const auto g = Tensor<bf16>::from(to_bf16(uniform<float>(n, -1, 1)), {n});
    cpu_grads.copy_(g);
    gpu_grads.copy_(g);
    cpu_opt.step();
    gpu_opt.step();
  }
  const auto master_cpu = cpu_opt.flat_state().back().second.to_vector();
  const auto master_gpu = gpu_opt.flat_state().back().second.to_vector();
  REQUIRE(gpu_opt.flat_state().back().first == "master");
  INFO("seed " << test_seed());
  CHECK(rel_err(master_gpu, to_double(master_cpu)) <= 1e-5);
  const auto p = gpu_values.to_vector();
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < p.size(); ++i) mismatches += p[i].bits != bf16(master_gpu[i]).bits;
  CHECK(mismatches == 0);
}

// Convolution, pooling and batch norm through ops/ on cuda:0 (the table's
// im2col / col2im / pooling / batch-norm kernels and cuBLAS) against the same
// ops on the CPU in double.
namespace {
template <class T>
struct Pair {
  Tensor<T> gpu;
  Tensor<double> ref;
};
template <class T>
Pair<T> random_pair(const Shape& s, double lo, double hi) {
  const auto v = uniform<T>(s.numel(), lo, hi);
  return {Tensor<T>::from(v, s).to(kGpu), Tensor<double>::from(to_double(v), s)};
}
template <class T>
Pair<T> zeros_pair(const Shape& s) {
  return {Tensor<T>::zeros(s, kGpu), Tensor<double>::zeros(s)};
}
}  // namespace

TEMPLATE_TEST_CASE("cuda: conv2d forward and backward agree with the CPU", "[gpu]", float, double) {
  using T = TestType;
  ops::Conv2dArgs a{.kernel = {3, 2}, .stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}};
  auto x = random_pair<T>({3, 4, 9, 7}, -1, 1), w = random_pair<T>({6, 2, 3, 2}, -1, 1);
  auto b = random_pair<T>({6}, -1, 1);
  auto y = ops::conv2d(x.gpu, w.gpu, b.gpu, a, 2);
  auto y_ref = ops::conv2d(x.ref, w.ref, b.ref, a, 2);
  CHECK_CLOSE(host(y), y_ref.to_vector());
  auto dy = random_pair<T>(y_ref.shape(), -1, 1);
  auto dw = zeros_pair<T>(w.ref.shape()), db = zeros_pair<T>(b.ref.shape());
  auto dx = ops::conv2d_backward(x.gpu, w.gpu, dy.gpu, dw.gpu, &db.gpu, a, 2);
  auto dx_ref = ops::conv2d_backward(x.ref, w.ref, dy.ref, dw.ref, &db.ref, a, 2);
  CHECK_CLOSE(host(dx), dx_ref.to_vector());
  CHECK_CLOSE(host(dw.gpu), dw.ref.to_vector());
  CHECK_CLOSE(host(db.gpu), db.ref.to_vector());
}

TEMPLATE_TEST_CASE("cuda: max and average pooling agree with the CPU", "[gpu]", float, double) {
  using T = TestType;
  ops::Conv2dArgs a{.kernel = {3, 3}, .stride = {2, 2}, .padding = {1, 1}};
  auto x = random_pair<T>({2, 3, 9, 8}, -1, 1);
  Tensor<std::int32_t> idx, idx_ref;
  auto y = ops::max_pool2d(x.gpu, a, idx);
  auto y_ref = ops::max_pool2d(x.ref, a, idx_ref);
  CHECK_CLOSE(host(y), y_ref.to_vector());
  CHECK(host(idx) == idx_ref.to_vector());
  auto dy = random_pair<T>(y_ref.shape(), -1, 1);
  CHECK_CLOSE(host(ops::max_pool2d_backward(x.gpu, idx, dy.gpu, a)),
              ops::max_pool2d_backward(x.ref, idx_ref, dy.ref, a).to_vector());
  CHECK_CLOSE(host(ops::avg_pool2d(x.gpu, a)), ops::avg_pool2d(x.ref, a).to_vector());
  CHECK_CLOSE(host(ops::avg_pool2d_backward(x.ref.shape(), dy.gpu, a)),
              ops::avg_pool2d_backward(x.ref.shape(), dy.ref, a).to_vector());
}

TEMPLATE_TEST_CASE("cuda: batch_norm forward, backward and running statistics agree with the CPU", "[gpu]", float,
                   double) {
  using T = TestType;
  auto x = random_pair<T>({5, 3, 4, 6}, 1, 3), w = random_pair<T>({3}, 0.5, 1.5), b = random_pair<T>({3}, -1, 1);
  auto rm = random_pair<T>({3}, -1, 1), rv = random_pair<T>({3}, 0.5, 2);
  for (const bool training : {true, false}) {
    INFO("training " << training);
    ops::BatchNormSaved<T> s;
    ops::BatchNormSaved<double> s_ref;
    auto y = ops::batch_norm(x.gpu, w.gpu, b.gpu, &rm.gpu, &rv.gpu, training, 0.1, 1e-5, s);
    auto y_ref = ops::batch_norm(x.ref, w.ref, b.ref, &rm.ref, &rv.ref, training, 0.1, 1e-5, s_ref);
    CHECK_CLOSE(host(y), y_ref.to_vector());
    CHECK_CLOSE(host(rm.gpu), rm.ref.to_vector());
    CHECK_CLOSE(host(rv.gpu), rv.ref.to_vector());
    auto dy = random_pair<T>(x.ref.shape(), -1, 1);
    auto dw = zeros_pair<T>({3}), db = zeros_pair<T>({3});
    CHECK_CLOSE(host(ops::batch_norm_backward(x.gpu, w.gpu, dy.gpu, s, &dw.gpu, &db.gpu)),
                ops::batch_norm_backward(x.ref, w.ref, dy.ref, s_ref, &dw.ref, &db.ref).to_vector());
    CHECK_CLOSE(host(dw.gpu), dw.ref.to_vector());
    CHECK_CLOSE(host(db.gpu), db.ref.to_vector());
  }
}
