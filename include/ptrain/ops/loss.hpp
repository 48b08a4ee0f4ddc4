#pragma once
// Softmax, log-softmax and the losses: softmax cross-entropy (with label
// smoothing), negative log-likelihood, and the pointwise losses of
// kernels/pointwise_math.hpp (MSE, L1, smooth L1, Huber, BCE with logits).
// The loss modules of nn/loss.hpp are built on these.

#include <cmath>
#include <type_traits>
#include <utility>

#include "ptrain/ops/device_loss.hpp"
#include "ptrain/ops/dispatch.hpp"
#include "ptrain/ops/vector.hpp"

namespace ptrain::ops {

/// How a loss combines its per-element values (torch's reduction="mean", "sum", "none").
enum class Reduction { Mean, Sum, None };

inline const char* reduction_name(Reduction r) {
  return r == Reduction::Mean ? "mean" : r == Reduction::Sum ? "sum" : "none";
}

namespace detail {
/// Cross-entropy's checks: targets on the CPU in [0, classes) or ignore_index (device
/// targets are checked by the kernel), label smoothing in [0, 1].
inline void check_cross_entropy_targets(const Tensor<std::int32_t>& targets, std::int64_t classes,
                                        std::int32_t ignore_index, double label_smoothing) {
  if (targets.device().is_cpu()) {
    const std::int32_t* t = targets.data();
    for (std::int64_t i = 0; i < targets.numel(); ++i)
      PTRAIN_CHECK(t[i] == ignore_index || (t[i] >= 0 && t[i] < classes), ShapeError,
                   "[ptrain.cross_entropy] target ", t[i], " at row ", i, " is outside [0, ", classes, ")");
  }
  PTRAIN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, Error, "[ptrain.loss.label_smoothing] ",
               label_smoothing, " is outside [0, 1]");
}
}  // namespace detail

/// Softmax over the last dimension.
template <class T>
Tensor<T> softmax(const Tensor<T>& x) {
  const std::int64_t rows = rows_of(x, "softmax input"), cols = x.size(-1);
  auto y = Tensor<T>::empty(x.shape(), x.device());
  if (detail::use_cuda_kernel(x.device(), &kernels::CudaKernels<T>::softmax_rows_one_read, "softmax_rows_one_read"))
    kernels::cuda_kernels<T>().softmax_rows_one_read(rows, cols, x.data(), y.data());
  else
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
  if (detail::use_cuda_kernel(y.device(), &kernels::CudaKernels<T>::softmax_rows_backward_one_read,
                              "softmax_rows_backward_one_read"))
    kernels::cuda_kernels<T>().softmax_rows_backward_one_read(rows, cols, y.data(), dy.data(), dx.data());
  else
    PTRAIN_DISPATCH(y.device(), T, softmax_rows_backward, rows, cols, y.data(), dy.data(), dx.data());
  return dx;
}

/// Log-softmax over the last dimension: x - logsumexp(x).
template <class T>
Tensor<T> log_softmax(const Tensor<T>& x) {
  const std::int64_t rows = rows_of(x, "log_softmax input"), cols = x.size(-1);
  auto y = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, log_softmax_rows, rows, cols, x.data(), y.data());
  return y;
}

/// Gradient of log_softmax given its output y: dy - softmax * sum(dy) per row.
template <class T>
Tensor<T> log_softmax_backward(const Tensor<T>& y, const Tensor<T>& dy) {
  check_shape(dy, y.shape(), "log_softmax output gradient");
  detail::check_devices("log_softmax_backward", y.device(), dy);
  const std::int64_t rows = rows_of(y, "log_softmax output"), cols = y.size(-1);
  auto dx = Tensor<T>::empty(y.shape(), y.device());
  PTRAIN_DISPATCH(y.device(), T, log_softmax_rows_backward, rows, cols, y.data(), dy.data(), dx.data());
  return dx;
}

/// Mean cross-entropy of logits [rows, classes] (or [..., classes]) against targets
/// [rows] with values in [0, classes) or ignore_index. Fills lse ([rows], float for bf16
/// logits) and valid (rows counted) for the backward pass. label_smoothing in [0, 1]
/// mixes in the mean of -log softmax over the classes (torch's definition).
template <class T>
double cross_entropy(const Tensor<T>& logits, const Tensor<std::int32_t>& targets, Tensor<acc_t<T>>& lse,
                     std::int64_t& valid, std::int32_t ignore_index = -100, double label_smoothing = 0.0) {
  const std::int64_t rows = rows_of(logits, "logits"), classes = logits.size(-1);
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.cross_entropy] ", rows, " rows of logits ",
               logits.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("cross_entropy", logits.device(), targets);
  detail::check_cross_entropy_targets(targets, classes, ignore_index, label_smoothing);
  lse = Tensor<acc_t<T>>::empty({rows}, logits.device());
  return PTRAIN_DISPATCH(logits.device(), T, cross_entropy_forward, rows, classes, logits.data(), targets.data(),
                         lse.data(), valid, ignore_index, static_cast<acc_t<T>>(label_smoothing));
}

