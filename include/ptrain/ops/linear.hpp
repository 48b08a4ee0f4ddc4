#pragma once
// Matrix products and the affine map y = x W^T + b (PyTorch's Linear layout:
// W is [out, in], so checkpoints exchange weights without transposes).

#include "ptrain/ops/dispatch.hpp"
#include "ptrain/ops/vector.hpp"

namespace ptrain::ops {

/// c = alpha * op(a) op(b) + beta * c for 2-D tensors.
template <class T>
void matmul_into(const Tensor<T>& a, const Tensor<T>& b, Tensor<T>& c, bool trans_a = false, bool trans_b = false,
                 acc_t<T> alpha = 1, acc_t<T> beta = 0) {
  PTRAIN_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, ShapeError, "[ptrain.matmul] needs 2-D tensors, got ",
               a.shape(), " ", b.shape(), " ", c.shape());
  const std::int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  const std::int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
  PTRAIN_CHECK(k == kb && c.size(0) == m && c.size(1) == n, ShapeError, "[ptrain.matmul] shapes ", a.shape(),
               trans_a ? "^T" : "", " x ", b.shape(), trans_b ? "^T" : "", " -> ", c.shape(), " do not match");
  detail::check_devices("matmul", a.device(), b, c);
  PTRAIN_DISPATCH(a.device(), T, gemm, trans_a, trans_b, m, n, k, alpha, a.data(), a.size(1), b.data(), b.size(1), beta,
                  c.data(), c.size(1));
}

/// op(a) op(b) as a new tensor.
template <class T>
Tensor<T> matmul(const Tensor<T>& a, const Tensor<T>& b, bool trans_a = false, bool trans_b = false) {
  PTRAIN_CHECK(a.dim() == 2 && b.dim() == 2, ShapeError, "[ptrain.matmul] needs 2-D tensors, got ", a.shape(), " ",
               b.shape());
  auto c = Tensor<T>::empty({trans_a ? a.size(1) : a.size(0), trans_b ? b.size(0) : b.size(1)}, a.device());
  matmul_into(a, b, c, trans_a, trans_b);
  return c;
}

namespace detail {
// y = x W^T + b, and with `pre` also pre = that and y = gelu(pre): one fused
// GEMM where the device has one (Note [cuBLASLt epilogues]), else the GEMM,
// the bias and the GELU apart.
template <class T>
Tensor<T> linear_impl(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, Tensor<T>* pre) {
  PTRAIN_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), ShapeError, "[ptrain.linear] input ",
               x.shape(), " does not match weight ", w.shape(), " (expected last dimension ", w.size(1), ")");
  const std::int64_t in = w.size(1), rows = rows_of(x, "linear input"), out = w.size(0);
  std::vector<std::int64_t> yshape(x.shape().begin(), x.shape().end());
  yshape.back() = out;
  auto y = Tensor<T>::empty(Shape(yshape), x.device());
  auto x2 = x.reshape({rows, in});
  if (b.defined()) {
    check_shape(b, {out}, "linear bias");
    detail::check_devices("linear", x.device(), w, b);
  }
  if (pre) *pre = Tensor<T>::empty(y.shape(), x.device());
  T* pre_data = pre ? pre->data() : nullptr;
  if (b.defined() && PTRAIN_DISPATCH(x.device(), T, linear_epilogue, rows, out, in, x2.data(), w.data(), b.data(),
                                     y.data(), pre_data, pre != nullptr))
    return y;
  Tensor<T>& z = pre ? *pre : y;  // x W^T + b
  auto z2 = z.reshape({rows, out});
  matmul_into(x2, w, z2, false, true);
  if (b.defined()) PTRAIN_DISPATCH(x.device(), T, bias_add, rows, out, z.data(), b.data());
  if (pre) PTRAIN_DISPATCH(x.device(), T, gelu_forward, z.numel(), z.data(), y.data());
  return y;
}
}  // namespace detail

/// y[..., out] = x[..., in] W^T + b, with W [out, in] and b [out] (b may be undefined).
template <class T>
Tensor<T> linear(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b) {
  return detail::linear_impl(x, w, b, static_cast<Tensor<T>*>(nullptr));
}

/// gelu(x W^T + b) (tanh form); pre receives x W^T + b for gelu_backward. On a GPU one
/// cuBLASLt GEMM with a fused epilogue when it applies (Note [cuBLASLt epilogues]).
template <class T>
Tensor<T> linear_gelu(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, Tensor<T>& pre) {
  return detail::linear_impl(x, w, b, &pre);
}

namespace detail {
// db += the bias gradient that a fused GEMM epilogue writes (not adds) into
// `part`, a fresh buffer; false, with db unchanged, off the GPU or where the
// epilogue does not apply.
template <class T, class Fused>
bool add_fused_bias_grad(Tensor<T> db, Fused&& fused) {
  if (!db.device().is_cuda()) return false;
  auto part = Tensor<T>::empty(db.shape(), db.device());
  if (!fused(part.data())) return false;
  axpy_(1, part, db);
  return true;
}
}  // namespace detail

