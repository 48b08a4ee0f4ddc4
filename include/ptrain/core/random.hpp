#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// Element i of a draw depends only on (seed, offset + i), never on the thread
// or device that computes it: every rank and the GPU produce the same numbers
// for the same seed and offset, and a checkpoint needs only (seed, offset) to
// resume the stream exactly.

#include <cmath>
#include <cstdint>

#include "ptrain/config.hpp"

namespace ptrain {

namespace detail {

struct Philox4 {
  std::uint32_t x[4];
};

PTRAIN_HOST_DEVICE std::uint32_t mulhilo(std::uint32_t a, std::uint32_t b, std::uint32_t& hi) {
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  hi = static_cast<std::uint32_t>(p >> 32);
  return static_cast<std::uint32_t>(p);
}

/// Ten Philox rounds on a 128-bit counter with a 64-bit key.
PTRAIN_HOST_DEVICE Philox4 philox(std::uint64_t key, std::uint64_t counter_lo, std::uint64_t counter_hi = 0) {
  std::uint32_t c0 = static_cast<std::uint32_t>(counter_lo), c1 = static_cast<std::uint32_t>(counter_lo >> 32);
  std::uint32_t c2 = static_cast<std::uint32_t>(counter_hi), c3 = static_cast<std::uint32_t>(counter_hi >> 32);
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, hi1;
    const std::uint32_t lo0 = mulhilo(0xD2511F53u, c0, hi0);
    const std::uint32_t lo1 = mulhilo(0xCD9E8D57u, c2, hi1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

/// Uniform float in [0, 1) from 24 random bits.
PTRAIN_HOST_DEVICE float to_unit_float(std::uint32_t bits) { return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f); }
/// Uniform double in [0, 1) from 53 random bits.
PTRAIN_HOST_DEVICE double to_unit_double(std::uint32_t a, std::uint32_t b) {
  const std::uint64_t bits = (static_cast<std::uint64_t>(a) << 21) ^ (b >> 11);
  return static_cast<double>(bits & ((1ull << 53) - 1)) * (1.0 / 9007199254740992.0);
}

}  // namespace detail

/// Uniform sample in [0, 1) for stream position `index` of `seed`.
PTRAIN_HOST_DEVICE double random_uniform(std::uint64_t seed, std::uint64_t index) {
  const auto r = detail::philox(seed, index);
  return detail::to_unit_double(r.x[0], r.x[1]);
}

/// Standard normal sample for stream position `index` of `seed` (Box-Muller).
PTRAIN_HOST_DEVICE double random_normal(std::uint64_t seed, std::uint64_t index) {
  const auto r = detail::philox(seed, index);
  const double u1 = 1.0 - detail::to_unit_double(r.x[0], r.x[1]);  // (0, 1], so log is finite
  const double u2 = detail::to_unit_double(r.x[2], r.x[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

/// A random stream: a seed and a position. Each draw of n numbers uses
/// positions [offset, offset + n) and advances the offset by n.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0, std::uint64_t offset = 0) : seed_(seed), offset_(offset) {}
  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }
  void set_offset(std::uint64_t offset) { offset_ = offset; }
  /// Reserves n positions and returns the first.
  std::uint64_t reserve(std::uint64_t n) {
    const std::uint64_t start = offset_;
    offset_ += n;
    return start;
  }
  double uniform() { return random_uniform(seed_, reserve(1)); }
  double normal() { return random_normal(seed_, reserve(1)); }
  /// Uniform integer in [0, n).
  std::uint64_t below(std::uint64_t n) {
    const auto r = detail::philox(seed_, reserve(1));
    const std::uint64_t bits = (static_cast<std::uint64_t>(r.x[0]) << 32) | r.x[1];
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(bits) * n) >> 64);
  }

 private:
  std::uint64_t seed_;
  std::uint64_t offset_;
};

}  // namespace ptrain

namespace ptrain {

/// The process-wide generator modules draw their initial weights from.
inline Generator& default_generator() {
  static Generator gen(0);
  return gen;
}

/// Restarts the default generator at position 0 of `seed` (like torch.manual_seed).
inline void manual_seed(std::uint64_t seed) { default_generator() = Generator(seed); }

}  // namespace ptrain
