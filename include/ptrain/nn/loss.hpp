#pragma once
// Losses. A loss takes targets besides its input, so it is not a Module:
// forward returns the reduced loss, backward the gradient of the input. Each
// follows the torch.nn loss of the same name (definitions, reductions,
// ignore_index); docs/nn.md has the table of formulas.
//
//   nn::MSELoss<float> mse;                       // reduction mean
//   nn::Cache<float> c;
//   double l = mse.forward(y, target, c);         // target: Tensor<float> of y's shape
//   Tensor<float> dy = mse.backward(c);           // d l / d y
//
// Targets (nn/targets.hpp) are class ids for CrossEntropyLoss and NLLLoss and
// values of the input's type for the others; the wrong kind raises
// [ptrain.loss.targets]. Reduction::None keeps one loss per element (per row for
// NLLLoss): forward_elements() returns them and backward_elements(dloss, cache)
// takes their gradient; forward() gives the mean or the sum.

#include <cstdint>
#include <sstream>
#include <string>

#include "ptrain/kernels/pointwise_math.hpp"
#include "ptrain/nn/module.hpp"
#include "ptrain/nn/targets.hpp"
#include "ptrain/ops/loss.hpp"

namespace ptrain::nn {

using ops::Reduction;

/// Mean softmax cross-entropy over rows of logits [rows, classes] (or
/// [..., classes]) with integer targets; targets equal to ignore_index do not
/// count. label_smoothing eps: (1 - eps) * nll + eps * mean over classes of
/// -log softmax (torch.nn.CrossEntropyLoss(label_smoothing=eps)).
template <class T>
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(std::int32_t ignore_index = -100, double label_smoothing = 0.0)
      : ignore_index_(ignore_index), smoothing_(label_smoothing) {
    PTRAIN_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, Error, "[ptrain.loss.label_smoothing] ",
                 label_smoothing, " is outside [0, 1]");
  }

  double forward(const Tensor<T>& logits, const Targets<T>& targets, Cache<T>& cache) {
    const Tensor<std::int32_t>& ids = targets.ids("CrossEntropyLoss");
    Tensor<acc_t<T>> lse;
    std::int64_t valid = 0;
    const double loss = ops::cross_entropy(logits, ids, lse, valid, ignore_index_, smoothing_);
    cache.tensors = {logits};
    cache.stats = {lse};
    cache.indices = {ids};
    cache.values = {static_cast<std::uint64_t>(valid)};
    return loss;
  }
  /// Gradient of `dloss * loss` with respect to the logits.
  Tensor<T> backward(Cache<T>& cache, acc_t<T> dloss = 1) {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 1, Error,
                 "[ptrain.backward] CrossEntropyLoss::backward without a forward");
    auto d = ops::cross_entropy_backward(cache.tensors[0], cache.stats[0], cache.indices[0],
                                         static_cast<std::int64_t>(cache.values[0]), dloss, ignore_index_, smoothing_);
    cache.clear();
    return d;
  }
  /// Loss and gradient in one pass, for a caller that no longer needs the logits (a
  /// language model's head output): overwrites logits with the gradient of dloss * loss
  /// and adds loss_weight * loss to `loss` without reading it on the host
  /// (ops::fused_classifier_, ops::DeviceLoss). Returns the gradient (the logits' storage).
  Tensor<T> forward_backward(Tensor<T>& logits, const Targets<T>& targets, ops::DeviceLoss& loss,
                             acc_t<T> dloss = 1, double loss_weight = 1.0) {
    ops::fused_classifier_(logits, targets.ids("CrossEntropyLoss"), loss, dloss, ignore_index_, smoothing_,
                           loss_weight);
    return logits;
  }

 private:
  std::int32_t ignore_index_;
  double smoothing_;
};

namespace detail {
/// The loss of reduced per-element values: their mean over `count` or their sum.
inline double reduce(double sum, std::int64_t count, Reduction r) {
  return r == Reduction::Sum ? sum : count > 0 ? sum / static_cast<double>(count) : 0.0;
}
inline void require_reduced(Reduction r, const char* name) {
  PTRAIN_CHECK(r != Reduction::None, Error, "[ptrain.loss.reduction] ", name, " has reduction none, which gives a "
               "loss per element: call forward_elements() and backward_elements(), or use reduction mean or sum");
}
}  // namespace detail

