// CPU kernels against naive loops in double.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <ptrain/config.hpp>  // before the kernels: Note [GCC 12 AVX-512 warnings]
#include <ptrain/kernels/cpu/bf16.hpp>
#include <ptrain/kernels/cpu/elementwise.hpp>
#include <ptrain/kernels/cpu/fused_classifier.hpp>
#include <ptrain/kernels/cpu/gemm.hpp>
#include <ptrain/kernels/cpu/layer_norm.hpp>
#include <ptrain/kernels/cpu/reduce.hpp>
#include <ptrain/kernels/cpu/softmax.hpp>
#include <ptrain/kernels/stochastic_round.hpp>
#include <ptrain/ops/vector.hpp>
#include <vector>

namespace test_cpu_kernels {

using namespace ptrain;
namespace k = ptrain::kernels::cpu;

namespace {
std::vector<double> random_vec(std::size_t n, std::uint64_t seed) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 2.0 * random_uniform(seed, i) - 1.0;
  return v;
}
}  // namespace

TEST_CASE("gemm matches a naive triple loop for every transpose and stride", "[kernels][gemm]") {
  const std::int64_t m = 7, n = 5, kk = 9, pad = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (double beta : {0.0, 1.0, -0.5}) {
        const std::int64_t lda = (ta ? m : kk) + pad, ldb = (tb ? kk : n) + pad, ldc = n + pad;
        auto a = random_vec(static_cast<std::size_t>((ta ? kk : m) * lda), 1);
        auto b = random_vec(static_cast<std::size_t>((tb ? n : kk) * ldb), 2);
        auto c = random_vec(static_cast<std::size_t>(m * ldc), 3);
        auto ref = c;
        // Rounding error is relative to the magnitude of the terms, not of a
        // result that cancels: bound it by 1e-12 * (|alpha| sum |a b| + |beta c|).
        // Padding columns keep tol 0: they must stay exactly as they were.
        std::vector<double> tol(c.size(), 0.0);
        const double alpha = 1.5;
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) {
            double s = 0, mag = 0;
            for (std::int64_t p = 0; p < kk; ++p) {
              const double t = (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
              s += t;
              mag += std::abs(t);
            }
            ref[i * ldc + j] = alpha * s + beta * c[i * ldc + j];
            tol[i * ldc + j] = 1e-12 * (std::abs(alpha) * mag + std::abs(beta * c[i * ldc + j]));
          }
        // The build's GEMM (OpenBLAS when present) and the Eigen fallback.
        auto c2 = c;
        k::gemm<double>(ta, tb, m, n, kk, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
        k::gemm_eigen<double>(ta, tb, m, n, kk, alpha, a.data(), lda, b.data(), ldb, beta, c2.data(), ldc);
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < ldc; ++j) {
            const auto idx = static_cast<std::size_t>(i * ldc + j);
            REQUIRE(std::abs(c[idx] - ref[idx]) <= tol[idx]);
            REQUIRE(std::abs(c2[idx] - ref[idx]) <= tol[idx]);
          }
        // float through the same paths.
        std::vector<float> af(a.begin(), a.end()), bf(b.begin(), b.end()), cf(c.size(), 0.0f);
        k::gemm<float>(ta, tb, m, n, kk, 1.0f, af.data(), lda, bf.data(), ldb, 0.0f, cf.data(), ldc);
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (std::int64_t p = 0; p < kk; ++p)
              s += (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
            REQUIRE(cf[i * ldc + j] == Approx(s).margin(1e-5));
          }
      }
}

TEST_CASE("softmax cross-entropy matches log-sum-exp in double and is stable", "[kernels][loss]") {
  const std::int64_t rows = 4, cols = 6;
  auto x = random_vec(rows * cols, 5);
  x[3] = 1000.0;  // would overflow a naive exp
  std::vector<std::int32_t> t = {3, 0, -100, 5};
  std::vector<double> lse(rows), d(rows * cols);
  std::int64_t valid = 0;
  const double loss = k::cross_entropy_forward<double>(rows, cols, x.data(), t.data(), lse.data(), valid);
  REQUIRE(valid == 3);
  double ref = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (t[r] < 0) continue;
    double mx = -1e300;
    for (std::int64_t c = 0; c < cols; ++c) mx = std::max(mx, x[r * cols + c]);
    double s = 0;
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(x[r * cols + c] - mx);
    ref += mx + std::log(s) - x[r * cols + t[r]];
  }
  REQUIRE(loss == Approx(ref / 3).epsilon(1e-12));
  REQUIRE(std::isfinite(loss));
  k::cross_entropy_backward<double>(rows, cols, x.data(), lse.data(), t.data(), valid, 1.0, d.data());
  for (std::int64_t c = 0; c < cols; ++c) REQUIRE(d[2 * cols + c] == 0.0);  // ignored row
  double row_sum = 0;
  for (std::int64_t c = 0; c < cols; ++c) row_sum += d[c];
  REQUIRE(std::abs(row_sum) < 1e-12);  // softmax - onehot sums to zero
}

