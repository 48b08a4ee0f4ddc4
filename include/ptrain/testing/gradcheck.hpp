#pragma once
// A finite-difference gradient check for modules, in double: what a user who
// writes a Module (docs/nn.md, "Writing a module") runs to test its backward.
//
//   MyLayer<double> layer(...);
//   auto r = ptrain::testing::check_gradients(layer, x);   // x: Tensor<double> input
//   if (!r.ok) std::cerr << r.report() << "\n";            // the worst element, analytic vs numeric
//
// For a fixed random R of the output's shape, the scalar L(x, params) =
// sum(f(x) * R) has dL/dy = R. backward(R) must return dL/dx and accumulate
// dL/dparam into each parameter's grad; every checked coordinate v is compared
// with the central difference (L(v + h) - L(v - h)) / 2h. An element passes
// when |analytic - numeric| <= tolerance * max(1, |numeric|).
//
// The module may live on the CPU or a CUDA device (tensors are read and
// perturbed through host copies); it must be deterministic (turn dropout off
// with train(false)) and smooth around the checked point (no input exactly at
// a kink such as ReLU's 0).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/ops/init.hpp"

namespace ptrain::testing {

struct GradcheckOptions {
  double step = 1e-5;              ///< h of the central difference
  double tolerance = 1e-7;         ///< relative to max(1, |numeric|)
  std::int64_t max_points = 64;    ///< coordinates checked per tensor, evenly spread (all when fewer)
  bool check_input = true;         ///< also check dL/dx (off for inputs that are ids)
  std::uint64_t seed = 123;        ///< of the random output weights R
};

/// The outcome: ok, and the element with the largest error over every checked tensor.
struct GradcheckResult {
  bool ok = true;
  std::int64_t checked = 0;        ///< coordinates compared
  std::int64_t failed = 0;         ///< of which outside the tolerance
  double worst_error = 0;          ///< largest |analytic - numeric| / max(1, |numeric|)
  std::string worst_tensor;        ///< "input" or the parameter's name
  std::int64_t worst_index = -1;   ///< flat index in that tensor
  double worst_analytic = 0, worst_numeric = 0;
  double tolerance = 0;

  /// One line for a log or a test failure.
  std::string report() const {
    std::ostringstream s;
    s.precision(10);
    s << (ok ? "gradients match" : "GRADIENT MISMATCH") << ": " << failed << " of " << checked
      << " coordinates outside tolerance " << tolerance;
    if (worst_index >= 0)
      s << "; worst: " << worst_tensor << " element " << worst_index << ", analytic " << worst_analytic
        << ", numeric " << worst_numeric << ", relative error " << worst_error;
    return s.str();
  }
  explicit operator bool() const { return ok; }
};

namespace detail {
inline double weighted_sum(const Tensor<double>& y, const std::vector<double>& r) {
  const std::vector<double> v = y.to_vector();
  double s = 0;
  for (std::size_t i = 0; i < v.size(); ++i) s += v[i] * r[i];
  return s;
}
}  // namespace detail

/// Checks the module's input gradient (unless options.check_input is off) and the
/// gradient of every parameter against central differences; see the top of this file.
/// Leaves the module's parameters as they were and its gradients as backward(R) left them.
inline GradcheckResult check_gradients(nn::Module<double>& m, const Tensor<double>& x,
                                       const GradcheckOptions& options = {}) {
  PTRAIN_CHECK(options.step > 0 && options.tolerance > 0 && options.max_points > 0, Error,
               "[ptrain.gradcheck.options] step, tolerance and max_points must be positive");
  GradcheckResult result;
  result.tolerance = options.tolerance;
  nn::Cache<double> cache;
  const Tensor<double> y = m.forward(x, cache);
  auto r_host = Tensor<double>::empty(y.shape());
  Generator gen(options.seed);
  ops::uniform_(r_host, -1.0, 1.0, gen);
  const std::vector<double> r = r_host.to_vector();
  m.zero_grad();
  const Tensor<double> dx = m.backward(r_host.to(y.device()), cache);

  auto loss = [&] {
    nn::Cache<double> c;
    return detail::weighted_sum(m.forward(x, c), r);
  };
  // Perturbs v through a host copy (v may live on a device), one coordinate at a time.
  auto check = [&](const Tensor<double>& v, const Tensor<double>& analytic_grad, const std::string& what) {
    PTRAIN_CHECK(analytic_grad.defined() && analytic_grad.numel() == v.numel(), Error, "[ptrain.gradcheck.grad] ",
                 what, ": backward gave no gradient of its shape ", v.shape());
    const std::vector<double> analytic = analytic_grad.to_vector();
    Tensor<double> host = v.to(Device::cpu());
    Tensor<double> target = v;  // shares v's storage
    const std::int64_t n = v.numel(), stride = std::max<std::int64_t>(1, n / options.max_points);
    for (std::int64_t i = 0; i < n; i += stride) {
      const double orig = host.data()[i], h = options.step;
      host.data()[i] = orig + h;
      target.copy_(host);
      const double lp = loss();
      host.data()[i] = orig - h;
      target.copy_(host);
      const double lm = loss();
      host.data()[i] = orig;
      target.copy_(host);
      const double numeric = (lp - lm) / (2 * h), a = analytic[static_cast<std::size_t>(i)];
      const double err = std::abs(a - numeric) / std::max(1.0, std::abs(numeric));
      ++result.checked;
      if (!(err <= options.tolerance)) ++result.failed;  // NaN fails too
      if (!(err <= result.worst_error)) {
        result.worst_error = err;
        result.worst_tensor = what;
        result.worst_index = i;
        result.worst_analytic = a;
        result.worst_numeric = numeric;
      }
    }
  };
  if (options.check_input) check(x, dx, "input");
  for (auto& p : m.named_trainable_parameters()) check(p.param->value, p.param->grad, p.name);
  result.ok = result.failed == 0;
  return result;
}

}  // namespace ptrain::testing