/// dlogits for a loss gradient dloss (1 for the loss itself).
template <class T>
Tensor<T> cross_entropy_backward(const Tensor<T>& logits, const Tensor<acc_t<T>>& lse,
                                 const Tensor<std::int32_t>& targets, std::int64_t valid, acc_t<T> dloss,
                                 std::int32_t ignore_index = -100, double label_smoothing = 0.0) {
  const std::int64_t rows = rows_of(logits, "logits"), classes = logits.size(-1);
  check_shape(lse, {rows}, "cross_entropy log-sum-exp");
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.cross_entropy] ", rows, " rows of logits ",
               logits.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("cross_entropy_backward", logits.device(), lse, targets);
  auto d = Tensor<T>::empty(logits.shape(), logits.device());
  PTRAIN_DISPATCH(logits.device(), T, cross_entropy_backward, rows, classes, logits.data(), lse.data(), targets.data(),
                  valid, dloss, d.data(), ignore_index, static_cast<acc_t<T>>(label_smoothing));
  return d;
}

namespace detail {
/// Per-element acc_t<T> values as a Tensor<T> (rounded for bf16; the same tensor for float and double).
template <class T>
Tensor<T> as_element_type(const Tensor<acc_t<T>>& v) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return v;
  } else {
    auto out = Tensor<T>::empty(v.shape(), v.device());
    cast_into(v, out);
    return out;
  }
}

/// Checks a pointwise loss's operands; returns the broadcast lengths of weight and pos_weight (0: none).
template <class T>
std::pair<std::int64_t, std::int64_t> check_pointwise_loss(const char* name, const Tensor<T>& input,
                                                           const Tensor<T>& target, const Tensor<T>& weight,
                                                           const Tensor<T>& pos_weight) {
  PTRAIN_CHECK(input.defined() && target.shape() == input.shape(), ShapeError, "[ptrain.loss.shape] ", name,
               ": the target has shape ", target.shape(), " but the input ", input.shape(),
               "; pass one target value per input element");
  check_devices(name, input.device(), target);
  // weight[i % len] broadcasts when its shape is a suffix of the input's (or it holds one value).
  auto broadcast_len = [&](const Tensor<T>& w, const char* what) -> std::int64_t {
    if (!w.defined()) return 0;
    check_devices(name, input.device(), w);
    bool suffix = w.dim() <= input.dim() && w.numel() > 0;
    for (int d = 1; suffix && d <= w.dim(); ++d) suffix = w.size(-d) == input.size(-d);
    PTRAIN_CHECK(suffix || w.numel() == 1, ShapeError, "[ptrain.loss.shape] ", name, ": ", what, " of shape ",
                 w.shape(), " does not broadcast to the input ", input.shape(),
                 "; give it the input's trailing dimensions (e.g. [classes]) or one value");
    return w.numel();
  };
  return {broadcast_len(weight, "weight"), broadcast_len(pos_weight, "pos_weight")};
}
}  // namespace detail

/// Per-element values of a pointwise loss (kernels/pointwise_math.hpp) of input and
/// target (one shape), times weight; weight and pos_weight (BCEWithLogits) are
/// undefined or broadcast over the input's leading dimensions (their shape a
/// suffix of the input's: [classes] for one per class).
template <class T>
Tensor<acc_t<T>> pointwise_loss(kernels::LossKind k, double param, const Tensor<T>& input, const Tensor<T>& target,
                                 const Tensor<T>& weight = {}, const Tensor<T>& pos_weight = {},
                                 const char* name = "loss") {
  const auto [wlen, plen] = detail::check_pointwise_loss(name, input, target, weight, pos_weight);
  auto out = Tensor<acc_t<T>>::empty(input.shape(), input.device());
  PTRAIN_DISPATCH(input.device(), T, pointwise_loss_forward, input.numel(), k, static_cast<acc_t<T>>(param),
                  input.data(), target.data(), weight.data(), wlen, pos_weight.data(), plen, out.data());
  return out;
}

/// Gradient with respect to the input of scale * sum(dy * losses) (dy null: of scale * sum(losses)).
template <class T>
Tensor<T> pointwise_loss_backward(kernels::LossKind k, double param, const Tensor<T>& input, const Tensor<T>& target,
                                  const Tensor<T>& weight, const Tensor<T>& pos_weight, const Tensor<T>* dy,
                                  acc_t<T> scale, const char* name = "loss") {
  const auto [wlen, plen] = detail::check_pointwise_loss(name, input, target, weight, pos_weight);
  if (dy) {
    check_shape(*dy, input.shape(), "loss gradient (reduction none)");
    detail::check_devices(name, input.device(), *dy);
  }
  auto dx = Tensor<T>::empty(input.shape(), input.device());
  PTRAIN_DISPATCH(input.device(), T, pointwise_loss_backward, input.numel(), k, static_cast<acc_t<T>>(param),
                  input.data(), target.data(), weight.data(), wlen, pos_weight.data(), plen,
                  dy ? dy->data() : nullptr, scale, dx.data());
  return dx;
}

