// Grouped-query flash attention on CUDA (kernels/cuda/gqa_attention.cuh) through
// ops::, against the CPU op computed in double from the same inputs: the forward,
// its log-sum-exp (against the CPU flash-contract kernel), dq, dk and dv, for
// Hkv = H, H/2 and 1, with and without document starts, with and without a
// sliding window shorter than S, head widths 32, 64 and 128; and the KV-cache
// decode against the full forward's last rows; GPT's packed qkv through
// ops::causal_attention (float, no dropout). Compiled by g++ like a user's
// .cpp. Bounds (gpu_util.hpp rel_err, norm-wise relative): float 1e-5 (float
// arithmetic; sums over at most S * H / Hkv terms); bf16 1e-2 (inputs are bf16
// values, so the reference sees what the kernel reads; the kernel computes in
// float and rounds each output once, 2^-9 relative). The backward must give the
// same bits on a second run (no atomics).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/nn/batch_context.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/ops/gqa_attention.hpp"
#include "gpu/gpu_util.hpp"

namespace test_gqa_attention {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

template <class T>
double bound() {
  return std::is_same_v<T, bf16> ? 1e-2 : 1e-5;
}

template <class T>
Tensor<T> gpu_tensor(const std::vector<T>& v, const Shape& s) {
  return Tensor<T>::from(v, s).to(kGpu);
}

Tensor<double> cpu_double(const std::vector<double>& v, const Shape& s) { return Tensor<double>::from(v, s); }

// Documents start at tokens 0, S/3 and S/2 + 1 of row 0 and 0 and S/4 of row 1.
Tensor<std::int32_t> starts_for(std::int64_t B, std::int64_t S) {
  auto ids = Tensor<std::int32_t>::full({B, S}, 1);
  for (std::int64_t b = 0; b < B; ++b) {
    ids.data()[b * S] = 0;
    if (b % 2 == 0) ids.data()[b * S + S / 3] = ids.data()[b * S + S / 2 + 1] = 0;
    else ids.data()[b * S + S / 4] = 0;
  }
  return nn::document_starts(ids, 0);
}

template <class T>
void check_case(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, bool documents,
                std::int64_t window) {
  CAPTURE(dtype_name(dtype_of<T>()), B, S, H, Hkv, D, documents, window, test_seed());
  const Shape qs{B, S, H, D}, ks{B, S, Hkv, D};
  const auto qv = uniform<T>(qs.numel(), -1.5, 1.5), kv = uniform<T>(ks.numel(), -1.5, 1.5),
             vv = uniform<T>(ks.numel(), -1, 1), dyv = uniform<T>(qs.numel(), -1, 1);
  const auto starts = documents ? starts_for(B, S) : Tensor<std::int32_t>();

  // The reference: the CPU op in double on the same values, and the CPU flash-contract lse.
  const auto q = cpu_double(to_double(qv), qs), k = cpu_double(to_double(kv), ks), v = cpu_double(to_double(vv), ks),
             dy = cpu_double(to_double(dyv), qs);
  ops::GqaSaved<double> ref_saved;
  const auto y_ref = ops::gqa_attention(q, k, v, ref_saved, starts, window);
  Tensor<double> dq_ref, dk_ref, dv_ref;
  ops::gqa_attention_backward(q, k, v, ref_saved, dy, dq_ref, dk_ref, dv_ref);
  auto y2 = Tensor<double>::empty(qs), lse_ref = Tensor<double>::empty({B, H, S});
  kernels::cpu::gqa_flash_forward(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D,
                                  documents ? starts.data() : nullptr, window, 1.0 / std::sqrt(double(D)), y2.data(),
                                  lse_ref.data());

  const auto gq = gpu_tensor(qv, qs), gk = gpu_tensor(kv, ks), gv = gpu_tensor(vv, ks), gdy = gpu_tensor(dyv, qs);
  const auto gstarts = documents ? starts.to(kGpu) : Tensor<std::int32_t>();
  ops::GqaSaved<T> saved;
  const auto y = ops::gqa_attention(gq, gk, gv, saved, gstarts, window);
  REQUIRE(y.device() == kGpu);
  REQUIRE(saved.lse.defined());
  CHECK(rel_err(y.to_vector(), y_ref.to_vector()) < bound<T>());
  CHECK(rel_err(saved.lse.to_vector(), lse_ref.to_vector(), 1.0) < 1e-5);
  Tensor<T> dq, dk, dv;
  ops::gqa_attention_backward(gq, gk, gv, saved, gdy, dq, dk, dv);
  CHECK(rel_err(dq.to_vector(), dq_ref.to_vector()) < bound<T>());
  CHECK(rel_err(dk.to_vector(), dk_ref.to_vector()) < bound<T>());
  CHECK(rel_err(dv.to_vector(), dv_ref.to_vector()) < bound<T>());
  // Deterministic: a second backward gives the same bits.
  Tensor<T> dq2, dk2, dv2;
  ops::gqa_attention_backward(gq, gk, gv, saved, gdy, dq2, dk2, dv2);
  const auto a = dk.to_vector(), b = dk2.to_vector(), c = dq.to_vector(), d = dq2.to_vector();
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(c.data(), d.data(), c.size() * sizeof(T)) == 0);
}

