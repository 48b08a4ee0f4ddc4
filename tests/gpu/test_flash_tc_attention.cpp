// The tensor-core flash attention (kernels/cuda/flash_tc_attention.cuh) through
// the kernel table, against attention computed in double by plain loops here
// (softmax(scale q k^T + mask) v and its gradients, one row at a time, no
// tiles), from the same bf16 values: y, lse, dq, dk, dv, for head widths 64 and
// 128, causal and not, Hkv = H and H/4 (query heads sharing a key/value head),
// sequence lengths that are and are not multiples of the 64-key tiles and
// 128-row blocks (1, 37, 128, 200, 1024). Then GPT's packed qkv through
// ops::causal_attention and separate q, k, v through ops::gqa_attention, which
// must take these kernels (the same bits as the direct call) and match the CPU
// op in double, and the cases the kernels decline. Compiled by g++ like a
// user's .cpp.
//
// Bounds (gpu_util.hpp rel_err, norm-wise relative): y, dq, dk, dv within
// tol<bf16>() = 1e-2. The inputs are bf16 values, so the reference sees what
// the kernel reads; the kernel's products of bf16 values are exact in its fp32
// accumulators, and it rounds three things to bf16: P before P V and dS before
// dS k, dS^T q (2^-9 relative each, independent signs, so a sum of n such terms
// errs by about 2^-9 of its own size, not n times), and each output once
// (2^-9). With D_i = dy_i . y_i read from the rounded y, the total stays near
// 2^-8 = 0.004, under 1e-2. lse within 1e-5 relative to max(|lse|, 1): fp32 sums
// of exact products and one log. The backward must give the same bits twice.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda_table.hpp"
#include "ptrain/nn/batch_context.hpp"
#include "ptrain/ops/attention.hpp"
#include "ptrain/ops/gqa_attention.hpp"
#include "gpu/gpu_util.hpp"

namespace test_flash_tc_attention {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

using Fwd = decltype(kernels::CudaKernels<bf16>::flash_tc_forward);
using Bwd = decltype(kernels::CudaKernels<bf16>::flash_tc_backward);

Fwd forward_kernel() { return kernels::cuda_kernel<bf16>(&kernels::CudaKernels<bf16>::flash_tc_forward, "flash_tc_forward"); }
Bwd backward_kernel() {
  return kernels::cuda_kernel<bf16>(&kernels::CudaKernels<bf16>::flash_tc_backward, "flash_tc_backward");
}

// Attention in double, one query row at a time: y, lse [B, H, S] and the gradients
// (dq with q's row stride, dk and dv with k's, the latter summed over a group's heads).
struct Reference {
  std::vector<double> y, lse, dq, dk, dv;
};

Reference reference(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                    const std::vector<double>& q, std::int64_t ldq, const std::vector<double>& k,
                    const std::vector<double>& v, std::int64_t ldkv, bool causal, const std::vector<double>& dy) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const std::int64_t group = H / Hkv;
  Reference r;
  r.y.assign(static_cast<std::size_t>(B * S * H * D), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * H * S), 0.0);
  r.dq.assign(static_cast<std::size_t>(B * S * H * D), 0.0);
  r.dk.assign(static_cast<std::size_t>(B * S * Hkv * D), 0.0);
  r.dv.assign(r.dk.size(), 0.0);
  std::vector<double> p(static_cast<std::size_t>(S)), dp(static_cast<std::size_t>(S));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t g = h / group, n = causal ? i + 1 : S;
        const double* qi = &q[static_cast<std::size_t>((b * S + i) * ldq + h * D)];
        const double* dyi = &dy[static_cast<std::size_t>((b * S + i) * H * D + h * D)];
        auto kv = [&](const std::vector<double>& t, std::int64_t j) {
          return &t[static_cast<std::size_t>((b * S + j) * ldkv + g * D)];
        };
        double mx = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (std::int64_t d = 0; d < D; ++d) s += qi[d] * kv(k, j)[d];
          p[static_cast<std::size_t>(j)] = s * scale;
          mx = std::max(mx, s * scale);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - mx);
        r.lse[static_cast<std::size_t>((b * H + h) * S + i)] = mx + std::log(sum);
        double Di = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          const double pj = p[static_cast<std::size_t>(j)] /= sum;
          double dpj = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            r.y[static_cast<std::size_t>((b * S + i) * H * D + h * D + d)] += pj * kv(v, j)[d];
            dpj += dyi[d] * kv(v, j)[d];
          }
          dp[static_cast<std::size_t>(j)] = dpj;
          Di += pj * dpj;
        }
        for (std::int64_t j = 0; j < n; ++j) {
          const double pj = p[static_cast<std::size_t>(j)], ds = pj * (dp[static_cast<std::size_t>(j)] - Di);
          const std::int64_t at = (b * S + j) * Hkv * D + g * D;
          for (std::int64_t d = 0; d < D; ++d) {
            r.dq[static_cast<std::size_t>((b * S + i) * H * D + h * D + d)] += scale * ds * kv(k, j)[d];
            r.dk[static_cast<std::size_t>(at + d)] += scale * ds * qi[d];
            r.dv[static_cast<std::size_t>(at + d)] += pj * dyi[d];
          }
        }
      }
  return r;
}

