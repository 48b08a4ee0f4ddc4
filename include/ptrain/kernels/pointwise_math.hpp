#pragma once
// The scalar formulas of the pointwise activations (Tanh, Sigmoid, SiLU,
// LeakyReLU) and of the pointwise losses (MSE, L1, smooth L1, Huber, binary
// cross-entropy with logits), with their derivatives. The CPU kernels
// (kernels/cpu/activation.hpp, loss.hpp) and the CUDA kernels (activation.cuh,
// loss.cuh) both evaluate these PTRAIN_HOST_DEVICE functions, so the two
// devices compute one definition; the tests check it against formulas written
// out on their own.
//
// A is the arithmetic type: float for float and bf16 tensors, double for double.

#include <cmath>

#include "ptrain/config.hpp"

namespace ptrain::kernels {

/// Which activation a pointwise activation kernel computes; param is LeakyReLU's negative slope.
enum class ActivationKind : int { Tanh, Sigmoid, SiLU, LeakyReLU };

/// Which loss a pointwise loss kernel computes; param is SmoothL1's beta or Huber's delta.
enum class LossKind : int { MSE, L1, SmoothL1, Huber, BCEWithLogits };

namespace math {

/// 1 / (1 + exp(-x)), taking exp of a non-positive number only (no overflow for any x).
template <class A>
PTRAIN_HOST_DEVICE A sigmoid(A x) {
  if (x >= A(0)) return A(1) / (A(1) + std::exp(-x));
  const A e = std::exp(x);
  return e / (A(1) + e);
}

/// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), exact for large |x|.
template <class A>
PTRAIN_HOST_DEVICE A softplus(A x) {
  return (x > A(0) ? x : A(0)) + std::log1p(std::exp(-std::fabs(x)));
}

template <class A>
PTRAIN_HOST_DEVICE A sign(A x) {
  return x > A(0) ? A(1) : (x < A(0) ? A(-1) : A(0));
}

template <class A>
PTRAIN_HOST_DEVICE A activation(ActivationKind k, A slope, A x) {
  switch (k) {
    case ActivationKind::Tanh: return std::tanh(x);
    case ActivationKind::Sigmoid: return sigmoid(x);
    case ActivationKind::SiLU: return x * sigmoid(x);
    case ActivationKind::LeakyReLU: return x > A(0) ? x : slope * x;
  }
  return x;
}

/// The activation's derivative from what its backward keeps (activation_saves_output):
/// the output y for Tanh and Sigmoid, the input x for SiLU and LeakyReLU.
template <class A>
PTRAIN_HOST_DEVICE A activation_grad(ActivationKind k, A slope, A saved) {
  switch (k) {
    case ActivationKind::Tanh: return A(1) - saved * saved;
    case ActivationKind::Sigmoid: return saved * (A(1) - saved);
    case ActivationKind::SiLU: {
      const A s = sigmoid(saved);
      return s * (A(1) + saved * (A(1) - s));
    }
    case ActivationKind::LeakyReLU: return saved > A(0) ? A(1) : slope;
  }
  return A(1);
}

/// True when the backward of k needs the forward's output (else its input).
PTRAIN_HOST_DEVICE bool activation_saves_output(ActivationKind k) {
  return k == ActivationKind::Tanh || k == ActivationKind::Sigmoid;
}

/// The loss of one element: input x, target t; pos_weight is BCEWithLogits' weight of positive targets.
/// Definitions of torch.nn.functional (smooth_l1_loss with beta 0 is l1_loss).
template <class A>
PTRAIN_HOST_DEVICE A loss(LossKind k, A param, A x, A t, A pos_weight) {
  const A d = x - t, a = std::fabs(d);
  switch (k) {
    case LossKind::MSE: return d * d;
    case LossKind::L1: return a;
    case LossKind::SmoothL1: return a < param ? A(0.5) * d * d / param : a - A(0.5) * param;
    case LossKind::Huber: return a < param ? A(0.5) * d * d : param * (a - A(0.5) * param);
    case LossKind::BCEWithLogits:
      // -(pw t log sigmoid(x) + (1 - t) log(1 - sigmoid(x))), with log sigmoid(x) = -softplus(-x).
      return pos_weight * t * softplus(-x) + (A(1) - t) * softplus(x);
  }
  return A(0);
}

/// d loss / dx of one element (at the kinks: the subgradient PyTorch uses, sign(0) = 0).
template <class A>
PTRAIN_HOST_DEVICE A loss_grad(LossKind k, A param, A x, A t, A pos_weight) {
  const A d = x - t, a = std::fabs(d);
  switch (k) {
    case LossKind::MSE: return A(2) * d;
    case LossKind::L1: return sign(d);
    case LossKind::SmoothL1: return a < param ? d / param : sign(d);
    case LossKind::Huber: return a < param ? d : param * sign(d);
    case LossKind::BCEWithLogits: return (A(1) - t) * sigmoid(x) - pos_weight * t * sigmoid(-x);
  }
  return A(0);
}

}  // namespace math
}  // namespace ptrain::kernels
