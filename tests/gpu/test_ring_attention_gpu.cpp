// Context parallelism's ring attention blocks on CUDA (kernels/cuda/ring_attention.cuh)
// through the kernel table, against kernels/cpu/ring_attention.hpp run in double on the
// same values: the forward's merge into a running output and log-sum-exp (rows that
// have seen no key yet, rows that see none of the block), the backward's additions to
// dq, dk and dv, for diagonal blocks, full blocks (the queries n or 3n after the
// keys), a partial overlap and keys after the queries; causal and packed-document
// masks (documents starting inside and before the block), a sliding window; GQA
// (Hkv = H, H/2, 1); row strides wider than the heads. Then parallel::ring_attention
// and allgather_attention on cuda:0 over a group of one (the dispatch) against the
// same calls on the CPU in double. Compiled by g++ like a user's .cpp; the kernels are
// gated (Note [The verification gate]): run with PTRAIN_UNVERIFIED_CUDA=1, as
// tools/gpu/run.sh does.
//
// Bounds (gpu_util.hpp tol<T>(), norm-wise relative): float 1e-5 (float arithmetic,
// sums over at most n * H / Hkv terms); bf16 1e-2 (inputs are bf16 values, so the
// reference sees what the kernel reads; the block's output and gradients are rounded
// to bf16 once before the merge or the add and once after, 2 * 2^-9). The
// log-sum-exp is float for both types: 1e-5 relative to max(|lse|, 1). The backward
// gives the same bits on a second run (no atomics).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu/gpu_util.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cpu/ring_attention.hpp"
#include "ptrain/kernels/cuda_table.hpp"
#include "ptrain/parallel/context_parallel.hpp"

namespace test_ring_attention_gpu {

using namespace ptrain;
using namespace ptrain::testing;

namespace {

/// The gated kernel `fn` for T from the table (throws [ptrain.cuda.unverified] while gated).
template <class T, class Fn>
Fn gated(Fn kernels::CudaKernels<T>::*fn, const char* name) {
  INFO(name << " is gated: run with PTRAIN_UNVERIFIED_CUDA=1 (tools/gpu/run.sh does)");
  return kernels::cuda_kernel<T>(fn, name);
}

/// Document starts (global positions) of `count` queries at positions q0 ..: documents
/// begin at 0, 5, 2n + 3 and 3n + 1, so that in some blocks a query's document starts
/// inside the keys and in others before or after them.
std::vector<std::int32_t> doc_starts(std::int64_t count, std::int64_t q0, std::int64_t n) {
  const std::int64_t begins[] = {0, 5, 2 * n + 3, 3 * n + 1};
  std::vector<std::int32_t> s(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i)
    for (std::int64_t b : begins)
      if (b <= q0 + i) s[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(b);
  return s;
}

struct Block {
  std::int64_t n, H, Hkv, D, q0, k0, window;
  bool documents, padded;  // padded: row strides 8 elements wider than the heads
};

/// The finite entries of got and want in one list each; an entry -inf in one must be -inf in the other.
template <class A>
void check_lse(const std::vector<A>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  std::vector<A> g;
  std::vector<double> w;
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("lse entry " << i);
    REQUIRE(std::isinf(static_cast<double>(got[i])) == std::isinf(want[i]));
    if (!std::isinf(want[i])) {
      g.push_back(got[i]);
      w.push_back(want[i]);
    }
  }
  CHECK(rel_err(g, w, 1.0) < 1e-5);
}

template <class T>
void check_block(const Block& c) {
  using A = acc_t<T>;
  const std::int64_t n = c.n, H = c.H, Hkv = c.Hkv, D = c.D, pad = c.padded ? 8 : 0;
  const std::int64_t ldq = H * D + pad, ldkv = Hkv * D + pad, ldy = H * D, ld_lse = n + 3;
  CAPTURE(dtype_name(dtype_of<T>()), n, H, Hkv, D, c.q0, c.k0, c.window, c.documents, c.padded, test_seed());
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto qv = uniform<T>(n * ldq, -1.5, 1.5), kv = uniform<T>(n * ldkv, -1.5, 1.5),
             vv = uniform<T>(n * ldkv, -1, 1);
  const auto starts = c.documents ? doc_starts(n, c.q0, n) : std::vector<std::int32_t>();
  const auto qd = to_double(qv), kd = to_double(kv), vd = to_double(vv);
  const auto gq = gpu(qv, {n * ldq}), gk = gpu(kv, {n * ldkv}), gv = gpu(vv, {n * ldkv});
  const auto gstarts = c.documents ? gpu(starts, {n}) : Tensor<std::int32_t>();
  const std::int32_t* sp = c.documents ? starts.data() : nullptr;
  const std::int32_t* gsp = c.documents ? gstarts.data() : nullptr;

  // The running state a previous block would leave: rows i % 3 == 0 have seen no key
  // (lse -inf; their y is garbage the kernel must not read), the others an output and
  // a log-sum-exp. Entries of lse past n (the stride) stay as they are.
  auto y0 = uniform<T>(n * ldy, -1, 1);
  std::vector<A> lse0(static_cast<std::size_t>(H * ld_lse));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < ld_lse; ++i)
      lse0[static_cast<std::size_t>(h * ld_lse + i)] =
          i % 3 == 0 ? -std::numeric_limits<A>::infinity() : static_cast<A>(-1 + 3 * rng().uniform());
  for (std::int64_t i = 0; i < n; i += 3) y0[static_cast<std::size_t>(i * ldy)] = nan_of<T>();