template <class T>
Tensor<T> gpu_tensor(const std::vector<T>& v, const Shape& s) {
  return Tensor<T>::from(v, s).to(kGpu);
}
template <class T>
Tensor<T> gpu_nan(const Shape& s) {
  return gpu_tensor(std::vector<T>(static_cast<std::size_t>(s.numel()), nan_of<T>()), s);
}

template <class T>
bool same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  const auto x = a.to_vector(), y = b.to_vector();
  return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
}

void check_case(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, bool causal) {
  CAPTURE(B, S, H, Hkv, D, causal, test_seed());
  const Shape qs{B, S, H, D}, ks{B, S, Hkv, D};
  const auto qv = uniform<bf16>(qs.numel(), -1.5, 1.5), kv = uniform<bf16>(ks.numel(), -1.5, 1.5),
             vv = uniform<bf16>(ks.numel(), -1, 1), dyv = uniform<bf16>(qs.numel(), -1, 1);
  const auto ref = reference(B, S, H, Hkv, D, to_double(qv), H * D, to_double(kv), to_double(vv), Hkv * D, causal,
                             to_double(dyv));

  const auto q = gpu_tensor(qv, qs), k = gpu_tensor(kv, ks), v = gpu_tensor(vv, ks), dy = gpu_tensor(dyv, qs);
  auto y = gpu_nan<bf16>(qs);
  auto lse = gpu_nan<float>({B, H, S});
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  REQUIRE(forward_kernel()(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, causal, scale, y.data(),
                           lse.data()));
  CHECK(rel_err(y.to_vector(), ref.y) < tol<bf16>());
  CHECK(rel_err(lse.to_vector(), ref.lse, 1.0) < 1e-5);

  auto backward = [&] {
    std::array<Tensor<bf16>, 3> g{gpu_nan<bf16>(qs), gpu_nan<bf16>(ks), gpu_nan<bf16>(ks)};
    REQUIRE(backward_kernel()(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, causal, y.data(),
                              lse.data(), dy.data(), scale, g[0].data(), g[1].data(), g[2].data()));
    return g;
  };
  const auto g = backward();
  CHECK(rel_err(g[0].to_vector(), ref.dq) < tol<bf16>());
  CHECK(rel_err(g[1].to_vector(), ref.dk) < tol<bf16>());
  CHECK(rel_err(g[2].to_vector(), ref.dv) < tol<bf16>());
  const auto again = backward();  // no atomics: the same bits
  for (int i = 0; i < 3; ++i) CHECK(same_bits(g[i], again[i]));
}

}  // namespace

