#pragma once
// 2-D convolution and pooling on NCHW tensors.
//
// Note [Convolution as GEMM]
// conv2d lowers each sample to GEMMs: im2col copies the input windows of one
// sample into col [C/groups kh kw, Ho Wo] per group, and the output of group
// g is W_g [Cout/groups, C/groups kh kw] x col_g, written straight into the
// NCHW output (no transpose). Backward recomputes the columns (the cache keeps
// only x): dW_g += dy_g col_g^T, dcol_g = W_g^T dy_g, and col2im scatters dcol
// back into dx. The bias is a rank-1 GEMM (b ones^T) added to the output and
// its gradient a GEMM with a ones vector, so every FLOP-heavy step is the
// device's GEMM (OpenBLAS on the CPU, cuBLAS on a GPU) and only the copies
// need kernels of their own. A 1x1 convolution with stride 1 and no padding
// uses the input as its columns. One sample at a time keeps the column buffer
// small (C kh kw Ho Wo elements) and in cache.

#include <array>

#include "ptrain/kernels/window.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// Hyper-parameters of a convolution or pooling window, as (height, width) pairs.
struct Conv2dArgs {
  std::array<std::int64_t, 2> kernel{1, 1};
  std::array<std::int64_t, 2> stride{1, 1};
  std::array<std::int64_t, 2> padding{0, 0};
  std::array<std::int64_t, 2> dilation{1, 1};
};

namespace detail {
// The window of `a` over the planes of an [N, C, H, W] input, checked: ShapeError naming `op`.
inline kernels::Window2d window_of(const Shape& x, const Conv2dArgs& a, const char* op) {
  PTRAIN_CHECK(x.size() == 4, ShapeError, "[ptrain.", op, ".shape] input ", x,
               " must be 4-D [N, C, H, W]; add the missing dimensions with reshape()");
  for (int i = 0; i < 2; ++i)
    PTRAIN_CHECK(a.kernel[i] > 0 && a.stride[i] > 0 && a.padding[i] >= 0 && a.dilation[i] > 0, ShapeError, "[ptrain.",
                 op, ".args] kernel, stride and dilation must be positive and padding non-negative");
  kernels::Window2d g;
  g.h = x[2];
  g.w = x[3];
  g.kh = a.kernel[0];
  g.kw = a.kernel[1];
  g.sh = a.stride[0];
  g.sw = a.stride[1];
  g.ph = a.padding[0];
  g.pw = a.padding[1];
  g.dh = a.dilation[0];
  g.dw = a.dilation[1];
  PTRAIN_CHECK(g.h + 2 * g.ph >= g.dh * (g.kh - 1) + 1 && g.w + 2 * g.pw >= g.dw * (g.kw - 1) + 1, ShapeError,
               "[ptrain.", op, ".shape] the ", g.kh, "x", g.kw, " window (dilation ", g.dh, "x", g.dw,
               ") does not fit the padded ", g.h + 2 * g.ph, "x", g.w + 2 * g.pw, " input ", x,
               "; use a larger input, more padding or a smaller kernel");
  return kernels::with_output_size(g);
}

// Per-sample GEMM pieces of conv2d (Note [Convolution as GEMM]).
struct ConvDims {
  std::int64_t n, c, cout, groups, plane_in, plane_out;
  std::int64_t cg, og, k;  // channels and outputs per group, k = C/groups kh kw
  bool direct;             // 1x1, stride 1, no padding: the input is its own columns
};

inline ConvDims conv_dims(const Shape& x, const Shape& w, std::int64_t groups, const kernels::Window2d& g) {
  ConvDims d{};
  d.n = x[0];
  d.c = x[1];
  d.cout = w[0];
  d.groups = groups;
  d.plane_in = g.h * g.w;
  d.plane_out = g.ho * g.wo;
  d.cg = d.c / groups;
  d.og = d.cout / groups;
  d.k = d.cg * g.kh * g.kw;
  d.direct = g.kh == 1 && g.kw == 1 && g.sh == 1 && g.sw == 1 && g.ph == 0 && g.pw == 0;
  return d;
}

template <class T>
ConvDims check_conv(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, std::int64_t groups,
                    const Conv2dArgs& a, kernels::Window2d& g) {
  PTRAIN_CHECK(w.dim() == 4 && w.size(2) == a.kernel[0] && w.size(3) == a.kernel[1], ShapeError,
               "[ptrain.conv2d.weight] weight ", w.shape(), " must be [Cout, Cin/groups, ", a.kernel[0], ", ",
               a.kernel[1], "]");
  g = window_of(x.shape(), a, "conv2d");
  PTRAIN_CHECK(groups > 0 && x.size(1) % groups == 0 && w.size(0) % groups == 0 && w.size(1) * groups == x.size(1),
               ShapeError, "[ptrain.conv2d.channels] input ", x.shape(), " and weight ", w.shape(), " with ", groups,
               " groups: input channels must equal weight.size(1) * groups and both channel counts divide by groups");
  if (b.defined()) {
    check_shape(b, {w.size(0)}, "conv2d bias");
    detail::check_devices("conv2d", x.device(), b);
  }
  detail::check_devices("conv2d", x.device(), w);
  return conv_dims(x.shape(), w.shape(), groups, g);
}
}  // namespace detail

