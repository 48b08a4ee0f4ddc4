#pragma once
// The per-token formulas of a mixture-of-experts router, forward and backward.
// The CPU kernels (kernels/cpu/moe.hpp) and the CUDA kernels (kernels/cuda/moe.cuh)
// both evaluate these PTRAIN_HOST_DEVICE functions, one token (one row of logits)
// at a time, so the two devices compute one definition (docs/moe.md, "Routing").
//
// For a row of logits l [E]:
//   lse      = log sum_e exp(l_e)
//   scores   s_e = exp(l_e - lse) (Softmax) or sigmoid(l_e) (Sigmoid)
//   probs    p_e = s_e (Softmax) or s_e / sum_m s_m (Sigmoid): what the load-balancing loss averages
//   top-k    the k experts of the largest logits (the same order as the scores'), ties to the
//            lower expert index, a NaN logit ranking lowest; experts in rank order
//   weights  w_j = scale * s_{i_j} / (renormalize ? sum_m s_{i_m} : 1)
//
// A is the arithmetic type: float for float and bf16 tensors, double for double.

#include <cmath>
#include <cstdint>

#include "ptrain/config.hpp"

namespace ptrain::kernels {

/// The router's score function.
enum class MoeScore : int { Softmax, Sigmoid };

namespace math {

/// The logit as the top-k compares it: NaN ranks below every number.
template <class A>
PTRAIN_HOST_DEVICE A moe_rank_key(A v) {
  return v != v ? -INFINITY : v;
}

/// True when expert a (logit la) ranks above expert b (logit lb): a larger logit, or an equal one and a lower index.
template <class A>
PTRAIN_HOST_DEVICE bool moe_ranks_above(A la, std::int64_t a, A lb, std::int64_t b) {
  const A ka = moe_rank_key(la), kb = moe_rank_key(lb);
  return ka > kb || (ka == kb && a < b);
}

/// s_e of a logit, given the row's log-sum-exp.
template <class A>
PTRAIN_HOST_DEVICE A moe_score(MoeScore kind, A logit, A lse) {
  if (kind == MoeScore::Softmax) return std::exp(logit - lse);
  if (logit >= A(0)) return A(1) / (A(1) + std::exp(-logit));
  const A e = std::exp(logit);
  return e / (A(1) + e);
}

/// One token's routing: experts idx[k], weights w[k], probs[E] and the log-sum-exp (file comment).
template <class T, class A>
PTRAIN_HOST_DEVICE void moe_route_row(std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize, A scale,
                                      const T* logits, std::int32_t* idx, T* w, A* probs, A* lse_out) {
  A m = -INFINITY;
  for (std::int64_t e = 0; e < E; ++e) {
    const A l = static_cast<A>(logits[e]);
    if (l > m) m = l;
  }
  A z = 0;
  for (std::int64_t e = 0; e < E; ++e) z += std::exp(static_cast<A>(logits[e]) - m);
  const A lse = m + std::log(z);
  *lse_out = lse;
  A ssum = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    probs[e] = moe_score(kind, static_cast<A>(logits[e]), lse);
    ssum += probs[e];
  }
  if (kind == MoeScore::Sigmoid)
    for (std::int64_t e = 0; e < E; ++e) probs[e] /= ssum;
  // Top-k: pick j is the best expert ranking below pick j - 1.
  A wsum = 0;
  for (std::int64_t j = 0; j < k; ++j) {
    std::int64_t best = -1;
    A lbest = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const A l = static_cast<A>(logits[e]);
      if (j > 0 && !moe_ranks_above(static_cast<A>(logits[idx[j - 1]]), idx[j - 1], l, e)) continue;
      if (best < 0 || moe_ranks_above(l, e, lbest, best)) {
        best = e;
        lbest = l;
      }
    }
    idx[j] = static_cast<std::int32_t>(best);
    wsum += moe_score(kind, lbest, lse);
  }
  const A norm = renormalize ? scale / wsum : scale;
  for (std::int64_t j = 0; j < k; ++j) w[j] = T(moe_score(kind, static_cast<A>(logits[idx[j]]), lse) * norm);
}

/// One token's dlogits [E] from dw [k] (the gradient of the weights moe_route_row wrote), the
/// load-balancing loss's gradient with respect to this token's probs (aux_grad [E], or null)
/// and the z-loss's (z_grad * 2 lse softmax(l) is added when z_grad != 0; z_grad = coefficient / tokens).
template <class T, class A>
PTRAIN_HOST_DEVICE void moe_route_backward_row(std::int64_t E, std::int64_t k, MoeScore kind, bool renormalize,
                                               A scale, const T* logits, const std::int32_t* idx, const T* dw, A lse,
                                               const A* aux_grad, A z_grad, T* dlogits) {
  auto score = [&](std::int64_t e) { return moe_score(kind, static_cast<A>(logits[e]), lse); };
  // Through the weights: w_j = scale s_j / S with S = sum of the chosen scores (S = 1 without renormalisation).
  A S = 1, dot = 0;
  if (renormalize) {
    S = 0;
    for (std::int64_t j = 0; j < k; ++j) S += score(idx[j]);
    for (std::int64_t j = 0; j < k; ++j) dot += scale * static_cast<A>(dw[j]) * score(idx[j]) / S;
  }
  // Sigmoid's probs p = s / sum(s): d/ds_e of sum_m a_m p_m is (a_e - sum_m a_m p_m) / sum(s).
  A ssum = 1, ap = 0;
  if (aux_grad && kind == MoeScore::Sigmoid) {
    ssum = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const A s = score(e);
      ssum += s;
      ap += aux_grad[e] * s;
    }
    ap /= ssum;
  }
  auto dscore = [&](std::int64_t e) {
    A d = 0;
    for (std::int64_t j = 0; j < k; ++j)
      if (idx[j] == e) d = (scale * static_cast<A>(dw[j]) - dot) / S;
    if (aux_grad) d += kind == MoeScore::Softmax ? aux_grad[e] : (aux_grad[e] - ap) / ssum;
    return d;
  };
  A sdot = 0;  // softmax: dl_e = s_e (ds_e - sum_m ds_m s_m)
  if (kind == MoeScore::Softmax)
    for (std::int64_t e = 0; e < E; ++e) sdot += dscore(e) * score(e);
  for (std::int64_t e = 0; e < E; ++e) {
    const A s = score(e);
    A dl = kind == MoeScore::Softmax ? s * (dscore(e) - sdot) : dscore(e) * s * (A(1) - s);
    if (z_grad != A(0)) dl += z_grad * A(2) * lse * std::exp(static_cast<A>(logits[e]) - lse);
    dlogits[e] = T(dl);
  }
}

}  // namespace math
}  // namespace ptrain::kernels
