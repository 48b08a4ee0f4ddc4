#pragma once
// Loss CPU kernels: the pointwise losses of kernels/pointwise_math.hpp and the
// negative log-likelihood. Per-element (per-row) losses go to an acc_t<T>
// array that ops/loss.hpp reduces; T is float, double or bf16 (computed in
// acc_t<T>, rounded once when a gradient is stored).
//
// Broadcasting: weight[i % weight_cols] multiplies element i's loss
// (weight_cols = n for a weight of the input's shape, the class count for one
// per class; null: no weight), pos_weight[i % classes] weights its positive term.

#include <cmath>
#include <cstdint>
#include <limits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/pointwise_math.hpp"

namespace ptrain::kernels::cpu {

/// out[i] = weight * loss_k(x[i], t[i]).
template <class T>
void pointwise_loss_forward(std::int64_t n, LossKind k, acc_t<T> param, const T* x, const T* t, const T* weight,
                            std::int64_t weight_cols, const T* pos_weight, std::int64_t classes, acc_t<T>* out) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i) {
    const A pw = pos_weight ? static_cast<A>(pos_weight[i % classes]) : A(1);
    A l = math::loss<A>(k, param, static_cast<A>(x[i]), static_cast<A>(t[i]), pw);
    if (weight) l *= static_cast<A>(weight[i % weight_cols]);
    out[i] = l;
  }
}

/// dx[i] = scale * dy[i] * weight * d loss_k / dx (dy null: 1), the gradient of
/// scale * sum(dy * losses).
template <class T>
void pointwise_loss_backward(std::int64_t n, LossKind k, acc_t<T> param, const T* x, const T* t, const T* weight,
                             std::int64_t weight_cols, const T* pos_weight, std::int64_t classes, const T* dy,
                             acc_t<T> scale, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i) {
    const A pw = pos_weight ? static_cast<A>(pos_weight[i % classes]) : A(1);
    A g = scale * math::loss_grad<A>(k, param, static_cast<A>(x[i]), static_cast<A>(t[i]), pw);
    if (weight) g *= static_cast<A>(weight[i % weight_cols]);
    if (dy) g *= static_cast<A>(dy[i]);
    dx[i] = T(g);
  }
}

/// Per row of log-probabilities [rows, cols]: loss[r] = -logp[r, t[r]] and
/// counted[r] = 1, or 0 and 0 where t[r] == ignore_index; NaN in both for a
/// target outside [0, cols) (ops/loss.hpp reports it).
template <class T>
void nll_forward(std::int64_t rows, std::int64_t cols, const T* logp, const std::int32_t* targets,
                 std::int32_t ignore_index, acc_t<T>* loss, acc_t<T>* counted) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) {
      loss[r] = counted[r] = A(0);
    } else if (t < 0 || t >= cols) {
      loss[r] = counted[r] = std::numeric_limits<A>::quiet_NaN();
    } else {
      loss[r] = -static_cast<A>(logp[r * cols + t]);
      counted[r] = A(1);
    }
  }
}

/// dlogp = 0 except dlogp[r, t[r]] = -scale * dy[r] (dy null: 1) on rows that count.
template <class T>
void nll_backward(std::int64_t rows, std::int64_t cols, const std::int32_t* targets, std::int32_t ignore_index,
                  const T* dy, acc_t<T> scale, T* dlogp) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* dr = dlogp + r * cols;
    for (std::int64_t c = 0; c < cols; ++c) dr[c] = T(A(0));
    const std::int32_t t = targets[r];
    if (t != ignore_index && t >= 0 && t < cols) dr[t] = T(-scale * (dy ? static_cast<A>(dy[r]) : A(1)));
  }
}

}  // namespace ptrain::kernels::cpu