TEST_CASE("tensor-core flash attention matches attention in double: widths 64, 128, causal or not, GQA",
          "[cuda:flash_tc_forward][cuda:flash_tc_backward][flash_tc][bf16]") {
  for (std::int64_t D : {64, 128})
    for (bool causal : {false, true})
      for (std::int64_t Hkv : {2, 1}) {  // H / Hkv = 1 (two heads of their own) and 4 (four heads, one pair)
        const std::int64_t H = Hkv == 2 ? 2 : 4;
        check_case(2, 1, H, Hkv, D, causal);
        check_case(2, 37, H, Hkv, D, causal);
        check_case(1, 200, H, Hkv, D, causal);
      }
  check_case(1, 128, 2, 2, 64, true);  // exactly one query block, two key tiles
}

TEST_CASE("tensor-core flash attention matches attention in double at sequence 1024",
          "[cuda:flash_tc_forward][cuda:flash_tc_backward][flash_tc][bf16]") {
  check_case(1, 1024, 4, 1, 64, true);  // eight query blocks, 16 key tiles, GQA 4
  check_case(1, 1024, 2, 2, 128, false);
}

TEST_CASE("GPT's packed attention and ops::gqa_attention in bf16 take the tensor-core kernels",
          "[cuda:flash_tc_forward][cuda:flash_tc_backward][flash_tc][bf16]") {
  SECTION("ops::causal_attention on packed qkv [B, S, 3C]") {
    const std::int64_t B = 2, S = 200, H = 2, D = 64, C = H * D;
    CAPTURE(test_seed());
    const auto qkv_v = uniform<bf16>(B * S * 3 * C, -1.5, 1.5), dy_v = uniform<bf16>(B * S * C, -1, 1);
    const auto qkv_d = Tensor<double>::from(to_double(qkv_v), {B, S, 3 * C});
    const auto dy_d = Tensor<double>::from(to_double(dy_v), {B, S, C});
    ops::AttentionSaved<double> ref_saved;
    const auto y_ref = ops::causal_attention(qkv_d, H, 0.0, 0, 0, ref_saved).to_vector();
    const auto dqkv_ref = ops::causal_attention_backward(qkv_d, ref_saved, H, dy_d).to_vector();

    const auto qkv = gpu_tensor(qkv_v, {B, S, 3 * C}), dy = gpu_tensor(dy_v, {B, S, C});
    ops::AttentionSaved<bf16> saved;
    const auto y = ops::causal_attention(qkv, H, 0.0, 0, 0, saved);
    REQUIRE(saved.lse.defined());
    const auto dqkv = ops::causal_attention_backward(qkv, saved, H, dy);
    CHECK(rel_err(y.to_vector(), y_ref) < tol<bf16>());
    CHECK(rel_err(dqkv.to_vector(), dqkv_ref) < tol<bf16>());

    // The op's results are the direct call's bits on the packed strides.
    const bf16* q = qkv.data();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    auto y2 = gpu_nan<bf16>({B, S, C});
    auto lse2 = gpu_nan<float>({B, H, S});
    auto dqkv2 = gpu_nan<bf16>({B, S, 3 * C});
    REQUIRE(forward_kernel()(B, S, H, H, D, q, 3 * C, q + C, q + 2 * C, 3 * C, true, scale, y2.data(), lse2.data()));
    bf16* dq = dqkv2.data();
    REQUIRE(backward_kernel()(B, S, H, H, D, q, 3 * C, q + C, q + 2 * C, 3 * C, true, y2.data(), lse2.data(),
                              dy.data(), scale, dq, dq + C, dq + 2 * C));
    CHECK(same_bits(y, y2));
    CHECK(same_bits(saved.lse, lse2));
    CHECK(same_bits(dqkv, dqkv2));
  }
  SECTION("ops::gqa_attention on q [B, S, H, D], k, v [B, S, Hkv, D]; document starts keep the gqa kernel") {
    const std::int64_t B = 1, S = 150, H = 4, Hkv = 1, D = 128;
    CAPTURE(test_seed());
    const Shape qs{B, S, H, D}, ks{B, S, Hkv, D};
    const auto qv = uniform<bf16>(qs.numel(), -1.5, 1.5), kv = uniform<bf16>(ks.numel(), -1.5, 1.5),
               vv = uniform<bf16>(ks.numel(), -1, 1), dyv = uniform<bf16>(qs.numel(), -1, 1);
    const auto ref =
        reference(B, S, H, Hkv, D, to_double(qv), H * D, to_double(kv), to_double(vv), Hkv * D, true, to_double(dyv));
    const auto q = gpu_tensor(qv, qs), k = gpu_tensor(kv, ks), v = gpu_tensor(vv, ks), dy = gpu_tensor(dyv, qs);
    ops::GqaSaved<bf16> saved;
    const auto y = ops::gqa_attention(q, k, v, saved);
    Tensor<bf16> dq, dk, dv;
    ops::gqa_attention_backward(q, k, v, saved, dy, dq, dk, dv);
    CHECK(rel_err(y.to_vector(), ref.y) < tol<bf16>());
    CHECK(rel_err(dq.to_vector(), ref.dq) < tol<bf16>());
    CHECK(rel_err(dk.to_vector(), ref.dk) < tol<bf16>());
    CHECK(rel_err(dv.to_vector(), ref.dv) < tol<bf16>());
    auto y2 = gpu_nan<bf16>(qs);
    auto lse2 = gpu_nan<float>({B, H, S});
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    REQUIRE(forward_kernel()(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, true, scale, y2.data(),
                             lse2.data()));
    CHECK(same_bits(y, y2));
    CHECK(same_bits(saved.lse, lse2));

    // With document starts the op runs the grouped-query kernel, still right.
    auto ids = Tensor<std::int32_t>::full({B, S}, 1);
    ids.data()[0] = ids.data()[S / 3] = 0;
    const auto starts = nn::document_starts(ids, 0);
    ops::GqaSaved<double> ref_saved;
    const auto qd = Tensor<double>::from(to_double(qv), qs), kd = Tensor<double>::from(to_double(kv), ks),
               vd = Tensor<double>::from(to_double(vv), ks);
    const auto y_doc_ref = ops::gqa_attention(qd, kd, vd, ref_saved, starts).to_vector();
    ops::GqaSaved<bf16> doc_saved;
    CHECK(rel_err(ops::gqa_attention(q, k, v, doc_saved, starts.to(kGpu)).to_vector(), y_doc_ref) < tol<bf16>());
  }
}

