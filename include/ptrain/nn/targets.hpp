#pragma once
// Targets: what a loss compares a model's output with, either int32 class ids
// (cross-entropy, NLL) or floating-point values of the model's element type
// (regression and binary losses). A batch, the engines and the losses carry
// one Targets, so a regression model trains through the same Engine and
// Trainer as a classifier.
//
//   Targets<float> a = labels;   // Tensor<std::int32_t> [B]: class ids
//   Targets<float> b = values;   // Tensor<float> [B, ...]: values
//   a.ids("CrossEntropyLoss");   // the ids, or [ptrain.loss.targets] naming the loss
//
// Note [Targets conversion]
// Targets converts implicitly from both tensor types, and to
// `const Tensor<std::int32_t>&` (throwing [ptrain.loss.targets] when it holds
// values), so code written when targets were always class ids compiles
// unchanged: `engine.forward_backward(x, labels)`, a LossFn lambda whose
// parameter is `const Tensor<std::int32_t>&`, `ce.forward(logits, labels, c)`.

#include <cstdint>
#include <utility>

#include "ptrain/core/error.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain::nn {

template <class T>
class Targets {
 public:
  Targets() = default;
  Targets(Tensor<std::int32_t> ids) : ids_(std::move(ids)) {}  // NOLINT: implicit (Note [Targets conversion])
  Targets(Tensor<T> values) : values_(std::move(values)) {}    // NOLINT: implicit (Note [Targets conversion])

  bool defined() const { return ids_.defined() || values_.defined(); }
  /// True for int32 class ids, false for values (or nothing).
  bool is_ids() const { return ids_.defined(); }
  bool is_values() const { return values_.defined(); }

  /// The class ids; [ptrain.loss.targets] naming `who` when these targets are values.
  const Tensor<std::int32_t>& ids(const char* who = "this loss") const {
    PTRAIN_CHECK(!values_.defined(), Error, "[ptrain.loss.targets] ", who, " takes int32 class ids, but the targets "
                 "are floating-point values (", dtype_name(dtype_of<T>()), ") of shape ", values_.shape(),
                 "; use a loss for values (MSELoss, L1Loss, HuberLoss, BCEWithLogitsLoss...) or pass class ids");
    return ids_;
  }
  /// The values; [ptrain.loss.targets] naming `who` when these targets are class ids.
  const Tensor<T>& values(const char* who = "this loss") const {
    PTRAIN_CHECK(!ids_.defined(), Error, "[ptrain.loss.targets] ", who, " takes floating-point target values (",
                 dtype_name(dtype_of<T>()), ") of the output's shape, but the targets are int32 class ids of shape ",
                 ids_.shape(),
                 "; use CrossEntropyLoss or NLLLoss for class ids, or convert the targets to the model's type");
    return values_;
  }
  operator const Tensor<std::int32_t>&() const { return ids(); }  // NOLINT (Note [Targets conversion])

  int dim() const { return ids_.defined() ? ids_.dim() : values_.dim(); }
  std::int64_t size(int d) const { return ids_.defined() ? ids_.size(d) : values_.size(d); }
  const Shape& shape() const { return ids_.defined() ? ids_.shape() : values_.shape(); }
  Device device() const { return ids_.defined() ? ids_.device() : values_.device(); }
  /// Rows [start, start + n) along the first dimension (a view).
  Targets narrow(std::int64_t start, std::int64_t n) const {
    return ids_.defined() ? Targets(ids_.narrow(start, n)) : Targets(values_.narrow(start, n));
  }
  /// A copy on `d` (the same tensors when they are there already).
  Targets to(Device d) const {
    if (device() == d || !defined()) return *this;
    return ids_.defined() ? Targets(ids_.to(d)) : Targets(values_.to(d));
  }

 private:
  Tensor<std::int32_t> ids_;
  Tensor<T> values_;
};

}  // namespace ptrain::nn
