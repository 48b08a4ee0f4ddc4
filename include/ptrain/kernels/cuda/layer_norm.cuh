#pragma once
// LayerNorm over the last dimension on device arrays:
//   y = (x - mean) * rstd * gamma + beta.
//
// Same names and arguments as kernels/cpu/layer_norm.hpp. Forward and the dx
// part of backward use one thread block per row; dgamma and dbeta are column
// sums over rows, done by a second kernel in a fixed order (no atomics), so
// gradients are the same bits on every run. Float, double and bf16 (Note [bf16
// kernels]).
//
// The *_one_read forms and the residual forms (h = x + residual written out,
// y = layer_norm(h); dh = layer_norm_backward(dy) + dresidual) keep each row in
// registers, so a row is read from global memory once (Note [Row kernels in
// one read]). They are gated (kernels/cuda_unverified.hpp) and the ops keep
// the kernels above while they are.
//
// Note [Row kernels in one read]
// A block of B = block_for_cols(d) threads (at most kRowThreads) owns a row;
// thread t holds elements t, t + B, ..., t + (N - 1) B in registers, N the
// power of two >= d / B, chosen at compile time (1 .. kRowMaxPerThread), so
// rows up to kRowRegisterWidth = 8192 wide are read once. The sums run in the
// order of the kernels above (each thread over its elements in order, then
// block_sum), with the same formulas. The backward runs a fixed grid of at most
// kRowPartialBlocks blocks; each keeps dgamma and dbeta for its columns in
// registers over the rows it owns (row r goes to block r mod grid), writes
// them as one partial row, and column_finish_kernel (reduce.cuh) adds the
// partials in block order: no atomics, the same bits on every run, and x and
// dy are read once where layer_norm_backward reads them three times. Wider
// rows take the kernels above (and, for the residual forms, an add kernel).
// The residual backward adds dresidual in acc_t<T> and rounds once (the CPU
// rounds the norm's gradient to T first).

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

inline constexpr std::int64_t kRowPartialBlocks = 512;

// out[i] = a[i] + b[i], rounded once; out may be a.
template <class T>
__global__ void add_rounded_kernel(std::int64_t n, const T* a, const T* b, T* out) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) out[i] = st<T>(ld(a[i]) + ld(b[i]));
}

template <class T>
void add_rounded(std::int64_t n, const T* a, const T* b, T* out) {
  add_rounded_kernel<T><<<grid_for(n), kBlock, 0, current_stream()>>>(n, a, b, out);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

// residual null: y = layer_norm(x). Otherwise h = x + residual (rounded to T) is
// written and y = layer_norm(h). Each thread keeps its N elements of the row.
template <class T, int N>
__global__ void __launch_bounds__(kRowThreads)
    layer_norm_rows_forward_kernel(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* gamma,
                                   const T* beta, acc_t<T> eps, T* h, T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  using A = acc_t<T>;
  const std::int64_t B = blockDim.x;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * d;
    A v[N];
    A sum = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t i = threadIdx.x + k * B;
      v[k] = A(0);
      if (i < d) {
        if (residual) {
          const T hv = st<T>(ld(x[base + i]) + ld(residual[base + i]));
          h[base + i] = hv;
          v[k] = ld(hv);
        } else {
          v[k] = ld(x[base + i]);
        }
        sum += v[k];
      }
    }
    const A m = block_sum(sum) / static_cast<A>(d);
    A var = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k)
      if (threadIdx.x + k * B < d) var += (v[k] - m) * (v[k] - m);
    const A s = A(1) / dev_sqrt(block_sum(var) / static_cast<A>(d) + eps);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t i = threadIdx.x + k * B;
      if (i < d) y[base + i] = st<T>((v[k] - m) * s * ld(gamma[i]) + ld(beta[i]));
    }
    if (threadIdx.x == 0) {
      mean[r] = m;
      rstd[r] = s;
    }
  }
}

// dx (plus dresidual when it is not null) for the rows r = blockIdx.x + j gridDim.x,
// and this block's dgamma, dbeta partial rows: partial[blockIdx.x, :] and
// partial[gridDim.x + blockIdx.x, :] ([2 gridDim.x, d]).
template <class T, int N>
__global__ void __launch_bounds__(kRowThreads)
    layer_norm_rows_backward_kernel(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean,
                                    const acc_t<T>* rstd, const T* gamma, const T* dy, const T* dresidual, T* dx,
                                    acc_t<T>* partial) {
  using A = acc_t<T>;
  const std::int64_t B = blockDim.x;
  A gam[N], dgam[N], dbet[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const std::int64_t i = threadIdx.x + k * B;
    gam[k] = i < d ? ld(gamma[i]) : A(0);
    dgam[k] = dbet[k] = A(0);
  }
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * d;
    const A m = mean[r], s = rstd[r];
    A xm[N], g[N];
    A g_sum = A(0), gx_sum = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t i = threadIdx.x + k * B;
      xm[k] = g[k] = A(0);
      if (i < d) {
        const A dyv = ld(dy[base + i]);
        xm[k] = ld(x[base + i]) - m;
        g[k] = dyv * gam[k];
        g_sum += g[k];
        gx_sum += g[k] * xm[k] * s;
        dgam[k] += dyv * (xm[k] * s);
        dbet[k] += dyv;
      }
    }
    const A g_mean = block_sum(g_sum) / static_cast<A>(d);
    const A gx_mean = block_sum(gx_sum) / static_cast<A>(d);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t i = threadIdx.x + k * B;
      if (i < d) {
        A v = s * (g[k] - g_mean - xm[k] * s * gx_mean);
        if (dresidual) v += ld(dresidual[base + i]);
        dx[base + i] = st<T>(v);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const std::int64_t i = threadIdx.x + k * B;
    if (i < d) {
      partial[static_cast<std::int64_t>(blockIdx.x) * d + i] = dgam[k];
      partial[static_cast<std::int64_t>(gridDim.x + blockIdx.x) * d + i] = dbet[k];
    }
  }
}

