#pragma once
// LayerNorm over the last dimension on device arrays:
//   y = (x - mean) * rstd * gamma + beta.
//
// Same names and arguments as kernels/cpu/layer_norm.hpp. Forward and the dx
// part of backward use one thread block per row; dgamma and dbeta are column
// sums over rows, done by a second kernel in a fixed order (no atomics), so
// gradients are the same bits on every run. Float, double and bf16 (Note [bf16
// kernels]).

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

// Two passes over the row (mean, then squared deviations), like the CPU: the
// one-pass E[x^2] - E[x]^2 loses digits when |mean| >> std.
template <class T>
__global__ void layer_norm_forward_kernel(std::int64_t rows, std::int64_t d, const T* x, const T* gamma,
                                          const T* beta, acc_t<T> eps, T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    A m = A(0);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) m += ld(xr[i]);
    m = block_sum(m) / static_cast<A>(d);
    A v = A(0);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) v += (ld(xr[i]) - m) * (ld(xr[i]) - m);
    v = block_sum(v) / static_cast<A>(d);
    const A s = A(1) / dev_sqrt(v + eps);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x)
      yr[i] = st<T>((ld(xr[i]) - m) * s * ld(gamma[i]) + ld(beta[i]));
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
  }
}

template <class T>
__global__ void layer_norm_backward_dx_kernel(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean,
                                              const acc_t<T>* rstd, const T* gamma, const T* dy, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const A m = mean[r], s = rstd[r];
    A g_mean = A(0), gx_mean = A(0);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      const A g = ld(dyr[i]) * ld(gamma[i]);
      g_mean += g;
      gx_mean += g * (ld(xr[i]) - m) * s;
    }
    g_mean = block_sum(g_mean) / static_cast<A>(d);
    gx_mean = block_sum(gx_mean) / static_cast<A>(d);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      const A xhat = (ld(xr[i]) - m) * s;
      dxr[i] = st<T>(s * (ld(dyr[i]) * ld(gamma[i]) - g_mean - xhat * gx_mean));
    }
  }
}

// LayerNorm's parameter-gradient terms for column sums (reduce.cuh):
// dy[r, i] * xhat[r, i] for dgamma and dy[r, i] for dbeta.
template <class T>
struct LayerNormParamTerms {
  static constexpr int K = 2;
  const T* x;
  const acc_t<T>* mean;
  const acc_t<T>* rstd;
  const T* dy;
  std::int64_t d;
  __device__ void operator()(std::int64_t r, std::int64_t i, acc_t<T>* out) const {
    const acc_t<T> g = ld(dy[r * d + i]);
    out[0] = g * ((ld(x[r * d + i]) - mean[r]) * rstd[r]);
    out[1] = g;
  }
};

}  // namespace detail

/// x, y: [rows, d]; gamma, beta: [d]; mean, rstd: [rows] saved for backward (device arrays;
/// float for bf16 x).
template <class T>
void layer_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* gamma, const T* beta, acc_t<T> eps,
                        T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  detail::check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  detail::layer_norm_forward_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(d), 0, current_stream()>>>(
      rows, d, x, gamma, beta, eps, y, mean, rstd);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma;
/// dgamma += sum_r dy * xhat; dbeta += sum_r dy.
template <class T>
void layer_norm_backward(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean, const acc_t<T>* rstd,
                         const T* gamma, const T* dy, T* dx, T* dgamma, T* dbeta) {
  detail::check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  const cudaStream_t stream = current_stream();
  detail::layer_norm_backward_dx_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(d), 0, stream>>>(
      rows, d, x, mean, rstd, gamma, dy, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::column_sums<T>(rows, d, detail::LayerNormParamTerms<T>{x, mean, rstd, dy, d},
                         detail::ColumnOutputs<T, 2>{{dgamma, dbeta}});
}

}  // namespace ptrain::kernels::cuda
