#pragma once
// Activations and dropout on tensors of any shape.

#include <cstdint>

#include "ptrain/kernels/cpu/swiglu.hpp"
#include "ptrain/ops/dispatch.hpp"
#include "ptrain/ops/vector.hpp"  // axpy_, scale_, sum, cast_into, ... (they lived here before)

namespace ptrain::ops {

template <class T>
Tensor<T> relu(const Tensor<T>& x) {
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, relu_forward, x.numel(), x.data(), y.data());
  return y;
}

/// Gradient of relu given the forward input x.
template <class T>
Tensor<T> relu_backward(const Tensor<T>& x, const Tensor<T>& dy) {
  check_shape(dy, x.shape(), "relu output gradient");
  detail::check_devices("relu_backward", x.device(), dy);
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, relu_backward, x.numel(), x.data(), dy.data(), dx.data());
  return dx;
}

/// GELU, tanh approximation (as in GPT-2).
template <class T>
Tensor<T> gelu(const Tensor<T>& x) {
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, gelu_forward, x.numel(), x.data(), y.data());
  return y;
}

template <class T>
Tensor<T> gelu_backward(const Tensor<T>& x, const Tensor<T>& dy) {
  check_shape(dy, x.shape(), "gelu output gradient");
  detail::check_devices("gelu_backward", x.device(), dy);
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, gelu_backward, x.numel(), x.data(), dy.data(), dx.data());
  return dx;
}

namespace detail {
template <class T>
Tensor<T> activation(const Tensor<T>& x, kernels::ActivationKind k, double param) {
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, activation_forward, x.numel(), k, static_cast<acc_t<T>>(param), x.data(), y.data());
  return y;
}
template <class T>
Tensor<T> activation_backward(const Tensor<T>& saved, const Tensor<T>& dy, kernels::ActivationKind k, double param,
                              const char* what) {
  check_shape(dy, saved.shape(), what);
  check_devices(what, saved.device(), dy);
  auto dx = Tensor<T>::empty(saved.shape(), saved.device());
  PTRAIN_DISPATCH(saved.device(), T, activation_backward, saved.numel(), k, static_cast<acc_t<T>>(param),
                  saved.data(), dy.data(), dx.data());
  return dx;
}
}  // namespace detail

/// tanh(x).
template <class T>
Tensor<T> tanh(const Tensor<T>& x) {
  return detail::activation(x, kernels::ActivationKind::Tanh, 0.0);
}
/// Gradient of tanh given its output y: dy * (1 - y^2).
template <class T>
Tensor<T> tanh_backward(const Tensor<T>& y, const Tensor<T>& dy) {
  return detail::activation_backward(y, dy, kernels::ActivationKind::Tanh, 0.0, "tanh output gradient");
}

/// 1 / (1 + exp(-x)).
template <class T>
Tensor<T> sigmoid(const Tensor<T>& x) {
  return detail::activation(x, kernels::ActivationKind::Sigmoid, 0.0);
}
/// Gradient of sigmoid given its output y: dy * y (1 - y).
template <class T>
Tensor<T> sigmoid_backward(const Tensor<T>& y, const Tensor<T>& dy) {
  return detail::activation_backward(y, dy, kernels::ActivationKind::Sigmoid, 0.0, "sigmoid output gradient");
}

/// x * sigmoid(x) (SiLU, swish).
template <class T>
Tensor<T> silu(const Tensor<T>& x) {
  return detail::activation(x, kernels::ActivationKind::SiLU, 0.0);
}
/// Gradient of silu given its input x.
template <class T>
Tensor<T> silu_backward(const Tensor<T>& x, const Tensor<T>& dy) {
  return detail::activation_backward(x, dy, kernels::ActivationKind::SiLU, 0.0, "silu output gradient");
}

/// silu(gate) * up, elementwise (the gated product of a SwiGLU MLP).
template <class T>
Tensor<T> swiglu(const Tensor<T>& gate, const Tensor<T>& up) {
  check_shape(up, gate.shape(), "swiglu up projection");
  detail::check_devices("swiglu", gate.device(), up);
  auto h = Tensor<T>::empty(gate.shape(), gate.device());
  PTRAIN_DISPATCH(gate.device(), T, swiglu_forward, gate.numel(), gate.data(), up.data(), h.data());
  return h;
}
/// Gradients of swiglu given its inputs: dgate and dup.
template <class T>
void swiglu_backward(const Tensor<T>& gate, const Tensor<T>& up, const Tensor<T>& dh, Tensor<T>& dgate,
                     Tensor<T>& dup) {
  check_shape(up, gate.shape(), "swiglu up projection");
  check_shape(dh, gate.shape(), "swiglu output gradient");
  detail::check_devices("swiglu_backward", gate.device(), up, dh);
  dgate = Tensor<T>::empty(gate.shape(), gate.device());
  dup = Tensor<T>::empty(gate.shape(), gate.device());
  PTRAIN_DISPATCH(gate.device(), T, swiglu_backward, gate.numel(), gate.data(), up.data(), dh.data(), dgate.data(),
                  dup.data());
}

/// x for x > 0, negative_slope * x otherwise.
template <class T>
Tensor<T> leaky_relu(const Tensor<T>& x, double negative_slope = 0.01) {
  return detail::activation(x, kernels::ActivationKind::LeakyReLU, negative_slope);
}
/// Gradient of leaky_relu given its input x (negative_slope at x = 0, as PyTorch).
template <class T>
Tensor<T> leaky_relu_backward(const Tensor<T>& x, const Tensor<T>& dy, double negative_slope = 0.01) {
  return detail::activation_backward(x, dy, kernels::ActivationKind::LeakyReLU, negative_slope,
                                     "leaky_relu output gradient");
}

/// Inverted dropout with the mask drawn from stream positions [offset, offset + numel) of seed.
/// Applying it to dy with the same (seed, offset) is its backward.
template <class T>
Tensor<T> dropout(const Tensor<T>& x, double p, std::uint64_t seed, std::uint64_t offset) {
  PTRAIN_CHECK(p >= 0.0 && p < 1.0, Error, "[ptrain.dropout] probability ", p, " must be in [0, 1)");
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, dropout, x.numel(), x.data(), y.data(), p, seed, offset);
  return y;
}

}  // namespace ptrain::ops
