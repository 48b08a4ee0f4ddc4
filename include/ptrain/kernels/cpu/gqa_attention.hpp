#pragma once
// Causal grouped-query attention on separate q, k, v buffers (the materialised path).
//
// Layout: q [B, S, H*D], k and v [B, S, Hkv*D] with Hkv dividing H; query head h
// reads key/value head h / (H / Hkv) (Hkv == H: multi-head, Hkv == 1: multi-query).
// y [B, S, H*D] receives head h at columns h*D, as q. Every GEMM reads the heads'
// strided slices in place. The row and column tiles skip the blocks above the
// diagonal as in kernels/cpu/attention.hpp (Note [Causal tiles]).
//
// Note [Sliding window]
// Query i of row b sees keys lo .. i, lo = max(starts[b, i], i - window + 1)
// (starts null: 0; window 0: no window): `window` keys counting its own, the mask
// of Hugging Face's sliding-window attention (transformers' masking_utils:
// sliding_window_overlay keeps kv_idx > q_idx - sliding_window, on top of the
// causal kv_idx <= q_idx), used by Mistral. Older transformers releases were not
// consistent about this count between their attention backends (transformers
// issues 29623 and 39408, fixed by pull request 40163). Every kernel of the family
// (the materialised path here, the flash-contract twins below, the CUDA kernels in
// kernels/cuda/gqa_attention.cuh) applies this one rule.
//
// The flash contract (gqa_flash_forward/backward, gqa_attention_decode): what the
// CUDA kernels compute, here as plain loops in the arithmetic type acc_t<T>, the
// reference the GPU tests and the stand-in kernel table use. q has row stride ldq
// (token (b, i), head h at q[(b*S + i)*ldq + h*D]), k and v row stride ldkv, so
// separate q, k, v and GPT's packed qkv [B, S, 3C] are both expressible; y and dy
// are [B, S, H*D]; the forward keeps lse [B, H, S] (each row's log-sum-exp of the
// scaled scores) and the backward recomputes the probabilities from it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"

namespace ptrain::kernels::cpu {

namespace detail {
/// The first key query i of row b sees (Note [Sliding window]); throws ShapeError for a
/// start outside 0..i.
inline std::int64_t gqa_first_key(std::int64_t S, std::int64_t b, std::int64_t i, const std::int32_t* starts,
                                  std::int64_t window) {
  std::int64_t lo = 0;
  if (starts) {
    lo = starts[b * S + i];
    PTRAIN_CHECK(lo >= 0 && lo <= i, ShapeError, "[ptrain.gqa_attention] document start ", lo, " of token ", i,
                 " in row ", b, " is not in 0..", i, "; build the starts with nn::document_starts");
  }
  return window > 0 ? std::max(lo, i - window + 1) : lo;
}
}  // namespace detail

/// Forward: probs [B, H, S, S] receives softmax(scale q k^T) with zeros outside each
/// row's keys. starts [B, S] (or null: all 0) masks documents: query i of row b sees keys
/// starts[b*S + i] .. i (0 <= starts <= i; Note [Batch context] in nn/batch_context.hpp);
/// window > 0 limits it to the last `window` of them (Note [Sliding window]).
template <class T>
void gqa_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                           const T* k, const T* v, T scale, T* probs, T* y, const std::int32_t* starts = nullptr,
                           std::int64_t window = 0) {
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
          const std::int64_t st = detail::gqa_first_key(S, b, i, starts, window);
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
/// Masked keys have probability 0, so their scores get gradient 0 with or without documents
/// or a window.
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

/// Flash-contract forward (Note [Sliding window]): y [B, S, H*D] and lse [B, H, S].
template <class T>
void gqa_flash_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                       std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, const std::int32_t* starts,
                       std::int64_t window, acc_t<T> scale, T* y, acc_t<T>* lse) {
  using A = acc_t<T>;
  const std::int64_t group = H / Hkv;
  std::vector<A> w(static_cast<std::size_t>(S)), acc(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        const T* qi = q + (b * S + i) * ldq + h * D;
        const std::int64_t lo = detail::gqa_first_key(S, b, i, starts, window), g = h / group;
        A mx = -std::numeric_limits<A>::infinity(), total = 0;
        for (std::int64_t j = lo; j <= i; ++j) {
          const T* kj = k + (b * S + j) * ldkv + g * D;
          A dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += static_cast<A>(qi[d]) * static_cast<A>(kj[d]);
          mx = std::max(mx, w[static_cast<std::size_t>(j)] = dot * scale);
        }
        std::fill(acc.begin(), acc.end(), A(0));
        for (std::int64_t j = lo; j <= i; ++j) {
          const A e = std::exp(w[static_cast<std::size_t>(j)] - mx);
          total += e;
          const T* vj = v + (b * S + j) * ldkv + g * D;
          for (std::int64_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += e * static_cast<A>(vj[d]);
        }
        T* yi = y + (b * S + i) * H * D + h * D;
        for (std::int64_t d = 0; d < D; ++d) yi[d] = static_cast<T>(acc[static_cast<std::size_t>(d)] / total);
        lse[(b * H + h) * S + i] = mx + std::log(total);
      }
}

/// Flash-contract backward: dq (q's strides), dk and dv (k's strides; every element,
/// a key/value head summing its query heads) from lse, y and dy [B, S, H*D].
template <class T>
void gqa_flash_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                        std::int64_t ldq, const T* k, const T* v, std::int64_t ldkv, const std::int32_t* starts,
                        std::int64_t window, const T* y, const acc_t<T>* lse, const T* dy, acc_t<T> scale, T* dq,
                        T* dk, T* dv) {
  using A = acc_t<T>;
  const std::int64_t group = H / Hkv;
  std::vector<A> gk(static_cast<std::size_t>(B * S * Hkv * D), A(0)), gv(gk.size(), A(0)),
      gq(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        const T* qi = q + (b * S + i) * ldq + h * D;
        const T* dyi = dy + (b * S + i) * H * D + h * D;
        const T* yi = y + (b * S + i) * H * D + h * D;
        const std::int64_t lo = detail::gqa_first_key(S, b, i, starts, window), g = h / group;
        const A l = lse[(b * H + h) * S + i];
        A di = 0;
        for (std::int64_t d = 0; d < D; ++d) di += static_cast<A>(dyi[d]) * static_cast<A>(yi[d]);
        std::fill(gq.begin(), gq.end(), A(0));
        for (std::int64_t j = lo; j <= i; ++j) {
          const T* kj = k + (b * S + j) * ldkv + g * D;
          const T* vj = v + (b * S + j) * ldkv + g * D;
          A s = 0, dp = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            s += static_cast<A>(qi[d]) * static_cast<A>(kj[d]);
            dp += static_cast<A>(dyi[d]) * static_cast<A>(vj[d]);
          }
          const A p = std::exp(s * scale - l), ds = p * (dp - di);
          A* gkj = gk.data() + ((b * S + j) * Hkv + g) * D;
          A* gvj = gv.data() + ((b * S + j) * Hkv + g) * D;
          for (std::int64_t d = 0; d < D; ++d) {
            gq[static_cast<std::size_t>(d)] += ds * static_cast<A>(kj[d]);
            gkj[d] += ds * static_cast<A>(qi[d]);
            gvj[d] += p * static_cast<A>(dyi[d]);
          }
        }
        T* dqi = dq + (b * S + i) * ldq + h * D;
        for (std::int64_t d = 0; d < D; ++d) dqi[d] = static_cast<T>(gq[static_cast<std::size_t>(d)] * scale);
      }
  for (std::int64_t r = 0; r < B * S; ++r)
    for (std::int64_t g = 0; g < Hkv; ++g)
      for (std::int64_t d = 0; d < D; ++d) {
        const std::size_t at = static_cast<std::size_t>((r * Hkv + g) * D + d);
        dk[r * ldkv + g * D + d] = static_cast<T>(gk[at] * scale);
        dv[r * ldkv + g * D + d] = static_cast<T>(gv[at]);
      }
}

