#pragma once
// LayerNorm over the last dimension: y = (x - mean) * rstd * gamma + beta.

#include <cmath>
#include <cstdint>

namespace ptrain::kernels::cpu {

/// x, y: [rows, d]; gamma, beta: [d]; mean, rstd: [rows] saved for backward.
template <class T>
void layer_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* gamma, const T* beta, T eps, T* y,
                        T* mean, T* rstd) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    T* yr = y + r * d;
    T m = 0;
    for (std::int64_t i = 0; i < d; ++i) m += xr[i];
    m /= static_cast<T>(d);
    T v = 0;
    for (std::int64_t i = 0; i < d; ++i) v += (xr[i] - m) * (xr[i] - m);
    v /= static_cast<T>(d);
    const T s = T(1) / std::sqrt(v + eps);
    for (std::int64_t i = 0; i < d; ++i) yr[i] = (xr[i] - m) * s * gamma[i] + beta[i];
    mean[r] = m;
    rstd[r] = s;
  }
}

/// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma;
/// dgamma += sum_r dy * xhat; dbeta += sum_r dy.
template <class T>
void layer_norm_backward(std::int64_t rows, std::int64_t d, const T* x, const T* mean, const T* rstd, const T* gamma,
                         const T* dy, T* dx, T* dgamma, T* dbeta) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* dyr = dy + r * d;
    T* dxr = dx + r * d;
    const T m = mean[r], s = rstd[r];
    T g_mean = 0, gx_mean = 0;
    for (std::int64_t i = 0; i < d; ++i) {
      const T xhat = (xr[i] - m) * s;
      const T g = dyr[i] * gamma[i];
      g_mean += g;
      gx_mean += g * xhat;
      dgamma[i] += dyr[i] * xhat;
      dbeta[i] += dyr[i];
    }
    g_mean /= static_cast<T>(d);
    gx_mean /= static_cast<T>(d);
    for (std::int64_t i = 0; i < d; ++i) {
      const T xhat = (xr[i] - m) * s;
      dxr[i] = s * (dyr[i] * gamma[i] - g_mean - xhat * gx_mean);
    }
  }
}

}  // namespace ptrain::kernels::cpu
