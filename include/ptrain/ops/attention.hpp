#pragma once
// Causal multi-head self-attention on a packed qkv tensor (GPT-2 layout).
//
//   auto qkv = ops::linear(x, w_attn, b_attn);            // [B, S, 3C]
//   AttentionSaved<float> saved;
//   auto y = ops::causal_attention(qkv, n_head, 0.0, 0, 0, saved);   // [B, S, C]
//   auto dqkv = ops::causal_attention_backward(qkv, saved, n_head, dy);
//
// Runs on qkv's device: kernels/cpu/attention.hpp (causal row tiles),
// kernels/cuda/flash_attention.cuh (fused, for bf16 on GPUs where it applies:
// saved keeps the output and the rows' log-sum-exp, no [S, S] tensor; without
// dropout at head widths 64 and 128 kernels/cuda/flash_tc_attention.cuh's
// tensor-core kernels run in its place once their gate lets them),
// kernels/cuda/gqa_attention.cuh (the grouped-query family's flash kernel on the
// packed qkv: float, and bf16 at head widths flash_attention.cuh has no kernel for,
// without dropout, once its gate lets it run: Note [The verification gate]), or
// kernels/cuda/attention.cuh (batched cuBLAS products and a masked softmax).
// Otherwise saved.probs is [B, H, S, S] on that device, like PyTorch's eager attention.

#include <cmath>
#include <type_traits>

#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// What the backward pass needs besides qkv: the probabilities and, with dropout, the dropped ones.
template <class T>
struct AttentionSaved {
  Tensor<T> probs;       ///< [B, H, S, S], zero above the diagonal (materialised path)
  Tensor<T> probs_drop;  ///< same shape, only when p > 0 (materialised path)
  double p = 0;
  std::uint64_t seed = 0, offset = 0;
  Tensor<T> out;         ///< [B, S, C]: the forward's output (fused path)
  Tensor<acc_t<T>> lse;  ///< [B, H, S]: each row's log-sum-exp (fused path; defined only there)
};

namespace detail {
template <class T>
void check_attention_input(const Tensor<T>& qkv, std::int64_t n_head) {
  PTRAIN_CHECK(qkv.dim() == 3 && qkv.size(2) % 3 == 0, ShapeError, "[ptrain.attention] qkv must be [B, S, 3C], got ",
               qkv.shape());
  PTRAIN_CHECK(n_head > 0 && (qkv.size(2) / 3) % n_head == 0, ShapeError, "[ptrain.attention] width ",
               qkv.size(2) / 3, " is not divisible by ", n_head, " heads");
}
/// Whether the grouped-query flash kernels take this CUDA case (packed qkv, H = Hkv):
/// no dropout, an even head width up to 128, float, or bf16 at a width the verified
/// flash_attention.cuh has no kernel for (32, 64 and 128 stay its own, and
/// set_flash_attention(false) sends them to the materialised path as before), both
/// kernels in the table and let through by the gate (kernels::cuda_kernel_usable).
template <class T>
bool gqa_packed_usable(std::int64_t D, double p) {
  const bool type_ok = std::is_same_v<T, float> || (std::is_same_v<T, bf16> && D != 32 && D != 64 && D != 128);
  return type_ok && p == 0 && D % 2 == 0 && D <= 128 &&
         kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::gqa_flash_forward, "gqa_flash_forward") &&
         kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::gqa_flash_backward, "gqa_flash_backward");
}
/// Whether the tensor-core flash kernels (kernels/cuda/flash_tc_attention.cuh, bf16)
/// are in the table and both let through by the gate (Note [The verification gate]);
/// they still decline, returning false, the cases they do not take (head width not 64
/// or 128, alignment, the GPU), and the caller then runs the kernel it ran before.
template <class T>
bool flash_tc_usable() {
  return kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::flash_tc_forward, "flash_tc_forward") &&
         kernels::cuda_kernel_usable(&kernels::CudaKernels<T>::flash_tc_backward, "flash_tc_backward");
}
}  // namespace detail