namespace {
/// Mean cross-entropy with label smoothing eps and its gradient times dloss, in double:
/// the definition written out (rows with target ignore or outside [0, cols) do not count).
double naive_cross_entropy(std::int64_t rows, std::int64_t cols, const std::vector<double>& x,
                           const std::vector<std::int32_t>& t, double eps, double dloss, std::vector<double>& grad) {
  std::int64_t valid = 0;
  for (auto ti : t) valid += ti >= 0 && ti < cols;
  double total = 0;
  grad.assign(x.size(), 0.0);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (t[r] < 0 || t[r] >= cols) continue;
    double mx = -1e300, s = 0, mean = 0;
    for (std::int64_t c = 0; c < cols; ++c) mx = std::max(mx, x[r * cols + c]);
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(x[r * cols + c] - mx), mean += x[r * cols + c] / cols;
    const double lse = mx + std::log(s);
    total += (1 - eps) * (lse - x[r * cols + t[r]]) + eps * (lse - mean);
    for (std::int64_t c = 0; c < cols; ++c)
      grad[r * cols + c] = dloss * (std::exp(x[r * cols + c] - lse) - (c == t[r] ? 1 - eps : 0.0) - eps / cols) / valid;
  }
  return total / valid;
}
}  // namespace

TEST_CASE("fused classifier: loss and in-place gradient against the definition in double", "[kernels][loss][fused]") {
  const std::int64_t rows = 5, cols = 37;
  auto x = random_vec(rows * cols, 11);
  for (auto& v : x) v *= 4.0;
  x[2 * cols + 1] = 500.0;  // would overflow a naive exp
  const std::vector<std::int32_t> t = {3, -100, 1, 36, 40};  // an ignored row and a target out of range
  for (double eps : {0.0, 0.1}) {
    std::vector<double> want;
    const double ref = naive_cross_entropy(rows, cols, x, t, eps, 0.5, want);
    // double and float against the definition; the accumulator adds weight * loss to what it held.
    std::vector<double> xd = x;
    double acc[2] = {0.25, 1.0};
    k::fused_classifier<double>(rows, cols, xd.data(), t.data(), -100, eps, 0.5, 2.0, acc);
    CHECK(acc[0] == Approx(0.25 + 2.0 * ref).epsilon(1e-13));
    CHECK(acc[1] == 2.0);  // one target outside [0, cols) added
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(xd[i] == Approx(want[i]).margin(1e-15));
    for (std::int64_t c = 0; c < cols; ++c) CHECK(xd[1 * cols + c] == 0.0);  // ignored
    for (std::int64_t c = 0; c < cols; ++c) CHECK(xd[4 * cols + c] == 0.0);  // target out of range
    std::vector<float> xf(x.begin(), x.end());
    double accf[2] = {0, 0};
    k::fused_classifier<float>(rows, cols, xf.data(), t.data(), -100, static_cast<float>(eps), 0.5f, 1.0, accf);
    CHECK(accf[0] == Approx(ref).epsilon(1e-5));
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(xf[i] == Approx(want[i]).margin(1e-7));
  }
}

// The same arithmetic as the two calls, row by row; the compiler may contract a
// multiply-add differently in the two places it inlines it (AVX-512, -O3), so the
// results agree to a few float ulps (1e-6 relative), not bit for bit.
TEST_CASE("fused classifier on the CPU agrees with cross_entropy forward and backward", "[kernels][loss][fused]") {
  const std::int64_t rows = 6, cols = 29;
  const auto x = random_vec(rows * cols, 12);
  const std::vector<std::int32_t> t = {0, 28, 7, -1, 13, 5};  // ignore_index -1
  const float eps = 0.05f, dloss = 0.75f;
  auto close = [](const auto& got, const auto& want) {
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(static_cast<float>(got[i])) -
                                       static_cast<double>(static_cast<float>(want[i]))));
      scale = std::max(scale, std::abs(static_cast<double>(static_cast<float>(want[i]))));
    }
    return worst <= 1e-6 * scale;
  };
  // float
  std::vector<float> xf(x.begin(), x.end()), lse(rows), d(rows * cols);
  std::int64_t valid = 0;
  const double loss = k::cross_entropy_forward<float>(rows, cols, xf.data(), t.data(), lse.data(), valid, -1, eps);
  k::cross_entropy_backward<float>(rows, cols, xf.data(), lse.data(), t.data(), valid, dloss, d.data(), -1, eps);
  double acc[2] = {0, 0};
  k::fused_classifier<float>(rows, cols, xf.data(), t.data(), -1, eps, dloss, 1.0, acc);
  CHECK(acc[0] == Approx(loss).epsilon(1e-6));
  CHECK(acc[1] == 0);
  CHECK(close(xf, d));
  // bf16: widened to float, the gradient rounded once (a float ulp apart can round to
  // neighbouring bf16 values: 2^-8 relative)
  std::vector<bf16> xb(x.size()), db(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) xb[i] = bf16(static_cast<float>(x[i]));
  const double lossb = k::cross_entropy_forward(rows, cols, xb.data(), t.data(), lse.data(), valid, -1, eps);
  k::cross_entropy_backward(rows, cols, xb.data(), lse.data(), t.data(), valid, dloss, db.data(), -1, eps);
  double accb[2] = {0, 0};
  k::fused_classifier<bf16>(rows, cols, xb.data(), t.data(), -1, eps, dloss, 1.0, accb);
  CHECK(accb[0] == Approx(lossb).epsilon(1e-6));
  for (std::size_t i = 0; i < xb.size(); ++i)
    CHECK(static_cast<float>(xb[i]) == Approx(static_cast<float>(db[i])).epsilon(0x1p-8).margin(1e-7));
}

