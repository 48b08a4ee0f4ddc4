#pragma once
// Row softmax and softmax cross-entropy on device arrays, numerically stable
// (max subtracted before exp, log-sum-exp kept per row).
//
// Same names and arguments as kernels/cpu/softmax.hpp. One thread block per
// row: the row's max and sum are block reductions, so a row is read from
// global memory two or three times (cross-entropy's forward: once) and never
// leaves the block. Float, double and bf16 (Note [bf16 kernels]; the
// log-sum-exp saved for backward is float).
//
// softmax_rows_one_read and softmax_rows_backward_one_read (gated; ops::softmax
// keeps softmax_rows while they are) read a row once: rows up to
// kRowRegisterWidth wide stay in registers (reduce.cuh, "rows in registers"),
// and a wider row's max and sum come from one pass with an online max (each
// thread keeps its running max m and sum of exp(x - m), rescaling the sum when
// m grows; Milakov and Gimelshein, "Online normalizer calculation for softmax",
// 2018), then a second pass writes y, two reads where softmax_rows makes three.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__device__ __forceinline__ acc_t<T> row_max(const T* xr, std::int64_t cols) {
  using A = acc_t<T>;
  A mx = A(-INFINITY);
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) mx = ld(xr[c]) > mx ? ld(xr[c]) : mx;
  return block_max(mx);
}

template <class T>
__global__ void softmax_rows_kernel(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    const A mx = row_max(xr, cols);
    A s = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += dev_exp(ld(xr[c]) - mx);
    const A inv = A(1) / block_sum(s);
    // Recomputing exp (rather than storing it and rescaling) keeps a bf16 row
    // rounded once; each thread writes only its own elements.
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = st<T>(dev_exp(ld(xr[c]) - mx) * inv);
  }
}

template <class T>
__global__ void softmax_rows_backward_kernel(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    A dot = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += ld(yr[c]) * ld(dyr[c]);
    dot = block_sum(dot);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dxr[c] = st<T>(ld(yr[c]) * (ld(dyr[c]) - dot));
  }
}

// Writes lse[r] and row_loss[r] = lse[r] - logits[r, target] (0 for ignored
// rows, NaN for targets outside [0, cols), which the host then reports); with
// label smoothing eps, (1 - eps) times that plus eps (lse[r] - mean of the row).
template <class T>
__global__ void cross_entropy_forward_kernel(std::int64_t rows, std::int64_t cols, const T* logits,
                                             const std::int32_t* targets, acc_t<T>* lse, double* row_loss,
                                             std::int32_t ignore_index, acc_t<T> smoothing) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * cols;
    // One pass: each thread keeps its running max m and sum s of exp(x - m)
    // (rescaled when m grows), then the block combines them at the block's max.
    A m = A(-INFINITY), s = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const A x = ld(xr[c]);
      if (x > m) {
        s = s * dev_exp(m - x) + A(1);
        m = x;
      } else if (m != A(-INFINITY)) {
        s += dev_exp(x - m);
      }
    }
    const A mx = block_max(m);
    s = block_sum(m == A(-INFINITY) ? A(0) : s * dev_exp(m - mx));
    A row_sum = A(0);
    if (smoothing != A(0)) {  // the same for the whole block, so every thread reaches block_sum
      for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) row_sum += ld(xr[c]);
      row_sum = block_sum(row_sum);
    }
    if (threadIdx.x == 0) {
      const A l = mx + dev_log(s);
      lse[r] = l;
      const std::int32_t t = targets[r];
      if (t == ignore_index) row_loss[r] = 0.0;
      else if (t < 0 || t >= cols) row_loss[r] = NAN;
      else if (smoothing == A(0)) row_loss[r] = static_cast<double>(l - ld(xr[t]));
      else
        row_loss[r] = static_cast<double>((A(1) - smoothing) * (l - ld(xr[t])) +
                                          smoothing * (l - row_sum / static_cast<A>(cols)));
    }
  }
}

