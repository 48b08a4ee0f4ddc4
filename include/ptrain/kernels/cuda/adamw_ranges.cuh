#pragma once
// AdamW over a whole flat buffer in one launch (kernels/cpu/adamw_ranges.hpp
// has the contract), and the sum of squares that its clipping reads, left on
// the device.
//
// The ranges (weight decay on or off) are a small device array of range ends
// and flags: a grid-stride loop visits indices in increasing order, so each
// thread finds an index's range by advancing from the previous one (at most
// nranges steps per thread in all). Scalars that depend only on the step (bias
// corrections, the decay factor) are computed on the host as adamw_update
// computes them; the clipping coefficient is computed by every thread from the
// device sum of squares (one load and one square root per thread), so neither
// the norm nor the coefficient visits the host. The bf16 copy is rounded to
// nearest or stochastically (kernels/stochastic_round.hpp: the same bits as
// the CPU for the same master value).

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/adamw_step.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"
#include "ptrain/kernels/stochastic_round.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class A>
struct AdamWScalars {
  A beta1, beta2, eps, step_size, inv_sqrt_bc2, decay;
  const double* grad_sumsq;
  double max_norm;
  bool stochastic;
  std::uint64_t seed, step;
  const double* lr_step;  // AdamWStep::lr_step: the step's scalars from device memory
  A weight_decay;
};

// AdamWStep::lr_step: the scalars adamw_update_ranges computes on the host, computed
// by each thread from the device's learning rate and step, by the same formulas.
template <class A>
__device__ void adamw_device_scalars(AdamWScalars<A>& s) {
  const A lr = static_cast<A>(s.lr_step[0]);
  const double step = s.lr_step[1];
  const A bc1 = A(1) - static_cast<A>(pow(static_cast<double>(s.beta1), step));
  const A bc2 = A(1) - static_cast<A>(pow(static_cast<double>(s.beta2), step));
  s.step_size = lr / bc1;
  s.inv_sqrt_bc2 = A(1) / sqrt(bc2);
  s.decay = A(1) - lr * s.weight_decay;
  s.step = static_cast<std::uint64_t>(step);
}

template <class T>
__global__ void adamw_ranges_kernel(std::int64_t n, std::int64_t nranges, const std::int64_t* ends,
                                    const std::uint8_t* decay_flags, acc_t<T>* p, const T* g, acc_t<T>* m,
                                    acc_t<T>* v, bf16* param, AdamWScalars<acc_t<T>> s) {
  using A = acc_t<T>;
  if (s.lr_step) adamw_device_scalars(s);
  A coef = A(1);
  if (s.grad_sumsq) {
    const double c = s.max_norm / (sqrt(*s.grad_sumsq) + 1e-6);
    if (c < 1.0) coef = static_cast<A>(c);
  }
  std::int64_t r = 0;
  for (std::int64_t i = global_index(); i < n; i += grid_stride()) {
    while (r + 1 < nranges && i >= ends[r]) ++r;
    const A decay = decay_flags[r] ? s.decay : A(1);
    const A gi = ld(g[i]) * coef;
    const A mi = s.beta1 * m[i] + (A(1) - s.beta1) * gi;
    const A vi = s.beta2 * v[i] + (A(1) - s.beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const A pi = p[i] * decay - s.step_size * mi / (dev_sqrt(vi) * s.inv_sqrt_bc2 + s.eps);
    p[i] = pi;
    if (param)
      param[i] = s.stochastic ? bf16_round_stochastic(static_cast<float>(pi), s.seed, s.step,
                                                      static_cast<std::uint64_t>(i))
                              : bf16(static_cast<float>(pi));
  }
}

}  // namespace detail

/// kernels::cpu::sum_squares_to on a device array: *out (device) = sum of x[i]^2, by
/// the partials and fixed-order final sum of kernels::cuda::sum_squares (the same bits);
/// asynchronous on the current stream.
template <class T>
void sum_squares_to(std::int64_t n, const T* x, double* out) {
  detail::check_element_type<T>();
  const int device = current_device();
  const cudaStream_t stream = current_stream(device);
  if (n <= 0) {
    PTRAIN_CHECK_CUDA(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  const unsigned grid = detail::grid_for(n, detail::kReduceBlock);
  const unsigned blocks = grid < detail::kMaxPartials ? grid : detail::kMaxPartials;
  auto scratch = Tensor<double>::empty({static_cast<std::int64_t>(blocks)}, Device::cuda(device));
  detail::sum_partial_kernel<T, true><<<blocks, detail::kReduceBlock, 0, stream>>>(n, x, scratch.data());
  PTRAIN_CHECK_CUDA_LAUNCH();
  detail::sum_final_kernel<double><<<1, detail::kMaxPartials, 0, stream>>>(static_cast<int>(blocks), scratch.data(),
                                                                          out);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

/// kernels::cpu::adamw_update_ranges on device arrays (ends, decay and
/// s.grad_sumsq too); one launch, asynchronous on the current stream.
template <class T>
void adamw_update_ranges(std::int64_t n, std::int64_t nranges, const std::int64_t* ends, const std::uint8_t* decay,
                         acc_t<T>* p, const T* g, acc_t<T>* m, acc_t<T>* v, bf16* param, const AdamWStep& s) {
  using A = acc_t<T>;
  detail::check_element_type<T>();
  if (n <= 0 || nranges <= 0) return;
  const A lr = static_cast<A>(s.lr), beta1 = static_cast<A>(s.beta1), beta2 = static_cast<A>(s.beta2),
          wd = static_cast<A>(s.weight_decay);
  const A bc1 = A(1) - static_cast<A>(std::pow(static_cast<double>(beta1), static_cast<double>(s.step)));
  const A bc2 = A(1) - static_cast<A>(std::pow(static_cast<double>(beta2), static_cast<double>(s.step)));
  detail::AdamWScalars<A> k{beta1,
                            beta2,
                            static_cast<A>(s.eps),
                            lr / bc1,
                            A(1) / std::sqrt(bc2),
                            A(1) - lr * wd,
                            s.grad_sumsq,
                            s.max_norm,
                            s.stochastic_rounding,
                            s.seed,
                            static_cast<std::uint64_t>(s.step),
                            s.lr_step,
                            wd};
  detail::adamw_ranges_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(n, nranges, ends, decay,
                                                                                              p, g, m, v, param, k);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
