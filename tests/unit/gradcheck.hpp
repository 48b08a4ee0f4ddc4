#pragma once
// Finite-difference gradient checks in double.
//
// For a module f and a fixed random R, the scalar L(x, params) = sum(f(x) * R)
// has dL/dy = R. backward(R) must give dL/dx and accumulate dL/dparams; each is
// compared with the central difference (L(v + h) - L(v - h)) / 2h.

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <ptrain/nn/module.hpp>
#include <ptrain/ops/init.hpp>

namespace ptrain::testing {

inline double dot(const Tensor<double>& a, const Tensor<double>& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a.data()[i] * b.data()[i];
  return s;
}

/// Checks at most `max_points` coordinates of each tensor (evenly spread).
inline void check_module_gradients(nn::Module<double>& m, const Tensor<double>& x, bool check_input = true,
                                   double tol = 1e-7, std::int64_t max_points = 64) {
  nn::Cache<double> cache;
  auto y = m.forward(x, cache);
  Generator gen(123);
  auto r = Tensor<double>::empty(y.shape());
  ops::uniform_(r, -1.0, 1.0, gen);
  m.zero_grad();
  auto dx = m.backward(r, cache);

  auto loss = [&] {
    nn::Cache<double> c;
    return dot(m.forward(x, c), r);
  };
  auto check = [&](Tensor<double> v, const Tensor<double>& analytic, const std::string& what) {
    const std::int64_t n = v.numel();
    const std::int64_t stride = std::max<std::int64_t>(1, n / max_points);
    for (std::int64_t i = 0; i < n; i += stride) {
      const double h = 1e-5, orig = v.data()[i];
      v.data()[i] = orig + h;
      const double lp = loss();
      v.data()[i] = orig - h;
      const double lm = loss();
      v.data()[i] = orig;
      const double numeric = (lp - lm) / (2 * h);
      INFO(what << " element " << i << ": analytic " << analytic.data()[i] << " numeric " << numeric);
      REQUIRE(std::abs(analytic.data()[i] - numeric) <= tol * std::max(1.0, std::abs(numeric)));
    }
  };
  if (check_input) check(x, dx, "input");
  for (auto& p : m.named_parameters()) check(p.param->value, p.param->grad, p.name);
}

}  // namespace ptrain::testing
