#pragma once
// The tests' form of ptrain::testing::check_gradients (ptrain/testing/gradcheck.hpp):
// a Catch2 REQUIRE with the report of the worst element; dot() for tests that
// build their own scalar; random_tensor() for their inputs.

#include <catch2/catch.hpp>
#include <ptrain/ops/init.hpp>
#include <ptrain/testing/gradcheck.hpp>

namespace ptrain::testing {

/// A CPU tensor of shape s, uniform in [lo, hi) from the stream of `seed`.
inline Tensor<double> random_tensor(const Shape& s, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  auto x = Tensor<double>::empty(s);
  Generator g(seed);
  ops::uniform_(x, lo, hi, g);
  return x;
}

/// sum(a * b) of two CPU tensors of one size.
inline double dot(const Tensor<double>& a, const Tensor<double>& b) {
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a.data()[i] * b.data()[i];
  return s;
}

inline void check_module_gradients(nn::Module<double>& m, const Tensor<double>& x, bool check_input = true,
                                   double tol = 1e-7, std::int64_t max_points = 64) {
  const GradcheckResult r =
      check_gradients(m, x, {.tolerance = tol, .max_points = max_points, .check_input = check_input});
  INFO(r.report());
  REQUIRE(r.ok);
}

}  // namespace ptrain::testing
