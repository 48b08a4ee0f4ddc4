#pragma once
// Sliding-window kernels on device arrays: im2col / col2im for convolutions
// (the GEMMs are cuBLAS, through ops/conv.hpp) and max and average pooling.
// Same names and arguments as kernels/cpu/conv.hpp; float and double. One
// thread per output element of each kernel: col2im and the pooling backward
// passes gather (each input element sums the outputs whose windows hold it)
// instead of scattering with atomics, so results do not depend on timing.

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/stream.hpp"
#include "ptrain/kernels/window.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void im2col_kernel(std::int64_t channels, Window2d g, const T* x, T* col) {
  const std::int64_t total = channels * g.kh * g.kw * g.ho * g.wo;
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t ow = e % g.wo, oh = (e / g.wo) % g.ho, r = e / (g.wo * g.ho);
    const std::int64_t j = r % g.kw, i = (r / g.kw) % g.kh, c = r / (g.kw * g.kh);
    const std::int64_t ih = oh * g.sh - g.ph + i * g.dh, iw = ow * g.sw - g.pw + j * g.dw;
    col[e] = (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) ? x[(c * g.h + ih) * g.w + iw] : T(0);
  }
}

// dx[c][ih][iw] += sum over the (i, j) taps and output positions that read it.
template <class T>
__global__ void col2im_kernel(std::int64_t channels, Window2d g, const T* col, T* dx) {
  const std::int64_t total = channels * g.h * g.w;
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t iw = e % g.w, ih = (e / g.w) % g.h, c = e / (g.w * g.h);
    T acc = T(0);
    for (std::int64_t i = 0; i < g.kh; ++i) {
      const std::int64_t th = ih + g.ph - i * g.dh;
      if (th < 0 || th % g.sh != 0 || th / g.sh >= g.ho) continue;
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const std::int64_t tw = iw + g.pw - j * g.dw;
        if (tw < 0 || tw % g.sw != 0 || tw / g.sw >= g.wo) continue;
        acc += col[(((c * g.kh + i) * g.kw + j) * g.ho + th / g.sh) * g.wo + tw / g.sw];
      }
    }
    dx[e] += acc;
  }
}

template <class T>
__global__ void max_pool2d_forward_kernel(std::int64_t planes, Window2d g, const T* x, T* y, std::int32_t* idx) {
  const std::int64_t total = planes * g.ho * g.wo;
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t ow = e % g.wo, oh = (e / g.wo) % g.ho, p = e / (g.wo * g.ho);
    const T* xp = x + p * g.h * g.w;
    T best = T(0);
    std::int64_t arg = -1;
    for (std::int64_t i = 0; i < g.kh; ++i) {
      const std::int64_t ih = oh * g.sh - g.ph + i * g.dh;
      if (ih < 0 || ih >= g.h) continue;
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const std::int64_t iw = ow * g.sw - g.pw + j * g.dw;
        if (iw < 0 || iw >= g.w) continue;
        const T v = xp[ih * g.w + iw];
        if (arg < 0 || v > best || v != v) {
          best = v;
          arg = ih * g.w + iw;
        }
      }
    }
    y[e] = best;
    idx[e] = static_cast<std::int32_t>(arg);
  }
}

// dx[p][k] = sum of dy over the outputs of plane p whose argmax is k.
template <class T>
__global__ void max_pool2d_backward_kernel(std::int64_t planes, Window2d g, const T* dy, const std::int32_t* idx,
                                           T* dx) {
  const std::int64_t total = planes * g.h * g.w;
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t iw = e % g.w, ih = (e / g.w) % g.h, p = e / (g.w * g.h);
    const std::int32_t k = static_cast<std::int32_t>(ih * g.w + iw);
    T acc = T(0);
    for (std::int64_t oh = 0; oh < g.ho; ++oh) {
      const std::int64_t top = oh * g.sh - g.ph;
      if (ih < top || ih >= top + (g.kh - 1) * g.dh + 1) continue;
      for (std::int64_t ow = 0; ow < g.wo; ++ow) {
        const std::int64_t left = ow * g.sw - g.pw;
        if (iw < left || iw >= left + (g.kw - 1) * g.dw + 1) continue;
        const std::int64_t o = (p * g.ho + oh) * g.wo + ow;
        if (idx[o] == k) acc += dy[o];
      }
    }
    dx[e] = acc;
  }
}