  auto yd = to_double(y0);
  std::vector<double> lsed(lse0.begin(), lse0.end());
  kernels::cpu::ring_attention_block_forward<double>(n, H, Hkv, D, qd.data(), ldq, c.q0, sp, kd.data(), vd.data(),
                                                     ldkv, c.k0, c.window, scale, yd.data(), ldy, lsed.data(), ld_lse);
  auto gy = gpu(y0, {n * ldy});
  auto glse = Tensor<A>::from(lse0, {H * ld_lse}).to(kGpu);
  gated<T>(&kernels::CudaKernels<T>::ring_attention_block_forward, "ring_attention_block_forward")(
      n, H, Hkv, D, gq.data(), ldq, c.q0, gsp, gk.data(), gv.data(), ldkv, c.k0, c.window, static_cast<A>(scale),
      gy.data(), ldy, glse.data(), ld_lse);
  // Rows i % 3 == 0 that see no key keep their NaN on both sides; compare the others.
  std::vector<T> got;
  std::vector<double> want;
  const auto y_got = gy.to_vector();
  for (std::size_t e = 0; e < y_got.size(); ++e)
    if (!std::isnan(yd[e])) {
      got.push_back(y_got[e]);
      want.push_back(yd[e]);
    }
  CHECK(rel_err(got, want) < tol<T>());
  check_lse(glse.to_vector(), lsed);

  // Backward from the merged state (rounded to T, as the ring keeps it): the kernels add
  // to dq, dk and dv, which start as random values; padding columns must stay as they are.
  std::vector<T> y_in(yd.size());
  for (std::size_t e = 0; e < yd.size(); ++e)
    y_in[e] = std::isnan(yd[e]) ? static_cast<T>(0.0f) : static_cast<T>(yd[e]);
  std::vector<A> lse_in(lsed.begin(), lsed.end());
  const auto dyv = uniform<T>(n * ldy, -1, 1), dq0 = uniform<T>(n * ldq, -0.25, 0.25),
             dk0 = uniform<T>(n * ldkv, -0.25, 0.25), dv0 = uniform<T>(n * ldkv, -0.25, 0.25);
  const auto y_ind = to_double(y_in), dyd = to_double(dyv);
  const std::vector<double> lse_ind(lse_in.begin(), lse_in.end());
  auto dqd = to_double(dq0), dkd = to_double(dk0), dvd = to_double(dv0);
  kernels::cpu::ring_attention_block_backward<double>(n, H, Hkv, D, qd.data(), ldq, c.q0, sp, kd.data(), vd.data(),
                                                      ldkv, c.k0, c.window, scale, y_ind.data(), ldy,
                                                      lse_ind.data(), ld_lse, dyd.data(), dqd.data(), dkd.data(),
                                                      dvd.data());
  const auto gy_in = gpu(y_in, {n * ldy}), gdy = gpu(dyv, {n * ldy});
  const auto glse_in = Tensor<A>::from(lse_in, {H * ld_lse}).to(kGpu);
  const auto backward = gated<T>(&kernels::CudaKernels<T>::ring_attention_block_backward,
                                 "ring_attention_block_backward");
  auto run = [&](Tensor<T>& dq, Tensor<T>& dk, Tensor<T>& dv) {
    dq = gpu(dq0, {n * ldq});
    dk = gpu(dk0, {n * ldkv});
    dv = gpu(dv0, {n * ldkv});
    backward(n, H, Hkv, D, gq.data(), ldq, c.q0, gsp, gk.data(), gv.data(), ldkv, c.k0, c.window,
             static_cast<A>(scale), gy_in.data(), ldy, glse_in.data(), ld_lse, gdy.data(), dq.data(), dk.data(),
             dv.data());
  };
  Tensor<T> dq, dk, dv, dq2, dk2, dv2;
  run(dq, dk, dv);
  CHECK(rel_err(dq.to_vector(), dqd) < tol<T>());
  CHECK(rel_err(dk.to_vector(), dkd) < tol<T>());
  CHECK(rel_err(dv.to_vector(), dvd) < tol<T>());
  run(dq2, dk2, dv2);
  const auto a = dk.to_vector(), b = dk2.to_vector(), e = dq.to_vector(), f = dq2.to_vector();
  CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(e.data(), f.data(), e.size() * sizeof(T)) == 0);
}