template <class T>
void check_decode(std::int64_t H, std::int64_t Hkv, std::int64_t D, std::int64_t window) {
  const std::int64_t n = 41, cap = 64;
  CAPTURE(dtype_name(dtype_of<T>()), H, Hkv, D, window, test_seed());
  const Shape qs{1, n, H, D}, ks{1, n, Hkv, D};
  const auto qv = uniform<T>(qs.numel(), -1.5, 1.5), kv = uniform<T>(ks.numel(), -1.5, 1.5),
             vv = uniform<T>(ks.numel(), -1, 1);
  ops::GqaSaved<double> saved;
  const auto y_ref = ops::gqa_attention(cpu_double(to_double(qv), qs), cpu_double(to_double(kv), ks),
                                        cpu_double(to_double(vv), ks), saved, {}, window)
                         .to_vector();
  auto kc = Tensor<T>::zeros({1, cap, Hkv, D}, kGpu), vc = Tensor<T>::zeros({1, cap, Hkv, D}, kGpu);
  kc.view(0, ks).copy_(Tensor<T>::from(kv, ks));
  vc.view(0, ks).copy_(Tensor<T>::from(vv, ks));
  const auto q = gpu_tensor(qv, qs);
  for (std::int64_t s : {1, 4}) {
    CAPTURE(s);
    const auto y = ops::gqa_attention_decode(q.view((n - s) * H * D, {1, s, H, D}), kc, vc, n, window).to_vector();
    const std::vector<double> want(y_ref.end() - s * H * D, y_ref.end());
    CHECK(rel_err(y, want) < bound<T>());
  }
}

}  // namespace

TEST_CASE("gqa flash attention (float) matches the CPU in double: GQA, MQA, MHA, documents, sliding window",
          "[cuda:gqa_flash_forward][cuda:gqa_flash_backward][gqa_attention]") {
  for (std::int64_t D : {32, 64, 128})
    for (std::int64_t Hkv : {4, 2, 1})
      for (bool documents : {false, true})
        for (std::int64_t window : {0, 7}) check_case<float>(2, 45, 4, Hkv, D, documents, window);
  // Longer rows than a key tile many times over, a window of several tiles, odd shapes.
  check_case<float>(1, 300, 2, 1, 64, true, 100);
  check_case<float>(3, 19, 6, 3, 8, false, 0);
  check_case<float>(1, 1, 2, 2, 2, false, 1);
}

TEST_CASE("gqa flash attention (bf16) matches the CPU in double: GQA, MQA, MHA, documents, sliding window",
          "[cuda:gqa_flash_forward][cuda:gqa_flash_backward][gqa_attention][bf16]") {
  for (std::int64_t D : {32, 64, 128})
    for (std::int64_t Hkv : {4, 2, 1})
      for (bool documents : {false, true})
        for (std::int64_t window : {0, 7}) check_case<bf16>(2, 45, 4, Hkv, D, documents, window);
  check_case<bf16>(1, 300, 2, 1, 64, true, 100);
}

TEST_CASE("gqa flash attention refuses head widths it has no kernel for", "[cuda:gqa_flash_forward][gqa_attention]") {
  for (std::int64_t D : {3, 130}) {
    CAPTURE(D);
    const auto q = Tensor<float>::zeros({1, 4, 2, D}, kGpu);
    ops::GqaSaved<float> saved;
    CHECK_THROWS_WITH(ops::gqa_attention(q, q, q, saved),
                      Catch::Contains("[ptrain.cuda.gqa_attention] head width " + std::to_string(D)));
  }
}

TEST_CASE("gqa KV-cache decode on CUDA equals the full forward's last rows, window included",
          "[cuda:gqa_attention_decode][gqa_attention]") {
  for (std::int64_t D : {32, 64, 128})
    for (std::int64_t Hkv : {4, 2, 1})
      for (std::int64_t window : {0, 9}) {
        check_decode<float>(4, Hkv, D, window);
        check_decode<bf16>(4, Hkv, D, window);
      }
}

TEST_CASE("GPT's packed attention in float without dropout takes the grouped-query kernels",
          "[cuda:gqa_flash_forward][cuda:gqa_flash_backward][gqa_attention]") {
  const std::int64_t B = 2, S = 37, H = 2, D = 32, C = H * D;
  const auto qkv_v = uniform<float>(B * S * 3 * C, -1.5, 1.5), dy_v = uniform<float>(B * S * C, -1, 1);
  const auto qkv = cpu_double(to_double(qkv_v), {B, S, 3 * C}), dy = cpu_double(to_double(dy_v), {B, S, C});
  ops::AttentionSaved<double> ref_saved;
  const auto y_ref = ops::causal_attention(qkv, H, 0.0, 0, 0, ref_saved).to_vector();
  const auto dqkv_ref = ops::causal_attention_backward(qkv, ref_saved, H, dy).to_vector();
  const auto g_qkv = gpu_tensor(qkv_v, {B, S, 3 * C}), g_dy = gpu_tensor(dy_v, {B, S, C});
  ops::AttentionSaved<float> saved;
  const auto y = ops::causal_attention(g_qkv, H, 0.0, 0, 0, saved);
  CHECK(saved.lse.defined());  // the fused path, not the materialised one
  CHECK_FALSE(saved.probs.defined());
  CHECK(rel_err(y.to_vector(), y_ref) < 1e-5);
  CHECK(rel_err(ops::causal_attention_backward(g_qkv, saved, H, g_dy).to_vector(), dqkv_ref) < 1e-5);
}

}  // namespace test_gqa_attention
