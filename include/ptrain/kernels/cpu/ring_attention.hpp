#pragma once
// Blocks of ring attention (context parallelism, parallel/context_parallel.hpp): the
// causal grouped-query attention of n queries against n keys of another chunk of the
// same sequence, each chunk n consecutive global positions (queries q0 .., keys k0 ..).
//
// Note [Ring attention blocks]
// Query i (global position q0 + i) of a chunk sees key j (global position k0 + j) when
//   lo(i) <= k0 + j <= q0 + i,   lo(i) = max(start_i, q0 + i - window + 1 if window > 0)
// where start_i is the global position where its document starts (null starts: 0).
// The forward merges each block into a running output y and log-sum-exp lse of the
// rows (y holds the normalised output of the keys seen so far, lse -inf before any):
//   l = log sum_j exp(s_j),  y_b = sum_j exp(s_j - l) v_j
//   L = logaddexp(lse, l),   y  = exp(lse - L) y + exp(l - L) y_b,   lse = L
// so after every block the rows hold softmax attention over all the keys they see,
// whatever the order of the blocks. The backward takes the final y and lse (the
// flash-attention backward): p_j = exp(s_j - lse), ds_j = p_j (dy.v_j - dy.y), and
// adds ds k scale to dq, ds q scale to dk and p dy to dv (a key/value head summing its
// query heads). q and dq have row stride ldq, y and dy ldy (H*D for contiguous heads),
// k, v, dk and dv ldkv; lse is [H, ld_lse] for the chunk's rows. Arithmetic in acc_t<T>.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ptrain/core/dtype.hpp"