/// y [N, Cout, Ho, Wo] = conv(x [N, C, H, W], w [Cout, C/groups, kh, kw]) + b [Cout]
/// (b may be undefined); PyTorch's F.conv2d (cross-correlation), zero padding.
template <class T>
Tensor<T> conv2d(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& b, const Conv2dArgs& a,
                 std::int64_t groups = 1) {
  kernels::Window2d g;
  const detail::ConvDims d = detail::check_conv(x, w, b, groups, a, g);
  const Device dev = x.device();
  auto y = Tensor<T>::empty({d.n, d.cout, g.ho, g.wo}, dev);
  Tensor<T> col = d.direct ? Tensor<T>() : Tensor<T>::empty({d.c * g.kh * g.kw, d.plane_out}, dev);
  Tensor<T> ones = b.defined() ? Tensor<T>::full({d.plane_out}, T(1)).to(dev) : Tensor<T>();
  for (std::int64_t s = 0; s < d.n; ++s) {
    const T* xs = x.data() + s * d.c * d.plane_in;
    T* ys = y.data() + s * d.cout * d.plane_out;
    const T* cols = xs;
    if (!d.direct) {
      PTRAIN_DISPATCH(dev, T, im2col, d.c, g, xs, col.data());
      cols = col.data();
    }
    for (std::int64_t gi = 0; gi < groups; ++gi)
      PTRAIN_DISPATCH(dev, T, gemm, false, false, d.og, d.plane_out, d.k, acc_t<T>(1), w.data() + gi * d.og * d.k,
                      d.k, cols + gi * d.k * d.plane_out, d.plane_out, acc_t<T>(0), ys + gi * d.og * d.plane_out,
                      d.plane_out);
    if (b.defined())  // y += b ones^T
      PTRAIN_DISPATCH(dev, T, gemm, false, false, d.cout, d.plane_out, 1, acc_t<T>(1), b.data(), 1, ones.data(),
                      d.plane_out, acc_t<T>(1), ys, d.plane_out);
  }
  return y;
}

/// Backward of conv2d: dw += dL/dw, db += dL/db (db may be null), returns dx
/// (undefined when need_dx is false: a first layer saves the col2im and a GEMM).
template <class T>
Tensor<T> conv2d_backward(const Tensor<T>& x, const Tensor<T>& w, const Tensor<T>& dy, const Tensor<T>& dw,
                          const Tensor<T>* db, const Conv2dArgs& a, std::int64_t groups = 1, bool need_dx = true) {
  if (db && !db->defined()) db = nullptr;  // undefined: a frozen parameter's (Note [Frozen parameters])
  const bool want_dw = dw.defined();
  kernels::Window2d g;
  const detail::ConvDims d = detail::check_conv(x, w, db ? *db : Tensor<T>(), groups, a, g);
  check_shape(dy, {d.n, d.cout, g.ho, g.wo}, "conv2d output gradient");
  if (want_dw) check_shape(dw, w.shape(), "conv2d weight gradient");
  detail::check_devices("conv2d_backward", x.device(), dy);
  if (want_dw) detail::check_devices("conv2d_backward", x.device(), dw);
  const Device dev = x.device();
  const Shape col_shape{d.c * g.kh * g.kw, d.plane_out};
  Tensor<T> col = d.direct || !want_dw ? Tensor<T>() : Tensor<T>::empty(col_shape, dev);
  Tensor<T> dcol = d.direct || !need_dx ? Tensor<T>() : Tensor<T>::empty(col_shape, dev);
  Tensor<T> ones = db ? Tensor<T>::full({d.plane_out}, T(1)).to(dev) : Tensor<T>();
  Tensor<T> dx = need_dx ? Tensor<T>::zeros(x.shape(), dev) : Tensor<T>();
  for (std::int64_t s = 0; s < d.n; ++s) {
    const T* xs = x.data() + s * d.c * d.plane_in;
    const T* dys = dy.data() + s * d.cout * d.plane_out;
    const T* cols = xs;
    if (!d.direct && want_dw) {
      PTRAIN_DISPATCH(dev, T, im2col, d.c, g, xs, col.data());
      cols = col.data();
    }
    T* dcols = need_dx ? (d.direct ? dx.data() + s * d.c * d.plane_in : dcol.data()) : nullptr;
    for (std::int64_t gi = 0; gi < groups; ++gi) {
      const T* dyg = dys + gi * d.og * d.plane_out;
      // dW_g += dy_g col_g^T
      if (want_dw)
        PTRAIN_DISPATCH(dev, T, gemm, false, true, d.og, d.k, d.plane_out, acc_t<T>(1), dyg, d.plane_out,
                        cols + gi * d.k * d.plane_out, d.plane_out, acc_t<T>(1), dw.data() + gi * d.og * d.k, d.k);
      // dcol_g = W_g^T dy_g
      if (need_dx)
        PTRAIN_DISPATCH(dev, T, gemm, true, false, d.k, d.plane_out, d.og, acc_t<T>(1), w.data() + gi * d.og * d.k,
                        d.k, dyg, d.plane_out, acc_t<T>(0), dcols + gi * d.k * d.plane_out, d.plane_out);
    }
    if (need_dx && !d.direct) PTRAIN_DISPATCH(dev, T, col2im, d.c, g, dcol.data(), dx.data() + s * d.c * d.plane_in);
    if (db)  // db += dy ones
      PTRAIN_DISPATCH(dev, T, gemm, false, false, d.cout, 1, d.plane_out, acc_t<T>(1), dys, d.plane_out,
                      ones.data(), 1, acc_t<T>(1), db->data(), 1);
  }
  return dx;
}

