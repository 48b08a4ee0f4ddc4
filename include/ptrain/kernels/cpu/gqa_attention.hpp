#pragma once
// Causal grouped-query attention on separate q, k, v buffers (the materialised path).
//
// Layout: q [B, S, H*D], k and v [B, S, Hkv*D] with Hkv dividing H; query head h
// reads key/value head h / (H / Hkv) (Hkv == H: multi-head, Hkv == 1: multi-query).
// y [B, S, H*D] receives head h at columns h*D, as q. Every GEMM reads the heads'
// strided slices in place. The row and column tiles skip the blocks above the
// diagonal as in kernels/cpu/attention.hpp (Note [Causal tiles]).

#include <algorithm>
#include <cstdint>

#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"

namespace ptrain::kernels::cpu {

/// Forward: probs [B, H, S, S] receives softmax(scale q k^T) with zeros above the diagonal.
/// starts [B, S] (or null: all 0) masks documents: query i of row b sees keys
/// starts[b*S + i] .. i (0 <= starts <= i; Note [Batch context] in nn/batch_context.hpp).
template <class T>
void gqa_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                           const T* k, const T* v, T scale, T* probs, T* y, const std::int32_t* starts = nullptr) {
  const std::int64_t ldq = H * D, ldkv = Hkv * D, group = H / Hkv;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const T* qh = q + b * S * ldq + h * D;
      const T* kh = k + b * S * ldkv + (h / group) * D;
      const T* vh = v + b * S * ldkv + (h / group) * D;
      T* P = probs + (b * H + h) * S * S;
      T* yh = y + b * S * ldq + h * D;
      for (std::int64_t r0 = 0; r0 < S; r0 += detail::kAttentionTile) {
        const std::int64_t r1 = std::min(S, r0 + detail::kAttentionTile);
        gemm<T>(false, true, r1 - r0, r1, D, scale, qh + r0 * ldq, ldq, kh, ldkv, T(0), P + r0 * S, S);
        for (std::int64_t i = r0; i < r1; ++i) {
          T* row = P + i * S;
          const std::int64_t st = starts ? starts[b * S + i] : 0;
          std::fill(row, row + st, T(0));
          detail::softmax_prefix(row + st, i + 1 - st);
          std::fill(row + i + 1, row + S, T(0));
        }
        gemm<T>(false, false, r1 - r0, D, r1, T(1), P + r0 * S, S, vh, ldkv, T(0), yh + r0 * ldq, ldq);
      }
    }
  }
}

/// Backward: given dy [B, S, H*D] and the forward's probs, writes dq [B, S, H*D] and
/// dk, dv [B, S, Hkv*D] (every element; a key/value head sums over its query heads).
/// Masked keys have probability 0, so their scores get gradient 0 with or without documents.
template <class T>
void gqa_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                            const T* q, const T* k, const T* v, const T* probs, const T* dy, T scale, T* dq, T* dk,
                            T* dv) {
  const std::int64_t ldq = H * D, ldkv = Hkv * D, group = H / Hkv;
  std::fill(dk, dk + B * S * ldkv, T(0));
  std::fill(dv, dv + B * S * ldkv, T(0));
  Scratch<T> ds_buf(static_cast<std::size_t>(S * S));
  T* dS = ds_buf.data();
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t qo = b * S * ldq + h * D, kvo = b * S * ldkv + (h / group) * D;
      const T* P = probs + (b * H + h) * S * S;
      // Row tiles: dP = dy v^T, then dS = P * (dP - rowsum(P * dP)) * scale, then dq = dS k.
      for (std::int64_t r0 = 0; r0 < S; r0 += detail::kAttentionTile) {
        const std::int64_t r1 = std::min(S, r0 + detail::kAttentionTile);
        gemm<T>(false, true, r1 - r0, r1, D, T(1), dy + qo + r0 * ldq, ldq, v + kvo, ldkv, T(0), dS + r0 * S, S);
        for (std::int64_t i = r0; i < r1; ++i) {
          T* row = dS + i * S;
          const T* prow = P + i * S;
          T dot = 0;
          for (std::int64_t j = 0; j <= i; ++j) dot += prow[j] * row[j];
          for (std::int64_t j = 0; j <= i; ++j) row[j] = prow[j] * (row[j] - dot) * scale;
          std::fill(row + i + 1, row + r1, T(0));
        }
        gemm<T>(false, false, r1 - r0, D, r1, T(1), dS + r0 * S, S, k + kvo, ldkv, T(0), dq + qo + r0 * ldq, ldq);
      }
      // Column tiles: only rows i >= c0 have non-zeros in columns [c0, c1); dk and dv accumulate.
      for (std::int64_t c0 = 0; c0 < S; c0 += detail::kAttentionTile) {
        const std::int64_t c1 = std::min(S, c0 + detail::kAttentionTile);
        gemm<T>(true, false, c1 - c0, D, S - c0, T(1), dS + c0 * S + c0, S, q + qo + c0 * ldq, ldq, T(1),
                dk + kvo + c0 * ldkv, ldkv);
        gemm<T>(true, false, c1 - c0, D, S - c0, T(1), P + c0 * S + c0, S, dy + qo + c0 * ldq, ldq, T(1),
                dv + kvo + c0 * ldkv, ldkv);
      }
    }
  }
}

}  // namespace ptrain::kernels::cpu
