#pragma once
// LayerNorm and RMSNorm over the last dimension, and each fused with the
// residual add before it (residual_layer_norm, residual_rms_norm). CPU and CUDA.

#include "ptrain/kernels/cpu/rms_norm.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// y = LayerNorm(x) with gamma, beta [d]; fills mean and rstd ([rows], float for bf16 x) for
/// the backward pass.
template <class T>
Tensor<T> layer_norm(const Tensor<T>& x, const Tensor<T>& gamma, const Tensor<T>& beta, acc_t<T> eps,
                     Tensor<acc_t<T>>& mean, Tensor<acc_t<T>>& rstd) {
  const std::int64_t rows = rows_of(x, "layer_norm input"), d = x.size(-1);
  check_shape(gamma, {d}, "layer_norm weight");
  check_shape(beta, {d}, "layer_norm bias");
  detail::check_devices("layer_norm", x.device(), gamma, beta);
  auto y = Tensor<T>::empty(x.shape(), x.device());
  mean = Tensor<acc_t<T>>::empty({rows}, x.device());
  rstd = Tensor<acc_t<T>>::empty({rows}, x.device());
  if (detail::use_cuda_kernel(x.device(), &kernels::CudaKernels<T>::layer_norm_forward_one_read,
                              "layer_norm_forward_one_read"))
    kernels::cuda_kernels<T>().layer_norm_forward_one_read(rows, d, x.data(), gamma.data(), beta.data(), eps, y.data(),
                                                           mean.data(), rstd.data());
  else
    PTRAIN_DISPATCH(x.device(), T, layer_norm_forward, rows, d, x.data(), gamma.data(), beta.data(), eps, y.data(),
                    mean.data(), rstd.data());
  return y;
}

/// Returns dx; accumulates dgamma and dbeta (each undefined when its parameter is frozen).
template <class T>
Tensor<T> layer_norm_backward(const Tensor<T>& x, const Tensor<acc_t<T>>& mean, const Tensor<acc_t<T>>& rstd,
                              const Tensor<T>& gamma, const Tensor<T>& dy, const Tensor<T>& dgamma_in,
                              const Tensor<T>& dbeta_in) {
  const std::int64_t rows = rows_of(x, "layer_norm input"), d = x.size(-1);
  auto dgamma = detail::grad_or_scratch(dgamma_in, {d}, x.device());
  auto dbeta = detail::grad_or_scratch(dbeta_in, {d}, x.device());
  check_shape(dy, x.shape(), "layer_norm output gradient");
  check_shape(mean, {rows}, "layer_norm mean");
  check_shape(rstd, {rows}, "layer_norm rstd");
  check_shape(gamma, {d}, "layer_norm weight");
  check_shape(dgamma, {d}, "layer_norm weight gradient");
  check_shape(dbeta, {d}, "layer_norm bias gradient");
  detail::check_devices("layer_norm_backward", x.device(), mean, rstd, gamma, dy, dgamma, dbeta);
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  if (detail::use_cuda_kernel(x.device(), &kernels::CudaKernels<T>::layer_norm_backward_one_read,
                              "layer_norm_backward_one_read"))
    kernels::cuda_kernels<T>().layer_norm_backward_one_read(rows, d, x.data(), mean.data(), rstd.data(), gamma.data(),
                                                            dy.data(), dx.data(), dgamma.data(), dbeta.data());
  else
    PTRAIN_DISPATCH(x.device(), T, layer_norm_backward, rows, d, x.data(), mean.data(), rstd.data(), gamma.data(),
                    dy.data(), dx.data(), dgamma.data(), dbeta.data());
  return dx;
}

/// True where residual_layer_norm and its backward run: on the CPU, and on a CUDA device
/// once the gate lets their kernels run; a caller takes ops::axpy_ and layer_norm otherwise.
template <class T>
bool residual_layer_norm_usable(Device dev) {
  return !dev.is_cuda() ||
         (detail::use_cuda_kernel(dev, &kernels::CudaKernels<T>::residual_layer_norm_forward,
                                  "residual_layer_norm_forward") &&
          detail::use_cuda_kernel(dev, &kernels::CudaKernels<T>::residual_layer_norm_backward,
                                  "residual_layer_norm_backward"));
}

