#pragma once
// Stochastic rounding of float to bf16, the same bits on the CPU and the GPU.
//
// A float x lies between two adjacent bf16 values lo <= x <= hi; rounding
// stochastically picks hi with probability (x - lo) / (hi - lo), so that the
// rounded value equals x on average and small updates to a bf16 copy are not
// lost to round-to-nearest. The draw is a counter-based hash of (seed, step,
// index) (Philox, core/random.hpp): element `index` of update `step` rounds the
// same way on every device and in every run, whatever thread computes it.

#include <cstdint>
#include <cstring>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"

namespace ptrain::kernels {

/// bf16 of x rounded up or down at random with the probabilities above; the draw is
/// the low 16 bits of Philox(seed; counter (index, step)). Infinities and NaN round to nearest.
PTRAIN_HOST_DEVICE bf16 bf16_round_stochastic(float x, std::uint64_t seed, std::uint64_t step, std::uint64_t index) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return bf16(x);
  // Adding a uniform 16-bit value to the bits that truncation drops carries into
  // the kept bits with probability (dropped bits) / 2^16. A finite float cannot
  // wrap: its magnitude bits stay below 0x7f800000, and at most the largest ones
  // carry into the exponent's all-ones pattern, giving an infinity of their sign.
  u += ::ptrain::detail::philox(seed, index, step).x[0] & 0xffffu;
  bf16 b;
  b.bits = static_cast<std::uint16_t>(u >> 16);
  return b;
}

}  // namespace ptrain::kernels
