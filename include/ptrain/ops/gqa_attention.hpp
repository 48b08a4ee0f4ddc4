#pragma once
// Causal grouped-query attention on separate q [B, S, H, D] and k, v [B, S, Hkv, D]
// (Llama, Mistral, Qwen2): Hkv divides H and query head h reads key/value head
// h / (H / Hkv); Hkv == 1 is multi-query attention, Hkv == H multi-head.
//
//   Tensor<float> probs;
//   auto y = ops::gqa_attention(q, k, v, probs);                 // [B, S, H, D]
//   Tensor<float> dq, dk, dv;
//   ops::gqa_attention_backward(q, k, v, probs, dy, dq, dk, dv);
//
// The materialised path (kernels/cpu/gqa_attention.hpp): probs [B, H, S, S] is kept
// for backward, zero above the diagonal. Rotary positions are applied to q and k
// before (ops/rotary.hpp). No dropout on the probabilities (Llama trains without).
// CPU only, float or double: a tensor on a CUDA device throws [ptrain.cuda.unsupported].

#include <cmath>
#include <type_traits>

#include "ptrain/kernels/cpu/gqa_attention.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

namespace detail {
template <class T>
void check_gqa_inputs(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const char* op) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "grouped-query attention has float and double CPU kernels only");
  PTRAIN_CHECK(q.dim() == 4, ShapeError, "[ptrain.gqa_attention] q must be [B, S, H, D], got ", q.shape());
  PTRAIN_CHECK(k.dim() == 4 && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), ShapeError,
               "[ptrain.gqa_attention] k must be [B, S, Hkv, D] = [", q.size(0), ", ", q.size(1), ", Hkv, ", q.size(3),
               "] for q ", q.shape(), ", got ", k.shape());
  check_shape(v, k.shape(), "gqa_attention v (the shape of k)");
  PTRAIN_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, ShapeError, "[ptrain.gqa_attention] ", k.size(2),
               " key/value heads do not divide ", q.size(2), " query heads");
  check_devices(op, q.device(), k, v);
  require_cpu(op, q.device());
}
}  // namespace detail

/// y [B, S, H, D] = softmax(q k^T / sqrt(D) + causal mask) v per query head, each
/// reading its group's key/value head; probs [B, H, S, S] is filled for backward.
/// document_starts, int32 [B, S] (nn::document_starts), also masks keys of earlier
/// documents: query i sees keys starts[b, i] .. i.
template <class T>
Tensor<T> gqa_attention(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, Tensor<T>& probs,
                        const Tensor<std::int32_t>& document_starts = {}) {
  detail::check_gqa_inputs(q, k, v, "gqa_attention");
  const std::int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  if (document_starts.defined()) {
    check_shape(document_starts, {B, S}, "gqa_attention document starts");
    detail::require_cpu("gqa_attention", document_starts.device());
    for (std::int64_t i = 0; i < B * S; ++i) {
      const std::int32_t st = document_starts.data()[i];
      PTRAIN_CHECK(st >= 0 && st <= i % S, ShapeError, "[ptrain.gqa_attention] document start ", st, " of token ",
                   i % S, " in row ", i / S, " is not in 0..", i % S, "; build the starts with nn::document_starts");
    }
  }
  probs = Tensor<T>::empty({B, H, S, S});
  auto y = Tensor<T>::empty(q.shape());
  kernels::cpu::gqa_attention_forward(B, S, H, Hkv, D, q.data(), k.data(), v.data(), T(1.0 / std::sqrt(double(D))),
                                      probs.data(), y.data(), document_starts.defined() ? document_starts.data() : nullptr);
  return y;
}

/// dq (shape of q), dk and dv (shape of k) for the output gradient dy [B, S, H, D].
template <class T>
void gqa_attention_backward(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const Tensor<T>& probs,
                            const Tensor<T>& dy, Tensor<T>& dq, Tensor<T>& dk, Tensor<T>& dv) {
  detail::check_gqa_inputs(q, k, v, "gqa_attention_backward");
  const std::int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  check_shape(probs, {B, H, S, S}, "saved gqa_attention probabilities");
  check_shape(dy, q.shape(), "gqa_attention output gradient");
  detail::check_devices("gqa_attention_backward", q.device(), probs, dy);
  dq = Tensor<T>::empty(q.shape());
  dk = Tensor<T>::empty(k.shape());
  dv = Tensor<T>::empty(k.shape());
  kernels::cpu::gqa_attention_backward(B, S, H, Hkv, D, q.data(), k.data(), v.data(), probs.data(), dy.data(),
                                       T(1.0 / std::sqrt(double(D))), dq.data(), dk.data(), dv.data());
}

}  // namespace ptrain::ops
