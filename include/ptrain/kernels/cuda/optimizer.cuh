#pragma once
// Optimizer updates as one pass over flat device arrays (parameters, gradients
// and state are contiguous, so a whole model is one launch).
//
// Same names, arguments and formulas as kernels/cpu/optimizer.hpp. Scalars
// that depend only on the step (bias corrections) are computed on the host
// exactly as the CPU computes them and passed in.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void sgd_update_kernel(std::int64_t n, T* p, const T* g, T* buf, T lr, T momentum, T dampening,
                                  bool nesterov, T weight_decay, bool first_step) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    T d = g[i] + weight_decay * p[i];
    if (momentum != T(0)) {
      const T b = first_step ? d : momentum * buf[i] + (T(1) - dampening) * d;
      buf[i] = b;
      d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
  }
}

template <class T>
__global__ void adamw_update_kernel(std::int64_t n, T* p, const T* g, T* m, T* v, T beta1, T beta2, T eps,
                                    T step_size, T inv_sqrt_bc2, T decay) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const T gi = g[i];
    const T mi = beta1 * m[i] + (T(1) - beta1) * gi;
    const T vi = beta2 * v[i] + (T(1) - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (dev_sqrt(vi) * inv_sqrt_bc2 + eps);
  }
}

// Mixed precision: the fp32 master copy is updated as above, from a float or
// bf16 gradient, and its bf16 rounding is written to the model's parameters
// in the same pass (no second kernel reads the master copy again).
template <class G>
__global__ void adamw_update_mixed_kernel(std::int64_t n, float* p, const G* g, float* m, float* v, float beta1,
                                          float beta2, float eps, float step_size, float inv_sqrt_bc2, float decay,
                                          bf16* param) {
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const float gi = static_cast<float>(g[i]);
    const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
    const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float pi = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
    p[i] = pi;
    param[i] = bf16(pi);
  }
}

}  // namespace detail

/// SGD with PyTorch's semantics: d = g + wd p; buf = first ? d : mu buf + (1 - dampening) d;
/// d = nesterov ? d + mu buf : buf; p -= lr d. buf may be null when momentum == 0.
template <class T>
void sgd_update(std::int64_t n, T* p, const T* g, T* buf, T lr, T momentum, T dampening, bool nesterov,
                T weight_decay, bool first_step) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::sgd_update_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      n, p, g, buf, lr, momentum, dampening, nesterov, weight_decay, first_step);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// AdamW (Loshchilov & Hutter): decoupled decay p *= 1 - lr wd, then the Adam
/// step with bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, as in
/// torch.optim.AdamW: p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).
template <class T>
void adamw_update(std::int64_t n, T* p, const T* g, T* m, T* v, T lr, T beta1, T beta2, T eps, T weight_decay,
                  std::int64_t step) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  const T bc1 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta1), static_cast<double>(step)));
  const T bc2 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta2), static_cast<double>(step)));
  const T step_size = lr / bc1;
  const T inv_sqrt_bc2 = T(1) / std::sqrt(bc2);
  const T decay = T(1) - lr * weight_decay;
  detail::adamw_update_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      n, p, g, m, v, beta1, beta2, eps, step_size, inv_sqrt_bc2, decay);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// adamw_update on fp32 master weights p with a float or bf16 gradient, writing
/// param[i] = bf16(p[i]) after the update (bf16 parameters, fp32 master weights
/// and moments: the mixed-precision recipe). Same scalars as adamw_update.
template <class G>
void adamw_update_mixed(std::int64_t n, float* p, const G* g, float* m, float* v, float lr, float beta1, float beta2,
                        float eps, float weight_decay, std::int64_t step, bf16* param) {
  static_assert(std::is_same_v<G, float> || std::is_same_v<G, bf16>,
                "ptrain::kernels::cuda::adamw_update_mixed: the gradient must be float or bf16");
  if (n <= 0) return;
  const float bc1 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta1), static_cast<double>(step)));
  const float bc2 = 1.0f - static_cast<float>(std::pow(static_cast<double>(beta2), static_cast<double>(step)));
  detail::adamw_update_mixed_kernel<G><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      n, p, g, m, v, beta1, beta2, eps, lr / bc1, 1.0f / std::sqrt(bc2), 1.0f - lr * weight_decay, param);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
