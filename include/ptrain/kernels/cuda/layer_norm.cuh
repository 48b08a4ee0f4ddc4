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

#include "ptrain/kernels/cuda/check.cuh"
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

// dgamma[i] += sum_r dy[r,i] xhat[r,i], dbeta[i] += sum_r dy[r,i]: the
// column-sum layout of bias_grad (32 columns per block, 16 warps over rows).
template <class T>
__global__ void layer_norm_backward_params_kernel(std::int64_t rows, std::int64_t d, const T* x,
                                                  const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy, T* dgamma,
                                                  T* dbeta) {
  using A = acc_t<T>;
  __shared__ A part_g[kColRows][kColTile + 1];
  __shared__ A part_b[kColRows][kColTile + 1];
  const std::int64_t col = static_cast<std::int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  A acc_g = A(0), acc_b = A(0);
  if (col < d)
    for (std::int64_t r = threadIdx.y; r < rows; r += kColRows) {
      const A g = ld(dy[r * d + col]);
      acc_g += g * ((ld(x[r * d + col]) - mean[r]) * rstd[r]);
      acc_b += g;
    }
  part_g[threadIdx.y][threadIdx.x] = acc_g;
  part_b[threadIdx.y][threadIdx.x] = acc_b;
  __syncthreads();
  if (threadIdx.y == 0 && col < d) {
    A sg = A(0), sb = A(0);
    for (int j = 0; j < kColRows; ++j) {
      sg += part_g[j][threadIdx.x];
      sb += part_b[j][threadIdx.x];
    }
    dgamma[col] = st<T>(ld(dgamma[col]) + sg);
    dbeta[col] = st<T>(ld(dbeta[col]) + sb);
  }
}

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
  const dim3 block(detail::kColTile, detail::kColRows);
  const auto grid = static_cast<unsigned>((d + detail::kColTile - 1) / detail::kColTile);
  detail::layer_norm_backward_params_kernel<T><<<grid, block, 0, stream>>>(rows, d, x, mean, rstd, dy, dgamma, dbeta);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
