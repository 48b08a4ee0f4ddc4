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

/// out[0] = the sum of the squares of x's elements (out: one double on x's device). On a
/// GPU nothing waits for the device: the sum stays there for adamw_update_ranges_'s clipping.
template <class T>
void sum_squares_into(const Tensor<T>& x, Tensor<double>& out) {
  PTRAIN_CHECK(out.numel() == 1, ShapeError, "[ptrain.optim.range] sum_squares_into: the result is one double, got ",
               out.shape());
  detail::check_devices("sum_squares_into", x.device(), out);
  PTRAIN_DISPATCH(x.device(), T, sum_squares_to, x.numel(), x.data(), out.data());
}

/// AdamW over a whole flat buffer in one call (kernels::cpu::adamw_update_ranges): p the
/// parameters (float, double) or their fp32 master copy (bf16, whose rounding goes to
/// *param), g the gradient, m and v the moments; `ends` (int64) and `decay` (uint8, one
/// flag per range) split the buffer into ranges, ends ascending to p.numel(); s.grad_sumsq,
/// when set, points into a double on the same device (sum_squares_into).
template <class T>
void adamw_update_ranges_(Tensor<acc_t<T>>& p, const Tensor<T>& g, Tensor<acc_t<T>>& m, Tensor<acc_t<T>>& v,
                          Tensor<bf16>* param, const Tensor<std::int64_t>& ends, const Tensor<std::uint8_t>& decay,
                          const kernels::AdamWStep& s) {
  detail::check_update("adamw_update_ranges", p, g, m, v);
  if (param) detail::check_update("adamw_update_ranges", p, *param);
  detail::check_devices("adamw_update_ranges", p.device(), ends, decay);
  PTRAIN_CHECK(ends.numel() == decay.numel() && ends.numel() > 0, ShapeError, "[ptrain.optim.range] ",
               ends.numel(), " range ends and ", decay.numel(), " decay flags; pass one flag per range");
  if (ends.device().is_cpu())
    PTRAIN_CHECK(ends.data()[ends.numel() - 1] == p.numel(), ShapeError, "[ptrain.optim.range] the ranges end at ",
                 ends.data()[ends.numel() - 1], " but the buffer holds ", p.numel(), " elements");
  PTRAIN_DISPATCH(p.device(), T, adamw_update_ranges, p.numel(), ends.numel(), ends.data(), decay.data(), p.data(),
                  g.data(), m.data(), v.data(), param ? param->data() : nullptr, s);
}

}  // namespace ptrain::ops
