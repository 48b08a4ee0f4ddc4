#pragma once
// Mixture-of-experts ops on tensors of either device: the router's top-k
// (ops::moe_route, moe_route_backward), the permutation of token slots into
// expert-grouped order (moe_permute_plan), the gather of token rows into that
// order (moe_gather, moe_gather_backward) and the weighted combine back into
// token order (moe_combine, moe_combine_backward), and the experts' GEMMs on the
// expert-grouped rows (grouped_matmul_into, grouped_matmul_weight_grad). nn::MoE
// (nn/moe.hpp) strings them together; docs/moe.md has the formulas. Tokens are the
// rows of [N, C] tensors; a token's k slots are the rows of [N, k] tensors.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "ptrain/kernels/cpu/moe.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

using kernels::MoeScore;

/// What moe_route gives for N tokens and E experts.
template <class T>
struct MoeRouting {
  Tensor<std::int32_t> experts;  ///< [N, k] chosen experts, best first
  Tensor<T> weights;             ///< [N, k] their combine weights
  Tensor<acc_t<T>> probs;        ///< [N, E] the probabilities the load-balancing loss averages
  Tensor<acc_t<T>> lse;          ///< [N] log-sum-exp of each row of logits (z-loss, backward)
};

/// Scores, top-k and weights of logits [N, E] (kernels/moe_math.hpp): k of the E experts per
/// token, ties to the lower index; weights renormalised over the k when `renormalize`, times scale.
template <class T>
MoeRouting<T> moe_route(const Tensor<T>& logits, std::int64_t k, MoeScore kind, bool renormalize, double scale) {
  PTRAIN_CHECK(logits.dim() == 2 && logits.size(1) > 0, ShapeError, "[ptrain.moe.route] logits must be [tokens, "
               "experts], got ", logits.shape());
  const std::int64_t n = logits.size(0), E = logits.size(1);
  PTRAIN_CHECK(k >= 1 && k <= E, ShapeError, "[ptrain.moe.route] top_k ", k, " must lie in [1, experts = ", E, "]");
  const Device d = logits.device();
  MoeRouting<T> r{Tensor<std::int32_t>::empty({n, k}, d), Tensor<T>::empty({n, k}, d),
                  Tensor<acc_t<T>>::empty({n, E}, d), Tensor<acc_t<T>>::empty({n}, d)};
  if (n > 0)
    PTRAIN_DISPATCH(d, T, moe_route, n, E, k, kind, renormalize, static_cast<acc_t<T>>(scale), logits.data(),
                    r.experts.data(), r.weights.data(), r.probs.data(), r.lse.data());
  return r;
}

/// dlogits [N, E] of moe_route from dweights [N, k], plus the load-balancing loss's gradient
/// aux_grad [E] with respect to each token's probs (undefined: none) and the z-loss's
/// (z_grad * 2 lse softmax(logits) per row; 0: none).
template <class T>
Tensor<T> moe_route_backward(const Tensor<T>& logits, const MoeRouting<T>& routing, const Tensor<T>& dweights,
                             MoeScore kind, bool renormalize, double scale, const Tensor<acc_t<T>>& aux_grad,
                             double z_grad) {
  const std::int64_t n = logits.size(0), E = logits.size(1), k = routing.experts.size(1);
  check_shape(dweights, routing.weights.shape(), "moe routing weights' gradient");
  check_shape(routing.lse, Shape{n}, "moe routing log-sum-exp");
  detail::check_devices("moe_route_backward", logits.device(), routing.experts, dweights, routing.lse);
  if (aux_grad.defined()) {
    check_shape(aux_grad, Shape{E}, "moe load-balancing gradient");
    detail::check_devices("moe_route_backward", logits.device(), aux_grad);
  }
  auto dlogits = Tensor<T>::empty(logits.shape(), logits.device());
  if (n > 0)
    PTRAIN_DISPATCH(logits.device(), T, moe_route_backward, n, E, k, kind, renormalize, static_cast<acc_t<T>>(scale),
                    logits.data(), routing.experts.data(), dweights.data(), routing.lse.data(),
                    aux_grad.defined() ? aux_grad.data() : nullptr, static_cast<acc_t<T>>(z_grad), dlogits.data());
  return dlogits;
}