// One block: out = {sum of row losses, counted rows, targets out of range}.
// A fixed summation order, so the loss is the same bits every run.
template <class Index>
__global__ void cross_entropy_total_kernel(std::int64_t rows, std::int64_t cols, const double* row_loss,
                                           const Index* targets, Index ignore_index, double* out) {
  double total = 0, valid = 0, bad = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const Index t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= cols) {
      bad += 1;
      continue;
    }
    total += row_loss[r];
    valid += 1;
  }
  total = block_sum(total);
  valid = block_sum(valid);
  bad = block_sum(bad);
  if (threadIdx.x == 0) {
    out[0] = total;
    out[1] = valid;
    out[2] = bad;
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(std::int64_t rows, std::int64_t cols, const T* logits,
                                              const acc_t<T>* lse, const std::int32_t* targets, acc_t<T> scale,
                                              T* dlogits, std::int32_t ignore_index, acc_t<T> smoothing) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {  // a block per row: no index division
    const T* xr = logits + r * cols;
    T* dr = dlogits + r * cols;
    const std::int32_t t = targets[r];
    const bool ignored = t == ignore_index;
    const A l = lse[r];
    const A uniform = scale * smoothing / static_cast<A>(cols);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      A d = ignored ? A(0) : scale * dev_exp(ld(xr[c]) - l) - uniform;
      if (!ignored && c == t) d -= scale * (A(1) - smoothing);
      dr[c] = st<T>(d);
    }
  }
}

// Online max and sum: folds x into a thread's running max m and sum s of exp(. - m).
template <class A>
__device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * dev_exp(m - x) + A(1);
    m = x;
  } else if (m != A(-INFINITY)) {
    s += dev_exp(x - m);
  }
}

// Rows up to N * blockDim.x wide, held in registers.
template <class T, int N>
__global__ void __launch_bounds__(kRowThreads)
    softmax_rows_registers_kernel(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  using A = acc_t<T>;
  const std::int64_t B = blockDim.x;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * cols;
    A v[N];
    A mx = A(-INFINITY);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t c = threadIdx.x + k * B;
      v[k] = c < cols ? ld(x[base + c]) : A(-INFINITY);
      mx = v[k] > mx ? v[k] : mx;
    }
    mx = block_max(mx);
    A s = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = threadIdx.x + k * B < cols ? dev_exp(v[k] - mx) : A(0);
      s += v[k];
    }
    const A inv = A(1) / block_sum(s);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t c = threadIdx.x + k * B;
      if (c < cols) y[base + c] = st<T>(v[k] * inv);
    }
  }
}

// Wider rows: the max and the sum in one pass (online_add), then y.
template <class T>
__global__ void softmax_rows_online_kernel(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  using A = acc_t<T>;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A m = A(-INFINITY), s = A(0);
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) online_add(m, s, ld(xr[c]));
    const A mx = block_max(m);
    const A inv = A(1) / block_sum(m == A(-INFINITY) ? A(0) : s * dev_exp(m - mx));
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = st<T>(dev_exp(ld(xr[c]) - mx) * inv);
  }
}

template <class T, int N>
__global__ void __launch_bounds__(kRowThreads)
    softmax_rows_backward_registers_kernel(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  using A = acc_t<T>;
  const std::int64_t B = blockDim.x;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t base = r * cols;
    A yv[N], dyv[N];
    A dot = A(0);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t c = threadIdx.x + k * B;
      yv[k] = dyv[k] = A(0);
      if (c < cols) {
        yv[k] = ld(y[base + c]);
        dyv[k] = ld(dy[base + c]);
        dot += yv[k] * dyv[k];
      }
    }
    dot = block_sum(dot);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const std::int64_t c = threadIdx.x + k * B;
      if (c < cols) dx[base + c] = st<T>(yv[k] * (dyv[k] - dot));
    }
  }
}

}  // namespace detail

