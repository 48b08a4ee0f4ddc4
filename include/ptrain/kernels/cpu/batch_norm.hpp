#pragma once
// Batch normalisation over x [n, c, hw] (NCHW with hw = H W; [N, C] has hw = 1):
// per-channel statistics over n and hw, then y = (x - mean) invstd w + b.
//
// Statistics are split into a reduction (batch_norm_stats: per-channel sums, in
// double) and a finalisation (batch_norm_finalize: mean, invstd, running
// statistics), and backward likewise, so that SyncBatchNorm can all-reduce the
// sums between the two steps (ops/batch_norm.hpp). Sums in double keep the
// one-pass variance sumsq / count - mean^2 accurate for float inputs.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ptrain/core/dtype.hpp"

namespace ptrain::kernels::cpu {

/// sums[ch] = sum of x[:, ch, :], sums[c + ch] = sum of its squares (sums: 2c doubles).
template <class T>
void batch_norm_stats(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, double* sums) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    double s = 0, q = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const T* p = x + (i * c + ch) * hw;
      for (std::int64_t k = 0; k < hw; ++k) {
        const double v = static_cast<double>(p[k]);
        s += v;
        q += v * v;
      }
    }
    sums[ch] = s;
    sums[c + ch] = q;
  }
}

/// From batch_norm_stats' sums over `count` values per channel: mean and
/// invstd = 1/sqrt(var + eps) with the biased variance; when running_mean is
/// not null also running = (1 - momentum) running + momentum batch, with the
/// unbiased variance var count / (count - 1) for running_var (PyTorch's rule).
template <class T>
void batch_norm_finalize(std::int64_t c, double count, const double* sums, double eps, double momentum,
                         acc_t<T>* mean, acc_t<T>* invstd, T* running_mean, T* running_var) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const double m = sums[ch] / count;
    const double var = std::max(sums[c + ch] / count - m * m, 0.0);
    mean[ch] = static_cast<acc_t<T>>(m);
    invstd[ch] = static_cast<acc_t<T>>(1.0 / std::sqrt(var + eps));
    if (running_mean) {
      const double unbiased = count > 1 ? var * count / (count - 1) : var;
      running_mean[ch] = static_cast<T>((1 - momentum) * static_cast<double>(running_mean[ch]) + momentum * m);
      running_var[ch] = static_cast<T>((1 - momentum) * static_cast<double>(running_var[ch]) + momentum * unbiased);
    }
  }
}

/// mean and invstd from the running statistics (evaluation mode).
template <class T>
void batch_norm_eval_stats(std::int64_t c, const T* running_mean, const T* running_var, double eps, acc_t<T>* mean,
                           acc_t<T>* invstd) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    mean[ch] = static_cast<acc_t<T>>(running_mean[ch]);
    invstd[ch] = static_cast<acc_t<T>>(1.0 / std::sqrt(static_cast<double>(running_var[ch]) + eps));
  }
}

/// y = (x - mean) invstd w + b; w and b may be null (no affine: 1 and 0).
template <class T>
void batch_norm_apply(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const acc_t<T>* mean,
                      const acc_t<T>* invstd, const T* w, const T* b, T* y) {
  using A = acc_t<T>;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t ch = 0; ch < c; ++ch) {
      const A scale = invstd[ch] * (w ? static_cast<A>(w[ch]) : A(1));
      const A shift = (b ? static_cast<A>(b[ch]) : A(0)) - mean[ch] * scale;
      const T* xp = x + (i * c + ch) * hw;
      T* yp = y + (i * c + ch) * hw;
      for (std::int64_t k = 0; k < hw; ++k) yp[k] = static_cast<T>(static_cast<A>(xp[k]) * scale + shift);
    }
}

/// sums[ch] = sum of dy[:, ch, :], sums[c + ch] = sum of dy xhat with xhat = (x - mean) invstd.
template <class T>
void batch_norm_backward_reduce(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* dy,
                                const acc_t<T>* mean, const acc_t<T>* invstd, double* sums) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    double s = 0, sx = 0;
    const double m = mean[ch], r = invstd[ch];
    for (std::int64_t i = 0; i < n; ++i) {
      const T* xp = x + (i * c + ch) * hw;
      const T* gp = dy + (i * c + ch) * hw;
      for (std::int64_t k = 0; k < hw; ++k) {
        const double g = static_cast<double>(gp[k]);
        s += g;
        sx += g * (static_cast<double>(xp[k]) - m) * r;
      }
    }
    sums[ch] = s;
    sums[c + ch] = sx;
  }
}

/// dx = w invstd (dy - sum_dy / count - xhat sum_dy_xhat / count) with
/// batch_norm_backward_reduce's sums over `count` values per channel, when the
/// statistics were the batch's (training); dx = w invstd dy when they were
/// constants (evaluation: sums may be null). w may be null (1).
template <class T>
void batch_norm_backward_apply(std::int64_t n, std::int64_t c, std::int64_t hw, const T* x, const T* dy,
                               const acc_t<T>* mean, const acc_t<T>* invstd, const T* w, const double* sums,
                               double count, T* dx) {
  using A = acc_t<T>;
  for (std::int64_t ch = 0; ch < c; ++ch) {
    const A r = invstd[ch], m = mean[ch];
    const A scale = r * (w ? static_cast<A>(w[ch]) : A(1));
    const A mdy = sums ? static_cast<A>(sums[ch] / count) : A(0);
    const A mdyx = sums ? static_cast<A>(sums[c + ch] / count) : A(0);
    for (std::int64_t i = 0; i < n; ++i) {
      const T* xp = x + (i * c + ch) * hw;
      const T* gp = dy + (i * c + ch) * hw;
      T* dp = dx + (i * c + ch) * hw;
      for (std::int64_t k = 0; k < hw; ++k) {
        const A xhat = (static_cast<A>(xp[k]) - m) * r;
        dp[k] = static_cast<T>(scale * (static_cast<A>(gp[k]) - mdy - xhat * mdyx));
      }
    }
  }
}

/// dw += sums[c..2c) (sum of dy xhat), db += sums[0..c) (sum of dy).
template <class T>
void batch_norm_param_grads(std::int64_t c, const double* sums, T* dw, T* db) {
  for (std::int64_t ch = 0; ch < c; ++ch) {
    dw[ch] += static_cast<T>(sums[c + ch]);
    db[ch] += static_cast<T>(sums[ch]);
  }
}

}  // namespace ptrain::kernels::cpu
