#pragma once
// Losses. A loss takes targets besides its input, so it is not a Module:
// forward returns the scalar loss, backward the gradient of the input.

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/loss.hpp"

namespace ptrain::nn {

/// Mean softmax cross-entropy over rows of logits [rows, classes] (or
/// [..., classes]) with integer targets; targets equal to ignore_index do not count.
template <class T>
class CrossEntropyLoss {
 public:
  explicit CrossEntropyLoss(std::int32_t ignore_index = -100) : ignore_index_(ignore_index) {}

  double forward(const Tensor<T>& logits, const Tensor<std::int32_t>& targets, Cache<T>& cache) {
    Tensor<acc_t<T>> lse;
    std::int64_t valid = 0;
    const double loss = ops::cross_entropy(logits, targets, lse, valid, ignore_index_);
    cache.tensors = {logits};
    cache.stats = {lse};
    cache.indices = {targets};
    cache.values = {static_cast<std::uint64_t>(valid)};
    return loss;
  }
  /// Gradient of `dloss * loss` with respect to the logits.
  Tensor<T> backward(Cache<T>& cache, acc_t<T> dloss = 1) {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.stats.size() == 1, Error,
                 "[ptrain.backward] CrossEntropyLoss::backward without a forward");
    auto d = ops::cross_entropy_backward(cache.tensors[0], cache.stats[0], cache.indices[0],
                                         static_cast<std::int64_t>(cache.values[0]), dloss, ignore_index_);
    cache.clear();
    return d;
  }

 private:
  std::int32_t ignore_index_;
};

}  // namespace ptrain::nn