template <class T>
__global__ void avg_pool2d_forward_kernel(std::int64_t planes, Window2d g, const T* x, T* y) {
  const std::int64_t total = planes * g.ho * g.wo;
  const T inv = T(1) / static_cast<T>(g.kh * g.kw);
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t ow = e % g.wo, oh = (e / g.wo) % g.ho, p = e / (g.wo * g.ho);
    const T* xp = x + p * g.h * g.w;
    T s = T(0);
    for (std::int64_t i = 0; i < g.kh; ++i) {
      const std::int64_t ih = oh * g.sh - g.ph + i;
      if (ih < 0 || ih >= g.h) continue;
      for (std::int64_t j = 0; j < g.kw; ++j) {
        const std::int64_t iw = ow * g.sw - g.pw + j;
        if (iw >= 0 && iw < g.w) s += xp[ih * g.w + iw];
      }
    }
    y[e] = s * inv;
  }
}

template <class T>
__global__ void avg_pool2d_backward_kernel(std::int64_t planes, Window2d g, const T* dy, T* dx) {
  const std::int64_t total = planes * g.h * g.w;
  const T inv = T(1) / static_cast<T>(g.kh * g.kw);
  for (std::int64_t e = global_index(); e < total; e += grid_stride()) {
    const std::int64_t iw = e % g.w, ih = (e / g.w) % g.h, p = e / (g.w * g.h);
    T acc = T(0);
    for (std::int64_t oh = 0; oh < g.ho; ++oh) {
      const std::int64_t top = oh * g.sh - g.ph;
      if (ih < top || ih >= top + g.kh) continue;
      for (std::int64_t ow = 0; ow < g.wo; ++ow) {
        const std::int64_t left = ow * g.sw - g.pw;
        if (iw >= left && iw < left + g.kw) acc += dy[(p * g.ho + oh) * g.wo + ow];
      }
    }
    dx[e] = acc * inv;
  }
}

}  // namespace detail

template <class T>
void im2col(std::int64_t channels, const Window2d& g, const T* x, T* col) {
  const std::int64_t n = channels * g.kh * g.kw * g.ho * g.wo;
  if (n <= 0) return;
  detail::im2col_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(channels, g, x, col);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void col2im(std::int64_t channels, const Window2d& g, const T* col, T* dx) {
  const std::int64_t n = channels * g.h * g.w;
  if (n <= 0) return;
  detail::col2im_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(channels, g, col, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void max_pool2d_forward(std::int64_t planes, const Window2d& g, const T* x, T* y, std::int32_t* idx) {
  const std::int64_t n = planes * g.ho * g.wo;
  if (n <= 0) return;
  detail::max_pool2d_forward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(planes, g, x, y,
                                                                                                     idx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void max_pool2d_backward(std::int64_t planes, const Window2d& g, const T* dy, const std::int32_t* idx, T* dx) {
  const std::int64_t n = planes * g.h * g.w;
  if (n <= 0) return;
  detail::max_pool2d_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(planes, g, dy,
                                                                                                      idx, dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void avg_pool2d_forward(std::int64_t planes, const Window2d& g, const T* x, T* y) {
  const std::int64_t n = planes * g.ho * g.wo;
  if (n <= 0) return;
  detail::avg_pool2d_forward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(planes, g, x, y);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
void avg_pool2d_backward(std::int64_t planes, const Window2d& g, const T* dy, T* dx) {
  const std::int64_t n = planes * g.h * g.w;
  if (n <= 0) return;
  detail::avg_pool2d_backward_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(planes, g, dy,
                                                                                                      dx);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