TEST_CASE("stochastic rounding to bf16 is unbiased, picks a neighbour and repeats per (seed, step, index)",
          "[kernels][bf16][fused]") {
  const float x = 1.0f + 0.3f * 0x1p-7f;  // 30% of the way from 1 to the next bf16, 1 + 2^-7
  const float lo = 1.0f, hi = 1.0f + 0x1p-7f;
  double sum = 0;
  int ups = 0;
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const float r = static_cast<float>(kernels::bf16_round_stochastic(x, 7, 3, static_cast<std::uint64_t>(i)));
    REQUIRE((r == lo || r == hi));
    ups += r == hi;
    sum += r;
  }
  // P(up) = 0.3: a binomial's standard deviation is sqrt(n 0.3 0.7) ~ 65; allow 5 of them.
  CHECK(std::abs(ups - 0.3 * n) < 5 * std::sqrt(n * 0.21));
  CHECK(std::abs(sum / n - x) < 5 * std::sqrt(0.21 / n) * 0x1p-7);
  CHECK(kernels::bf16_round_stochastic(x, 7, 3, 11).bits == kernels::bf16_round_stochastic(x, 7, 3, 11).bits);
  int differ = 0;  // another step draws again
  for (int i = 0; i < 64; ++i)
    differ += kernels::bf16_round_stochastic(x, 7, 3, i).bits != kernels::bf16_round_stochastic(x, 7, 4, i).bits;
  CHECK(differ > 0);
  // Values that are bf16 already stay; infinities and NaN round to nearest.
  CHECK(static_cast<float>(kernels::bf16_round_stochastic(-2.5f, 1, 1, 5)) == -2.5f);
  CHECK(std::isinf(static_cast<float>(kernels::bf16_round_stochastic(INFINITY, 1, 1, 5))));
  CHECK(std::isnan(static_cast<float>(kernels::bf16_round_stochastic(NAN, 1, 1, 5))));
}

TEST_CASE("layer norm forward normalises rows", "[kernels][layer_norm]") {
  const std::int64_t rows = 3, dd = 8;
  auto x = random_vec(rows * dd, 9);
  std::vector<double> g(dd, 2.0), b(dd, 0.5), y(rows * dd), mean(rows), rstd(rows);
  k::layer_norm_forward<double>(rows, dd, x.data(), g.data(), b.data(), 1e-5, y.data(), mean.data(), rstd.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    double m = 0, v = 0;
    for (std::int64_t i = 0; i < dd; ++i) m += x[r * dd + i] / dd;
    for (std::int64_t i = 0; i < dd; ++i) v += (x[r * dd + i] - m) * (x[r * dd + i] - m) / dd;
    for (std::int64_t i = 0; i < dd; ++i)
      REQUIRE(y[r * dd + i] == Approx(2.0 * (x[r * dd + i] - m) / std::sqrt(v + 1e-5) + 0.5).epsilon(1e-12));
  }
}

TEST_CASE("dropout keeps about 1-p of the elements, scaled, with a reproducible mask", "[kernels][dropout]") {
  const std::int64_t n = 100000;
  std::vector<float> x(n, 1.0f), y(n), y2(n);
  k::dropout<float>(n, x.data(), y.data(), 0.25, 11, 1000);
  k::dropout<float>(n, x.data(), y2.data(), 0.25, 11, 1000);
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    REQUIRE(y[i] == y2[i]);
    REQUIRE((y[i] == 0.0f || y[i] == Approx(1.0f / 0.75f)));
    kept += y[i] != 0.0f;
  }
  REQUIRE(std::abs(static_cast<double>(kept) / n - 0.75) < 0.007);  // ~5 sigma
}

TEST_CASE("reductions and argmax", "[kernels][reduce]") {
  std::vector<float> x = {1, -2, 3, 3, 0.5f, -1};
  REQUIRE(k::sum<float>(6, x.data()) == Approx(4.5));
  REQUIRE(k::sum_squares<float>(6, x.data()) == Approx(1 + 4 + 9 + 9 + 0.25 + 1));
  std::int32_t am[2];
  k::argmax_rows<float>(2, 3, x.data(), am);
  REQUIRE(am[0] == 2);
  REQUIRE(am[1] == 0);
  REQUIRE(ops::argmax_rows(Tensor<float>::from(x, {3, 2})).to_vector() == std::vector<std::int32_t>{0, 0, 0});
  REQUIRE_THROWS_WITH(ops::argmax_rows(Tensor<float>::empty({2, 0})), Catch::Contains("[ptrain.argmax]"));
}

}  // namespace test_cpu_kernels