/// The mean over tokens of each column of probs [N, E] (the load-balancing loss's P_e), on the host.
template <class A>
std::vector<double> moe_mean_probs(const Tensor<A>& probs) {
  PTRAIN_CHECK(probs.dim() == 2 && probs.size(0) > 0, ShapeError, "[ptrain.moe.probs] probs must be [tokens > 0, "
               "experts], got ", probs.shape());
  const std::int64_t n = probs.size(0), E = probs.size(1);
  auto sums = Tensor<A>::zeros({E}, probs.device());
  PTRAIN_DISPATCH(probs.device(), A, bias_grad, n, E, probs.data(), sums.data());  // column sums
  std::vector<double> mean;
  for (A v : sums.to_vector()) mean.push_back(static_cast<double>(v) / static_cast<double>(n));
  return mean;
}

/// Where each token slot goes in the expert-grouped buffer (kernels::cpu::moe_permute_plan).
struct MoePlan {
  Tensor<std::int32_t> pos;            ///< [N, k] each slot's row, -1 when dropped
  Tensor<std::int32_t> token_of;       ///< [rows()] each row's token
  std::vector<std::int64_t> routed;    ///< [E] slots the router sent to each expert (before capacity)
  std::vector<std::int64_t> offsets;   ///< [E + 1] where each expert's rows begin (host copy)
  std::int64_t rows() const { return offsets.back(); }
};

/// The stable permutation of the slots of experts [N, k] (values in [0, E)) into expert-grouped
/// order; capacity > 0 keeps each expert's first `capacity` slots in token order, <= 0 all.
/// Reads 2E + 1 counts back to the host (the grouped GEMM's segments), so on a GPU it waits
/// for the current stream.
inline MoePlan moe_permute_plan(const Tensor<std::int32_t>& experts, std::int64_t E, std::int64_t capacity) {
  PTRAIN_CHECK(experts.dim() == 2 && E > 0, ShapeError, "[ptrain.moe.plan] experts must be [tokens, k] and E > 0, "
               "got ", experts.shape(), " and E = ", E);
  PTRAIN_CHECK(experts.numel() < INT32_MAX, ShapeError, "[ptrain.moe.plan] ", experts.numel(),
               " token slots exceed the 32-bit row indices; split the batch");
  const std::int64_t n = experts.size(0), k = experts.size(1);
  const Device d = experts.device();
  MoePlan plan{Tensor<std::int32_t>::empty({n, k}, d), Tensor<std::int32_t>::empty({n * k}, d), {}, {}};
  auto counts = Tensor<std::int32_t>::empty({2 * E + 1}, d);  // routed [E], then offsets [E + 1]
  // An int32 kernel: it sits in every floating type's table, reached through float's.
  PTRAIN_DISPATCH(d, float, moe_permute_plan, n, k, E, capacity, experts.data(), counts.data(), counts.data() + E,
                  plan.pos.data(), plan.token_of.data());
  const auto host = counts.to_vector();
  plan.routed.assign(host.begin(), host.begin() + E);
  PTRAIN_CHECK(std::accumulate(plan.routed.begin(), plan.routed.end(), std::int64_t(0)) == n * k, ShapeError,
               "[ptrain.moe.experts] some of the ", n * k, " token slots name an expert outside [0, ", E, ")");
  plan.offsets.assign(host.begin() + E, host.end());
  plan.token_of = plan.token_of.view(0, {plan.rows()});
  return plan;
}

/// x [N, C] -> xp [rows, C], row r = x[token_of[r]]: tokens grouped by expert.
template <class T>
Tensor<T> moe_gather(const Tensor<T>& x, const MoePlan& plan) {
  PTRAIN_CHECK(x.dim() == 2 && x.size(0) == plan.pos.size(0), ShapeError, "[ptrain.moe.gather] input ", x.shape(),
               " does not have the plan's ", plan.pos.size(0), " tokens");
  detail::check_devices("moe_gather", x.device(), plan.pos);
  const std::int64_t c = x.size(1);
  auto xp = Tensor<T>::empty({plan.rows(), c}, x.device());
  if (plan.rows() > 0) PTRAIN_DISPATCH(x.device(), T, moe_gather, plan.rows(), c, plan.token_of.data(), x.data(), xp.data());
  return xp;
}

/// Backward of moe_gather: dx [N, C], token t's rows summed in slot order (no atomics).
template <class T>
Tensor<T> moe_gather_backward(const Tensor<T>& dxp, const MoePlan& plan) {
  PTRAIN_CHECK(dxp.dim() == 2 && dxp.size(0) == plan.rows(), ShapeError, "[ptrain.moe.gather] gradient ", dxp.shape(),
               " does not have the plan's ", plan.rows(), " rows");
  detail::check_devices("moe_gather_backward", dxp.device(), plan.pos);
  const std::int64_t n = plan.pos.size(0), k = plan.pos.size(1), c = dxp.size(1);
  auto dx = Tensor<T>::empty({n, c}, dxp.device());
  if (n > 0) PTRAIN_DISPATCH(dxp.device(), T, moe_gather_backward, n, k, c, plan.pos.data(), dxp.data(), dx.data());
  return dx;
}

