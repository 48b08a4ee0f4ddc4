#pragma once
// Rotary position embedding in place on device arrays x [B, S, H, D],
// Hugging Face's rotate-half convention (kernels/cpu/rotary.hpp has the
// formula). Same name and arguments as the CPU kernel; the frequencies come by
// value (kernels/rotary_freqs.hpp), filled on the host, so they are the CPU's
// doubles. One thread per (token, frequency) pair rotates that pair in every
// head: the angle and its sine and cosine in double, the rotation in acc_t<T>.
// Float, double and bf16 (Note [bf16 kernels]).
//
// Position ids are read on the device only: the kernel does not check them.
// A negative id rotates by a negative angle instead of failing as on the CPU,
// so a caller with ids on the device passes non-negative ones (the layers build
// them on the host, where ops::rotary_ checks them through the CPU kernel).

#include <cuda_runtime.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/rotary_freqs.hpp"

namespace ptrain::kernels::cuda {

namespace detail {

template <class T>
__global__ void rotary_kernel(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D,
                              const std::int32_t* positions, std::int64_t pos_batch_stride, RotaryFreqs freqs,
                              bool inverse, T* x) {
  using A = acc_t<T>;
  const std::int64_t half = D / 2, n = B * S * half;
  for (std::int64_t idx = global_index(); idx < n; idx += grid_stride()) {
    const std::int64_t i = idx % half, token = idx / half, b = token / S, s = token % S;
    const double pos = positions ? static_cast<double>(positions[b * pos_batch_stride + s]) : static_cast<double>(s);
    double sn, c;
    sincos(pos * freqs.inv_freq[i], &sn, &c);
    const A ca = static_cast<A>(c), sa = static_cast<A>(inverse ? -sn : sn);
    T* row = x + token * H * D;
    for (std::int64_t h = 0; h < H; ++h) {
      T* xh = row + h * D;
      const A lo = ld(xh[i]), hi = ld(xh[i + half]);
      xh[i] = st<T>(lo * ca - hi * sa);
      xh[i + half] = st<T>(hi * ca + lo * sa);
    }
  }
}

}  // namespace detail

/// positions: token (b, s) is at positions[b * pos_batch_stride + s] (device array; null
/// means s); freqs.half == D/2 (not checked here: ops::rotary_ makes them).
template <class T>
void rotary_apply(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const std::int32_t* positions,
                  std::int64_t pos_batch_stride, const RotaryFreqs& freqs, bool inverse, T* x) {
  detail::check_element_type<T>();
  const std::int64_t n = B * S * (D / 2);
  if (n <= 0 || H <= 0) return;
  detail::rotary_kernel<T><<<detail::grid_for(n), detail::kBlock, 0, current_stream()>>>(
      B, S, H, D, positions, pos_batch_stride, freqs, inverse, x);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

}  // namespace ptrain::kernels::cuda
