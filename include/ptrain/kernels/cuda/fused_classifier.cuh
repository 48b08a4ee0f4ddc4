#pragma once
// The fused classifier on device arrays (kernels/cpu/fused_classifier.hpp has
// the contract): loss and dlogits of mean softmax cross-entropy in one kernel
// that overwrites the logits with their gradient, the loss added to a device
// accumulator; nothing waits for the host.
//
// Three launches: a one-block count of the rows that count (the mean's
// divisor, needed before any gradient is written), the row kernel, and a
// one-block sum of the per-block loss partials into the accumulator. The row
// kernel gives each row one block: a first sweep keeps each thread's running
// max and sum of exp (rescaled when the max grows) and reads the target's
// logit, block reductions give the log-sum-exp, and a second sweep writes
// dloss (softmax - onehot) / counted over the row; the row is read twice (the
// second time mostly from L2) and written once. Both sweeps load 16 bytes per
// thread before using them (kUnroll<T> elements a block apart), so that a bf16
// row streams at the memory's speed rather than at one 2-byte load per thread. Thread 0 adds each row's loss
// to its block's partial in the block's row order, and the partials are
// summed in block order by one block, so the loss is the same bits every run.
// Float, double and bf16 (float arithmetic, Note [bf16 kernels]).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

// counts = {rows that count, targets outside [0, cols) that are not ignore_index}.
template <class Index>
__global__ void fused_classifier_count_kernel(std::int64_t rows, std::int64_t cols, const Index* targets,
                                              Index ignore_index, double* counts) {
  double valid = 0, bad = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const Index t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= cols) bad += 1;
    else valid += 1;
  }
  valid = block_sum(valid);
  bad = block_sum(bad);
  if (threadIdx.x == 0) {
    counts[0] = valid;
    counts[1] = bad;
  }
}

template <class T>
__global__ void fused_classifier_kernel(std::int64_t rows, std::int64_t cols, T* logits, const std::int32_t* targets,
                                        std::int32_t ignore_index, acc_t<T> smoothing, acc_t<T> dloss,
                                        const double* counts, double* partial) {
  using A = acc_t<T>;
  constexpr int U = kUnroll<T>;
  const auto valid = static_cast<std::int64_t>(counts[0]);
  const A scale = valid ? dloss / static_cast<A>(valid) : A(0);  // as the CPU computes it
  const A uniform = scale * smoothing / static_cast<A>(cols);
  double block_total = 0;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    T* xr = logits + r * cols;
    const std::int32_t t = targets[r];
    const bool counted = t != ignore_index && t >= 0 && t < cols;
    // Read before the barriers in block_max: the second sweep overwrites xr[t].
    const A xt = counted ? ld(xr[t]) : A(0);
    // Each pass takes kUnroll<T> elements a block apart (16 bytes of the row per
    // thread in flight, Note [Elementwise loops]) and folds them into the running
    // max and sum with one rescaling.
    A m = A(-INFINITY), s = A(0), row_sum = A(0);
    for (std::int64_t base = threadIdx.x; base < cols; base += U * blockDim.x) {
      A xs[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const std::int64_t c = base + k * static_cast<std::int64_t>(blockDim.x);
        xs[k] = c < cols ? ld(xr[c]) : A(-INFINITY);
      }
      A pm = m;
#pragma unroll
      for (int k = 0; k < U; ++k) pm = xs[k] > pm ? xs[k] : pm;
      if (pm != A(-INFINITY)) {
        A add = A(0);
#pragma unroll
        for (int k = 0; k < U; ++k) add += dev_exp(xs[k] - pm);  // exp(-inf) = 0 past the row's end
        s = s * dev_exp(m - pm) + add;
        m = pm;
      }
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (base + k * static_cast<std::int64_t>(blockDim.x) < cols) row_sum += xs[k];
    }
    const A mx = block_max(m);
    s = block_sum(m == A(-INFINITY) ? A(0) : s * dev_exp(m - mx));
    if (smoothing != A(0)) row_sum = block_sum(row_sum);  // the same for the whole block
    const A lse = mx + dev_log(s);
    if (threadIdx.x == 0 && counted) {
      block_total += smoothing == A(0) ? static_cast<double>(lse - xt)
                                       : static_cast<double>((A(1) - smoothing) * (lse - xt) +
                                                             smoothing * (lse - row_sum / static_cast<A>(cols)));
    }
    for (std::int64_t base = threadIdx.x; base < cols; base += U * blockDim.x) {
      A xs[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const std::int64_t c = base + k * static_cast<std::int64_t>(blockDim.x);
        if (c < cols) xs[k] = ld(xr[c]);
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const std::int64_t c = base + k * static_cast<std::int64_t>(blockDim.x);
        if (c >= cols) break;
        A d = counted ? scale * dev_exp(xs[k] - lse) - uniform : A(0);
        if (counted && c == t) d -= scale * (A(1) - smoothing);
        xr[c] = st<T>(d);
      }
    }
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = block_total;
}

// One block: loss[0] += weight * (sum of the partials in block order) / counted; loss[1] += bad targets.
// (A template, as every kernel in these headers: Note in reduce.cuh's sum_final_kernel.)
template <class Unused = void>
__global__ void fused_classifier_total_kernel(int blocks, const double* partial, const double* counts, double weight,
                                              double* loss) {
  double total = 0;
  for (int i = static_cast<int>(threadIdx.x); i < blocks; i += static_cast<int>(blockDim.x)) total += partial[i];
  total = block_sum(total);
  if (threadIdx.x == 0) {
    const double valid = counts[0];
    loss[0] += weight * (valid > 0 ? total / valid : 0.0);
    loss[1] += counts[1];
  }
}

}  // namespace detail

/// kernels::cpu::fused_classifier on device arrays (logits, targets and loss on the
/// current device); asynchronous on the current stream.
template <class T>
void fused_classifier(std::int64_t rows, std::int64_t cols, T* logits, const std::int32_t* targets,
                      std::int32_t ignore_index, acc_t<T> smoothing, acc_t<T> dloss, double loss_weight,
                      double* loss) {
  detail::check_element_type<T>();
  if (rows <= 0) return;
  PTRAIN_CHECK(cols > 0, ShapeError, "[ptrain.cuda.cross_entropy] logits have ", rows, " rows but no columns");
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  const unsigned blocks = detail::grid_for_rows(rows);
  // The two counts, then one partial per block; from the device's allocator.
  auto scratch = Tensor<double>::empty({2 + static_cast<std::int64_t>(blocks)}, Device::cuda(device));
  double* counts = scratch.data();
  double* partial = counts + 2;
  detail::fused_classifier_count_kernel<std::int32_t><<<1, 1024, 0, stream>>>(rows, cols, targets, ignore_index,
                                                                              counts);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::fused_classifier_kernel<T><<<blocks, detail::block_for_cols(cols), 0, stream>>>(
      rows, cols, logits, targets, ignore_index, smoothing, dloss, counts, partial);
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::fused_classifier_total_kernel<><<<1, 1024, 0, stream>>>(static_cast<int>(blocks), partial, counts,
                                                                  loss_weight, loss);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