/// y [N, C], y[t] = sum_j w[t, j] yp[pos[t, j]] over kept slots, in order j (no atomics);
/// pos undefined means the identity (yp [N * k, C]).
template <class T>
Tensor<T> moe_combine(const Tensor<T>& yp, const Tensor<std::int32_t>& pos, const Tensor<T>& w) {
  PTRAIN_CHECK(yp.dim() == 2 && w.dim() == 2, ShapeError, "[ptrain.moe.combine] expert outputs ", yp.shape(),
               " and weights ", w.shape(), " must be 2-D");
  const std::int64_t n = w.size(0), k = w.size(1), c = yp.size(1);
  if (pos.defined()) {
    check_shape(pos, w.shape(), "moe slot rows");
    detail::check_devices("moe_combine", yp.device(), pos);
  } else {
    check_shape(yp, Shape{n * k, c}, "moe expert outputs");
  }
  detail::check_devices("moe_combine", yp.device(), w);
  auto y = Tensor<T>::empty({n, c}, yp.device());
  if (n > 0)
    PTRAIN_DISPATCH(yp.device(), T, moe_combine, n, k, c, pos.defined() ? pos.data() : nullptr, w.data(), yp.data(),
                    y.data());
  return y;
}

/// Backward of moe_combine: dyp [rows of yp, C] and dw [N, k] (0 for dropped slots).
template <class T>
void moe_combine_backward(const Tensor<T>& yp, const Tensor<std::int32_t>& pos, const Tensor<T>& w, const Tensor<T>& dy,
                          Tensor<T>& dyp, Tensor<T>& dw) {
  const std::int64_t n = w.size(0), k = w.size(1), c = yp.size(1);
  check_shape(dy, Shape{n, c}, "moe combine output gradient");
  if (pos.defined()) check_shape(pos, w.shape(), "moe slot rows");
  detail::check_devices("moe_combine_backward", yp.device(), w, dy);
  dyp = Tensor<T>::empty(yp.shape(), yp.device());
  dw = Tensor<T>::empty(w.shape(), yp.device());
  if (n > 0)
    PTRAIN_DISPATCH(yp.device(), T, moe_combine_backward, n, k, c, pos.defined() ? pos.data() : nullptr, w.data(),
                    yp.data(), dy.data(), dyp.data(), dw.data());
}

namespace detail {
// offsets [experts + 1], non-decreasing from 0 to rows.
inline void check_expert_offsets(const std::vector<std::int64_t>& offsets, std::size_t experts, std::int64_t rows) {
  PTRAIN_CHECK(offsets.size() == experts + 1 && offsets.front() == 0 && offsets.back() == rows &&
                   std::is_sorted(offsets.begin(), offsets.end()),
               ShapeError, "[ptrain.moe.grouped_gemm] offsets must be ", experts + 1, " non-decreasing row offsets "
               "from 0 to the ", rows, " rows, one more than the ", experts, " weights");
}

// The groups of one grouped GEMM (kernels::cpu::grouped_gemm), run on a device by the kernel
// table's grouped_gemm where the gate lets it, else by one verified gemm per group (Note
// [The verification gate]).
template <class T>
struct GemmGroups {
  std::vector<std::int64_t> m, n, k;
  std::vector<const T*> a, b;
  std::vector<T*> c;