/// y [B, S, C] = softmax(q k^T / sqrt(D) + causal mask) v per head, with dropout p on the
/// probabilities drawn from stream positions [offset, offset + B*H*S*S) of seed.
template <class T>
Tensor<T> causal_attention(const Tensor<T>& qkv, std::int64_t n_head, double p, std::uint64_t seed,
                           std::uint64_t offset, AttentionSaved<T>& saved) {
  detail::check_attention_input(qkv, n_head);
  PTRAIN_CHECK(p >= 0.0 && p < 1.0, Error, "[ptrain.dropout] probability ", p, " must be in [0, 1)");
  const std::int64_t B = qkv.size(0), S = qkv.size(1), C = qkv.size(2) / 3, D = C / n_head;
  const Device dev = qkv.device();
  saved.p = p;
  saved.seed = seed;
  saved.offset = offset;
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(double(D)));
  if (PTRAIN_DISPATCH(dev, T, flash_attention_supported, D, qkv.data())) {
    saved.out = Tensor<T>::empty({B, S, C}, dev);
    saved.lse = Tensor<acc_t<T>>::empty({B, n_head, S}, dev);
    // Without dropout the tensor-core kernels first, on the packed strides (q = qkv,
    // k = qkv + C, v = qkv + 2C, row stride 3C); they keep the same out and lse.
    const T* q = qkv.data();
    if (p == 0 && detail::flash_tc_usable<T>() &&
        kernels::cuda_kernels<T>().flash_tc_forward(B, S, n_head, n_head, D, q, 3 * C, q + C, q + 2 * C, 3 * C, true,
                                                    scale, saved.out.data(), saved.lse.data()))
      return saved.out;
    PTRAIN_DISPATCH(dev, T, flash_attention_forward, B, S, n_head, D, qkv.data(), scale, p, seed, offset,
                    saved.out.data(), saved.lse.data());
    return saved.out;
  }
  if (dev.is_cuda() && detail::gqa_packed_usable<T>(D, p)) {
    // q = qkv, k = qkv + C, v = qkv + 2C, each with row stride 3C (Note [GQA flash attention]).
    saved.out = Tensor<T>::empty({B, S, C}, dev);
    saved.lse = Tensor<acc_t<T>>::empty({B, n_head, S}, dev);
    const T* q = qkv.data();
    kernels::cuda_kernel<T>(&kernels::CudaKernels<T>::gqa_flash_forward, "gqa_flash_forward")(
        B, S, n_head, n_head, D, q, 3 * C, q + C, q + 2 * C, 3 * C, nullptr, 0, scale, saved.out.data(),
        saved.lse.data());
    return saved.out;
  }
  saved.probs = Tensor<T>::empty({B, n_head, S, S}, dev);
  saved.probs_drop = p > 0 ? Tensor<T>::empty({B, n_head, S, S}, dev) : Tensor<T>();
  auto y = Tensor<T>::empty({B, S, C}, dev);
  PTRAIN_DISPATCH(dev, T, causal_attention_forward, B, S, n_head, D, qkv.data(), scale, saved.probs.data(),
                  saved.probs_drop.data(), p, seed, offset, y.data());
  return y;
}

/// dqkv [B, S, 3C] for the output gradient dy [B, S, C].
template <class T>
Tensor<T> causal_attention_backward(const Tensor<T>& qkv, const AttentionSaved<T>& saved, std::int64_t n_head,
                                    const Tensor<T>& dy) {
  detail::check_attention_input(qkv, n_head);
  const std::int64_t B = qkv.size(0), S = qkv.size(1), C = qkv.size(2) / 3, D = C / n_head;
  check_shape(dy, {B, S, C}, "attention output gradient");
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(double(D)));
  if (saved.lse.defined()) {
    check_shape(saved.out, {B, S, C}, "saved attention output");
    check_shape(saved.lse, {B, n_head, S}, "saved attention log-sum-exp");
    detail::check_devices("causal_attention_backward", qkv.device(), dy, saved.out, saved.lse);
    auto dqkv = Tensor<T>::empty(qkv.shape(), qkv.device());
    const T* q = qkv.data();
    T* dq = dqkv.data();
    if (saved.p == 0 && qkv.device().is_cuda() && detail::flash_tc_usable<T>() &&
        kernels::cuda_kernels<T>().flash_tc_backward(B, S, n_head, n_head, D, q, 3 * C, q + C, q + 2 * C, 3 * C, true,
                                                     saved.out.data(), saved.lse.data(), dy.data(), scale, dq, dq + C,
                                                     dq + 2 * C))
      return dqkv;
    // The fused kernels keep the same out and lse (the natural log-sum-exp of the scaled
    // scores), so either backward serves either forward without dropout: the verified
    // kernel where it applies, else the grouped-query one.
    if (!PTRAIN_DISPATCH(qkv.device(), T, flash_attention_supported, D, qkv.data()) &&
        detail::gqa_packed_usable<T>(D, saved.p)) {
      kernels::cuda_kernel<T>(&kernels::CudaKernels<T>::gqa_flash_backward, "gqa_flash_backward")(
          B, S, n_head, n_head, D, q, 3 * C, q + C, q + 2 * C, 3 * C, nullptr, 0, saved.out.data(), saved.lse.data(),
          dy.data(), scale, dq, dq + C, dq + 2 * C);
      return dqkv;
    }
    PTRAIN_DISPATCH(qkv.device(), T, flash_attention_backward, B, S, n_head, D, qkv.data(), saved.out.data(),
                    saved.lse.data(), saved.p, saved.seed, saved.offset, dy.data(), scale, dqkv.data());
    return dqkv;
  }
  check_shape(saved.probs, {B, n_head, S, S}, "saved attention probabilities");
  if (saved.p > 0) check_shape(saved.probs_drop, {B, n_head, S, S}, "saved dropped attention probabilities");
  detail::check_devices("causal_attention_backward", qkv.device(), dy, saved.probs);
  auto dqkv = Tensor<T>::empty(qkv.shape(), qkv.device());
  PTRAIN_DISPATCH(qkv.device(), T, causal_attention_backward, B, S, n_head, D, qkv.data(), saved.probs.data(),
                  saved.probs_drop.data(), saved.p, saved.seed, saved.offset, dy.data(), scale, dqkv.data());
  return dqkv;
}

}  // namespace ptrain::ops
