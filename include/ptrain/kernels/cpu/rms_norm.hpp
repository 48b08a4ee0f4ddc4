#pragma once
// RMSNorm over the last dimension: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps)
// (Llama's LlamaRMSNorm). Reads T, computes in acc_t<T> (float for bf16) and rounds
// once when it stores.

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

}  // namespace ptrain::kernels::cpu