TEST_CASE("tensor-core flash attention declines what it does not take and refuses bad head counts",
          "[cuda:flash_tc_forward][flash_tc][bf16]") {
  const std::int64_t B = 1, S = 8, H = 2;
  auto buf = Tensor<bf16>::zeros({B, S, 3 * H * 128 + 8}, kGpu);
  auto y = Tensor<bf16>::zeros({B, S, H * 128}, kGpu);
  auto lse = Tensor<float>::zeros({B, H, S}, kGpu);
  const bf16* p = buf.data();
  const std::int64_t ld = 3 * H * 128 + 8;
  // Head width 32 (flash_attention.cuh's), and a q one element off its 16-byte boundary.
  CHECK_FALSE(forward_kernel()(B, S, H, H, 32, p, ld, p, p, ld, true, 1.0f, y.data(), lse.data()));
  CHECK_FALSE(forward_kernel()(B, S, H, H, 64, p + 1, ld, p, p, ld, true, 1.0f, y.data(), lse.data()));
  CHECK(forward_kernel()(B, S, H, H, 64, p, ld, p, p, ld, true, 1.0f, y.data(), lse.data()));
  // The table has no float form.
  CHECK(kernels::cuda_kernels<float>().flash_tc_forward == nullptr);
  CHECK_THROWS_WITH(forward_kernel()(B, S, 3, 2, 64, p, ld, p, p, ld, true, 1.0f, y.data(), lse.data()),
                    Catch::Contains("[ptrain.cuda.flash_tc]") && Catch::Contains("do not divide"));
}

}  // namespace test_flash_tc_attention
