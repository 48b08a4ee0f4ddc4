#pragma once
// Fused optimizer updates on flat ranges of parameters, gradients and state, on
// the parameters' device (optim/sgd.hpp and optim/adamw.hpp call these). Every
// tensor holds the same number of elements; they are updated in place.
//
//   auto p = values.view(begin, {n}), g = grads.view(begin, {n});
//   ops::adamw_update_(p, g, m, v, lr, 0.9f, 0.999f, 1e-8f, 0.01f, step);

#include <type_traits>

#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

namespace detail {
inline void check_update_length(const char* op, std::int64_t params, std::int64_t other) {
  PTRAIN_CHECK(other == params, ShapeError, "[ptrain.optim.range] ", op, ": ", other, " elements against ", params,
               " parameters; pass ranges of the same length");
}
template <class T, class... Ts>
void check_update(const char* op, const Tensor<T>& p, const Ts&... ts) {
  (check_update_length(op, p.numel(), ts.numel()), ...);
  check_devices(op, p.device(), ts...);
}
}  // namespace detail

/// torch.optim.SGD's update of p from g; buf is the momentum buffer (undefined without
/// momentum), first_step fills it with the first gradient as PyTorch does.
template <class T>
void sgd_update_(Tensor<T>& p, const Tensor<T>& g, Tensor<T>& buf, T lr, T momentum, T dampening, bool nesterov,
                 T weight_decay, bool first_step) {
  static_assert(!std::is_same_v<T, bf16>, "ptrain::ops::sgd_update_: bf16 parameters need fp32 master weights");
  if (buf.defined()) detail::check_update("sgd_update", p, g, buf);
  else detail::check_update("sgd_update", p, g);
  PTRAIN_DISPATCH(p.device(), T, sgd_update, p.numel(), p.data(), g.data(), buf.defined() ? buf.data() : nullptr, lr,
                  momentum, dampening, nesterov, weight_decay, first_step);
}

/// torch.optim.AdamW's update of p from g with moments m and v; `step` counts from 1.
template <class T>
void adamw_update_(Tensor<T>& p, const Tensor<T>& g, Tensor<T>& m, Tensor<T>& v, T lr, T beta1, T beta2, T eps,
                   T weight_decay, std::int64_t step) {
  detail::check_update("adamw_update", p, g, m, v);
  PTRAIN_DISPATCH(p.device(), T, adamw_update, p.numel(), p.data(), g.data(), m.data(), v.data(), lr, beta1, beta2,
                  eps, weight_decay, step);
}

/// AdamW for mixed precision: updates the fp32 master weights from a gradient in G
/// (bf16 or float) with fp32 moments, and writes their bf16 rounding to param.
template <class G>
void adamw_update_mixed_(Tensor<float>& master, const Tensor<G>& g, Tensor<float>& m, Tensor<float>& v, float lr,
                         float beta1, float beta2, float eps, float weight_decay, std::int64_t step,
                         Tensor<bf16>& param) {
  detail::check_update("adamw_update_mixed", master, g, m, v, param);
  PTRAIN_DISPATCH(master.device(), G, adamw_update_mixed, master.numel(), master.data(), g.data(), m.data(), v.data(),
                  lr, beta1, beta2, eps, weight_decay, step, param.data());
}

}  // namespace ptrain::ops