/// The residual add of a pre-norm block fused with the next LayerNorm: h = x + residual is
/// returned in `h` and y = layer_norm(h, gamma, beta) is the result, with mean and rstd as
/// layer_norm's. On the CPU the bits equal ops::axpy_ into a copy of residual followed by
/// layer_norm; a CUDA device does both in one kernel (gated: residual_layer_norm_usable).
template <class T>
Tensor<T> residual_layer_norm(const Tensor<T>& x, const Tensor<T>& residual, const Tensor<T>& gamma,
                              const Tensor<T>& beta, acc_t<T> eps, Tensor<T>& h, Tensor<acc_t<T>>& mean,
                              Tensor<acc_t<T>>& rstd) {
  const std::int64_t rows = rows_of(x, "residual_layer_norm input"), d = x.size(-1);
  check_shape(residual, x.shape(), "residual_layer_norm residual");
  check_shape(gamma, {d}, "residual_layer_norm weight");
  check_shape(beta, {d}, "residual_layer_norm bias");
  detail::check_devices("residual_layer_norm", x.device(), residual, gamma, beta);
  h = Tensor<T>::empty(x.shape(), x.device());
  auto y = Tensor<T>::empty(x.shape(), x.device());
  mean = Tensor<acc_t<T>>::empty({rows}, x.device());
  rstd = Tensor<acc_t<T>>::empty({rows}, x.device());
  PTRAIN_DISPATCH(x.device(), T, residual_layer_norm_forward, rows, d, x.data(), residual.data(), gamma.data(),
                  beta.data(), eps, h.data(), y.data(), mean.data(), rstd.data());
  return y;
}

/// Backward of residual_layer_norm given its h, mean and rstd: returns dh =
/// layer_norm_backward(dy) + dresidual (the gradient of both x and residual), accumulates
/// dgamma and dbeta (undefined: frozen). On the CPU the bits equal layer_norm_backward followed by
/// ops::axpy_(1, dresidual, dh); a CUDA device does both in one kernel (gated).
template <class T>
Tensor<T> residual_layer_norm_backward(const Tensor<T>& h, const Tensor<acc_t<T>>& mean, const Tensor<acc_t<T>>& rstd,
                                       const Tensor<T>& gamma, const Tensor<T>& dy, const Tensor<T>& dresidual,
                                       const Tensor<T>& dgamma_in, const Tensor<T>& dbeta_in) {
  const std::int64_t rows = rows_of(h, "residual_layer_norm input"), d = h.size(-1);
  auto dgamma = detail::grad_or_scratch(dgamma_in, {d}, h.device());
  auto dbeta = detail::grad_or_scratch(dbeta_in, {d}, h.device());
  check_shape(dy, h.shape(), "residual_layer_norm output gradient");
  check_shape(dresidual, h.shape(), "residual_layer_norm residual-stream gradient");
  check_shape(mean, {rows}, "residual_layer_norm mean");
  check_shape(rstd, {rows}, "residual_layer_norm rstd");
  check_shape(gamma, {d}, "residual_layer_norm weight");
  check_shape(dgamma, {d}, "residual_layer_norm weight gradient");
  check_shape(dbeta, {d}, "residual_layer_norm bias gradient");
  detail::check_devices("residual_layer_norm_backward", h.device(), mean, rstd, gamma, dy, dresidual, dgamma, dbeta);
  auto dh = Tensor<T>::empty(h.shape(), h.device());
  PTRAIN_DISPATCH(h.device(), T, residual_layer_norm_backward, rows, d, h.data(), mean.data(), rstd.data(),
                  gamma.data(), dy.data(), dresidual.data(), dh.data(), dgamma.data(), dbeta.data());
  return dh;
}

/// y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (Llama's RMSNorm), weight [d];
/// fills rstd ([rows], float for bf16 x) for the backward pass.
template <class T>
Tensor<T> rms_norm(const Tensor<T>& x, const Tensor<T>& weight, acc_t<T> eps, Tensor<acc_t<T>>& rstd) {
  const std::int64_t rows = rows_of(x, "rms_norm input"), d = x.size(-1);
  check_shape(weight, {d}, "rms_norm weight");
  detail::check_devices("rms_norm", x.device(), weight);
  auto y = Tensor<T>::empty(x.shape(), x.device());
  rstd = Tensor<acc_t<T>>::empty({rows}, x.device());
  PTRAIN_DISPATCH(x.device(), T, rms_norm_forward, rows, d, x.data(), weight.data(), eps, y.data(), rstd.data());
  return y;
}

