#pragma once
// Activation CPU kernels beyond ReLU and GELU (elementwise.hpp): the pointwise
// ones of kernels/pointwise_math.hpp and log-softmax over rows. They read T,
// compute in acc_t<T> (float for bf16) and round once when they store, so one
// template serves float, double and bf16.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cpu {

/// y = activation k of x (param: LeakyReLU's negative slope).
template <class T>
void activation_forward(std::int64_t n, ActivationKind k, acc_t<T> param, const T* x, T* y) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i) y[i] = T(math::activation<A>(k, param, static_cast<A>(x[i])));
}

/// dx = dy * activation'(...), saved being the forward's output for Tanh and
/// Sigmoid and its input for SiLU and LeakyReLU (math::activation_saves_output).
template <class T>
void activation_backward(std::int64_t n, ActivationKind k, acc_t<T> param, const T* saved, const T* dy, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i)
    dx[i] = T(static_cast<A>(dy[i]) * math::activation_grad<A>(k, param, static_cast<A>(saved[i])));
}

/// y[r, :] = x[r, :] - logsumexp(x[r, :]) for a [rows, cols] array.
template <class T>
void log_softmax_rows(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A mx = static_cast<A>(xr[0]);
    for (std::int64_t c = 1; c < cols; ++c) mx = std::max(mx, static_cast<A>(xr[c]));
    A s = 0;
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(static_cast<A>(xr[c]) - mx);
    const A lse = mx + std::log(s);
    for (std::int64_t c = 0; c < cols; ++c) yr[c] = T(static_cast<A>(xr[c]) - lse);
  }
}

/// dx = dy - exp(y) * sum(dy) row by row, y being the log-softmax output.
template <class T>
void log_softmax_rows_backward(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    A s = 0;
    for (std::int64_t c = 0; c < cols; ++c) s += static_cast<A>(dyr[c]);
    for (std::int64_t c = 0; c < cols; ++c)
      dxr[c] = T(static_cast<A>(dyr[c]) - std::exp(static_cast<A>(yr[c])) * s);
  }
}

}  // namespace ptrain::kernels::cpu
