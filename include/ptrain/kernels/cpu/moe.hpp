#pragma once
// Mixture-of-experts kernels: the router's scores, top-k and weights (and their
// backward), the permutation of token slots into expert-grouped order, the gather
// of token rows into that order and the weighted combine back (and their backwards).
// docs/moe.md has the formulas; kernels/moe_math.hpp the per-token router maths
// that the CUDA twins (kernels/cuda/moe.cuh) evaluate too.
//
// A "slot" is one of a token's k choices: slot s = t * k + j is token t's j-th expert.
// pos[s] is the slot's row in the expert-grouped buffer, or -1 when the slot was
// dropped (beyond its expert's capacity). Every sum runs in a fixed order (a token's
// k slots in order j = 0..k-1), in acc_t<T>, rounded once: the results are the same
// bits on every run.

#include <algorithm>
#include <climits>
#include <cstdint>
#include <vector>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"  // gemm for bf16, which grouped_gemm calls
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/moe_math.hpp"

namespace ptrain::kernels::cpu {

/// Per token t of n: experts idx [n, k], weights w [n, k], probs [n, E] and lse [n] of the
/// logits [n, E] (kernels/moe_math.hpp).
template <class T>
void moe_route(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize, acc_t<T> scale,
               const T* logits, std::int32_t* idx, T* w, acc_t<T>* probs, acc_t<T>* lse) {
  for (std::int64_t t = 0; t < n; ++t)
    math::moe_route_row<T, acc_t<T>>(E, k, kind, renormalize, scale, logits + t * E, idx + t * k, w + t * k,
                                     probs + t * E, lse + t);
}

/// dlogits [n, E] of moe_route from dw [n, k], the load-balancing gradient aux_grad [E] (the same
/// for every token; may be null) and the z-loss factor z_grad (kernels/moe_math.hpp).
template <class T>
void moe_route_backward(std::int64_t n, std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize,
                        acc_t<T> scale, const T* logits, const std::int32_t* idx, const T* dw, const acc_t<T>* lse,
                        const acc_t<T>* aux_grad, acc_t<T> z_grad, T* dlogits) {
  for (std::int64_t t = 0; t < n; ++t)
    math::moe_route_backward_row<T, acc_t<T>>(E, k, kind, renormalize, scale, logits + t * E, idx + t * k, dw + t * k,
                                              lse[t], aux_grad, z_grad, dlogits + t * E);
}

/// The permutation of the n * k slots (experts idx [n * k], each in [0, E)) into expert-grouped
/// order, stable (an expert's slots in slot order, so in token order): routed [E] slots per
/// expert; offsets [E + 1], where expert e's kept rows begin (offsets[E] rows in all); pos [n * k]
/// each slot's row or -1; token_of [offsets[E]] each row's token. With capacity > 0 an expert
/// keeps its first `capacity` slots and drops the rest; capacity <= 0 keeps all (dropless).
inline void moe_permute_plan(std::int64_t n, std::int64_t k, std::int64_t E, std::int64_t capacity,
                             const std::int32_t* idx, std::int32_t* routed, std::int32_t* offsets, std::int32_t* pos,
                             std::int32_t* token_of) {
  const std::int64_t slots = n * k, cap = capacity > 0 ? capacity : INT_MAX;
  std::fill(routed, routed + E, 0);
  for (std::int64_t s = 0; s < slots; ++s) {
    PTRAIN_CHECK(idx[s] >= 0 && idx[s] < E, ShapeError, "[ptrain.moe.experts] slot ", s, " names expert ", idx[s],
                 ", outside [0, ", E, ")");
    ++routed[idx[s]];
  }
  offsets[0] = 0;
  for (std::int64_t e = 0; e < E; ++e)
    offsets[e + 1] = offsets[e] + static_cast<std::int32_t>(std::min<std::int64_t>(routed[e], cap));
  std::vector<std::int64_t> next(static_cast<std::size_t>(E), 0);
  for (std::int64_t s = 0; s < slots; ++s) {
    const std::int64_t r = next[static_cast<std::size_t>(idx[s])]++;
    if (r < cap) {
      const std::int32_t p = offsets[idx[s]] + static_cast<std::int32_t>(r);
      pos[s] = p;
      token_of[p] = static_cast<std::int32_t>(s / k);
    } else {
      pos[s] = -1;
    }
  }
}

/// xp[r, :] = x[token_of[r], :] for the m rows of the expert-grouped buffer (width c).
template <class T>
void moe_gather(std::int64_t m, std::int64_t c, const std::int32_t* token_of, const T* x, T* xp) {
  for (std::int64_t r = 0; r < m; ++r) std::copy(x + token_of[r] * c, x + (token_of[r] + 1) * c, xp + r * c);
}

/// dx[t, :] = sum over j of dxp[pos[t * k + j], :] (dropped slots skipped; zeros when all are).
template <class T>
void moe_gather_backward(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* dxp, T* dx) {
  using A = acc_t<T>;
  std::vector<A> acc(static_cast<std::size_t>(c));
  for (std::int64_t t = 0; t < n; ++t) {
    std::fill(acc.begin(), acc.end(), A(0));
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t p = pos[t * k + j];
      if (p < 0) continue;
      for (std::int64_t i = 0; i < c; ++i) acc[static_cast<std::size_t>(i)] += static_cast<A>(dxp[p * c + i]);
    }
    for (std::int64_t i = 0; i < c; ++i) dx[t * c + i] = T(acc[static_cast<std::size_t>(i)]);
  }
}

