#pragma once
// Causal multi-head attention on a packed qkv buffer.
//
// Layout (GPT-2's c_attn output): qkv is [B, S, 3C] with C = H * D; head h of
// q, k and v starts at columns h*D, C + h*D and 2C + h*D. Every GEMM reads
// those strided slices in place (leading dimension 3C), so there is no
// split/transpose copy, and y [B, S, C] receives head h at columns h*D.
//
// Note [Causal tiles]
// Row i attends to columns 0..i only. Rows are processed in tiles of kTile;
// a tile of rows [r0, r1) needs columns [0, r1), so the score and value GEMMs
// skip the upper-right blocks (about half the attention FLOPs at S >> kTile).
// Inside the diagonal block the entries j > i are computed and then written
// as exact zeros in P, which makes every later product over those blocks
// correct without masks. P rows are zero beyond the diagonal in full.
//
// Dropout on the attention probabilities keeps element (b, h, i, j) when
// uniform(seed, offset + ((b*H + h)*S + i)*S + j) >= p, so the backward pass
// regenerates the mask; the dropped probabilities are kept for dV.

#include "ptrain/config.hpp"  // before Eigen: Note [GCC 12 AVX-512 warnings]
#include <Eigen/Core>
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"

namespace ptrain::kernels::cpu {

namespace detail {
constexpr std::int64_t kAttentionTile = 64;

// In place: row[0..n) = softmax(row[0..n)), vectorised exp through Eigen.
template <class T>
void softmax_prefix(T* row, std::int64_t n) {
  using Arr = Eigen::Array<T, Eigen::Dynamic, 1>;
  Eigen::Map<Arr> r(row, n);
  const T mx = r.maxCoeff();
  r = (r - mx).exp();
  r *= T(1) / r.sum();
}

inline bool attention_keep(double p, std::uint64_t seed, std::uint64_t index) {
  return random_uniform(seed, index) >= p;
}
}  // namespace detail

/// Forward. probs [B, H, S, S] receives softmax(scale q k^T) with zeros above the
/// diagonal. When p > 0, probs_drop [B, H, S, S] receives the dropped and
/// rescaled probabilities that multiply v (probs_drop may be null when p == 0).
template <class T>
void causal_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv, T scale,
                              T* probs, T* probs_drop, double p, std::uint64_t seed, std::uint64_t offset, T* y) {
  const std::int64_t C = H * D, ld = 3 * C;
  const T keep_scale = T(1.0 / (1.0 - p));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const T* q = qkv + b * S * ld + h * D;
      const T* k = q + C;
      const T* v = q + 2 * C;
      const std::int64_t head = b * H + h;
      T* P = probs + head * S * S;
      T* Pd = p > 0 ? probs_drop + head * S * S : P;
      T* yh = y + b * S * C + h * D;
      for (std::int64_t r0 = 0; r0 < S; r0 += detail::kAttentionTile) {
        const std::int64_t r1 = std::min(S, r0 + detail::kAttentionTile);
        gemm<T>(false, true, r1 - r0, r1, D, scale, q + r0 * ld, ld, k, ld, T(0), P + r0 * S, S);
        for (std::int64_t i = r0; i < r1; ++i) {
          T* row = P + i * S;
          detail::softmax_prefix(row, i + 1);
          std::fill(row + i + 1, row + S, T(0));
          if (p > 0) {
            T* drow = Pd + i * S;
            const std::uint64_t base = offset + static_cast<std::uint64_t>((head * S + i) * S);
            for (std::int64_t j = 0; j <= i; ++j)
              drow[j] = detail::attention_keep(p, seed, base + static_cast<std::uint64_t>(j)) ? row[j] * keep_scale
                                                                                               : T(0);
            std::fill(drow + i + 1, drow + S, T(0));
          }
        }
        gemm<T>(false, false, r1 - r0, D, r1, T(1), Pd + r0 * S, S, v, ld, T(0), yh + r0 * C, C);
      }
    }
  }
}

