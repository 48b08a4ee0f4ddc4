#pragma once
// Elementwise CPU kernels: bias, activations, dropout, axpy.
//
// Plain loops over contiguous arrays; at -O2/-O3 the compiler vectorises them.
// GELU goes through Eigen arrays because Eigen has a vectorised tanh.

#include "ptrain/config.hpp"  // before Eigen: Note [GCC 12 AVX-512 warnings]
#include <Eigen/Core>
#include <cmath>
#include <cstdint>

#include "ptrain/core/random.hpp"

namespace ptrain::kernels::cpu {

/// y[r, :] += bias for each of `rows` rows of width `cols`.
template <class T>
void bias_add(std::int64_t rows, std::int64_t cols, T* y, const T* bias) {
  for (std::int64_t r = 0; r < rows; ++r) {
    T* row = y + r * cols;
    for (std::int64_t c = 0; c < cols; ++c) row[c] += bias[c];
  }
}

/// dbias += sum over rows of dy (column sums of a [rows, cols] array).
template <class T>
void bias_grad(std::int64_t rows, std::int64_t cols, const T* dy, T* dbias) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* row = dy + r * cols;
    for (std::int64_t c = 0; c < cols; ++c) dbias[c] += row[c];
  }
}

template <class T>
void relu_forward(std::int64_t n, const T* x, T* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] > T(0) ? x[i] : T(0);
}

/// dx = dy where x > 0, else 0 (x is the forward input).
template <class T>
void relu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  for (std::int64_t i = 0; i < n; ++i) dx[i] = x[i] > T(0) ? dy[i] : T(0);
}

// GELU, tanh form (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
void gelu_forward(std::int64_t n, const T* x, T* y) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  Eigen::Map<const Arr> xa(x, n);
  Eigen::Map<Arr> ya(y, n);
  const T k0 = T(0.7978845608028654), k1 = T(0.044715);
  ya = T(0.5) * xa * (T(1) + (k0 * (xa + k1 * xa.cube())).tanh());
}

template <class T>
void gelu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  Eigen::Map<const Arr> xa(x, n), dya(dy, n);
  Eigen::Map<Arr> dxa(dx, n);
  const T k0 = T(0.7978845608028654), k1 = T(0.044715);
  // d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) k0 (1 + 3 k1 x^2), t = tanh(k0 (x + k1 x^3))
  const Arr t = (k0 * (xa + k1 * xa.cube())).tanh();
  dxa = dya * (T(0.5) * (T(1) + t) + T(0.5) * xa * (T(1) - t.square()) * k0 * (T(1) + T(3) * k1 * xa.square()));
}

/// Inverted dropout: y = x * mask / (1 - p), mask[i] = uniform(seed, offset + i) >= p.
/// The backward pass regenerates the same mask from (seed, offset): nothing is stored.
template <class T>
void dropout(std::int64_t n, const T* x, T* y, double p, std::uint64_t seed, std::uint64_t offset) {
  const T scale = T(1.0 / (1.0 - p));
  for (std::int64_t i = 0; i < n; ++i)
    y[i] = random_uniform(seed, offset + static_cast<std::uint64_t>(i)) >= p ? x[i] * scale : T(0);
}

/// y += alpha * x
template <class T>
void axpy(std::int64_t n, T alpha, const T* x, T* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <class T>
void scale(std::int64_t n, T alpha, T* x) {
  for (std::int64_t i = 0; i < n; ++i) x[i] *= alpha;
}

}  // namespace ptrain::kernels::cpu
