#pragma once
// Sliding-window kernels over NCHW planes: im2col / col2im for convolutions
// (ops/conv.hpp turns a convolution into GEMMs on the columns) and max and
// average pooling. One plane is h x w contiguous elements; geometry in
// kernels/window.hpp.

#include <cstdint>
#include <limits>

#include "ptrain/kernels/window.hpp"

namespace ptrain::kernels::cpu {

/// col[(c kh + i) kw + j][oh wo + ow] = x[c][oh sh - ph + i dh][ow sw - pw + j dw]
/// (0 outside the plane): x [channels, h, w] of one sample, col [channels kh kw, ho wo].
template <class T>
void im2col(std::int64_t channels, const Window2d& g, const T* x, T* col) {
  const std::int64_t plane = g.h * g.w;
  for (std::int64_t c = 0; c < channels; ++c)
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j) {
        T* out = col + ((c * g.kh + i) * g.kw + j) * g.ho * g.wo;
        const T* xc = x + c * plane;
        for (std::int64_t oh = 0; oh < g.ho; ++oh) {
          const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
          T* row = out + oh * g.wo;
          if (ih < 0 || ih >= g.h) {
            for (std::int64_t ow = 0; ow < g.wo; ++ow) row[ow] = T(0);
            continue;
          }
          const T* xr = xc + ih * g.w;
          const std::int64_t off = j * g.dw - g.pw;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.sw + off;
            row[ow] = (iw >= 0 && iw < g.w) ? xr[iw] : T(0);
          }
        }
      }
}

/// The adjoint of im2col: dx[c][ih][iw] += every column entry that im2col read from it.
template <class T>
void col2im(std::int64_t channels, const Window2d& g, const T* col, T* dx) {
  const std::int64_t plane = g.h * g.w;
  for (std::int64_t c = 0; c < channels; ++c)
    for (std::int64_t i = 0; i < g.kh; ++i)
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const T* in = col + ((c * g.kh + i) * g.kw + j) * g.ho * g.wo;
        T* dc = dx + c * plane;
        for (std::int64_t oh = 0; oh < g.ho; ++oh) {
          const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
          if (ih < 0 || ih >= g.h) continue;
          const T* row = in + oh * g.wo;
          T* dr = dc + ih * g.w;
          const std::int64_t off = j * g.dw - g.pw;
          for (std::int64_t ow = 0; ow < g.wo; ++ow) {
            const std::int64_t iw = ow * g.sw + off;
            if (iw >= 0 && iw < g.w) dr[iw] += row[ow];
          }
        }
      }
}

/// y[p][oh][ow] = max of the window (padding counts as -inf); idx gets the
/// argmax's offset ih w + iw in its plane (the first one on ties). x [planes, h, w].
template <class T>
void max_pool2d_forward(std::int64_t planes, const Window2d& g, const T* x, T* y, std::int32_t* idx) {
  for (std::int64_t p = 0; p < planes; ++p) {
    const T* xp = x + p * g.h * g.w;
    for (std::int64_t oh = 0; oh < g.ho; ++oh)
      for (std::int64_t ow = 0; ow < g.wo; ++ow) {
        T best = -std::numeric_limits<T>::infinity();
        std::int64_t arg = -1;
        for (std::int64_t i = 0; i < g.kh; ++i) {
          const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
          if (ih < 0 || ih >= g.h) continue;
          for (std::int64_t j = 0; j < g.kw; ++j) {
            const std::int64_t iw = ow * g.sw - g.pw + j * g.dw;
            if (iw < 0 || iw >= g.w) continue;
            const T v = xp[ih * g.w + iw];
            if (arg < 0 || v > best || v != v) {  // NaN propagates, as in PyTorch
              best = v;
              arg = ih * g.w + iw;
              if (v != v) break;
            }
          }
        }
        const std::int64_t o = (p * g.ho + oh) * g.wo + ow;
        y[o] = best;
        idx[o] = static_cast<std::int32_t>(arg);
      }
  }
}

/// dx = 0, then dx[p][idx] += dy for every output of max_pool2d_forward.
template <class T>
void max_pool2d_backward(std::int64_t planes, const Window2d& g, const T* dy, const std::int32_t* idx, T* dx) {
  const std::int64_t in = g.h * g.w, out = g.ho * g.wo;
  for (std::int64_t i = 0; i < planes * in; ++i) dx[i] = T(0);
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t o = 0; o < out; ++o) dx[p * in + idx[p * out + o]] += dy[p * out + o];
}

/// y = mean of the kh x kw window, padding counted as zeros (PyTorch's
/// count_include_pad=True); dilation is 1.
template <class T>
void avg_pool2d_forward(std::int64_t planes, const Window2d& g, const T* x, T* y) {
  const T inv = T(1) / static_cast<T>(g.kh * g.kw);
  for (std::int64_t p = 0; p < planes; ++p) {
    const T* xp = x + p * g.h * g.w;
    for (std::int64_t oh = 0; oh < g.ho; ++oh)
      for (std::int64_t ow = 0; ow < g.wo; ++ow) {
        T s = T(0);
        for (std::int64_t i = 0; i < g.kh; ++i) {
          const std::int64_t ih = oh * g.sh - g.ph + i;
          if (ih < 0 || ih >= g.h) continue;
          for (std::int64_t j = 0; j < g.kw; ++j) {
            const std::int64_t iw = ow * g.sw - g.pw + j;
            if (iw >= 0 && iw < g.w) s += xp[ih * g.w + iw];
          }
        }
        y[(p * g.ho + oh) * g.wo + ow] = s * inv;
      }
  }
}

/// dx = 0, then each dy spread evenly over its window.
template <class T>
void avg_pool2d_backward(std::int64_t planes, const Window2d& g, const T* dy, T* dx) {
  const T inv = T(1) / static_cast<T>(g.kh * g.kw);
  for (std::int64_t i = 0; i < planes * g.h * g.w; ++i) dx[i] = T(0);
  for (std::int64_t p = 0; p < planes; ++p) {
    T* dp = dx + p * g.h * g.w;
    for (std::int64_t oh = 0; oh < g.ho; ++oh)
      for (std::int64_t ow = 0; ow < g.wo; ++ow) {
        const T d = dy[(p * g.ho + oh) * g.wo + ow] * inv;
        for (std::int64_t i = 0; i < g.kh; ++i) {
          const std::int64_t ih = oh * g.sh - g.ph + i;
          if (ih < 0 || ih >= g.h) continue;
          for (std::int64_t j = 0; j < g.kw; ++j) {
            const std::int64_t iw = ow * g.sw - g.pw + j;
            if (iw >= 0 && iw < g.w) dp[ih * g.w + iw] += d;
          }
        }
      }
  }
}

}  // namespace ptrain::kernels::cpu
