#pragma once
// Rotary position embedding in place on x [B, S, H, D], Hugging Face's rotate-half
// convention: for i < D/2, with angle a = position * inv_freq[i],
//   x'[i]       = x[i] cos a - x[i + D/2] sin a
//   x'[i + D/2] = x[i + D/2] cos a + x[i] sin a.
// The rotation is orthogonal, so the backward pass is the same loop with the angle
// negated (inverse = true). Angles are computed in double, the rotation in acc_t<T>.

#include <cmath>
#include <cstdint>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/kernels/rotary_freqs.hpp"

namespace ptrain::kernels::cpu {

/// positions: the position of token (b, s) is positions[b * pos_batch_stride + s]
/// (pos_batch_stride 0 shares one row of S positions across the batch); null means s.
/// Throws ShapeError [ptrain.rotary] for a negative position, before x is touched.
/// freqs: D/2 angular frequencies (freqs.half == D/2).
template <class T>
void rotary_apply(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const std::int32_t* positions,
                  std::int64_t pos_batch_stride, const RotaryFreqs& freqs, bool inverse, T* x) {
  using A = acc_t<T>;
  const std::int64_t half = D / 2;
  PTRAIN_CHECK(freqs.half == half, ShapeError, "[ptrain.rotary] ", freqs.half, " frequencies for head width ", D,
               "; make them with ops::rotary_freqs(D, config)");
  if (positions)
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s)
        PTRAIN_CHECK(positions[b * pos_batch_stride + s] >= 0, ShapeError, "[ptrain.rotary] position id ",
                     positions[b * pos_batch_stride + s], " at index ", b * pos_batch_stride + s, " is negative");
  const double* inv_freq = freqs.inv_freq;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t s = 0; s < S; ++s) {
      const double pos = positions ? positions[b * pos_batch_stride + s] : static_cast<double>(s);
      T* row = x + (b * S + s) * H * D;
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = pos * inv_freq[i];
        const A c = static_cast<A>(std::cos(angle)), sn = static_cast<A>(inverse ? -std::sin(angle) : std::sin(angle));
        for (std::int64_t h = 0; h < H; ++h) {
          T* xh = row + h * D;
          const A lo = static_cast<A>(xh[i]), hi = static_cast<A>(xh[i + half]);
          xh[i] = T(lo * c - hi * sn);
          xh[i + half] = T(hi * c + lo * sn);
        }
      }
    }
  }
}

}  // namespace ptrain::kernels::cpu