/// Backward: given dy [B, S, C] and the forward's probs (and probs_drop when
/// p > 0), writes dqkv [B, S, 3C] (every element).
template <class T>
void causal_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const T* qkv,
                               const T* probs, const T* probs_drop, double p, std::uint64_t seed,
                               std::uint64_t offset, const T* dy, T scale, T* dqkv) {
  const std::int64_t C = H * D, ld = 3 * C;
  const T keep_scale = T(1.0 / (1.0 - p));
  Scratch<T> ds_buf(static_cast<std::size_t>(S * S));
  T* dS = ds_buf.data();
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const T* q = qkv + b * S * ld + h * D;
      const T* k = q + C;
      const T* v = q + 2 * C;
      T* dq = dqkv + b * S * ld + h * D;
      T* dk = dq + C;
      T* dv = dq + 2 * C;
      const std::int64_t head = b * H + h;
      const T* P = probs + head * S * S;
      const T* Pd = p > 0 ? probs_drop + head * S * S : P;
      const T* dyh = dy + b * S * C + h * D;
      // Row tiles: dP = dy v^T, then dS = P * (dP - rowsum(P * dP)) * scale, then dq = dS k.
      for (std::int64_t r0 = 0; r0 < S; r0 += detail::kAttentionTile) {
        const std::int64_t r1 = std::min(S, r0 + detail::kAttentionTile);
        gemm<T>(false, true, r1 - r0, r1, D, T(1), dyh + r0 * C, C, v, ld, T(0), dS + r0 * S, S);
        for (std::int64_t i = r0; i < r1; ++i) {
          T* row = dS + i * S;
          const T* prow = P + i * S;
          if (p > 0) {
            const std::uint64_t base = offset + static_cast<std::uint64_t>((head * S + i) * S);
            for (std::int64_t j = 0; j <= i; ++j)
              row[j] = detail::attention_keep(p, seed, base + static_cast<std::uint64_t>(j)) ? row[j] * keep_scale
                                                                                             : T(0);
          }
          T dot = 0;
          for (std::int64_t j = 0; j <= i; ++j) dot += prow[j] * row[j];
          for (std::int64_t j = 0; j <= i; ++j) row[j] = prow[j] * (row[j] - dot) * scale;
          std::fill(row + i + 1, row + r1, T(0));
        }
        gemm<T>(false, false, r1 - r0, D, r1, T(1), dS + r0 * S, S, k, ld, T(0), dq + r0 * ld, ld);
      }
      // Column tiles: only rows i >= c0 have non-zeros in columns [c0, c1).
      for (std::int64_t c0 = 0; c0 < S; c0 += detail::kAttentionTile) {
        const std::int64_t c1 = std::min(S, c0 + detail::kAttentionTile);
        gemm<T>(true, false, c1 - c0, D, S - c0, T(1), dS + c0 * S + c0, S, q + c0 * ld, ld, T(0), dk + c0 * ld, ld);
        gemm<T>(true, false, c1 - c0, D, S - c0, T(1), Pd + c0 * S + c0, S, dyh + c0 * C, C, T(0), dv + c0 * ld,
                ld);
      }
    }
  }
}

/// The fused attention is a GPU kernel (kernels/cuda/flash_attention.cuh); on the
/// CPU it never applies, and ops:: take causal_attention_* instead.
template <class T>
bool flash_attention_supported(std::int64_t, const T*) {
  return false;
}
template <class T>
void flash_attention_forward(std::int64_t, std::int64_t, std::int64_t, std::int64_t, const T*, acc_t<T>, double,
                             std::uint64_t, std::uint64_t, T*, acc_t<T>*) {
  PTRAIN_THROW(Error, "[ptrain.attention.flash] the fused attention runs on CUDA devices only");
}
template <class T>
void flash_attention_backward(std::int64_t, std::int64_t, std::int64_t, std::int64_t, const T*, const T*,
                              const acc_t<T>*, double, std::uint64_t, std::uint64_t, const T*, acc_t<T>, T*) {
  PTRAIN_THROW(Error, "[ptrain.attention.flash] the fused attention runs on CUDA devices only");
}

}  // namespace ptrain::kernels::cpu
