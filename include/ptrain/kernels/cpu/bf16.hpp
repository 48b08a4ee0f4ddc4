#pragma once
// bf16 on the CPU: each kernel widens its bf16 arrays to float, runs the float
// kernel, and rounds what it writes back to bf16 once, the contract of the
// CUDA bf16 kernels (Note [bf16 kernels] in kernels/cuda/device.cuh): float
// arithmetic, float statistics (LayerNorm's mean and rstd, the log-sum-exp),
// float scalars. Overloads, not templates, so ops:: reach them through the
// same names; the copies make them a reference for the GPU path and for
// tests, not a fast path.

#include <cstdint>
#include <vector>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/elementwise.hpp"
#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/gqa_attention.hpp"
#include "ptrain/kernels/cpu/layer_norm.hpp"
#include "ptrain/kernels/cpu/optimizer.hpp"
#include "ptrain/kernels/cpu/reduce.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"

namespace ptrain::kernels::cpu {

namespace detail {
/// The first n values of x as floats (exact); empty for a null x.
inline Scratch<float> widen(const bf16* x, std::int64_t n) {
  Scratch<float> v;
  if (x == nullptr || n <= 0) return v;
  v.resize(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(x[i]);
  return v;
}
/// y[i] = bf16(v[i]), rounded to nearest even; nothing for a null y.
inline void narrow(const Scratch<float>& v, bf16* y) {
  if (y == nullptr) return;
  for (std::size_t i = 0; i < v.size(); ++i) y[i] = bf16(v[i]);
}
inline float* data_or_null(Scratch<float>& v) { return v.empty() ? nullptr : v.data(); }
/// y = bf16(f(float(x))) for an elementwise float kernel called as f(x, y).
template <class F>
void via_float(std::int64_t n, const bf16* x, bf16* y, F&& f) {
  auto xf = widen(x, n);
  Scratch<float> yf(xf.size());
  f(xf.data(), yf.data());
  narrow(yf, y);
}
/// dx = bf16(f(float(x), float(dy))) for an elementwise float backward called as f(x, dy, dx).
template <class F>
void via_float(std::int64_t n, const bf16* x, const bf16* dy, bf16* dx, F&& f) {
  auto xf = widen(x, n), dyf = widen(dy, n);
  Scratch<float> dxf(xf.size());
  f(xf.data(), dyf.data(), dxf.data());
  narrow(dxf, dx);
}
/// Elements a row-major [rows, cols] matrix with leading dimension ld spans.
inline std::int64_t extent(std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  return rows > 0 && cols > 0 ? (rows - 1) * ld + cols : 0;
}
}  // namespace detail

/// y[i] = x[i] converted: to bf16 through float, rounding to nearest even; from bf16 exactly.
template <class From, class To>
void cast(std::int64_t n, const From* x, To* y) {
  static_assert(is_bf16_cast<From, To>, "ptrain::kernels::cpu::cast: float or double <-> bf16");
  for (std::int64_t i = 0; i < n; ++i) y[i] = static_cast<To>(static_cast<float>(x[i]));
}

/// adamw_update on fp32 master weights p from a bf16 gradient, then param = bf16(p)
/// (kernels::cuda::adamw_update_mixed on the CPU).
inline void adamw_update_mixed(std::int64_t n, float* p, const bf16* g, float* m, float* v, float lr, float beta1,
                               float beta2, float eps, float weight_decay, std::int64_t step, bf16* param) {
  auto gf = detail::widen(g, n);
  adamw_update<float>(n, p, gf.data(), m, v, lr, beta1, beta2, eps, weight_decay, step);
  for (std::int64_t i = 0; i < n; ++i) param[i] = bf16(p[i]);
}

inline void bias_add(std::int64_t rows, std::int64_t cols, bf16* y, const bf16* bias) {
  auto yf = detail::widen(y, rows * cols), bf = detail::widen(bias, cols);
  bias_add<float>(rows, cols, yf.data(), bf.data());
  detail::narrow(yf, y);
}

inline void bias_grad(std::int64_t rows, std::int64_t cols, const bf16* dy, bf16* dbias) {
  auto dyf = detail::widen(dy, rows * cols), dbf = detail::widen(dbias, cols);
  bias_grad<float>(rows, cols, dyf.data(), dbf.data());
  detail::narrow(dbf, dbias);
}

inline void relu_forward(std::int64_t n, const bf16* x, bf16* y) {
  detail::via_float(n, x, y, [n](const float* a, float* b) { relu_forward<float>(n, a, b); });
}

inline void relu_backward(std::int64_t n, const bf16* x, const bf16* dy, bf16* dx) {
  detail::via_float(n, x, dy, dx, [n](const float* a, const float* d, float* b) { relu_backward<float>(n, a, d, b); });
}

inline void gelu_forward(std::int64_t n, const bf16* x, bf16* y) {
  detail::via_float(n, x, y, [n](const float* a, float* b) { gelu_forward<float>(n, a, b); });
}

inline void gelu_backward(std::int64_t n, const bf16* x, const bf16* dy, bf16* dx) {
  detail::via_float(n, x, dy, dx, [n](const float* a, const float* d, float* b) { gelu_backward<float>(n, a, d, b); });
}

inline void dropout(std::int64_t n, const bf16* x, bf16* y, double p, std::uint64_t seed, std::uint64_t offset) {
  detail::via_float(n, x, y, [&](const float* a, float* b) { dropout<float>(n, a, b, p, seed, offset); });
}

inline void axpy(std::int64_t n, float alpha, const bf16* x, bf16* y) {
  auto xf = detail::widen(x, n), yf = detail::widen(y, n);
  axpy<float>(n, alpha, xf.data(), yf.data());
  detail::narrow(yf, y);
}

inline void scale(std::int64_t n, float alpha, bf16* x) {
  auto xf = detail::widen(x, n);
  scale<float>(n, alpha, xf.data());
  detail::narrow(xf, x);
}

inline double sum(std::int64_t n, const bf16* x) {
  auto xf = detail::widen(x, n);
  return sum<float>(n, xf.data());
}

inline double sum_squares(std::int64_t n, const bf16* x) {
  auto xf = detail::widen(x, n);
  return sum_squares<float>(n, xf.data());
}

inline void argmax_rows(std::int64_t rows, std::int64_t cols, const bf16* x, std::int32_t* out) {
  auto xf = detail::widen(x, rows * cols);
  argmax_rows<float>(rows, cols, xf.data(), out);
}

inline void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                 const bf16* a, std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, bf16* c,
                 std::int64_t ldc) {
  auto af = detail::widen(a, detail::extent(trans_a ? k : m, trans_a ? m : k, lda));
  auto bf = detail::widen(b, detail::extent(trans_b ? n : k, trans_b ? k : n, ldb));
  auto cf = detail::widen(c, detail::extent(m, n, ldc));
  gemm<float>(trans_a, trans_b, m, n, k, alpha, detail::data_or_null(af), lda, detail::data_or_null(bf), ldb, beta,
              detail::data_or_null(cf), ldc);
  for (std::int64_t i = 0; i < m; ++i)  // only the [m, n] block: the padding keeps its bits
    for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = bf16(cf[static_cast<std::size_t>(i * ldc + j)]);
}

inline void layer_norm_forward(std::int64_t rows, std::int64_t d, const bf16* x, const bf16* gamma, const bf16* beta,
                               float eps, bf16* y, float* mean, float* rstd) {
  auto xf = detail::widen(x, rows * d), gf = detail::widen(gamma, d), bf = detail::widen(beta, d);
  Scratch<float> yf(xf.size());
  layer_norm_forward<float>(rows, d, xf.data(), gf.data(), bf.data(), eps, yf.data(), mean, rstd);
  detail::narrow(yf, y);
}

inline void layer_norm_backward(std::int64_t rows, std::int64_t d, const bf16* x, const float* mean,
                                const float* rstd, const bf16* gamma, const bf16* dy, bf16* dx, bf16* dgamma,
                                bf16* dbeta) {
  auto xf = detail::widen(x, rows * d), gf = detail::widen(gamma, d), dyf = detail::widen(dy, rows * d);
  auto dgf = detail::widen(dgamma, d), dbf = detail::widen(dbeta, d);
  Scratch<float> dxf(xf.size());
  layer_norm_backward<float>(rows, d, xf.data(), mean, rstd, gf.data(), dyf.data(), dxf.data(), dgf.data(),
                             dbf.data());
  detail::narrow(dxf, dx);
  detail::narrow(dgf, dgamma);
  detail::narrow(dbf, dbeta);
}

/// h = bf16(x + residual), then layer_norm_forward of h: the bits of axpy and layer_norm_forward.
inline void residual_layer_norm_forward(std::int64_t rows, std::int64_t d, const bf16* x, const bf16* residual,
                                        const bf16* gamma, const bf16* beta, float eps, bf16* h, bf16* y, float* mean,
                                        float* rstd) {
  for (std::int64_t i = 0; i < rows * d; ++i) h[i] = bf16(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
  layer_norm_forward(rows, d, h, gamma, beta, eps, y, mean, rstd);
}

/// dh = bf16(bf16(layer_norm_backward dx) + dresidual): the bits of layer_norm_backward and axpy.
inline void residual_layer_norm_backward(std::int64_t rows, std::int64_t d, const bf16* h, const float* mean,
                                         const float* rstd, const bf16* gamma, const bf16* dy, const bf16* dresidual,
                                         bf16* dh, bf16* dgamma, bf16* dbeta) {
  layer_norm_backward(rows, d, h, mean, rstd, gamma, dy, dh, dgamma, dbeta);
  for (std::int64_t i = 0; i < rows * d; ++i)
    dh[i] = bf16(static_cast<float>(dh[i]) + static_cast<float>(dresidual[i]));
}

inline void softmax_rows(std::int64_t rows, std::int64_t cols, const bf16* x, bf16* y) {
  detail::via_float(rows * cols, x, y, [=](const float* a, float* b) { softmax_rows<float>(rows, cols, a, b); });
}

inline void softmax_rows_backward(std::int64_t rows, std::int64_t cols, const bf16* y, const bf16* dy, bf16* dx) {
  detail::via_float(rows * cols, y, dy, dx, [=](const float* a, const float* d, float* b) {
    softmax_rows_backward<float>(rows, cols, a, d, b);
  });
}

inline double cross_entropy_forward(std::int64_t rows, std::int64_t cols, const bf16* logits,
                                    const std::int32_t* targets, float* lse, std::int64_t& valid,
                                    std::int32_t ignore_index = -100, float smoothing = 0.0f) {
  auto lf = detail::widen(logits, rows * cols);
  return cross_entropy_forward<float>(rows, cols, lf.data(), targets, lse, valid, ignore_index, smoothing);
}

inline void cross_entropy_backward(std::int64_t rows, std::int64_t cols, const bf16* logits, const float* lse,
                                   const std::int32_t* targets, std::int64_t valid, float dloss, bf16* dlogits,
                                   std::int32_t ignore_index = -100, float smoothing = 0.0f) {
  detail::via_float(rows * cols, logits, dlogits, [&](const float* a, float* b) {
    cross_entropy_backward<float>(rows, cols, a, lse, targets, valid, dloss, b, ignore_index, smoothing);
  });
}

inline void embedding_forward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const bf16* table,
                              const bf16* pos, std::int64_t seq, bf16* out) {
  std::int64_t vocab = 0, positions = pos ? (rows < seq ? rows : seq) : 0;
  for (std::int64_t r = 0; r < rows; ++r) vocab = ids[r] + 1 > vocab ? ids[r] + 1 : vocab;
  auto tf = detail::widen(table, vocab * dim), pf = detail::widen(pos, positions * dim);
  Scratch<float> of(static_cast<std::size_t>(rows * dim));
  embedding_forward<float>(rows, dim, ids, detail::data_or_null(tf), detail::data_or_null(pf), seq, of.data());
  detail::narrow(of, out);
}

inline void embedding_backward(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, const bf16* dout,
                               bf16* dtable, bf16* dpos, std::int64_t seq) {
  std::int64_t vocab = 0, positions = dpos ? (rows < seq ? rows : seq) : 0;
  for (std::int64_t r = 0; r < rows; ++r) vocab = ids[r] + 1 > vocab ? ids[r] + 1 : vocab;
  auto df = detail::widen(dout, rows * dim), tf = detail::widen(dtable, vocab * dim);
  auto pf = detail::widen(dpos, positions * dim);
  embedding_backward<float>(rows, dim, ids, df.data(), detail::data_or_null(tf), detail::data_or_null(pf), seq);
  detail::narrow(tf, dtable);
  detail::narrow(pf, dpos);
}

inline void causal_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D,
                                     const bf16* qkv, float scale, bf16* probs, bf16* probs_drop, double p,
                                     std::uint64_t seed, std::uint64_t offset, bf16* y) {
  const std::int64_t C = H * D, PP = B * H * S * S;
  auto qf = detail::widen(qkv, B * S * 3 * C);
  Scratch<float> pf(static_cast<std::size_t>(PP)), pdf(probs_drop ? pf.size() : 0),
      yf(static_cast<std::size_t>(B * S * C));
  causal_attention_forward<float>(B, S, H, D, qf.data(), scale, pf.data(), detail::data_or_null(pdf), p, seed, offset,
                                  yf.data());
  detail::narrow(pf, probs);
  detail::narrow(pdf, probs_drop);
  detail::narrow(yf, y);
}