/// Block offsets (q0, k0) for chunks of n: diagonal at 0 and at 2n, full blocks one and
/// three chunks apart, a partial overlap, keys after the queries (nothing visible).
template <class T>
void check_offsets(std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, bool documents,
                   std::int64_t window, bool padded) {
  const std::int64_t offsets[][2] = {{0, 0}, {2 * n, 2 * n}, {n, 0}, {3 * n, 0}, {n + 5, 5}, {7, 3}, {0, n}};
  for (const auto& o : offsets) check_block<T>({n, H, Hkv, D, o[0], o[1], window, documents, padded});
}

}  // namespace

TEST_CASE("ring attention blocks (float) on CUDA match the CPU kernels in double: offsets, documents, windows, GQA",
          "[cuda:ring_attention_block_forward][cuda:ring_attention_block_backward][ring_attention]") {
  for (std::int64_t Hkv : {4, 2, 1})
    for (bool documents : {false, true})
      for (std::int64_t window : {0, 13}) check_offsets<float>(40, 4, Hkv, 32, documents, window, false);
  check_offsets<float>(40, 2, 1, 64, true, 0, true);   // row strides wider than the heads
  check_offsets<float>(70, 2, 2, 128, true, 50, false);  // several key tiles per block
  check_offsets<float>(9, 3, 1, 8, false, 0, true);
}

TEST_CASE("ring attention blocks (bf16) on CUDA match the CPU kernels in double",
          "[cuda:ring_attention_block_forward][cuda:ring_attention_block_backward][ring_attention][bf16]") {
  for (std::int64_t Hkv : {4, 1})
    for (bool documents : {false, true}) check_offsets<bf16>(40, 4, Hkv, 64, documents, documents ? 0 : 13, false);
}

TEST_CASE("the CUDA ring attention backward refuses y and dy with padded rows",
          "[cuda:ring_attention_block_backward][ring_attention]") {
  const auto backward = gated<float>(&kernels::CudaKernels<float>::ring_attention_block_backward,
                                     "ring_attention_block_backward");
  auto t = Tensor<float>::zeros({4096}, kGpu);
  auto lse = Tensor<float>::zeros({64}, kGpu);
  CHECK_THROWS_WITH(backward(8, 2, 2, 16, t.data(), 32, 0, nullptr, t.data(), t.data(), 32, 0, 0, 0.25f, t.data(), 40,
                             lse.data(), 8, t.data(), t.data(), t.data(), t.data()),
                    Catch::Contains("[ptrain.cuda.ring_attention]"));
}