template <class T>
void layer_norm_rows_forward(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* gamma,
                             const T* beta, acc_t<T> eps, T* h, T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  if (d > kRowRegisterWidth) {  // too wide for registers: the add, then the kernel above
    const T* in = x;
    if (residual) {
      add_rounded<T>(rows * d, x, residual, h);
      in = h;
    }
    layer_norm_forward_kernel<T><<<grid_for_rows(rows), block_for_cols(d), 0, current_stream()>>>(
        rows, d, in, gamma, beta, eps, y, mean, rstd);
    PTRAIN_CHECK_CUDA_LAUNCH();
    return;
  }
  const int block = block_for_cols(d);
  with_per_thread(row_per_thread(d, block), [&](auto n) {
    layer_norm_rows_forward_kernel<T, decltype(n)::value><<<grid_for_rows(rows), block, 0, current_stream()>>>(
        rows, d, x, residual, gamma, beta, eps, h, y, mean, rstd);
  });
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void layer_norm_rows_backward(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean,
                              const acc_t<T>* rstd, const T* gamma, const T* dy, const T* dresidual, T* dx, T* dgamma,
                              T* dbeta);

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

namespace detail {
template <class T>
void layer_norm_rows_backward(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean,
                              const acc_t<T>* rstd, const T* gamma, const T* dy, const T* dresidual, T* dx, T* dgamma,
                              T* dbeta) {
  check_element_type<T>();
  if (rows <= 0 || d <= 0) return;
  if (d > kRowRegisterWidth) {  // too wide for registers: the kernels above, then the add
    layer_norm_backward<T>(rows, d, x, mean, rstd, gamma, dy, dx, dgamma, dbeta);
    if (dresidual) add_rounded<T>(rows * d, dx, dresidual, dx);
    return;
  }
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const std::int64_t blocks = rows < kRowPartialBlocks ? rows : kRowPartialBlocks;
  auto partial = Tensor<acc_t<T>>::empty({2 * blocks * d}, Device::cuda(device));
  const int block = block_for_cols(d);
  with_per_thread(row_per_thread(d, block), [&](auto n) {
    layer_norm_rows_backward_kernel<T, decltype(n)::value><<<static_cast<unsigned>(blocks), block, 0, stream>>>(
        rows, d, x, mean, rstd, gamma, dy, dresidual, dx, partial.data());
  });
  PTRAIN_CHECK_CUDA_LAUNCH();
  column_finish_kernel<acc_t<T>, T, 2><<<grid_for(d), kBlock, 0, stream>>>(d, blocks, partial.data(),
                                                                          ColumnOutputs<T, 2>{{dgamma, dbeta}});
  PTRAIN_CHECK_CUDA_LAUNCH();
}
}  // namespace detail

/// layer_norm_forward with each row read once (Note [Row kernels in one read]); gated.
template <class T>
void layer_norm_forward_one_read(std::int64_t rows, std::int64_t d, const T* x, const T* gamma, const T* beta,
                                 acc_t<T> eps, T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  detail::layer_norm_rows_forward<T>(rows, d, x, nullptr, gamma, beta, eps, nullptr, y, mean, rstd);
}

/// layer_norm_backward with x and dy read once (Note [Row kernels in one read]); gated.
template <class T>
void layer_norm_backward_one_read(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* mean,
                                  const acc_t<T>* rstd, const T* gamma, const T* dy, T* dx, T* dgamma, T* dbeta) {
  detail::layer_norm_rows_backward<T>(rows, d, x, mean, rstd, gamma, dy, nullptr, dx, dgamma, dbeta);
}

/// h = x + residual (rounded to T), written out, and y = layer_norm(h), one kernel; gated.
template <class T>
void residual_layer_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* gamma,
                                 const T* beta, acc_t<T> eps, T* h, T* y, acc_t<T>* mean, acc_t<T>* rstd) {
  detail::layer_norm_rows_forward<T>(rows, d, x, residual, gamma, beta, eps, h, y, mean, rstd);
}

/// dh = layer_norm_backward(dy) + dresidual (added in acc_t<T>, rounded once); dgamma, dbeta
/// += as layer_norm_backward; one kernel and the column finish; gated.
template <class T>
void residual_layer_norm_backward(std::int64_t rows, std::int64_t d, const T* h, const acc_t<T>* mean,
                                  const acc_t<T>* rstd, const T* gamma, const T* dy, const T* dresidual, T* dh,
                                  T* dgamma, T* dbeta) {
  detail::layer_norm_rows_backward<T>(rows, d, h, mean, rstd, gamma, dy, dresidual, dh, dgamma, dbeta);
}

}  // namespace ptrain::kernels::cuda
