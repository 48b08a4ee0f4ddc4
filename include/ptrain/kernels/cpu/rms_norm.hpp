#pragma once
// RMSNorm over the last dimension: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps)
// (Llama's LlamaRMSNorm). Reads T, computes in acc_t<T> (float for bf16) and rounds
// once when it stores. The residual forms fuse the residual add before the norm of a
// pre-norm block (h = x + residual; y = rms_norm(h)) and the residual stream's
// gradient after its backward (dh = rms_norm_backward(dy) + dresidual).

#include <cmath>
#include <cstdint>
#include <vector>

#include "ptrain/core/dtype.hpp"

namespace ptrain::kernels::cpu {

/// x, y: [rows, d]; w: [d]; rstd: [rows], saved for backward.
template <class T>
void rms_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* w, acc_t<T> eps, T* y, acc_t<T>* rstd) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    A ss = 0;
    for (std::int64_t i = 0; i < d; ++i) ss += static_cast<A>(xr[i]) * static_cast<A>(xr[i]);
    const A s = A(1) / std::sqrt(ss / static_cast<A>(d) + eps);
    for (std::int64_t i = 0; i < d; ++i) yr[i] = T(static_cast<A>(xr[i]) * s * static_cast<A>(w[i]));
    rstd[r] = s;
  }
}

/// With g = dy * w and xhat = x * rstd: dx = rstd * (g - xhat * mean(g * xhat));
/// dw += sum over rows of dy * xhat (summed in acc_t<T>, added to dw once).
template <class T>
void rms_norm_backward(std::int64_t rows, std::int64_t d, const T* x, const acc_t<T>* rstd, const T* w, const T* dy,
                       T* dx, T* dw) {
  using A = acc_t<T>;
  std::vector<A> dw_sum(static_cast<std::size_t>(d), A(0));
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const A s = rstd[r];
    A gx_mean = 0;
    for (std::int64_t i = 0; i < d; ++i) {
      const A xhat = static_cast<A>(xr[i]) * s, dyi = static_cast<A>(dyr[i]);
      gx_mean += dyi * static_cast<A>(w[i]) * xhat;
      dw_sum[static_cast<std::size_t>(i)] += dyi * xhat;
    }
    gx_mean /= static_cast<A>(d);
    for (std::int64_t i = 0; i < d; ++i) {
      const A xhat = static_cast<A>(xr[i]) * s;
      dxr[i] = T(s * (static_cast<A>(dyr[i]) * static_cast<A>(w[i]) - xhat * gx_mean));
    }
  }
  for (std::int64_t i = 0; i < d; ++i) dw[i] = T(static_cast<A>(dw[i]) + dw_sum[static_cast<std::size_t>(i)]);
}

/// h = x + residual (rounded to T), written out, and y = rms_norm(h): row by row, each
/// row's h first and then rms_norm_forward of that row, so the results are the bits of
/// the add followed by rms_norm_forward. x, residual, h, y: [rows, d]; rstd: [rows].
template <class T>
void residual_rms_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* w,
                               acc_t<T> eps, T* h, T* y, acc_t<T>* rstd) {
  using A = acc_t<T>;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* rr = residual + r * d;
    T* hr = h + r * d;
    for (std::int64_t i = 0; i < d; ++i) hr[i] = T(static_cast<A>(xr[i]) + static_cast<A>(rr[i]));
    rms_norm_forward(1, d, hr, w, eps, y + r * d, rstd + r);
  }
}

/// dh = rms_norm_backward(dy) + dresidual, the norm's gradient rounded to T before the
/// add (the bits of rms_norm_backward followed by adding dresidual); dw += as there.
/// h: the forward's h; dy, dresidual, dh: [rows, d].
template <class T>
void residual_rms_norm_backward(std::int64_t rows, std::int64_t d, const T* h, const acc_t<T>* rstd, const T* w,
                                const T* dy, const T* dresidual, T* dh, T* dw) {
  using A = acc_t<T>;
  rms_norm_backward(rows, d, h, rstd, w, dy, dh, dw);
  for (std::int64_t i = 0; i < rows * d; ++i) dh[i] = T(static_cast<A>(dh[i]) + static_cast<A>(dresidual[i]));
}

}  // namespace ptrain::kernels::cpu
