#pragma once
// Rotary position embedding (RoPE), in place on q or k laid out [B, S, H, D]: the
// layout of a projection's output [B, S, H*D] seen per head. Hugging Face's
// rotate-half convention (LlamaRotaryEmbedding, apply_rotary_pos_emb): dimension i
// is paired with i + D/2, not with its neighbour as in the original paper.
//
//   ops::RotaryConfig rope{.theta = 500000.0, .llama3_scaling = ops::Llama3RopeScaling{}};
//   ops::rotary_(q, rope);                  // positions 0..S-1
//   ops::rotary_(k, rope, position_ids);    // int32 [S] or [B, S]
//   ...
//   ops::rotary_backward_(dq, rope);        // the same positions: the inverse rotation
//
// Note [Llama 3 rotary scaling]
// inv_freq[i] = theta^(-2i/D) for i < D/2. Llama 3 (rope_type "llama3" in a Hugging
// Face config.json) rescales these by wavelength w = 2 pi / inv_freq against the
// original context L = original_max_position_embeddings: w > L / low_freq_factor
// (low frequencies) divides by factor; w < L / high_freq_factor (high frequencies)
// keeps inv_freq; in between, with s = (L / w - low_freq_factor) /
// (high_freq_factor - low_freq_factor), inv_freq becomes (1 - s) inv_freq / factor +
// s inv_freq. This is transformers' _compute_llama3_parameters, whose attention
// scaling is 1. It is computed here in double (transformers computes in float32).
//
// CPU and CUDA. The frequencies are computed on the host (ops::rotary_freqs, head
// widths up to 256) and reach the kernel by value; position ids are on x's device.
// Negative ids are refused by the CPU kernel ([ptrain.rotary]); on a CUDA device the
// ids are not read on the host, so no call waits for the device, and a negative id
// rotates by a negative angle: a caller with ids on the device must pass ids >= 0.
// nn::document_positions (nn/batch_context.hpp) builds them on the host from the
// token ids, non-negative by construction.

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "ptrain/kernels/cpu/rotary.hpp"
#include "ptrain/kernels/rotary_freqs.hpp"
#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// Llama 3's frequency scaling (Hugging Face's rope_scaling with rope_type "llama3").
struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 8192;
};

struct RotaryConfig {
  double theta = 10000.0;                                          ///< rope_theta, the base of the frequencies
  std::optional<Llama3RopeScaling> llama3_scaling = std::nullopt;  ///< none: plain RoPE
};

/// The D/2 angular frequencies of head width D under config (Note [Llama 3 rotary scaling]).
inline std::vector<double> rotary_inv_freq(std::int64_t head_dim, const RotaryConfig& config) {
  PTRAIN_CHECK(head_dim > 0 && head_dim % 2 == 0, ShapeError, "[ptrain.rotary] head width ", head_dim,
               " must be positive and even (dimension i pairs with i + D/2)");
  PTRAIN_CHECK(config.theta > 0, Error, "[ptrain.rotary] theta ", config.theta, " must be positive");
  std::vector<double> inv(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < inv.size(); ++i)
    inv[i] = 1.0 / std::pow(config.theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
  if (!config.llama3_scaling) return inv;
  const Llama3RopeScaling& sc = *config.llama3_scaling;
  PTRAIN_CHECK(sc.factor >= 1 && sc.low_freq_factor > 0 && sc.high_freq_factor > sc.low_freq_factor &&
                   sc.original_max_position_embeddings > 0,
               Error,
               "[ptrain.rotary.llama3] scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
               "original_max_position_embeddings > 0; got factor ",
               sc.factor, ", low_freq_factor ", sc.low_freq_factor, ", high_freq_factor ", sc.high_freq_factor,
               ", original_max_position_embeddings ", sc.original_max_position_embeddings);
  const double pi = std::acos(-1.0), L = static_cast<double>(sc.original_max_position_embeddings);
  const double low_wavelen = L / sc.low_freq_factor, high_wavelen = L / sc.high_freq_factor;
  for (double& f : inv) {
    const double wavelen = 2 * pi / f;
    if (wavelen > low_wavelen) {
      f /= sc.factor;
    } else if (!(wavelen < high_wavelen)) {
      const double s = (L / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor);
      f = (1 - s) * f / sc.factor + s * f;
    }
  }
  return inv;
}

/// rotary_inv_freq(head_dim, config) as the kernels take it; head_dim <= 256.
inline kernels::RotaryFreqs rotary_freqs(std::int64_t head_dim, const RotaryConfig& config) {
  const std::vector<double> inv = rotary_inv_freq(head_dim, config);
  kernels::RotaryFreqs f;
  PTRAIN_CHECK(static_cast<std::int64_t>(inv.size()) <= kernels::RotaryFreqs::kMaxHalf, ShapeError,
               "[ptrain.rotary] head width ", head_dim, " exceeds ", 2 * kernels::RotaryFreqs::kMaxHalf,
               ", the widest the rotary kernels take");
  f.half = static_cast<std::int64_t>(inv.size());
  for (std::size_t i = 0; i < inv.size(); ++i) f.inv_freq[i] = inv[i];
  return f;
}

namespace detail {
template <class T>
void rotary_apply(Tensor<T>& x, const RotaryConfig& config, const Tensor<std::int32_t>& positions, bool inverse,
                  const char* op) {
  PTRAIN_CHECK(x.dim() == 4, ShapeError, "[ptrain.rotary] ", op, " needs x as [B, S, H, D], got ", x.shape(),
               "; reshape a [B, S, H*D] projection to [B, S, H, D]");
  const std::int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  const kernels::RotaryFreqs freqs = rotary_freqs(D, config);
  std::int64_t batch_stride = 0;
  if (positions.defined()) {
    PTRAIN_CHECK((positions.dim() == 1 && positions.size(0) == S) ||
                     (positions.dim() == 2 && positions.size(0) == B && positions.size(1) == S),
                 ShapeError, "[ptrain.rotary] position ids must be [S] = [", S, "] or [B, S] = [", B, ", ", S,
                 "], got ", positions.shape());
    check_devices(op, x.device(), positions);
    batch_stride = positions.dim() == 2 ? S : 0;
  }
  PTRAIN_DISPATCH(x.device(), T, rotary_apply, B, S, H, D, positions.data(), batch_stride, freqs, inverse, x.data());
}
}  // namespace detail

/// Rotates x [B, S, H, D] in place by its tokens' positions: position_ids int32 [S]
/// (shared by the batch) or [B, S], 0..S-1 when undefined.
template <class T>
void rotary_(Tensor<T>& x, const RotaryConfig& config, const Tensor<std::int32_t>& position_ids = {}) {
  detail::rotary_apply(x, config, position_ids, false, "rotary_");
}

/// Backward of rotary_, in place on the gradient dx [B, S, H, D]: the inverse
/// rotation, with the forward's config and position ids.
template <class T>
void rotary_backward_(Tensor<T>& dx, const RotaryConfig& config, const Tensor<std::int32_t>& position_ids = {}) {
  detail::rotary_apply(dx, config, position_ids, true, "rotary_backward_");
}

}  // namespace ptrain::ops