TEST_CASE("copy_strided_rows on CUDA copies the CPU kernel's elements and nothing else",
          "[cuda:copy_strided_rows][ring_attention]") {
  const std::int64_t rows = 37, width = 24, ld_src = 72, ld_dst = 30;
  const auto src = uniform<float>(rows * ld_src, -1, 1), dst0 = uniform<float>(rows * ld_dst, -1, 1);
  auto want = dst0;
  kernels::cpu::copy_strided_rows<float>(rows, width, src.data() + 24, ld_src, want.data(), ld_dst);
  const auto gsrc = gpu(src, {rows * ld_src});
  auto gdst = gpu(dst0, {rows * ld_dst});
  gated<float>(&kernels::CudaKernels<float>::copy_strided_rows, "copy_strided_rows")(
      rows, width, gsrc.data() + 24, ld_src, gdst.data(), ld_dst);
  CHECK(gdst.to_vector() == want);
}

TEST_CASE("ring and all-gather attention on cuda:0 (a group of one) match the CPU in double",
          "[cuda:ring_attention_block_forward][cuda:ring_attention_block_backward][ring_attention]") {
  // cp = 1: the rank holds chunks 0 and 1, so the ring runs two diagonal blocks and the
  // full block of chunk 1's queries against chunk 0's keys.
  const std::int64_t B = 2, c = 24, n2 = 2 * c, H = 4, Hkv = 2, D = 32;
  const Shape qs{B, n2, H, D}, ks{B, n2, Hkv, D};
  const auto qv = uniform<float>(qs.numel(), -1.5, 1.5), kv = uniform<float>(ks.numel(), -1.5, 1.5),
             vv = uniform<float>(ks.numel(), -1, 1), dyv = uniform<float>(qs.numel(), -1, 1);
  std::vector<std::int32_t> sv;
  for (std::int64_t b = 0; b < B; ++b) {
    const auto s = doc_starts(n2, 0, c);
    sv.insert(sv.end(), s.begin(), s.end());
  }
  const auto starts = Tensor<std::int32_t>::from(sv, {B, n2});
  parallel::ContextParallelGroup one(nullptr), one_gather(nullptr, parallel::KVExchange::AllGather);
  for (bool documents : {false, true})
    for (std::int64_t window : {0, 11})
      for (auto* g : {&one, &one_gather}) {
        CAPTURE(documents, window, g == &one_gather, test_seed());
        const auto st = documents ? starts : Tensor<std::int32_t>();
        parallel::RingSaved<double> ref_saved;
        const auto q = ref(qv, qs), k = ref(kv, ks), v = ref(vv, ks), dy = ref(dyv, qs);
        const auto y_ref = parallel::context_attention(*g, q, k, v, st, window, ref_saved);
        Tensor<double> dq_ref, dk_ref, dv_ref;
        parallel::context_attention_backward(*g, q, k, v, ref_saved, dy, dq_ref, dk_ref, dv_ref);

        parallel::RingSaved<float> saved;
        const auto gq = gpu(qv, qs), gk = gpu(kv, ks), gv = gpu(vv, ks), gdy = gpu(dyv, qs);
        const auto y = parallel::context_attention(*g, gq, gk, gv, documents ? st.to(kGpu) : st, window, saved);
        REQUIRE(y.device() == kGpu);
        CHECK(rel_err(y.to_vector(), y_ref.to_vector()) < 1e-5);
        CHECK(rel_err(saved.lse.to_vector(), ref_saved.lse.to_vector(), 1.0) < 1e-5);
        Tensor<float> dq, dk, dv;
        parallel::context_attention_backward(*g, gq, gk, gv, saved, gdy, dq, dk, dv);
        REQUIRE(dk.device() == kGpu);
        CHECK(rel_err(dq.to_vector(), dq_ref.to_vector()) < 1e-5);
        CHECK(rel_err(dk.to_vector(), dk_ref.to_vector()) < 1e-5);
        CHECK(rel_err(dv.to_vector(), dv_ref.to_vector()) < 1e-5);
      }
}

TEST_CASE("ring attention refuses tensors on two devices", "[ring_attention]") {
  parallel::ContextParallelGroup one(nullptr);
  const auto q = Tensor<float>::zeros({1, 8, 2, 16}, kGpu);
  const auto k = Tensor<float>::zeros({1, 8, 2, 16});
  parallel::RingSaved<float> saved;
  CHECK_THROWS_WITH(parallel::ring_attention(one, q, k, k, Tensor<std::int32_t>(), 0, saved),
                    Catch::Contains("[ptrain.device.mismatch]"));
}

}  // namespace test_ring_attention_gpu
