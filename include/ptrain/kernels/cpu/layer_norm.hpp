#pragma once
// LayerNorm over the last dimension: y = (x - mean) * rstd * gamma + beta, and its
// residual form, which fuses the residual add before the norm of a pre-norm block
// (h = x + residual; y = layer_norm(h)) and the residual stream's gradient after its
// backward (dh = layer_norm_backward(dy) + dresidual). bf16 forms: kernels/cpu/bf16.hpp.

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

/// h = x + residual, written out, and y = layer_norm(h): row by row, each row's h first
/// and then layer_norm_forward of that row, so the results are the bits of the add
/// followed by layer_norm_forward. x, residual, h, y: [rows, d]; mean, rstd: [rows].
template <class T>
void residual_layer_norm_forward(std::int64_t rows, std::int64_t d, const T* x, const T* residual, const T* gamma,
                                 const T* beta, T eps, T* h, T* y, T* mean, T* rstd) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * d;
    const T* rr = residual + r * d;
    T* hr = h + r * d;
    for (std::int64_t i = 0; i < d; ++i) hr[i] = xr[i] + rr[i];
    layer_norm_forward(1, d, hr, gamma, beta, eps, y + r * d, mean + r, rstd + r);
  }
}

/// dh = layer_norm_backward(dy) + dresidual (the bits of layer_norm_backward followed by
/// adding dresidual); dgamma, dbeta += as there. h: the forward's h; dy, dresidual, dh: [rows, d].
template <class T>
void residual_layer_norm_backward(std::int64_t rows, std::int64_t d, const T* h, const T* mean, const T* rstd,
                                  const T* gamma, const T* dy, const T* dresidual, T* dh, T* dgamma, T* dbeta) {
  layer_norm_backward(rows, d, h, mean, rstd, gamma, dy, dh, dgamma, dbeta);
  for (std::int64_t i = 0; i < rows * d; ++i) dh[i] += dresidual[i];
}

}  // namespace ptrain::kernels::cpu
