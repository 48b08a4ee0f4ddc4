#pragma once
// Causal grouped-query attention on separate q [B, S, H, D] and k, v [B, S, Hkv, D]
// (Llama, Mistral, Qwen2): Hkv divides H and query head h reads key/value head
// h / (H / Hkv); Hkv == 1 is multi-query attention, Hkv == H multi-head.
//
//   ops::GqaSaved<float> saved;
//   auto y = ops::gqa_attention(q, k, v, saved);                 // [B, S, H, D]
//   Tensor<float> dq, dk, dv;
//   ops::gqa_attention_backward(q, k, v, saved, dy, dq, dk, dv);
//
// Optional document starts (int32 [B, S], nn::document_starts: query i sees keys
// starts[b, i] .. i) and a sliding window (query i sees its last `window` keys,
// itself included, as Hugging Face's Mistral; Note [Sliding window] in
// kernels/cpu/gqa_attention.hpp). Runs on q's device:
//   CPU   the materialised path (kernels/cpu/gqa_attention.hpp; bf16 computes in
//         float, kernels/cpu/bf16.hpp): saved.probs [B, H, S, S] is kept for
//         backward, zero outside each row's keys.
//   CUDA  flash attention (kernels/cuda/gqa_attention.cuh; float and bf16): saved
//         keeps the output and each row's log-sum-exp [B, H, S], and the backward
//         recomputes the probabilities (Note [GQA flash attention]). The starts
//         must be on the device too. bf16 at head widths 64 and 128 without
//         document starts or window takes kernels/cuda/flash_tc_attention.cuh's
//         tensor-core kernels instead once their gate lets them (same out and lse).
// Rotary positions are applied to q and k before (ops/rotary.hpp). No dropout on
// the probabilities (Llama trains without).

#include <cmath>
#include <type_traits>

#include "ptrain/kernels/cpu/gqa_attention.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// What gqa_attention_backward needs besides q, k and v.
template <class T>
struct GqaSaved {
  Tensor<T> probs;              ///< [B, H, S, S] (CPU)
  Tensor<T> out;                ///< [B, S, H, D]: the forward's output (CUDA)
  Tensor<acc_t<T>> lse;         ///< [B, H, S]: each row's log-sum-exp of the scaled scores (CUDA)
  Tensor<std::int32_t> starts;  ///< the forward's document starts, or undefined (CUDA)
  std::int64_t window = 0;      ///< the forward's sliding window (CUDA)
};

namespace detail {
template <class T>
void check_gqa_inputs(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const char* op) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, bf16>,
                "grouped-query attention takes float, double (CPU) or bf16 tensors");
  PTRAIN_CHECK(q.dim() == 4, ShapeError, "[ptrain.gqa_attention] q must be [B, S, H, D], got ", q.shape());
  PTRAIN_CHECK(k.dim() == 4 && k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == q.size(3), ShapeError,
               "[ptrain.gqa_attention] k must be [B, S, Hkv, D] = [", q.size(0), ", ", q.size(1), ", Hkv, ", q.size(3),
               "] for q ", q.shape(), ", got ", k.shape());
  check_shape(v, k.shape(), "gqa_attention v (the shape of k)");
  PTRAIN_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, ShapeError, "[ptrain.gqa_attention] ", k.size(2),
               " key/value heads do not divide ", q.size(2), " query heads");
  check_devices(op, q.device(), k, v);
}

inline void check_gqa_window(std::int64_t window) {
  PTRAIN_CHECK(window >= 0, Error, "[ptrain.gqa_attention.window] sliding window ", window,
               " must be >= 0 (0: none)");
}
}  // namespace detail

/// y [B, S, H, D] = softmax(q k^T / sqrt(D) + mask) v per query head, each reading its
/// group's key/value head; `saved` is filled for backward. The mask is causal;
/// document_starts, int32 [B, S] (nn::document_starts), also masks keys of earlier
/// documents (query i sees keys starts[b, i] .. i); window > 0 keeps each query's last
/// `window` keys, itself included (0: no window).
template <class T>
Tensor<T> gqa_attention(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, GqaSaved<T>& saved,
                        const Tensor<std::int32_t>& document_starts = {}, std::int64_t window = 0) {
  detail::check_gqa_inputs(q, k, v, "gqa_attention");
  detail::check_gqa_window(window);
  const std::int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  const Device dev = q.device();
  if (document_starts.defined()) {
    check_shape(document_starts, {B, S}, "gqa_attention document starts");
    detail::check_devices("gqa_attention (document starts)", dev, document_starts);
  }
  const std::int32_t* starts = document_starts.defined() ? document_starts.data() : nullptr;
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(double(D)));
  saved = GqaSaved<T>{};
  if (dev.is_cuda()) {
    saved.out = Tensor<T>::empty(q.shape(), dev);
    saved.lse = Tensor<acc_t<T>>::empty({B, H, S}, dev);
    saved.starts = document_starts;
    saved.window = window;
    if (!starts && window == 0 && detail::flash_tc_usable<T>() &&
        kernels::cuda_kernels<T>().flash_tc_forward(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D,
                                                    true, scale, saved.out.data(), saved.lse.data()))
      return saved.out;
    kernels::cuda_kernel<T>(&kernels::CudaKernels<T>::gqa_flash_forward, "gqa_flash_forward")(
        B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, starts, window, scale, saved.out.data(),
        saved.lse.data());
    return saved.out;
  }
  saved.probs = Tensor<T>::empty({B, H, S, S});
  auto y = Tensor<T>::empty(q.shape());
  kernels::cpu::gqa_attention_forward(B, S, H, Hkv, D, q.data(), k.data(), v.data(), scale, saved.probs.data(),
                                      y.data(), starts, window);
  return y;
}

