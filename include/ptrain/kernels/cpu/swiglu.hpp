#pragma once
// The gated product of a SwiGLU MLP: h = silu(gate) * up, elementwise, and its
// backward. Reads T, computes in acc_t<T> and rounds once when it stores.

#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cpu {

/// h[i] = silu(gate[i]) * up[i].
template <class T>
void swiglu_forward(std::int64_t n, const T* gate, const T* up, T* h) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i)
    h[i] = T(math::activation<A>(ActivationKind::SiLU, A(0), static_cast<A>(gate[i])) * static_cast<A>(up[i]));
}

/// dgate = dh * up * silu'(gate); dup = dh * silu(gate).
template <class T>
void swiglu_backward(std::int64_t n, const T* gate, const T* up, const T* dh, T* dgate, T* dup) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i) {
    const A g = static_cast<A>(gate[i]), d = static_cast<A>(dh[i]);
    dgate[i] = T(d * static_cast<A>(up[i]) * math::activation_grad<A>(ActivationKind::SiLU, A(0), g));
    dup[i] = T(d * math::activation<A>(ActivationKind::SiLU, A(0), g));
  }
}

}  // namespace ptrain::kernels::cpu