namespace ptrain::kernels::cpu {

namespace detail {
/// The first global key position query i of a ring block sees (Note [Ring attention blocks]).
inline std::int64_t ring_first_key(std::int64_t qpos, const std::int32_t* starts, std::int64_t i, std::int64_t window) {
  std::int64_t lo = starts ? starts[i] : 0;
  if (window > 0) lo = std::max(lo, qpos - window + 1);
  return lo;
}
}  // namespace detail

/// Merges the attention of n queries (positions q0 ..) against n keys (positions k0 ..)
/// into y and lse (Note [Ring attention blocks]); starts: the queries' document starts
/// (global positions) or null.
template <class T>
void ring_attention_block_forward(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                                  std::int64_t ldq, std::int64_t q0, const std::int32_t* starts, const T* k,
                                  const T* v, std::int64_t ldkv, std::int64_t k0, std::int64_t window,
                                  acc_t<T> scale, T* y, std::int64_t ldy, acc_t<T>* lse,
                                  std::int64_t ld_lse) {
  using A = acc_t<T>;
  const std::int64_t group = H / Hkv;
  std::vector<A> w(static_cast<std::size_t>(n)), acc(static_cast<std::size_t>(D));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t qpos = q0 + i;
    const std::int64_t lo = std::max<std::int64_t>(0, detail::ring_first_key(qpos, starts, i, window) - k0);
    const std::int64_t hi = std::min<std::int64_t>(n - 1, qpos - k0);
    if (lo > hi) continue;  // no key of this block is visible to the row
    for (std::int64_t h = 0; h < H; ++h) {
      const T* qi = q + i * ldq + h * D;
      const std::int64_t g = h / group;
      A mx = -std::numeric_limits<A>::infinity(), total = 0;
      for (std::int64_t j = lo; j <= hi; ++j) {
        const T* kj = k + j * ldkv + g * D;
        A dot = 0;
        for (std::int64_t d = 0; d < D; ++d) dot += static_cast<A>(qi[d]) * static_cast<A>(kj[d]);
        mx = std::max(mx, w[static_cast<std::size_t>(j)] = dot * scale);
      }
      std::fill(acc.begin(), acc.end(), A(0));
      for (std::int64_t j = lo; j <= hi; ++j) {
        const A e = std::exp(w[static_cast<std::size_t>(j)] - mx);
        total += e;
        const T* vj = v + j * ldkv + g * D;
        for (std::int64_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += e * static_cast<A>(vj[d]);
      }
      const A l = mx + std::log(total);
      A& run = lse[h * ld_lse + i];
      T* yi = y + i * ldy + h * D;
      if (run == -std::numeric_limits<A>::infinity()) {
        for (std::int64_t d = 0; d < D; ++d) yi[d] = static_cast<T>(acc[static_cast<std::size_t>(d)] / total);
        run = l;
        continue;
      }
      const A L = std::max(run, l) + std::log1p(std::exp(-std::abs(run - l)));
      const A a = std::exp(run - L), b = std::exp(l - L);
      for (std::int64_t d = 0; d < D; ++d)
        yi[d] = static_cast<T>(a * static_cast<A>(yi[d]) + b * acc[static_cast<std::size_t>(d)] / total);
      run = L;
    }
  }
}

/// Adds the block's gradients to dq, dk and dv from the final y and lse of the rows
/// (Note [Ring attention blocks]).
template <class T>
void ring_attention_block_backward(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, const T* q,
                                   std::int64_t ldq, std::int64_t q0, const std::int32_t* starts, const T* k,
                                   const T* v, std::int64_t ldkv, std::int64_t k0, std::int64_t window,
                                   acc_t<T> scale, const T* y, std::int64_t ldy, const acc_t<T>* lse,
                                   std::int64_t ld_lse, const T* dy, T* dq, T* dk, T* dv) {
  using A = acc_t<T>;
  const std::int64_t group = H / Hkv;
  std::vector<A> gq(static_cast<std::size_t>(D));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t qpos = q0 + i;
    const std::int64_t lo = std::max<std::int64_t>(0, detail::ring_first_key(qpos, starts, i, window) - k0);
    const std::int64_t hi = std::min<std::int64_t>(n - 1, qpos - k0);
    if (lo > hi) continue;
    for (std::int64_t h = 0; h < H; ++h) {
      const T* qi = q + i * ldq + h * D;
      const T* yi = y + i * ldy + h * D;
      const T* dyi = dy + i * ldy + h * D;
      const std::int64_t g = h / group;
      const A l = lse[h * ld_lse + i];
      A di = 0;
      for (std::int64_t d = 0; d < D; ++d) di += static_cast<A>(dyi[d]) * static_cast<A>(yi[d]);
      std::fill(gq.begin(), gq.end(), A(0));
      for (std::int64_t j = lo; j <= hi; ++j) {
        const T* kj = k + j * ldkv + g * D;
        const T* vj = v + j * ldkv + g * D;
        A s = 0, dp = 0;
        for (std::int64_t d = 0; d < D; ++d) {
          s += static_cast<A>(qi[d]) * static_cast<A>(kj[d]);
          dp += static_cast<A>(dyi[d]) * static_cast<A>(vj[d]);
        }
        const A p = std::exp(s * scale - l), ds = p * (dp - di) * scale;
        T* dkj = dk + j * ldkv + g * D;
        T* dvj = dv + j * ldkv + g * D;
        for (std::int64_t d = 0; d < D; ++d) {
          gq[static_cast<std::size_t>(d)] += ds * static_cast<A>(kj[d]);
          dkj[d] = static_cast<T>(static_cast<A>(dkj[d]) + ds * static_cast<A>(qi[d]));
          dvj[d] = static_cast<T>(static_cast<A>(dvj[d]) + p * static_cast<A>(dyi[d]));
        }
      }
      T* dqi = dq + i * ldq + h * D;
      for (std::int64_t d = 0; d < D; ++d)
        dqi[d] = static_cast<T>(static_cast<A>(dqi[d]) + gq[static_cast<std::size_t>(d)]);
    }
  }
}

/// dst[r * ld_dst + i] = src[r * ld_src + i] for `rows` rows of `width` elements: the q,
/// k and v columns of a packed qkv out of and back into it.
template <class T>
void copy_strided_rows(std::int64_t rows, std::int64_t width, const T* src, std::int64_t ld_src, T* dst,
                       std::int64_t ld_dst) {
  for (std::int64_t r = 0; r < rows; ++r) std::copy(src + r * ld_src, src + r * ld_src + width, dst + r * ld_dst);
}

}  // namespace ptrain::kernels::cpu
