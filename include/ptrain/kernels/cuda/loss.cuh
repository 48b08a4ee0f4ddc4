#pragma once
// Loss CUDA kernels: the pointwise losses of kernels/pointwise_math.hpp and the
// negative log-likelihood. Same names, arguments and broadcasting as
// kernels/cpu/loss.hpp; float, double and bf16 (Note [bf16 kernels]: per-element
// losses and scalars in float); launched on current_stream() without waiting.
// The reductions are ops/loss.hpp's sums of the per-element arrays.

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

// Weights and the upstream gradient are read through pointers that may be
// null, so they are not inputs of the pointwise loop.
template <class T>
struct LossWeights {
  const T* weight;
  std::int64_t weight_cols;
  const T* pos_weight;
  std::int64_t classes;
  __device__ acc_t<T> pw(std::int64_t i) const { return pos_weight ? ld(pos_weight[i % classes]) : acc_t<T>(1); }
  __device__ acc_t<T> w(std::int64_t i) const { return weight ? ld(weight[i % weight_cols]) : acc_t<T>(1); }
};

template <class T>
struct PointwiseLossOp {
  LossKind kind;
  acc_t<T> param;
  LossWeights<T> wts;
  __device__ acc_t<T> operator()(std::int64_t i, T x, T t) const {
    return wts.w(i) * math::loss(kind, param, ld(x), ld(t), wts.pw(i));
  }
};

template <class T>
struct PointwiseLossBackwardOp {
  LossKind kind;
  acc_t<T> param;
  LossWeights<T> wts;
  const T* dy;
  acc_t<T> scale;
  __device__ T operator()(std::int64_t i, T x, T t) const {
    acc_t<T> g = scale * math::loss_grad(kind, param, ld(x), ld(t), wts.pw(i)) * wts.w(i);
    if (dy) g *= ld(dy[i]);
    return st<T>(g);
  }
};

template <class T>
__global__ void nll_forward_kernel(std::int64_t rows, std::int64_t cols, const T* logp,
                                   const std::int32_t* targets, std::int32_t ignore_index, acc_t<T>* loss,
                                   acc_t<T>* counted) {
  using A = acc_t<T>;
  for (std::int64_t r = global_index(); r < rows; r += grid_stride()) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) {
      loss[r] = counted[r] = A(0);
    } else if (t < 0 || t >= cols) {
      loss[r] = counted[r] = A(NAN);
    } else {
      loss[r] = -ld(logp[r * cols + t]);
      counted[r] = A(1);
    }
  }
}

template <class T>
struct NllBackwardOp {
  std::int64_t cols;
  const std::int32_t* targets;
  std::int32_t ignore_index;
  const T* dy;
  acc_t<T> scale;
  __device__ T operator()(std::int64_t i, T) const {
    const std::int64_t r = i / cols;
    const std::int32_t t = targets[r];
    if (t == ignore_index || i - r * cols != t) return st<T>(acc_t<T>(0));
    return st<T>(-scale * (dy ? ld(dy[r]) : acc_t<T>(1)));
  }
};

}  // namespace detail

/// out[i] = weight * loss_k(x[i], t[i]) (kernels/cpu/loss.hpp's broadcasting).
template <class T>
void pointwise_loss_forward(std::int64_t n, LossKind k, acc_t<T> param, const T* x, const T* t, const T* weight,
                            std::int64_t weight_cols, const T* pos_weight, std::int64_t classes, acc_t<T>* out) {
  detail::pointwise(n, out, detail::PointwiseLossOp<T>{k, param, {weight, weight_cols, pos_weight, classes}}, x, t);
}

/// dx[i] = scale * dy[i] * weight * d loss_k / dx (dy null: 1).
template <class T>
void pointwise_loss_backward(std::int64_t n, LossKind k, acc_t<T> param, const T* x, const T* t, const T* weight,
                             std::int64_t weight_cols, const T* pos_weight, std::int64_t classes, const T* dy,
                             acc_t<T> scale, T* dx) {
  detail::pointwise(n, dx,
                    detail::PointwiseLossBackwardOp<T>{k, param, {weight, weight_cols, pos_weight, classes}, dy, scale},
                    x, t);
}

/// loss[r] = -logp[r, t[r]], counted[r] = 1 (0 and 0 for ignore_index, NaN for a target outside [0, cols)).
template <class T>
void nll_forward(std::int64_t rows, std::int64_t cols, const T* logp, const std::int32_t* targets,
                 std::int32_t ignore_index, acc_t<T>* loss, acc_t<T>* counted) {
  detail::check_element_type<T>();
  if (rows <= 0) return;
  detail::nll_forward_kernel<T><<<detail::grid_for(rows), detail::kBlock, 0, current_stream()>>>(
      rows, cols, logp, targets, ignore_index, loss, counted);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// dlogp = 0 except dlogp[r, t[r]] = -scale * dy[r] (dy null: 1) on rows that count.
template <class T>
void nll_backward(std::int64_t rows, std::int64_t cols, const std::int32_t* targets, std::int32_t ignore_index,
                  const T* dy, acc_t<T> scale, T* dlogp) {
  if (rows <= 0 || cols <= 0) return;
  // dlogp is both the (unread) input and the output of the pointwise loop.
  detail::pointwise(rows * cols, dlogp, detail::NllBackwardOp<T>{cols, targets, ignore_index, dy, scale},
                    static_cast<const T*>(dlogp));
}

}  // namespace ptrain::kernels::cuda
