#pragma once
// Global-norm gradient clipping (torch.nn.utils.clip_grad_norm_).

#include <cmath>
#include <functional>

#include "ptrain/ops/vector.hpp"

namespace ptrain::optim {

/// Scales grads so that their global L2 norm is at most max_norm and returns
/// the norm before clipping. `reduce_sum` combines the local sum of squares
/// across ranks when each rank holds part of the gradient (FSDP) or when a
/// caller wants the norm of several buffers; identity by default.
template <class T>
double clip_grad_norm_(Tensor<T>& grads, double max_norm,
                       const std::function<double(double)>& reduce_sum = {}) {
  double sq = ops::sum_squares(grads);
  if (reduce_sum) sq = reduce_sum(sq);
  const double norm = std::sqrt(sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) ops::scale_(grads, static_cast<acc_t<T>>(coef));
  return norm;
}

}  // namespace ptrain::optim