/// dq (shape of q), dk and dv (shape of k) for the output gradient dy [B, S, H, D].
template <class T>
void gqa_attention_backward(const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v, const GqaSaved<T>& saved,
                            const Tensor<T>& dy, Tensor<T>& dq, Tensor<T>& dk, Tensor<T>& dv) {
  detail::check_gqa_inputs(q, k, v, "gqa_attention_backward");
  const std::int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  const Device dev = q.device();
  check_shape(dy, q.shape(), "gqa_attention output gradient");
  detail::check_devices("gqa_attention_backward", dev, dy);
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(double(D)));
  dq = Tensor<T>::empty(q.shape(), dev);
  dk = Tensor<T>::empty(k.shape(), dev);
  dv = Tensor<T>::empty(k.shape(), dev);
  if (dev.is_cuda()) {
    PTRAIN_CHECK(saved.lse.defined(), Error, "[ptrain.gqa_attention] the saved state has no log-sum-exp: pass the "
                 "GqaSaved that gqa_attention filled for these tensors");
    check_shape(saved.out, q.shape(), "saved gqa_attention output");
    check_shape(saved.lse, {B, H, S}, "saved gqa_attention log-sum-exp");
    detail::check_devices("gqa_attention_backward", dev, saved.out, saved.lse);
    if (saved.starts.defined()) check_shape(saved.starts, {B, S}, "saved gqa_attention document starts");
    if (!saved.starts.defined() && saved.window == 0 && detail::flash_tc_usable<T>() &&
        kernels::cuda_kernels<T>().flash_tc_backward(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D,
                                                     true, saved.out.data(), saved.lse.data(), dy.data(), scale,
                                                     dq.data(), dk.data(), dv.data()))
      return;
    kernels::cuda_kernel<T>(&kernels::CudaKernels<T>::gqa_flash_backward, "gqa_flash_backward")(
        B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D,
        saved.starts.defined() ? saved.starts.data() : nullptr, saved.window, saved.out.data(), saved.lse.data(),
        dy.data(), scale, dq.data(), dk.data(), dv.data());
    return;
  }
  check_shape(saved.probs, {B, H, S, S}, "saved gqa_attention probabilities");
  detail::check_devices("gqa_attention_backward", dev, saved.probs);
  kernels::cpu::gqa_attention_backward(B, S, H, Hkv, D, q.data(), k.data(), v.data(), saved.probs.data(), dy.data(),
                                       scale, dq.data(), dk.data(), dv.data());
}

/// KV-cache decode: y [1, s, H, D] for the queries q [1, s, H, D] at positions n - s ..
/// n - 1 against the first n positions of k_cache and v_cache [1, capacity, Hkv, D]
/// (which hold the queries' own keys and values): row i of y equals row n - s + i of
/// gqa_attention over those n positions. window as gqa_attention's. Arithmetic in
/// double on the CPU, in float on CUDA.
template <class T>
Tensor<T> gqa_attention_decode(const Tensor<T>& q, const Tensor<T>& k_cache, const Tensor<T>& v_cache, std::int64_t n,
                               std::int64_t window = 0) {
  PTRAIN_CHECK(q.dim() == 4 && q.size(0) == 1, ShapeError, "[ptrain.gqa_attention.decode] q must be [1, s, H, D], got ",
               q.shape());
  PTRAIN_CHECK(k_cache.dim() == 4 && k_cache.size(0) == 1 && k_cache.size(3) == q.size(3), ShapeError,
               "[ptrain.gqa_attention.decode] the key cache must be [1, capacity, Hkv, ", q.size(3), "], got ",
               k_cache.shape());
  check_shape(v_cache, k_cache.shape(), "gqa_attention_decode value cache (the shape of the key cache)");
  const std::int64_t s = q.size(1), H = q.size(2), Hkv = k_cache.size(2), D = q.size(3);
  PTRAIN_CHECK(Hkv > 0 && H % Hkv == 0, ShapeError, "[ptrain.gqa_attention.decode] ", Hkv,
               " key/value heads do not divide ", H, " query heads");
  PTRAIN_CHECK(s <= n && n <= k_cache.size(1), ShapeError, "[ptrain.gqa_attention.decode] ", n,
               " cached positions for ", s, " queries and a cache of ", k_cache.size(1),
               "; n must be in s .. capacity");
  detail::check_gqa_window(window);
  const Device dev = q.device();
  detail::check_devices("gqa_attention_decode", dev, k_cache, v_cache);
  auto y = Tensor<T>::empty(q.shape(), dev);
  PTRAIN_DISPATCH(dev, T, gqa_attention_decode, s, n, H, Hkv, D, q.data(), k_cache.data(), v_cache.data(), window,
                  1.0 / std::sqrt(static_cast<double>(D)), y.data());
  return y;
}

}  // namespace ptrain::ops
