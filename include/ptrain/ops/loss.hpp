#pragma once
// Softmax and softmax cross-entropy.

#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// Softmax over the last dimension.
template <class T>
Tensor<T> softmax(const Tensor<T>& x) {
  const std::int64_t rows = rows_of(x, "softmax input"), cols = x.size(-1);
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, softmax_rows, rows, cols, x.data(), y.data());
  return y;
}

/// Gradient of softmax given its output y.
template <class T>
Tensor<T> softmax_backward(const Tensor<T>& y, const Tensor<T>& dy) {
  check_shape(dy, y.shape(), "softmax output gradient");
  detail::check_devices("softmax_backward", y.device(), dy);
  const std::int64_t rows = rows_of(y, "softmax output"), cols = y.size(-1);
  auto dx = Tensor<T>::empty(y.shape(), y.device());
  PTRAIN_DISPATCH(y.device(), T, softmax_rows_backward, rows, cols, y.data(), dy.data(), dx.data());
  return dx;
}

/// Mean cross-entropy of logits [rows, classes] (or [..., classes]) against targets
/// [rows] with values in [0, classes) or ignore_index. Fills lse ([rows], float for bf16
/// logits) and valid (rows counted) for the backward pass.
template <class T>
double cross_entropy(const Tensor<T>& logits, const Tensor<std::int32_t>& targets, Tensor<acc_t<T>>& lse,
                     std::int64_t& valid, std::int32_t ignore_index = -100) {
  const std::int64_t rows = rows_of(logits, "logits"), classes = logits.size(-1);
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.cross_entropy] ", rows, " rows of logits ",
               logits.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("cross_entropy", logits.device(), targets);
  if (targets.device().is_cpu()) {
    const std::int32_t* t = targets.data();
    for (std::int64_t i = 0; i < rows; ++i)
      PTRAIN_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < classes), ShapeError,
                   "[ptrain.cross_entropy] target ", t[i], " at row ", i, " is outside [0, ", classes, ")");
  }
  lse = Tensor<acc_t<T>>::empty({rows}, logits.device());
  return PTRAIN_DISPATCH(logits.device(), T, cross_entropy_forward, rows, classes, logits.data(), targets.data(),
                         lse.data(), valid, ignore_index);
}

/// dlogits for a loss gradient dloss (1 for the loss itself).
template <class T>
Tensor<T> cross_entropy_backward(const Tensor<T>& logits, const Tensor<acc_t<T>>& lse,
                                 const Tensor<std::int32_t>& targets, std::int64_t valid, acc_t<T> dloss,
                                 std::int32_t ignore_index = -100) {
  const std::int64_t rows = rows_of(logits, "logits"), classes = logits.size(-1);
  check_shape(lse, {rows}, "cross_entropy log-sum-exp");
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.cross_entropy] ", rows, " rows of logits ",
               logits.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("cross_entropy_backward", logits.device(), lse, targets);
  auto d = Tensor<T>::empty(logits.shape(), logits.device());
  PTRAIN_DISPATCH(logits.device(), T, cross_entropy_backward, rows, classes, logits.data(), lse.data(), targets.data(),
                  valid, dloss, d.data(), ignore_index);
  return d;
}

}  // namespace ptrain::ops
