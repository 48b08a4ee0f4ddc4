#pragma once
// Optimizer updates as one pass over flat arrays (parameters, gradients and
// state are contiguous, so a whole model is one call).

#include <cmath>
#include <cstdint>

namespace ptrain::kernels::cpu {

/// SGD with PyTorch's semantics: d = g + wd p; buf = first ? d : mu buf + (1 - dampening) d;
/// d = nesterov ? d + mu buf : buf; p -= lr d. buf may be null when momentum == 0.
template <class T>
void sgd_update(std::int64_t n, T* p, const T* g, T* buf, T lr, T momentum, T dampening, bool nesterov,
                T weight_decay, bool first_step) {
  for (std::int64_t i = 0; i < n; ++i) {
    T d = g[i] + weight_decay * p[i];
    if (momentum != T(0)) {
      buf[i] = first_step ? d : momentum * buf[i] + (T(1) - dampening) * d;
      d = nesterov ? d + momentum * buf[i] : buf[i];
    }
    p[i] -= lr * d;
  }
}

/// AdamW (Loshchilov & Hutter): decoupled decay p *= 1 - lr wd, then the Adam
/// step with bias corrections bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, as in
/// torch.optim.AdamW: p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps).
template <class T>
void adamw_update(std::int64_t n, T* p, const T* g, T* m, T* v, T lr, T beta1, T beta2, T eps, T weight_decay,
                  std::int64_t step) {
  const T bc1 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta1), static_cast<double>(step)));
  const T bc2 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta2), static_cast<double>(step)));
  const T step_size = lr / bc1;
  const T inv_sqrt_bc2 = T(1) / std::sqrt(bc2);
  const T decay = T(1) - lr * weight_decay;
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = beta1 * m[i] + (T(1) - beta1) * g[i];
    v[i] = beta2 * v[i] + (T(1) - beta2) * g[i] * g[i];
    p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
}

}  // namespace ptrain::kernels::cpu