  void add(std::int64_t mg, std::int64_t ng, std::int64_t kg, const T* ag, const T* bg, T* cg) {
    m.push_back(mg);
    n.push_back(ng);
    k.push_back(kg);
    a.push_back(ag);
    b.push_back(bg);
    c.push_back(cg);
  }
  void run(Device d, bool trans_a, bool trans_b, acc_t<T> alpha, std::int64_t lda, std::int64_t ldb, acc_t<T> beta,
           std::int64_t ldc) const {
    if (c.empty()) return;
    if (d.is_cuda() && !use_cuda_kernel(d, &kernels::CudaKernels<T>::grouped_gemm, "grouped_gemm")) {
      for (std::size_t g = 0; g < c.size(); ++g)
        PTRAIN_DISPATCH(d, T, gemm, trans_a, trans_b, m[g], n[g], k[g], alpha, a[g], lda, b[g], ldb, beta, c[g], ldc);
      return;
    }
    PTRAIN_DISPATCH(d, T, grouped_gemm, trans_a, trans_b, static_cast<std::int64_t>(c.size()), m.data(), n.data(),
                    k.data(), alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
  }
};
}  // namespace detail

/// The experts' GEMM on rows grouped by expert, as one grouped GEMM: for every expert e with
/// rows [lo, hi) = [offsets[e], offsets[e + 1]),
///   y[lo:hi] = alpha x[lo:hi] op(w[e]) + beta y[lo:hi],
/// op(w) = w^T when trans_w (w[e] [N, K], a Linear's weight: the forward x W^T), else w
/// (w[e] [K, N]: the input gradient dy W). x [M, K], y [M, N], offsets [E + 1] from 0 to M for
/// the E = w.size() weights; an expert without rows is skipped.
template <class T>
void grouped_matmul_into(const Tensor<T>& x, const std::vector<Tensor<T>>& w, const std::vector<std::int64_t>& offsets,
                         Tensor<T>& y, bool trans_w, acc_t<T> alpha = 1, acc_t<T> beta = 0) {
  PTRAIN_CHECK(!w.empty() && x.dim() == 2 && y.dim() == 2 && w[0].dim() == 2, ShapeError,
               "[ptrain.moe.grouped_gemm] needs 2-D x and y and at least one 2-D weight, got x ", x.shape(), ", y ",
               y.shape(), " and ", w.size(), " weights");
  const std::int64_t M = x.size(0), K = x.size(1), N = trans_w ? w[0].size(0) : w[0].size(1);
  const Shape ws = trans_w ? Shape{N, K} : Shape{K, N};
  check_shape(y, Shape{M, N}, "grouped GEMM output");
  detail::check_devices("grouped_matmul_into", x.device(), y);
  for (const auto& we : w) {
    check_shape(we, ws, "grouped GEMM weight");
    detail::check_devices("grouped_matmul_into", x.device(), we);
  }
  detail::check_expert_offsets(offsets, w.size(), M);
  detail::GemmGroups<T> groups;
  for (std::size_t e = 0; e < w.size(); ++e)
    if (const std::int64_t lo = offsets[e], rows = offsets[e + 1] - lo; rows > 0)
      groups.add(rows, N, K, x.data() + lo * K, w[e].data(), y.data() + lo * N);
  groups.run(x.device(), false, trans_w, alpha, K, trans_w ? K : N, beta, N);
}

/// The experts' weight gradients on rows grouped by expert, as one grouped GEMM: for every
/// expert e with rows [lo, hi) = [offsets[e], offsets[e + 1]) and a defined dw[e]
/// (undefined: a frozen weight, skipped),
///   dw[e] = alpha dy[lo:hi]^T x[lo:hi] + beta dw[e],
/// dy [M, N], x [M, K], dw[e] [N, K]. An expert without rows gets dw[e] = beta dw[e] (left
/// alone when beta = 1, the accumulation of gradients).
template <class T>
void grouped_matmul_weight_grad(const Tensor<T>& dy, const Tensor<T>& x, const std::vector<std::int64_t>& offsets,
                                const std::vector<Tensor<T>>& dw, acc_t<T> alpha = 1, acc_t<T> beta = 1) {
  PTRAIN_CHECK(dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0), ShapeError, "[ptrain.moe.grouped_gemm] "
               "needs 2-D dy and x with the same rows, got ", dy.shape(), " and ", x.shape());
  const std::int64_t M = dy.size(0), N = dy.size(1), K = x.size(1);
  detail::check_devices("grouped_matmul_weight_grad", dy.device(), x);
  detail::check_expert_offsets(offsets, dw.size(), M);
  detail::GemmGroups<T> groups;
  for (std::size_t e = 0; e < dw.size(); ++e) {
    if (!dw[e].defined()) continue;
    check_shape(dw[e], Shape{N, K}, "grouped GEMM weight gradient");
    detail::check_devices("grouped_matmul_weight_grad", dy.device(), dw[e]);
    const std::int64_t lo = offsets[e], rows = offsets[e + 1] - lo;
    if (rows > 0 || beta != acc_t<T>(1)) groups.add(N, K, rows, dy.data() + lo * N, x.data() + lo * K, dw[e].data());
  }
  groups.run(dy.device(), true, false, alpha, N, K, beta, K);
}

}  // namespace ptrain::ops