/// Backward of linear: dw += dy^T x, db += column sums of dy, returns dx = dy W
/// (undefined when need_dx is false, which saves a GEMM for the first layer).
/// An undefined dw or *db is a frozen parameter's (Note [Frozen parameters] in
/// nn/flat_parameters.hpp): its GEMM or sum is skipped. On a GPU the bias
/// gradient comes out of the weight-gradient GEMM where it can (Note [cuBLASLt
/// epilogues]).
template <class T>
Tensor<T> linear_backward(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& dy, const Tensor<T>& dw,
                          const Tensor<T>* db, bool need_dx = true) {
  if (db && !db->defined()) db = nullptr;
  PTRAIN_CHECK(w.dim() == 2 && x.dim() >= 1 && x.size(-1) == w.size(1), ShapeError, "[ptrain.linear.backward] input ",
               x.shape(), " does not match weight ", w.shape());
  const std::int64_t in = w.size(1), out = w.size(0), rows = rows_of(x, "linear input");
  PTRAIN_CHECK(dy.dim() >= 1 && dy.size(-1) == out && dy.numel() == rows * out, ShapeError,
               "[ptrain.linear.backward] output gradient ", dy.shape(), " does not match input ", x.shape(),
               " and weight ", w.shape());
  const bool want_dw = dw.defined();
  if (want_dw) {
    check_shape(dw, w.shape(), "linear weight gradient");
    detail::check_devices("linear_backward", x.device(), dw);
  }
  detail::check_devices("linear_backward", x.device(), w, dy);
  if (db) {
    check_shape(*db, Shape{out}, "linear bias gradient");
    detail::check_devices("linear_backward", x.device(), *db);
  }
  auto dy2 = dy.reshape({rows, out});
  auto x2 = x.reshape({rows, in});
  const bool fused = want_dw && db && detail::add_fused_bias_grad(*db, [&](T* part) {
    return PTRAIN_DISPATCH(x.device(), T, linear_weight_grad_epilogue, rows, out, in, dy.data(), x2.data(), dw.data(),
                           part);
  });
  if (!fused) {
    if (want_dw) {
      Tensor<T> dw2 = dw;
      matmul_into(dy2, x2, dw2, true, false, 1, 1);
    }
    if (db) PTRAIN_DISPATCH(x.device(), T, bias_grad, rows, out, dy.data(), db->data());
  }
  if (!need_dx) return {};
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  auto dx2 = dx.reshape({rows, in});
  matmul_into(dy2, w, dx2);
  return dx;
}

/// Backward of y = gelu(pre) W^T + b down to pre, for an MLP's second layer: as
/// linear_backward with x = h = gelu(pre) for dw and db, then returns dpre =
/// gelu'(pre) * (dy W) and adds its column sums to db_pre, the bias gradient of
/// the layer that produced pre (undefined gradients are frozen parameters', as in
/// linear_backward). On a GPU in bf16, dpre and db_pre come out of one GEMM (Note
/// [cuBLASLt epilogues]).
template <class T>
Tensor<T> linear_gelu_backward(const Tensor<T>& h, const Tensor<T>& pre, const Tensor<T>& w, const Tensor<T>& dy,
                               const Tensor<T>& dw, const Tensor<T>* db, const Tensor<T>& db_pre_in) {
  check_shape(pre, h.shape(), "GELU input");
  const std::int64_t in = w.size(1), out = w.size(0), rows = rows_of(h, "linear input");
  auto db_pre = detail::grad_or_scratch(db_pre_in, Shape{in}, pre.device());
  check_shape(db_pre, Shape{in}, "bias gradient before the GELU");
  detail::check_devices("linear_gelu_backward", h.device(), pre, db_pre);
  linear_backward(h, w, dy, dw, db, false);  // checks the rest before anything is written
  auto dpre = Tensor<T>::empty(pre.shape(), pre.device());
  const bool fused = detail::add_fused_bias_grad(db_pre, [&](T* part) {
    return PTRAIN_DISPATCH(pre.device(), T, linear_dgelu_epilogue, rows, out, in, dy.data(), w.data(), pre.data(),
                           dpre.data(), part);
  });
  if (!fused) {
    auto dpre2 = dpre.reshape({rows, in});
    matmul_into(dy.reshape({rows, out}), w, dpre2);
    PTRAIN_DISPATCH(pre.device(), T, gelu_backward, dpre.numel(), pre.data(), dpre.data(), dpre.data());
    PTRAIN_DISPATCH(pre.device(), T, bias_grad, rows, in, dpre.data(), db_pre.data());
  }
  return dpre;
}

}  // namespace ptrain::ops