/// Negative log-likelihood of log-probabilities [rows, classes] (or [..., classes])
/// against targets [rows]: per-row losses -logp[r, t[r]] (0 where t[r] == ignore_index),
/// and through `counted` the number of rows that count.
template <class T>
Tensor<acc_t<T>> nll(const Tensor<T>& logp, const Tensor<std::int32_t>& targets, std::int64_t& counted,
                     std::int32_t ignore_index = -100) {
  const std::int64_t rows = rows_of(logp, "log-probabilities"), classes = logp.size(-1);
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.loss.nll] ", rows, " rows of log-probabilities ",
               logp.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("nll", logp.device(), targets);
  auto loss = Tensor<acc_t<T>>::empty({rows}, logp.device());
  auto count = Tensor<acc_t<T>>::empty({rows}, logp.device());
  PTRAIN_DISPATCH(logp.device(), T, nll_forward, rows, classes, logp.data(), targets.data(), ignore_index,
                  loss.data(), count.data());
  const double c = sum(count);  // NaN when a target lies outside [0, classes)
  PTRAIN_CHECK(!std::isnan(c), ShapeError, "[ptrain.loss.nll] a target lies outside [0, ", classes,
               ") and is not ignore_index (", ignore_index, "); check the labels and the number of classes");
  counted = static_cast<std::int64_t>(c);
  return loss;
}

/// Gradient with respect to logp (of shape `shape`) of scale * sum(dy * per-row losses) (dy null: 1).
template <class T>
Tensor<T> nll_backward(const Shape& shape, Device device, const Tensor<std::int32_t>& targets,
                       const Tensor<T>* dy, acc_t<T> scale, std::int32_t ignore_index = -100) {
  auto d = Tensor<T>::empty(shape, device);
  const std::int64_t rows = rows_of(d, "log-probabilities"), classes = d.size(-1);
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.loss.nll] ", rows, " rows of log-probabilities ",
               shape, " but ", targets.numel(), " targets");
  detail::check_devices("nll_backward", device, targets);
  if (dy) {
    check_shape(*dy, {rows}, "loss gradient (reduction none)");
    detail::check_devices("nll_backward", device, *dy);
  }
  PTRAIN_DISPATCH(device, T, nll_backward, rows, classes, targets.data(), ignore_index, dy ? dy->data() : nullptr,
                  scale, d.data());
  return d;
}

}  // namespace ptrain::ops

// ------------------------------------------------------------ fused classifier ----

namespace ptrain::ops {

/// Mean cross-entropy of logits [rows, classes] (or [..., classes]) against targets
/// [rows] and its gradient in one pass that writes the gradient of dloss * loss over
/// the logits (for a caller that no longer needs them: the LM head's output), adding
/// loss_weight * loss to `loss` without reading it on the host (DeviceLoss). Same
/// arguments and results as cross_entropy followed by cross_entropy_backward (on the
/// CPU the same bits), except that targets outside [0, classes) on a GPU are reported
/// when the loss is read (their rows get no gradient). On a GPU the fused kernel runs
/// once it has passed its GPU tests (Note [The verification gate]); until then the
/// verified kernels run, which read the loss on the host each call.
template <class T>
void fused_classifier_(Tensor<T>& logits, const Tensor<std::int32_t>& targets, DeviceLoss& loss,
                       acc_t<T> dloss = 1, std::int32_t ignore_index = -100, double label_smoothing = 0.0,
                       double loss_weight = 1.0) {
  const std::int64_t rows = rows_of(logits, "logits"), classes = logits.size(-1);
  PTRAIN_CHECK(targets.numel() == rows, ShapeError, "[ptrain.cross_entropy] ", rows, " rows of logits ",
               logits.shape(), " but ", targets.numel(), " targets");
  detail::check_devices("fused_classifier", logits.device(), targets);
  PTRAIN_CHECK(rows == 0 || classes > 0, ShapeError, "[ptrain.cross_entropy] logits ", logits.shape(),
               " have no classes");
  detail::check_cross_entropy_targets(targets, classes, ignore_index, label_smoothing);
  Tensor<double>& acc = loss.bind(logits.device());
  if (logits.device().is_cuda() &&
      !kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::fused_classifier, "fused_classifier")) {
    Tensor<acc_t<T>> lse;
    std::int64_t valid = 0;
    const double l = cross_entropy(logits, targets, lse, valid, ignore_index, label_smoothing);
    logits.copy_(cross_entropy_backward(logits, lse, targets, valid, dloss, ignore_index, label_smoothing));
    loss.add_host(loss_weight * l);
  } else {
    PTRAIN_DISPATCH(logits.device(), T, fused_classifier, rows, classes, logits.data(), targets.data(), ignore_index,
                    static_cast<acc_t<T>>(label_smoothing), dloss, loss_weight, acc.data());
  }
  loss.add_weight(loss_weight);
}

}  // namespace ptrain::ops