/// y [N, C, Ho, Wo] = max over each window of x [N, C, H, W] (padding is -inf);
/// idx receives each maximum's offset in its input plane, for max_pool2d_backward.
template <class T>
Tensor<T> max_pool2d(const Tensor<T>& x, const Conv2dArgs& a, Tensor<std::int32_t>& idx) {
  const kernels::Window2d g = detail::window_of(x.shape(), a, "max_pool2d");
  PTRAIN_CHECK(2 * g.ph <= g.kh && 2 * g.pw <= g.kw, ShapeError, "[ptrain.max_pool2d.args] padding ", g.ph, "x",
               g.pw, " must be at most half the ", g.kh, "x", g.kw, " kernel (as in PyTorch)");
  PTRAIN_CHECK(g.h * g.w <= INT32_MAX, ShapeError, "[ptrain.max_pool2d.shape] planes of ", g.h * g.w,
               " elements exceed the int32 indices");
  auto y = Tensor<T>::empty({x.size(0), x.size(1), g.ho, g.wo}, x.device());
  idx = Tensor<std::int32_t>::empty(y.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, max_pool2d_forward, x.size(0) * x.size(1), g, x.data(), y.data(), idx.data());
  return y;
}

template <class T>
Tensor<T> max_pool2d_backward(const Tensor<T>& x, const Tensor<std::int32_t>& idx, const Tensor<T>& dy,
                              const Conv2dArgs& a) {
  const kernels::Window2d g = detail::window_of(x.shape(), a, "max_pool2d");
  check_shape(dy, {x.size(0), x.size(1), g.ho, g.wo}, "max_pool2d output gradient");
  check_shape(idx, dy.shape(), "max_pool2d indices");
  detail::check_devices("max_pool2d_backward", x.device(), dy, idx);
  auto dx = Tensor<T>::empty(x.shape(), x.device());
  PTRAIN_DISPATCH(x.device(), T, max_pool2d_backward, x.size(0) * x.size(1), g, dy.data(), idx.data(), dx.data());
  return dx;
}

/// y [N, C, Ho, Wo] = mean over each window of x [N, C, H, W], padding counted as
/// zeros (PyTorch's count_include_pad=True); no dilation.
template <class T>
Tensor<T> avg_pool2d(const Tensor<T>& x, const Conv2dArgs& a) {
  PTRAIN_CHECK(a.dilation[0] == 1 && a.dilation[1] == 1, ShapeError, "[ptrain.avg_pool2d.args] no dilation");
  const kernels::Window2d g = detail::window_of(x.shape(), a, "avg_pool2d");
  PTRAIN_CHECK(2 * g.ph <= g.kh && 2 * g.pw <= g.kw, ShapeError, "[ptrain.avg_pool2d.args] padding ", g.ph, "x",
               g.pw, " must be at most half the ", g.kh, "x", g.kw, " kernel (as in PyTorch)");
  auto y = Tensor<T>::empty({x.size(0), x.size(1), g.ho, g.wo}, x.device());
  PTRAIN_DISPATCH(x.device(), T, avg_pool2d_forward, x.size(0) * x.size(1), g, x.data(), y.data());
  return y;
}

/// Backward of avg_pool2d for an input of shape x_shape.
template <class T>
Tensor<T> avg_pool2d_backward(const Shape& x_shape, const Tensor<T>& dy, const Conv2dArgs& a) {
  const kernels::Window2d g = detail::window_of(x_shape, a, "avg_pool2d");
  check_shape(dy, {x_shape[0], x_shape[1], g.ho, g.wo}, "avg_pool2d output gradient");
  auto dx = Tensor<T>::empty(x_shape, dy.device());
  PTRAIN_DISPATCH(dy.device(), T, avg_pool2d_backward, x_shape[0] * x_shape[1], g, dy.data(), dx.data());
  return dx;
}

}  // namespace ptrain::ops
