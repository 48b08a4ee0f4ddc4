#pragma once
// The gated product of a SwiGLU MLP on device arrays, h = silu(gate) * up, and
// its backward. Same names and arguments as kernels/cpu/swiglu.hpp, on SiLU's
// scalar formulas of kernels/pointwise_math.hpp (the CPU's); float, double and
// bf16 (Note [bf16 kernels]); launched on current_stream().

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/elementwise.cuh"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
struct SwigluOp {
  __device__ T operator()(std::int64_t, T gate, T up) const {
    using A = acc_t<T>;
    return st<T>(math::activation<A>(ActivationKind::SiLU, A(0), ld(gate)) * ld(up));
  }
};

template <class T>
__global__ void swiglu_backward_kernel(std::int64_t n, const T* gate, const T* up, const T* dh, T* dgate, T* dup) {
  using A = acc_t<T>;
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    const A g = ld(gate[i]), d = ld(dh[i]);
    dgate[i] = st<T>(d * ld(up[i]) * math::activation_grad<A>(ActivationKind::SiLU, A(0), g));
    dup[i] = st<T>(d * math::activation<A>(ActivationKind::SiLU, A(0), g));
  }
}

}  // namespace detail

/// h[i] = silu(gate[i]) * up[i].
template <class T>
void swiglu_forward(std::int64_t n, const T* gate, const T* up, T* h) {
  detail::pointwise(n, h, detail::SwigluOp<T>{}, gate, up);
}

/// dgate = dh * up * silu'(gate); dup = dh * silu(gate).
template <class T>
void swiglu_backward(std::int64_t n, const T* gate, const T* up, const T* dh, T* dgate, T* dup) {
  detail::check_element_type<T>();
  if (n <= 0) return;
  detail::swiglu_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, gate, up, dh,
                                                                                                  dgate, dup);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
