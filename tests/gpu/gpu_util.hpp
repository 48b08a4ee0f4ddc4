#pragma once
// Inputs and error measures shared by the GPU tests (test_kernels.cu and the
// .cpp files beside it): one seed per run (printed on failure; PTRAIN_TEST_SEED
// repeats it), uniform random values, and the norm-wise relative error.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "ptrain/core/device.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain::testing {

inline const Device kGpu = Device::cuda(0);

inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* s = std::getenv("PTRAIN_TEST_SEED")) return static_cast<std::uint64_t>(std::strtoull(s, nullptr, 10));
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) | rd();
  }();
  return seed;
}

inline Generator& rng() {
  static Generator g(test_seed());
  return g;
}

/// The norm-wise relative error bound of a result in T computed from T inputs (file comment
/// of test_kernels.cu): bf16 rounds its result to 8 bits, float and double are a few ulp.
template <class T>
constexpr double tol() {
  return std::is_same_v<T, bf16> ? 1e-2 : std::is_same_v<T, float> ? 1e-5 : 1e-12;
}

/// A quiet NaN of T: outputs start as it, so an element a kernel forgets to write fails.
template <class T>
T nan_of() {
  if constexpr (std::is_same_v<T, bf16>) return bf16(std::numeric_limits<float>::quiet_NaN());
  else return std::numeric_limits<T>::quiet_NaN();
}

/// x as a double (exact for bf16, float, double).
template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, bf16>) return static_cast<float>(x);
  else return static_cast<double>(x);
}

template <class T>
std::vector<T> uniform(std::int64_t n, double lo, double hi) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = static_cast<T>(lo + (hi - lo) * rng().uniform());
  return v;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  std::vector<double> out;
  out.reserve(v.size());
  for (const T& x : v) out.push_back(as_double(x));
  return out;
}

/// Host values as a GPU tensor of shape s.
template <class T>
Tensor<T> gpu(const std::vector<T>& v, const Shape& s) {
  return Tensor<T>::from(v, s).to(kGpu);
}

/// The same values in double on the CPU: the reference's input.
template <class T>
Tensor<double> ref(const std::vector<T>& v, const Shape& s) {
  return Tensor<double>::from(to_double(v), s);
}

/// max |got - ref| / max(max |ref|, floor); infinity when got has a non-finite value
/// where ref is finite.
template <class T>
double rel_err(const std::vector<T>& got, const std::vector<double>& ref, double floor = 0) {
  REQUIRE(got.size() == ref.size());
  double max_diff = 0, max_ref = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = as_double(got[i]);
    if (!std::isfinite(g) && std::isfinite(ref[i])) return std::numeric_limits<double>::infinity();
    max_diff = std::max(max_diff, std::abs(g - ref[i]));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  max_ref = std::max(max_ref, floor);
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

/// Every parameter gradient of `gpu` (a model on the GPU) against the same parameter's
/// of `cpu` (same names, same order): norm-wise relative error at most `bound`, and the
/// reference not all zeros (a gradient of zeros would pass trivially).
template <class Model>
void check_same_gradients(Model& cpu, Model& gpu, double bound) {
  auto cpu_params = cpu.named_parameters();
  auto gpu_params = gpu.named_parameters();
  REQUIRE(cpu_params.size() == gpu_params.size());
  for (std::size_t i = 0; i < cpu_params.size(); ++i) {
    INFO("parameter " << cpu_params[i].name);
    REQUIRE(gpu_params[i].name == cpu_params[i].name);
    REQUIRE(gpu_params[i].param->grad.device() == kGpu);
    const auto ref = to_double(cpu_params[i].param->grad.to_vector());
    const double err = rel_err(gpu_params[i].param->grad.to_vector(), ref);
    INFO("relative error " << err);
    CHECK(err <= bound);
    CHECK(std::any_of(ref.begin(), ref.end(), [](double g) { return g != 0.0; }));
  }
}

}  // namespace ptrain::testing