/// Negative log-likelihood of log-probabilities [rows, classes] (or
/// [..., classes], e.g. LogSoftmax's output) against class ids [rows]:
/// -logp[r, t[r]], reduced over the rows whose target is not ignore_index
/// (torch.nn.NLLLoss without class weights).
template <class T>
class NLLLoss {
 public:
  explicit NLLLoss(Reduction reduction = Reduction::Mean, std::int32_t ignore_index = -100)
      : reduction_(reduction), ignore_index_(ignore_index) {}

  double forward(const Tensor<T>& logp, const Targets<T>& targets, Cache<T>& cache) {
    detail::require_reduced(reduction_, "NLLLoss");
    std::int64_t counted = 0;
    const double total = ops::sum(run(logp, targets, cache, counted));
    cache.values = {static_cast<std::uint64_t>(counted)};
    return detail::reduce(total, counted, reduction_);
  }
  Tensor<T> backward(Cache<T>& cache, acc_t<T> dloss = 1) {
    check_cache(cache, 1);
    const auto counted = static_cast<std::int64_t>(cache.values[0]);
    const acc_t<T> scale =
        reduction_ == Reduction::Sum ? dloss : counted > 0 ? dloss / static_cast<acc_t<T>>(counted) : acc_t<T>(0);
    return finish(cache, nullptr, scale);
  }
  /// The loss of each row ([rows]; 0 for ignored rows), whatever the reduction.
  Tensor<T> forward_elements(const Tensor<T>& logp, const Targets<T>& targets, Cache<T>& cache) {
    std::int64_t counted = 0;
    return ops::detail::as_element_type<T>(run(logp, targets, cache, counted));
  }
  /// Gradient of sum(dloss * forward_elements()) with respect to logp.
  Tensor<T> backward_elements(const Tensor<T>& dloss, Cache<T>& cache) {
    check_cache(cache, 0);
    return finish(cache, &dloss, acc_t<T>(1));
  }

 private:
  Tensor<acc_t<T>> run(const Tensor<T>& logp, const Targets<T>& targets, Cache<T>& cache, std::int64_t& counted) {
    const Tensor<std::int32_t>& ids = targets.ids("NLLLoss");
    auto rows = ops::nll(logp, ids, counted, ignore_index_);
    cache.clear();
    cache.tensors = {logp};
    cache.indices = {ids};
    return rows;
  }
  void check_cache(const Cache<T>& cache, std::size_t values) const {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.values.size() == values, Error,
                 "[ptrain.backward] NLLLoss::backward", values ? "" : "_elements", " without a matching forward",
                 values ? "" : "_elements", " in this cache");
  }
  Tensor<T> finish(Cache<T>& cache, const Tensor<T>* dy, acc_t<T> scale) {
    const Tensor<T>& logp = cache.tensors[0];
    auto d = ops::nll_backward<T>(logp.shape(), logp.device(), cache.indices[0], dy, scale, ignore_index_);
    cache.clear();
    return d;
  }

  Reduction reduction_;
  std::int32_t ignore_index_;
};

/// A loss of an input and a target of one shape that is a sum or mean of a
/// per-element formula (kernels/pointwise_math.hpp). The concrete losses below
/// pick the formula; the reduction's mean divides by the number of elements,
/// as torch does (also with a weight).
template <class T>
class PointwiseLoss {
 public:
  double forward(const Tensor<T>& input, const Targets<T>& target, Cache<T>& cache) {
    detail::require_reduced(reduction_, name_);
    const double total = ops::sum(run(input, target, cache));
    return detail::reduce(total, input.numel(), reduction_);
  }
  /// Gradient of `dloss * loss` with respect to the input.
  Tensor<T> backward(Cache<T>& cache, acc_t<T> dloss = 1) {
    check_cache(cache);
    const std::int64_t n = cache.tensors[0].numel();
    const acc_t<T> scale =
        reduction_ == Reduction::Sum ? dloss : n > 0 ? dloss / static_cast<acc_t<T>>(n) : acc_t<T>(0);
    return finish(cache, nullptr, scale);
  }
  /// The loss of each element (the input's shape), whatever the reduction.
  Tensor<T> forward_elements(const Tensor<T>& input, const Targets<T>& target, Cache<T>& cache) {
    return ops::detail::as_element_type<T>(run(input, target, cache));
  }
  /// Gradient of sum(dloss * forward_elements()) with respect to the input.
  Tensor<T> backward_elements(const Tensor<T>& dloss, Cache<T>& cache) {
    check_cache(cache);
    return finish(cache, &dloss, acc_t<T>(1));
  }
  Reduction reduction() const { return reduction_; }
  std::string describe() const {
    std::ostringstream s;
    s << name_ << "(reduction=" << ops::reduction_name(reduction_);
    if (kind_ == kernels::LossKind::SmoothL1) s << ", beta=" << param_;
    if (kind_ == kernels::LossKind::Huber) s << ", delta=" << param_;
    s << ")";
    return s.str();
  }

