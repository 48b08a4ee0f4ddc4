#pragma once
// RMSNorm over the last dimension on device arrays, y = x * rstd * w with
// rstd = 1 / sqrt(mean(x^2) + eps), and its residual form (h = x + residual
// written out, y = rms_norm(h); dh = rms_norm_backward(dy) + dresidual).
//
// Same names and arguments as kernels/cpu/rms_norm.hpp. Forward and the dx part
// of backward use one thread block per row, the residual forms included (the
// add and the norm in one kernel, one read of x and residual). dw is a column
// sum over rows by reduce.cuh's column_sums, in a fixed order (no atomics), so
// gradients are the same bits on every run. Float, double and bf16 (Note [bf16
// kernels]). The residual backward adds dresidual to the norm's gradient in
// acc_t<T> and rounds once (the CPU rounds the norm's gradient to T first).

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

// residual null: y = rms_norm(x). Otherwise h = x + residual (rounded to T) is
// written and y = rms_norm(h); each thread reads back only the h it wrote.
template <class T>
__global__ void rms_norm_forward_kernel(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* w,
                                        acc_t<T> eps, T* h, T* y, acc_t<T>* rstd) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    const T* in = xr;
    A ss = A(0);
    if (residual) {
      const T* rr = residual + r * d;
      T* hr = h + r * d;
      for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
        const T v = st<T>(ld(xr[i]) + ld(rr[i]));
        hr[i] = v;
        ss += ld(v) * ld(v);
      }
      in = hr;
    } else {
      for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) ss += ld(xr[i]) * ld(xr[i]);
    }
    ss = block_sum(ss);
    const A s = A(1) / dev_sqrt(ss / static_cast<A>(d) + eps);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) yr[i] = st<T>(ld(in[i]) * s * ld(w[i]));
    if (threadIdx.x == 0) rstd[r] = s;
  }
}

// dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w, plus dresidual when it is not null.
template <class T>
__global__ void rms_norm_backward_dx_kernel(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* rstd,
                                            const T* w, const T* dy, const T* dresidual, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const A s = rstd[r];
    A gx_mean = A(0);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) gx_mean += ld(dyr[i]) * ld(w[i]) * (ld(xr[i]) * s);
    gx_mean = block_sum(gx_mean) / static_cast<A>(d);
    for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
      A v = s * (ld(dyr[i]) * ld(w[i]) - ld(xr[i]) * s * gx_mean);
      if (dresidual) v += ld(dresidual[r * d + i]);
      dxr[i] = st<T>(v);
    }
  }
}

// RMSNorm's weight-gradient term for column sums (reduce.cuh): dy[r, i] * xhat[r, i].
template <class T>
struct RmsNormParamTerms {
  static constexpr int K = 1;
  const T* x;
  const acc_t<T>* rstd;
  const T* dy;
  std::int64_t d;
  __device__ void operator()(std::int64_t r, std::int64_t i, acc_t<T>* out) const {
    out[0] = ld(dy[r * d + i]) * (ld(x[r * d + i]) * rstd[r]);
  }
};

template <class T>
void rms_norm_forward_launch(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* w,
                             acc_t<T> eps, T* h, T* y, acc_t<T>* rstd) {
  check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  rms_norm_forward_kernel<T><<<grid_for_rows(rows), block_for_cols(d), 0, current_stream()>>>(rows, d, x, residual, w,
                                                                                             eps, h, y, rstd);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void rms_norm_backward_launch(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* rstd, const T* w,
                              const T* dy, const T* dresidual, T* dx, T* dw) {
  check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  rms_norm_backward_dx_kernel<T><<<grid_for_rows(rows), block_for_cols(d), 0, current_stream()>>>(
      rows, d, x, rstd, w, dy, dresidual, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
  column_sums<T>(rows, d, RmsNormParamTerms<T>{x, rstd, dy, d}, ColumnOutputs<T, 1>{{dw}});
}

}  // namespace detail

/// x, y: [rows, d]; w: [d]; rstd: [rows] saved for backward (float for bf16 x).
template <class T>
void rms_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* w, acc_t<T> eps, T* y,
                      acc_t<T>* rstd) {
  detail::rms_norm_forward_launch<T>(rows, d, x, nullptr, w, eps, nullptr, y, rstd);
}

/// dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w; dw += sum_r dy * xhat.
template <class T>
void rms_norm_backward(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* rstd, const T* w, const T* dy,
                       T* dx, T* dw) {
  detail::rms_norm_backward_launch<T>(rows, d, x, rstd, w, dy, nullptr, dx, dw);
}

/// h = x + residual (rounded to T), written out, and y = rms_norm(h), one kernel.
template <class T>
void residual_rms_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* w,
                               acc_t<T> eps, T* h, T* y, acc_t<T>* rstd) {
  detail::rms_norm_forward_launch<T>(rows, d, x, residual, w, eps, h, y, rstd);
}

/// dh = rms_norm_backward(dy) + dresidual (added in acc_t<T>, rounded once); dw += as rms_norm_backward.
template <class T>
void residual_rms_norm_backward(std::int64_t rows, std::int64_t d, const T* h, const acc_t<T>* rstd, const T* w,
                                const T* dy, const T* dresidual, T* dh, T* dw) {
  detail::rms_norm_backward_launch<T>(rows, d, h, rstd, w, dy, dresidual, dh, dw);
}

}  // namespace ptrain::kernels::cuda