/// softmax_rows with each row read once, or twice for rows over kRowRegisterWidth (online
/// max and sum); gated.
template <class T>
void softmax_rows_one_read(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  const int block = detail::block_for_cols(cols);
  if (cols > detail::kRowRegisterWidth) {
    detail::softmax_rows_online_kernel<T><<<detail::grid_for_rows(rows), block, 0, current_stream()>>>(rows, cols, x, y);
  } else {
    detail::with_per_thread(detail::row_per_thread(cols, block), [&](auto n) {
      detail::softmax_rows_registers_kernel<T, decltype(n)::value>
          <<<detail::grid_for_rows(rows), block, 0, current_stream()>>>(rows, cols, x, y);
    });
  }
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// softmax_rows_backward with y and dy read once (rows up to kRowRegisterWidth; wider rows
/// take softmax_rows_backward's kernel); gated.
template <class T>
void softmax_rows_backward_one_read(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  const int block = detail::block_for_cols(cols);
  if (cols > detail::kRowRegisterWidth) {
    detail::softmax_rows_backward_kernel<T>
        <<<detail::grid_for_rows(rows), block, 0, current_stream()>>>(rows, cols, y, dy, dx);
  } else {
    detail::with_per_thread(detail::row_per_thread(cols, block), [&](auto n) {
      detail::softmax_rows_backward_registers_kernel<T, decltype(n)::value>
          <<<detail::grid_for_rows(rows), block, 0, current_stream()>>>(rows, cols, y, dy, dx);
    });
  }
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// y[r, :] = softmax(x[r, :]) for a [rows, cols] array.
template <class T>
void softmax_rows(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::softmax_rows_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(rows, cols, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dx = y * (dy - sum(dy * y)) row by row, y being the softmax output.
template <class T>
void softmax_rows_backward(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  detail::softmax_rows_backward_kernel<T>
      <<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, current_stream()>>>(rows, cols, y, dy, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// Mean cross-entropy of logits [rows, cols] against integer targets [rows] (device arrays),
/// with label smoothing as kernels::cpu::cross_entropy_forward defines it.
/// Rows whose target equals ignore_index do not count. Writes each row's
/// log-sum-exp to lse (device) and returns the mean loss and, through valid,
/// the number of counted rows; waits for the current stream. Throws ShapeError
/// when a target lies outside [0, cols).
template <class T>
double cross_entropy_forward(std::int64_t rows, std::int64_t cols, const T* logits, const std::int32_t* targets,
                             acc_t<T>* lse, std::int64_t& valid, std::int32_t ignore_index = -100,
                             acc_t<T> smoothing = 0) {
  detail::check_element_type<T>();
  valid = 0;
  if (rows <= 0) return 0.0;
  PTRAIN_CHECK(cols > 0, ShapeError, "[ptrain.cuda.cross_entropy] logits have ", rows, " rows but no columns");
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  // Per-row losses, then the three totals; from the device's allocator.
  auto scratch = Tensor<double>::empty({rows + 3}, Device::cuda(device));
  double* row_loss = scratch.data();
  double* totals = row_loss + rows;
  detail::cross_entropy_forward_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0, stream>>>(
      rows, cols, logits, targets, lse, row_loss, ignore_index, smoothing);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::cross_entropy_total_kernel<std::int32_t><<<1, 1024, 0, stream>>>(rows, cols, row_loss, targets, ignore_index, totals);
  PTRAIN_CHECK_CUDA_LAUNCH();
  double host[3] = {0, 0, 0};
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(host, totals, sizeof(host), cudaMemcpyDeviceToHost, stream));
  PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  PTRAIN_CHECK(host[2] == 0, ShapeError, "[ptrain.cuda.cross_entropy] ", static_cast<std::int64_t>(host[2]),
               " target(s) lie outside [0, ", cols, ") and are not ignore_index (", ignore_index,
               "); check the labels and the number of classes");
  valid = static_cast<std::int64_t>(host[1]);
  return valid ? host[0] / static_cast<double>(valid) : 0.0;
}

/// dlogits = dloss * (softmax(logits) - (1 - eps) onehot(target) - eps / cols) / valid
/// (eps: label smoothing); ignored rows get 0.
template <class T>
void cross_entropy_backward(std::int64_t rows, std::int64_t cols, const T* logits, const acc_t<T>* lse,
                            const std::int32_t* targets, std::int64_t valid, acc_t<T> dloss, T* dlogits,
                            std::int32_t ignore_index = -100, acc_t<T> smoothing = 0) {
  using A = acc_t<T>;
  detail::check_element_type<T>();
  if (rows <= 0 || cols <= 0) return;
  const A scale = valid ? dloss / static_cast<A>(valid) : A(0);  // as the CPU computes it
  detail::cross_entropy_backward_kernel<T><<<detail::grid_for_rows(rows), detail::block_for_cols(cols), 0,
                                            current_stream()>>>(
      rows, cols, logits, lse, targets, scale, dlogits, ignore_index, smoothing);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
