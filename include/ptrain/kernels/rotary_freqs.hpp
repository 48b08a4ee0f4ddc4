#pragma once
// The angular frequencies of rotary position embedding as one value that the
// CPU and CUDA rotary kernels take by value (kernels/cpu/rotary.hpp,
// kernels/cuda/rotary.cuh) and the kernel table names: ops::rotary_freqs fills
// it on the host once per call, so both devices rotate by the same doubles.

#include <cstdint>

namespace ptrain::kernels {

/// inv_freq[i] for i < half = D/2 (Note [Llama 3 rotary scaling] in ops/rotary.hpp).
struct RotaryFreqs {
  static constexpr std::int64_t kMaxHalf = 128;  ///< head widths up to 256
  std::int64_t half = 0;
  double inv_freq[kMaxHalf] = {};
};

}  // namespace ptrain::kernels
