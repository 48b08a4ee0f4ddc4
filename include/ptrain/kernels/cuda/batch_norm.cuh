#pragma once
// Batch normalisation over x [n, c, hw] on device arrays. Same names and
// arguments as kernels/cpu/batch_norm.hpp (read its header for the split into
// reductions and finalisation); float and double. The per-channel reductions
// run one block per channel and accumulate in double in a fixed order, so the
// statistics are the same bits on every run.

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void batch_norm_stats_kernel(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, double* sums) {
  for (std::int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    double s = 0, q = 0;
    for (std::int64_t e = threadIdx.x; e < n * hw; e += blockDim.x) {
      const double v = static_cast<double>(x[((e / hw) * c + ch) * hw + e % hw]);
      s += v;
      q += v * v;
    }
    s = block_sum(s);
    q = block_sum(q);
    if (threadIdx.x == 0) {
      sums[ch] = s;
      sums[c + ch] = q;
    }
  }
}

template <class T>
__global__ void batch_norm_finalize_kernel(std::int64_t c, double count, const double* sums, double eps,
                                           double momentum, T* mean, T* invstd, T* running_mean, T* running_var) {
  for (std::int64_t ch = global_index(); ch < c; ch += grid_stride()) {
    const double m = sums[ch] / count;
    double var = sums[c + ch] / count - m * m;
    var = var > 0 ? var : 0.0;
    mean[ch] = static_cast<T>(m);
    invstd[ch] = static_cast<T>(1.0 / sqrt(var + eps));
    if (running_mean) {
      const double unbiased = count > 1 ? var * count / (count - 1) : var;
      running_mean[ch] = static_cast<T>((1 - momentum) * static_cast<double>(running_mean[ch]) + momentum * m);
      running_var[ch] = static_cast<T>((1 - momentum) * static_cast<double>(running_var[ch]) + momentum * unbiased);
    }
  }
}

template <class T>
__global__ void batch_norm_eval_stats_kernel(std::int64_t c, const T* running_mean, const T* running_var, double eps,
                                             T* mean, T* invstd) {
  for (std::int64_t ch = global_index(); ch < c; ch += grid_stride()) {
    mean[ch] = running_mean[ch];
    invstd[ch] = static_cast<T>(1.0 / sqrt(static_cast<double>(running_var[ch]) + eps));
  }
}

template <class T>
__global__ void batch_norm_apply_kernel(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* mean,
                                        const T* invstd, const T* w, const T* b, T* y) {
  for (std::int64_t e = global_index(); e < n * c * hw; e += grid_stride()) {
    const std::int64_t ch = (e / hw) % c;
    const T scale = invstd[ch] * (w ? w[ch] : T(1));
    y[e] = (x[e] - mean[ch]) * scale + (b ? b[ch] : T(0));
  }
}

template <class T>
__global__ void batch_norm_backward_reduce_kernel(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x,
                                                  const T* dy, const T* mean, const T* invstd, double* sums) {
  for (std::int64_t ch = blockIdx.x; ch < c; ch += gridDim.x) {
    const double m = mean[ch], r = invstd[ch];
    double s = 0, sx = 0;
    for (std::int64_t e = threadIdx.x; e < n * hw; e += blockDim.x) {
      const std::int64_t i = ((e / hw) * c + ch) * hw + e % hw;
      const double g = static_cast<double>(dy[i]);
      s += g;
      sx += g * (static_cast<double>(x[i]) - m) * r;
    }
    s = block_sum(s);
    sx = block_sum(sx);
    if (threadIdx.x == 0) {
      sums[ch] = s;
      sums[c + ch] = sx;
    }
  }
}

template <class T>
__global__ void batch_norm_backward_apply_kernel(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x,
                                                 const T* dy, const T* mean, const T* invstd, const T* w,
                                                 const double* sums, double count, T* dx) {
  for (std::int64_t e = global_index(); e < n * c * hw; e += grid_stride()) {
    const std::int64_t ch = (e / hw) % c;
    const T r = invstd[ch];
    const T scale = r * (w ? w[ch] : T(1));
    const T mdy = sums ? static_cast<T>(sums[ch] / count) : T(0);
    const T mdyx = sums ? static_cast<T>(sums[c + ch] / count) : T(0);
    dx[e] = scale * (dy[e] - mdy - (x[e] - mean[ch]) * r * mdyx);
  }
}

template <class T>
__global__ void batch_norm_param_grads_kernel(std::int64_t c, const double* sums, T* dw, T* db) {
  for (std::int64_t ch = global_index(); ch < c; ch += grid_stride()) {
    dw[ch] += static_cast<T>(sums[c + ch]);
    db[ch] += static_cast<T>(sums[ch]);
  }
}

inline unsigned channel_blocks(std::int64_t c) { return grid_for_rows(c); }

}  // namespace detail

template <class T>
void batch_norm_stats(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, double* sums) {
  detail::batch_norm_stats_kernel<T><<<detail::channel_blocks(c), detail::kBlock, 0, current_stream()>>>(n, c, hw, x,
                                                                                                        sums);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_finalize(std::int64_t c, double count, const double* sums, double eps, double momentum, T* mean,
                         T* invstd, T* running_mean, T* running_var) {
  detail::batch_norm_finalize_kernel<T><<<detail::grid_for(c), detail::kBlock, 0, current_stream()>>>(
      c, count, sums, eps, momentum, mean, invstd, running_mean, running_var);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_eval_stats(std::int64_t c, const T* running_mean, const T* running_var, double eps, T* mean,
                           T* invstd) {
  detail::batch_norm_eval_stats_kernel<T><<<detail::grid_for(c), detail::kBlock, 0, current_stream()>>>(
      c, running_mean, running_var, eps, mean, invstd);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_apply(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* mean, const T* invstd,
                      const T* w, const T* b, T* y) {
  if (n * c * hw <= 0) return;
  detail::batch_norm_apply_kernel<T><<<detail::grid_for(n * c * hw), detail::kBlock, 0, current_stream()>>>(
      n, c, hw, x, mean, invstd, w, b, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_backward_reduce(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* dy,
                                const T* mean, const T* invstd, double* sums) {
  detail::batch_norm_backward_reduce_kernel<T><<<detail::channel_blocks(c), detail::kBlock, 0, current_stream()>>>(
      n, c, hw, x, dy, mean, invstd, sums);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_backward_apply(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* dy,
                               const T* mean, const T* invstd, const T* w, const double* sums, double count, T* dx) {
  if (n * c * hw <= 0) return;
  detail::batch_norm_backward_apply_kernel<T><<<detail::grid_for(n * c * hw), detail::kBlock, 0, current_stream()>>>(
      n, c, hw, x, dy, mean, invstd, w, sums, count, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void batch_norm_param_grads(std::int64_t c, const double* sums, T* dw, T* db) {
  detail::batch_norm_param_grads_kernel<T><<<detail::grid_for(c), detail::kBlock, 0, current_stream()>>>(c, sums, dw,
                                                                                                         db);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
