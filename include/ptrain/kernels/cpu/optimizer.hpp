#pragma once
// Optimizer updates as one pass over flat arrays (parameters, gradients and
// state are contiguous, so a whole model is one call).

#include "ptrain/config.hpp"  // before Eigen: Note [GCC 12 AVX-512 warnings]
#include <Eigen/Core>
#include <algorithm>
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
///
/// Eigen arrays vectorise sqrt and division whatever the compiler flags (a
/// plain loop keeps sqrt scalar unless -fno-math-errno). The three updates run
/// chunk by chunk so each chunk stays in L1 between them: one pass over memory.
template <class T>
void adamw_update(std::int64_t n, T* p, const T* g, T* m, T* v, T lr, T beta1, T beta2, T eps, T weight_decay,
                  std::int64_t step) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  const T bc1 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta1), static_cast<double>(step)));
  const T bc2 = T(1) - static_cast<T>(std::pow(static_cast<double>(beta2), static_cast<double>(step)));
  const T step_size = lr / bc1;
  const T inv_sqrt_bc2 = T(1) / std::sqrt(bc2);
  const T decay = T(1) - lr * weight_decay;
  constexpr std::int64_t kChunk = 1024;
  for (std::int64_t start = 0; start < n; start += kChunk) {
    const std::int64_t len = std::min(kChunk, n - start);
    Eigen::Map<const Arr> gc(g + start, len);
    Eigen::Map<Arr> pc(p + start, len), mc(m + start, len), vc(v + start, len);
    mc = beta1 * mc + (T(1) - beta1) * gc;
    vc = beta2 * vc + (T(1) - beta2) * gc.square();
    pc = pc * decay - step_size * mc / (vc.sqrt() * inv_sqrt_bc2 + eps);
  }
}

}  // namespace ptrain::kernels::cpu