 protected:
  PointwiseLoss(const char* name, kernels::LossKind kind, double param, Reduction reduction, Tensor<T> weight = {},
                Tensor<T> pos_weight = {})
      : name_(name), kind_(kind), param_(param), reduction_(reduction), weight_(std::move(weight)),
        pos_weight_(std::move(pos_weight)) {}

 private:
  Tensor<acc_t<T>> run(const Tensor<T>& input, const Targets<T>& target, Cache<T>& cache) {
    const Tensor<T>& t = target.values(name_);
    auto losses = ops::pointwise_loss(kind_, param_, input, t, weight_, pos_weight_, name_);
    cache.clear();
    cache.tensors = {input, t};
    return losses;
  }
  void check_cache(const Cache<T>& cache) const {
    PTRAIN_CHECK(cache.tensors.size() == 2, Error, "[ptrain.backward] ", name_, "::backward without a forward in "
                 "this cache");
  }
  Tensor<T> finish(Cache<T>& cache, const Tensor<T>* dy, acc_t<T> scale) {
    auto d = ops::pointwise_loss_backward(kind_, param_, cache.tensors[0], cache.tensors[1], weight_, pos_weight_,
                                          dy, scale, name_);
    cache.clear();
    return d;
  }

  const char* name_;
  kernels::LossKind kind_;
  double param_;
  Reduction reduction_;
  Tensor<T> weight_, pos_weight_;
};

/// (x - y)^2 (torch.nn.MSELoss).
template <class T>
class MSELoss : public PointwiseLoss<T> {
 public:
  explicit MSELoss(Reduction reduction = Reduction::Mean)
      : PointwiseLoss<T>("MSELoss", kernels::LossKind::MSE, 0.0, reduction) {}
};

/// |x - y| (torch.nn.L1Loss).
template <class T>
class L1Loss : public PointwiseLoss<T> {
 public:
  explicit L1Loss(Reduction reduction = Reduction::Mean)
      : PointwiseLoss<T>("L1Loss", kernels::LossKind::L1, 0.0, reduction) {}
};

/// 0.5 (x - y)^2 / beta where |x - y| < beta, else |x - y| - 0.5 beta (torch.nn.SmoothL1Loss;
/// beta 0 is L1Loss).
template <class T>
class SmoothL1Loss : public PointwiseLoss<T> {
 public:
  explicit SmoothL1Loss(Reduction reduction = Reduction::Mean, double beta = 1.0)
      : PointwiseLoss<T>("SmoothL1Loss", kernels::LossKind::SmoothL1, check_positive(beta), reduction) {}

 private:
  static double check_positive(double beta) {
    PTRAIN_CHECK(beta >= 0.0, Error, "[ptrain.loss.beta] SmoothL1Loss's beta must be >= 0, got ", beta);
    return beta;
  }
};

/// 0.5 (x - y)^2 where |x - y| < delta, else delta (|x - y| - 0.5 delta) (torch.nn.HuberLoss).
template <class T>
class HuberLoss : public PointwiseLoss<T> {
 public:
  explicit HuberLoss(Reduction reduction = Reduction::Mean, double delta = 1.0)
      : PointwiseLoss<T>("HuberLoss", kernels::LossKind::Huber, check_positive(delta), reduction) {}

 private:
  static double check_positive(double delta) {
    PTRAIN_CHECK(delta > 0.0, Error, "[ptrain.loss.delta] HuberLoss's delta must be > 0, got ", delta);
    return delta;
  }
};

/// Binary cross-entropy of logits x against targets y in [0, 1], computed
/// stably from x: weight * (pos_weight * y * softplus(-x) + (1 - y) * softplus(x))
/// (torch.nn.BCEWithLogitsLoss). weight and pos_weight are optional; their
/// shapes are suffixes of the input's ([classes] for one value per class).
template <class T>
class BCEWithLogitsLoss : public PointwiseLoss<T> {
 public:
  explicit BCEWithLogitsLoss(Reduction reduction = Reduction::Mean, Tensor<T> weight = {}, Tensor<T> pos_weight = {})
      : PointwiseLoss<T>("BCEWithLogitsLoss", kernels::LossKind::BCEWithLogits, 0.0, reduction, std::move(weight),
                         std::move(pos_weight)) {}
};

}  // namespace ptrain::nn
