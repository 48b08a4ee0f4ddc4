#pragma once
// Elementwise CUDA kernels: bias, activations, dropout, axpy, and the float <-> bf16
// casts of mixed precision. Float, double and bf16 (Note [bf16 kernels]).
//
// Same names and arguments as kernels/cpu/elementwise.hpp, on device pointers
// of the current device; each launches on current_stream() and returns without
// waiting. Grid-stride loops, so any n runs with a bounded grid.

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/kernels/cuda/check.cuh"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void bias_add_kernel(std::int64_t rows, std::int64_t cols, T* y, const T* bias) {
  for (std::int64_t i = global_index(); i < rows * cols; i += grid_stride()) y[i] = st<T>(ld(y[i]) + ld(bias[i % cols]));
}

// The bias gradient's term for column sums (reduce.cuh): dy[r, c].
template <class T>
struct BiasGradTerm {
  static constexpr int K = 1;
  const T* dy;
  std::int64_t cols;
  __device__ void operator()(std::int64_t r, std::int64_t c, acc_t<T>* out) const { out[0] = ld(dy[r * cols + c]); }
};

template <class T>
__global__ void relu_forward_kernel(std::int64_t n, const T* x, T* y) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) y[i] = ld(x[i]) > 0 ? x[i] : T(0);
}

template <class T>
__global__ void relu_backward_kernel(std::int64_t n, const T* x, const T* dy, T* dx) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) dx[i] = ld(x[i]) > 0 ? dy[i] : T(0);
}

template <class T>
__global__ void gelu_forward_kernel(std::int64_t n, const T* x, T* y) {
  using A = acc_t<T>;
  const A k0 = A(0.7978845608028654), k1 = A(0.044715);
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const A v = ld(x[i]);
    y[i] = st<T>(A(0.5) * v * (A(1) + dev_tanh(k0 * (v + k1 * v * v * v))));
  }
}

template <class T>
__global__ void gelu_backward_kernel(std::int64_t n, const T* x, const T* dy, T* dx) {
  using A = acc_t<T>;
  const A k0 = A(0.7978845608028654), k1 = A(0.044715);
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const A v = ld(x[i]);
    const A t = dev_tanh(k0 * (v + k1 * v * v * v));
    dx[i] = st<T>(ld(dy[i]) * (A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * k0 * (A(1) + A(3) * k1 * v * v)));
  }
}

// The mask comes from random_uniform(seed, offset + i), the CPU's formula, in
// double as on the CPU, so both devices drop exactly the same elements.
template <class T>
__global__ void dropout_kernel(std::int64_t n, const T* x, T* y, double p, acc_t<T> scale, std::uint64_t seed,
                               std::uint64_t offset) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride())
    y[i] = random_uniform(seed, offset + static_cast<std::uint64_t>(i)) >= p ? st<T>(ld(x[i]) * scale) : T(0);
}

template <class T>
__global__ void axpy_kernel(std::int64_t n, acc_t<T> alpha, const T* x, T* y) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) y[i] = st<T>(ld(y[i]) + alpha * ld(x[i]));
}

template <class T>
__global__ void scale_kernel(std::int64_t n, acc_t<T> alpha, T* x) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) x[i] = st<T>(ld(x[i]) * alpha);
}

}  // namespace detail

/// y[r, :] += bias for each of `rows` rows of width `cols`.
template <class T>
void bias_add(std::int64_t rows, std::int64_t cols, T* y, const T* bias) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::bias_add_kernel<T><<<detail::grid_for(rows * cols), detail::kBlock, 0, current_stream()>>>(rows, cols, y, bias);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dbias += sum over rows of dy (column sums of a [rows, cols] array).
template <class T>
void bias_grad(std::int64_t rows, std::int64_t cols, const T* dy, T* dbias) {
  detail::check_element_type<T>();
  detail::column_sums<T>(rows, cols, detail::BiasGradTerm<T>{dy, cols}, detail::ColumnOutputs<T, 1>{{dbias}});
}

template <class T>
void relu_forward(std::int64_t n, const T* x, T* y) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::relu_forward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dx = dy where x > 0, else 0 (x is the forward input).
template <class T>
void relu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::relu_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, dy, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// GELU, tanh form (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
void gelu_forward(std::int64_t n, const T* x, T* y) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::gelu_forward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void gelu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::gelu_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, dy, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// Inverted dropout: y = x * mask / (1 - p), mask[i] = uniform(seed, offset + i) >= p.
/// The same mask as kernels::cpu::dropout for the same (seed, offset).
template <class T>
void dropout(std::int64_t n, const T* x, T* y, double p, std::uint64_t seed, std::uint64_t offset) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  const acc_t<T> scale = acc_t<T>(1.0 / (1.0 - p));  // rounded as the CPU rounds it
  detail::dropout_kernel<T>
      <<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, y, p, scale, seed, offset);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// y += alpha * x
template <class T>
void axpy(std::int64_t n, acc_t<T> alpha, const T* x, T* y) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::axpy_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, alpha, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void scale(std::int64_t n, acc_t<T> alpha, T* x) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::scale_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, alpha, x);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

namespace detail {
template <class From, class To>
__global__ void cast_kernel(std::int64_t n, const From* x, To* y) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) y[i] = static_cast<To>(static_cast<float>(x[i]));
}
}  // namespace detail

/// y[i] = x[i] converted: to bf16 through float, rounding to nearest even (NaN stays
/// NaN) with bf16's own conversion, so the bits equal the CPU's; from bf16 exactly.
template <class From, class To>
void cast(std::int64_t n, const From* x, To* y) {
  static_assert(is_bf16_cast<From, To>, "ptrain::kernels::cuda::cast: float or double <-> bf16");
  if (n <= 0) return;
  detail::cast_kernel<From, To><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