/// KV-cache decode: y [s, H*D] for s queries q [s, H*D] at positions n - s .. n - 1
/// against n keys and values k, v [n, Hkv*D] (one sequence; Note [Sliding window] with
/// positions for indices). Arithmetic in double whatever T.
template <class T>
void gqa_attention_decode(std::int64_t s, std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                          const T* q, const T* k, const T* v, std::int64_t window, double scale, T* y) {
  PTRAIN_CHECK(s <= n, ShapeError, "[ptrain.gqa_attention.decode] ", s, " queries after ", n,
               " keys; the keys must include the queries' own");
  const std::int64_t past = n - s;
  auto wide = [](T x) { return static_cast<double>(static_cast<acc_t<T>>(x)); };
  std::vector<double> w(static_cast<std::size_t>(n)), acc(static_cast<std::size_t>(D));
  for (std::int64_t i = 0; i < s; ++i)
    for (std::int64_t h = 0; h < H; ++h) {
      const T* qi = q + (i * H + h) * D;
      const std::int64_t g = h / (H / Hkv), last = past + i;
      const std::int64_t lo = window > 0 ? std::max<std::int64_t>(0, last - window + 1) : 0;
      double mx = -std::numeric_limits<double>::infinity(), total = 0;
      for (std::int64_t j = lo; j <= last; ++j) {
        const T* kj = k + (j * Hkv + g) * D;
        double dot = 0;
        for (std::int64_t d = 0; d < D; ++d) dot += wide(qi[d]) * wide(kj[d]);
        mx = std::max(mx, w[static_cast<std::size_t>(j)] = dot * scale);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (std::int64_t j = lo; j <= last; ++j) {
        const double e = std::exp(w[static_cast<std::size_t>(j)] - mx);
        total += e;
        const T* vj = v + (j * Hkv + g) * D;
        for (std::int64_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += e * wide(vj[d]);
      }
      for (std::int64_t d = 0; d < D; ++d)
        y[(i * H + h) * D + d] = static_cast<T>(acc[static_cast<std::size_t>(d)] / total);
    }
}

}  // namespace ptrain::kernels::cpu