/// y[t, :] = sum over j of w[t, j] yp[pos[t * k + j], :], dropped slots skipped; pos null
/// means pos[s] = s (yp holds the n * k slots in order; k = 1 scales rows of yp by w).
template <class T>
void moe_combine(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* w, const T* yp,
                 T* y) {
  using A = acc_t<T>;
  std::vector<A> acc(static_cast<std::size_t>(c));
  for (std::int64_t t = 0; t < n; ++t) {
    std::fill(acc.begin(), acc.end(), A(0));
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = t * k + j, p = pos ? pos[s] : s;
      if (p < 0) continue;
      const A ws = static_cast<A>(w[s]);
      for (std::int64_t i = 0; i < c; ++i) acc[static_cast<std::size_t>(i)] += ws * static_cast<A>(yp[p * c + i]);
    }
    for (std::int64_t i = 0; i < c; ++i) y[t * c + i] = T(acc[static_cast<std::size_t>(i)]);
  }
}

/// Backward of moe_combine: dyp[pos[s], :] = w[s] dy[t, :] and dw[s] = dy[t, :] . yp[pos[s], :]
/// for each kept slot s of token t; dw[s] = 0 for a dropped slot.
template <class T>
void moe_combine_backward(std::int64_t n, std::int64_t k, std::int64_t c, const std::int32_t* pos, const T* w,
                          const T* yp, const T* dy, T* dyp, T* dw) {
  using A = acc_t<T>;
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t s = t * k + j, p = pos ? pos[s] : s;
      if (p < 0) {
        dw[s] = T(0);
        continue;
      }
      const A ws = static_cast<A>(w[s]);
      A dot = 0;
      for (std::int64_t i = 0; i < c; ++i) {
        const A d = static_cast<A>(dy[t * c + i]);
        dot += d * static_cast<A>(yp[p * c + i]);
        dyp[p * c + i] = T(ws * d);
      }
      dw[s] = T(dot);
    }
}

/// The grouped GEMM: for each group g < groups, C_g = alpha op(A_g) op(B_g) + beta C_g, as gemm()
/// with sizes m[g], n[g], k[g], the operands at a[g], b[g], c[g] and the leading dimensions
/// shared by all groups. The sizes and the pointer arrays are host arrays (on a GPU the
/// pointers point into device memory). A group with m or n = 0 is a no-op and one with k = 0
/// gives C_g = beta C_g. Here one gemm per group, in group order: the same calls, so the
/// same bits, as a loop of gemm() (ops::grouped_matmul_into has the expert-segment forms).
template <class T>
void grouped_gemm(bool trans_a, bool trans_b, std::int64_t groups, const std::int64_t* m, const std::int64_t* n,
                  const std::int64_t* k, acc_t<T> alpha, const T* const* a, std::int64_t lda, const T* const* b,
                  std::int64_t ldb, acc_t<T> beta, T* const* c, std::int64_t ldc) {
  for (std::int64_t g = 0; g < groups; ++g)
    gemm(trans_a, trans_b, m[g], n[g], k[g], alpha, a[g], lda, b[g], ldb, beta, c[g], ldc);
}

}  // namespace ptrain::kernels::cpu
