#pragma once
// Activation CUDA kernels beyond ReLU and GELU: the pointwise ones of
// kernels/pointwise_math.hpp (the CPU's formulas, evaluated on the device) and
// log-softmax over rows. Same names and arguments as kernels/cpu/activation.hpp;
// float, double and bf16 (Note [bf16 kernels]); launched on current_stream().

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
struct ActivationOp {
  ActivationKind kind;
  acc_t<T> param;
  __device__ T operator()(std::int64_t, T x) const { return st<T>(math::activation(kind, param, ld(x))); }
};

template <class T>
struct ActivationBackwardOp {
  ActivationKind kind;
  acc_t<T> param;
  __device__ T operator()(std::int64_t, T saved, T dy) const {
    return st<T>(ld(dy) * math::activation_grad(kind, param, ld(saved)));
  }
};

// One block per row, like softmax_rows_kernel (softmax.cuh).
template <class T>
__global__ void log_softmax_rows_kernel(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A mx = A(-INFINITY);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) mx = ld(xr[c]) > mx ? ld(xr[c]) : mx;
    mx = block_max(mx);
    A s = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += dev_exp(ld(xr[c]) - mx);
    const A lse = mx + dev_log(block_sum(s));
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = st<T>(ld(xr[c]) - lse);
  }
}

template <class T>
__global__ void log_softmax_rows_backward_kernel(std::int64_t rows, std::int64_t cols, const T* y, const T* dy,
                                                 T* dx) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    A s = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += ld(dyr[c]);
    s = block_sum(s);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      dxr[c] = st<T>(ld(dyr[c]) - dev_exp(ld(yr[c])) * s);
  }
}

}  // namespace detail

/// y = activation k of x (param: LeakyReLU's negative slope).
template <class T>
void activation_forward(std::int64_t n, ActivationKind k, acc_t<T> param, const T* x, T* y) {
  detail::pointwise(n, y, detail::ActivationOp<T>{k, param}, x);
}

/// dx = dy * activation'(saved): saved is the output for Tanh and Sigmoid, the input for SiLU and LeakyReLU.
template <class T>
void activation_backward(std::int64_t n, ActivationKind k, acc_t<T> param, const T* saved, const T* dy, T* dx) {
  detail::pointwise(n, dx, detail::ActivationBackwardOp<T>{k, param}, saved, dy);
}

/// y[r, :] = x[r, :] - logsumexp(x[r, :]) for a [rows, cols] array.
template <class T>
void log_softmax_rows(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::log_softmax_rows_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(rows, cols, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dx = dy - exp(y) * sum(dy) row by row, y being the log-softmax output.
template <class T>
void log_softmax_rows_backward(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::log_softmax_rows_backward_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(rows, cols, y, dy, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