inline void causal_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D,
                                      const bf16* qkv, const bf16* probs, const bf16* probs_drop, double p,
                                      std::uint64_t seed, std::uint64_t offset, const bf16* dy, float scale,
                                      bf16* dqkv) {
  const std::int64_t C = H * D, PP = B * H * S * S;
  auto qf = detail::widen(qkv, B * S * 3 * C), pf = detail::widen(probs, PP), dyf = detail::widen(dy, B * S * C);
  auto pdf = detail::widen(probs_drop, PP);
  Scratch<float> df(qf.size());
  causal_attention_backward<float>(B, S, H, D, qf.data(), pf.data(), detail::data_or_null(pdf), p, seed, offset,
                                   dyf.data(), scale, df.data());
  detail::narrow(df, dqkv);
}

inline void gqa_attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                                  const bf16* q, const bf16* k, const bf16* v, float scale, bf16* probs, bf16* y,
                                  const std::int32_t* starts = nullptr, std::int64_t window = 0) {
  auto qf = detail::widen(q, B * S * H * D), kf = detail::widen(k, B * S * Hkv * D), vf = detail::widen(v, B * S * Hkv * D);
  Scratch<float> pf(static_cast<std::size_t>(B * H * S * S)), yf(qf.size());
  gqa_attention_forward<float>(B, S, H, Hkv, D, qf.data(), kf.data(), vf.data(), scale, pf.data(), yf.data(), starts,
                               window);
  detail::narrow(pf, probs);
  detail::narrow(yf, y);
}

inline void gqa_attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                                   const bf16* q, const bf16* k, const bf16* v, const bf16* probs, const bf16* dy,
                                   float scale, bf16* dq, bf16* dk, bf16* dv) {
  auto qf = detail::widen(q, B * S * H * D), kf = detail::widen(k, B * S * Hkv * D), vf = detail::widen(v, B * S * Hkv * D);
  auto pf = detail::widen(probs, B * H * S * S), dyf = detail::widen(dy, B * S * H * D);
  Scratch<float> dqf(qf.size()), dkf(kf.size()), dvf(vf.size());
  gqa_attention_backward<float>(B, S, H, Hkv, D, qf.data(), kf.data(), vf.data(), pf.data(), dyf.data(), scale,
                                dqf.data(), dkf.data(), dvf.data());
  detail::narrow(dqf, dq);
  detail::narrow(dkf, dk);
  detail::narrow(dvf, dv);
}

}  // namespace ptrain::kernels::cpu