/// Returns dx; accumulates dweight (undefined: frozen).
template <class T>
Tensor<T> rms_norm_backward(const Tensor<T>& x, const Tensor<acc_t<T>>& rstd, const Tensor<T>& weight,
                            const Tensor<T>& dy, const Tensor<T>& dweight_in) {
  const std::int64_t rows = rows_of(x, "rms_norm input"), d = x.size(-1);
  auto dweight = detail::grad_or_scratch(dweight_in, {d}, x.device());
  check_shape(dy, x.shape(), "rms_norm output gradient");
  check_shape(rstd, {rows}, "rms_norm rstd");
  check_shape(weight, {d}, "rms_norm weight");
  check_shape(dweight, {d}, "rms_norm weight gradient");
  detail::check_devices("rms_norm_backward", x.device(), rstd, weight, dy, dweight);
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, rms_norm_backward, rows, d, x.data(), rstd.data(), weight.data(), dy.data(),
                  dx.data(), dweight.data());
  return dx;
}

/// The residual add of a pre-norm block fused with the next RMSNorm: h = x + residual is
/// returned in `h` and y = rms_norm(h, weight) is the result, with rstd as rms_norm's. On
/// the CPU the bits equal ops::axpy_ into a copy of residual followed by rms_norm; a CUDA
/// device does both in one kernel.
template <class T>
Tensor<T> residual_rms_norm(const Tensor<T>& x, const Tensor<T>& residual, const Tensor<T>& weight, acc_t<T> eps,
                            Tensor<T>& h, Tensor<acc_t<T>>& rstd) {
  const std::int64_t rows = rows_of(x, "residual_rms_norm input"), d = x.size(-1);
  check_shape(residual, x.shape(), "residual_rms_norm residual");
  check_shape(weight, {d}, "residual_rms_norm weight");
  detail::check_devices("residual_rms_norm", x.device(), residual, weight);
  h = Tensor<T>::empty(x.shape(), x.device());
  auto y = Tensor<T>::empty(x.shape(), x.device());
  rstd = Tensor<acc_t<T>>::empty({rows}, x.device());
  PTRAIN_DISPATCH(x.device(), T, residual_rms_norm_forward, rows, d, x.data(), residual.data(), weight.data(), eps,
                  h.data(), y.data(), rstd.data());
  return y;
}

/// Backward of residual_rms_norm given its h and rstd: returns dh = rms_norm_backward(dy) +
/// dresidual (the gradient of both x and residual), accumulates dweight (undefined: frozen).
/// On the CPU the bits equal rms_norm_backward followed by ops::axpy_(1, dresidual, dh).
template <class T>
Tensor<T> residual_rms_norm_backward(const Tensor<T>& h, const Tensor<acc_t<T>>& rstd, const Tensor<T>& weight,
                                     const Tensor<T>& dy, const Tensor<T>& dresidual, const Tensor<T>& dweight_in) {
  const std::int64_t rows = rows_of(h, "residual_rms_norm input"), d = h.size(-1);
  auto dweight = detail::grad_or_scratch(dweight_in, {d}, h.device());
  check_shape(dy, h.shape(), "residual_rms_norm output gradient");
  check_shape(dresidual, h.shape(), "residual_rms_norm residual-stream gradient");
  check_shape(rstd, {rows}, "residual_rms_norm rstd");
  check_shape(weight, {d}, "residual_rms_norm weight");
  check_shape(dweight, {d}, "residual_rms_norm weight gradient");
  detail::check_devices("residual_rms_norm_backward", h.device(), rstd, weight, dy, dresidual, dweight);
  auto dh = Tensor<T>::empty(h.shape(), h.device());
  PTRAIN_DISPATCH(h.device(), T, residual_rms_norm_backward, rows, d, h.data(), rstd.data(), weight.data(), dy.data(),
                  dresidual.data(), dh.data(), dweight.data());
  return dh;
}

}  // namespace ptrain::ops
