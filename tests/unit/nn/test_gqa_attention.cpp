// Grouped-query attention on the CPU with document starts and a sliding window:
// ops::gqa_attention (the materialised path) against a naive double loop written
// here from Hugging Face's masks (causal kv <= q, sliding kv > q - window, and the
// document of each query); its backward against finite differences; the
// flash-contract kernels (kernels::cpu::gqa_flash_*, the CUDA kernels' reference)
// against the materialised path, also on GPT's packed qkv layout; bf16 against
// double; and the KV-cache decode against the full forward.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include <ptrain/nn/batch_context.hpp>
#include <ptrain/nn/gqa_attention.hpp>
#include <ptrain/ops/gqa_attention.hpp>

#include "unit/gradcheck.hpp"

namespace test_gqa_attention {

using namespace ptrain;
using Catch::Matchers::Contains;
using ptrain::testing::random_tensor;

namespace {

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

std::vector<double> values(const Tensor<double>& t) { return t.to_vector(); }

// Token ids of B rows where `sep` starts a document: row 0 has documents at 0, 5 and 23,
// row 1 at 0 and 11 (and more rows repeat the pattern).
Tensor<std::int32_t> document_ids(std::int64_t B, std::int64_t S, std::int32_t sep) {
  auto ids = Tensor<std::int32_t>::empty({B, S});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < S; ++i) {
      const bool start = b % 2 == 0 ? (i == 5 || i == 23) : i == 11;
      ids.data()[b * S + i] = start ? sep : static_cast<std::int32_t>(1 + (i * 7 + b) % 9);
    }
  return ids;
}

// y[b, i, h] = sum_j softmax_j(q.k / sqrt(D)) v over the keys j that Hugging Face's
// masks leave query i: j <= i, j > i - window (window > 0), and j in i's document.
std::vector<double> naive(const Tensor<double>& q, const Tensor<double>& k, const Tensor<double>& v,
                          const Tensor<std::int32_t>& ids, std::int32_t sep, std::int64_t window) {
  const std::int64_t B = q.size(0), S = q.size(1), H = q.size(2), Hkv = k.size(2), D = q.size(3);
  std::vector<double> y(static_cast<std::size_t>(q.numel()), 0.0);
  auto doc = [&](std::int64_t b, std::int64_t i) {  // the document index of token i
    std::int64_t n = 0;
    if (ids.defined())
      for (std::int64_t t = 1; t <= i; ++t) n += ids.data()[b * S + t] == sep;
    return n;
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < S; ++i) {
        const std::int64_t g = h / (H / Hkv);
        std::vector<double> w(static_cast<std::size_t>(S), 0.0);
        std::vector<bool> seen(static_cast<std::size_t>(S), false);
        double mx = -1e300, z = 0;
        for (std::int64_t j = 0; j < S; ++j) {
          const bool visible = j <= i && (window == 0 || j > i - window) && doc(b, j) == doc(b, i);
          if (!visible) continue;
          double dot = 0;
          for (std::int64_t d = 0; d < D; ++d) dot += q.at({b, i, h, d}) * k.at({b, j, g, d});
          w[static_cast<std::size_t>(j)] = dot / std::sqrt(double(D));
          seen[static_cast<std::size_t>(j)] = true;
          mx = std::max(mx, w[static_cast<std::size_t>(j)]);
        }
        for (std::int64_t j = 0; j < S; ++j)
          if (seen[static_cast<std::size_t>(j)]) z += std::exp(w[static_cast<std::size_t>(j)] - mx);
        for (std::int64_t j = 0; j < S; ++j) {
          if (!seen[static_cast<std::size_t>(j)]) continue;
          const double p = std::exp(w[static_cast<std::size_t>(j)] - mx) / z;
          for (std::int64_t d = 0; d < D; ++d)
            y[static_cast<std::size_t>(((b * S + i) * H + h) * D + d)] += p * v.at({b, j, g, d});
        }
      }
  return y;
}

}  // namespace

TEST_CASE("gqa_attention with a sliding window and documents matches a naive loop", "[gqa_attention][nn][llama]") {
  const std::int32_t sep = 0;
  for (std::int64_t Hkv : {4, 2, 1})
    for (std::int64_t window : {0, 1, 5, 64})
      for (bool documents : {false, true}) {
        CAPTURE(Hkv, window, documents);
        const std::int64_t B = 2, S = 70, H = 4, D = 6;  // S = 70 crosses the 64-row tile
        auto q = random_tensor({B, S, H, D}, 1), k = random_tensor({B, S, Hkv, D}, 2),
             v = random_tensor({B, S, Hkv, D}, 3);
        const auto ids = documents ? document_ids(B, S, sep) : Tensor<std::int32_t>();
        const auto starts = documents ? nn::document_starts(ids, sep) : Tensor<std::int32_t>();
        ops::GqaSaved<double> saved;
        const auto y = ops::gqa_attention(q, k, v, saved, starts, window);
        CHECK(max_abs_diff(values(y), naive(q, k, v, ids, sep, window)) < 1e-12);
      }
}

TEST_CASE("gqa_attention's backward with a sliding window and documents equals finite differences",
          "[gqa_attention][nn][llama]") {
  const std::int32_t sep = 0;
  const std::int64_t B = 2, S = 13, H = 4, Hkv = 2, D = 4, window = 4;
  auto q = random_tensor({B, S, H, D}, 11), k = random_tensor({B, S, Hkv, D}, 12), v = random_tensor({B, S, Hkv, D}, 13);
  auto ids = Tensor<std::int32_t>::from({0, 3, 4, 0, 5, 6, 7, 8, 9, 1, 2, 3, 4,  // documents at 0 and 3
                                         5, 6, 7, 8, 9, 1, 2, 3, 0, 4, 5, 6, 7},  // and at 0 and 8
                                        {B, S});
  const auto starts = nn::document_starts(ids, sep);
  const auto w = random_tensor({B, S, H, D}, 14);  // loss = sum(w * y)
  auto loss = [&]() {
    ops::GqaSaved<double> s;
    const auto y = ops::gqa_attention(q, k, v, s, starts, window);
    double l = 0;
    for (std::int64_t i = 0; i < y.numel(); ++i) l += w.data()[i] * y.data()[i];
    return l;
  };
  ops::GqaSaved<double> saved;
  ops::gqa_attention(q, k, v, saved, starts, window);
  Tensor<double> dq, dk, dv;
  ops::gqa_attention_backward(q, k, v, saved, w, dq, dk, dv);
  const double eps = 1e-6;
  for (auto [x, g] : {std::pair{&q, &dq}, std::pair{&k, &dk}, std::pair{&v, &dv}}) {
    double worst = 0;
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      const double keep = x->data()[i];
      x->data()[i] = keep + eps;
      const double up = loss();
      x->data()[i] = keep - eps;
      const double down = loss();
      x->data()[i] = keep;
      worst = std::max(worst, std::abs((up - down) / (2 * eps) - g->data()[i]));
    }
    CHECK(worst < 1e-8);
  }
}

TEST_CASE("the flash-contract CPU kernels equal the materialised path, separate and packed",
          "[gqa_attention][kernels]") {
  const std::int32_t sep = 0;
  const std::int64_t B = 2, S = 37, H = 4, D = 8;
  for (std::int64_t Hkv : {4, 2, 1})
    for (std::int64_t window : {0, 6})
      for (bool documents : {false, true}) {
        CAPTURE(Hkv, window, documents);
        auto q = random_tensor({B, S, H, D}, 21), k = random_tensor({B, S, Hkv, D}, 22),
             v = random_tensor({B, S, Hkv, D}, 23), dy = random_tensor({B, S, H, D}, 24);
        const auto starts = documents ? nn::document_starts(document_ids(B, S, sep), sep) : Tensor<std::int32_t>();
        const std::int32_t* st = documents ? starts.data() : nullptr;
        ops::GqaSaved<double> saved;
        const auto y = ops::gqa_attention(q, k, v, saved, starts, window);
        Tensor<double> dq, dk, dv;
        ops::gqa_attention_backward(q, k, v, saved, dy, dq, dk, dv);

        const double scale = 1.0 / std::sqrt(double(D));
        auto fy = Tensor<double>::empty(q.shape()), lse = Tensor<double>::empty({B, H, S});
        kernels::cpu::gqa_flash_forward(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, st, window,
                                        scale, fy.data(), lse.data());
        CHECK(max_abs_diff(values(fy), values(y)) < 1e-12);
        // lse = log sum_j exp(score): probs = exp(score - lse), so the row's largest probability
        // p_max = exp(max score - lse); check lse against the materialised probabilities' rows.
        double worst = 0;
        for (std::int64_t bh = 0; bh < B * H; ++bh)
          for (std::int64_t i = 0; i < S; ++i) {
            const std::int64_t b = bh / H, h = bh % H, g = h / (H / Hkv);
            // p_ii > 0 always (a query sees itself): lse = score_ii - log p_ii.
            double dot = 0;
            for (std::int64_t d = 0; d < D; ++d) dot += q.at({b, i, h, d}) * k.at({b, i, g, d});
            const double want = dot * scale - std::log(saved.probs.data()[(bh * S + i) * S + i]);
            worst = std::max(worst, std::abs(lse.data()[bh * S + i] - want));
          }
        CHECK(worst < 1e-12);
        auto fdq = Tensor<double>::empty(q.shape()), fdk = Tensor<double>::empty(k.shape()),
             fdv = Tensor<double>::empty(k.shape());
        kernels::cpu::gqa_flash_backward(B, S, H, Hkv, D, q.data(), H * D, k.data(), v.data(), Hkv * D, st, window,
                                         fy.data(), lse.data(), dy.data(), scale, fdq.data(), fdk.data(), fdv.data());
        CHECK(max_abs_diff(values(fdq), values(dq)) < 1e-12);
        CHECK(max_abs_diff(values(fdk), values(dk)) < 1e-12);
        CHECK(max_abs_diff(values(fdv), values(dv)) < 1e-12);

        if (Hkv != H) continue;
        // GPT's packed layout: qkv [B, S, 3C], q = qkv, k = qkv + C, v = qkv + 2C, row stride 3C.
        const std::int64_t C = H * D;
        auto qkv = Tensor<double>::empty({B, S, 3 * C});
        for (std::int64_t r = 0; r < B * S; ++r)
          for (std::int64_t c = 0; c < C; ++c) {
            qkv.data()[r * 3 * C + c] = q.data()[r * C + c];
            qkv.data()[r * 3 * C + C + c] = k.data()[r * C + c];
            qkv.data()[r * 3 * C + 2 * C + c] = v.data()[r * C + c];
          }
        auto py = Tensor<double>::empty(q.shape()), plse = Tensor<double>::empty({B, H, S});
        kernels::cpu::gqa_flash_forward(B, S, H, H, D, qkv.data(), 3 * C, qkv.data() + C, qkv.data() + 2 * C, 3 * C,
                                        st, window, scale, py.data(), plse.data());
        CHECK(values(py) == values(fy));
        auto dqkv = Tensor<double>::zeros({B, S, 3 * C});
        kernels::cpu::gqa_flash_backward(B, S, H, H, D, qkv.data(), 3 * C, qkv.data() + C, qkv.data() + 2 * C, 3 * C,
                                         st, window, py.data(), plse.data(), dy.data(), scale, dqkv.data(),
                                         dqkv.data() + C, dqkv.data() + 2 * C);
        double packed = 0;
        for (std::int64_t r = 0; r < B * S; ++r)
          for (std::int64_t c = 0; c < C; ++c) {
            packed = std::max(packed, std::abs(dqkv.data()[r * 3 * C + c] - fdq.data()[r * C + c]));
            packed = std::max(packed, std::abs(dqkv.data()[r * 3 * C + C + c] - fdk.data()[r * C + c]));
            packed = std::max(packed, std::abs(dqkv.data()[r * 3 * C + 2 * C + c] - fdv.data()[r * C + c]));
          }
        CHECK(packed == 0.0);
      }
}

TEST_CASE("gqa_attention in bf16 on the CPU stays close to double on the same inputs",
          "[gqa_attention][nn][llama][bf16]") {
  // Inputs exactly representable in bf16. The bf16 path computes in float and rounds
  // y and the kept probabilities to bf16 (2^-8 relative each), so y and the gradients
  // carry about 1% relative error at worst: 2e-2 norm-wise relative.
  const std::int32_t sep = 0;
  const std::int64_t B = 2, S = 40, H = 4, Hkv = 2, D = 8, window = 9;
  const auto starts = nn::document_starts(document_ids(B, S, sep), sep);
  auto to_bf16 = [](const Tensor<double>& x) {
    auto b = Tensor<bf16>::empty(x.shape());
    ops::cast_into(x, b);
    return b;
  };
  auto to_double = [](const Tensor<bf16>& x) {
    auto d = Tensor<double>::empty(x.shape());
    ops::cast_into(x, d);
    return d;
  };
  auto qb = to_bf16(random_tensor({B, S, H, D}, 31)), kb = to_bf16(random_tensor({B, S, Hkv, D}, 32)),
       vb = to_bf16(random_tensor({B, S, Hkv, D}, 33)), dyb = to_bf16(random_tensor({B, S, H, D}, 34));
  auto q = to_double(qb), k = to_double(kb), v = to_double(vb), dy = to_double(dyb);
  ops::GqaSaved<double> sd;
  ops::GqaSaved<bf16> sb;
  const auto yd = ops::gqa_attention(q, k, v, sd, starts, window);
  const auto yb = ops::gqa_attention(qb, kb, vb, sb, starts, window);
  Tensor<double> dq, dk, dv;
  Tensor<bf16> dqb, dkb, dvb;
  ops::gqa_attention_backward(q, k, v, sd, dy, dq, dk, dv);
  ops::gqa_attention_backward(qb, kb, vb, sb, dyb, dqb, dkb, dvb);
  auto rel = [&](const Tensor<bf16>& got, const Tensor<double>& want) {
    const auto g = values(to_double(got)), w = values(want);
    double num = 0, den = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      num += (g[i] - w[i]) * (g[i] - w[i]);
      den += w[i] * w[i];
    }
    return std::sqrt(num / den);
  };
  CHECK(rel(yb, yd) < 2e-2);
  CHECK(rel(dqb, dq) < 2e-2);
  CHECK(rel(dkb, dk) < 2e-2);
  CHECK(rel(dvb, dv) < 2e-2);
  CHECK(rel(yb, yd) > 0.0);  // the bf16 path really rounds (a test that cannot pass by calling double)
}

TEST_CASE("gqa_attention_decode equals the full forward's last rows, window included", "[gqa_attention][nn][llama]") {
  const std::int64_t n = 23, H = 4, Hkv = 2, D = 6, cap = 30;
  for (std::int64_t window : {0, 1, 7}) {
    CAPTURE(window);
    auto q = random_tensor({1, n, H, D}, 41), k = random_tensor({1, n, Hkv, D}, 42), v = random_tensor({1, n, Hkv, D}, 43);
    ops::GqaSaved<double> saved;
    const auto y = ops::gqa_attention(q, k, v, saved, {}, window);
    auto kc = Tensor<double>::zeros({1, cap, Hkv, D}), vc = Tensor<double>::zeros({1, cap, Hkv, D});
    kc.view(0, k.shape()).copy_(k);
    vc.view(0, v.shape()).copy_(v);
    for (std::int64_t s : {1, 3}) {
      const auto qs = q.view((n - s) * H * D, {1, s, H, D});
      const auto ys = ops::gqa_attention_decode(qs, kc, vc, n, window);
      CHECK(max_abs_diff(values(ys), values(y.view((n - s) * H * D, {1, s, H, D}))) < 1e-12);
    }
  }
  auto q = random_tensor({1, 2, H, D}, 44), kc = random_tensor({1, cap, Hkv, D}, 45);
  CHECK_THROWS_WITH(ops::gqa_attention_decode(q, kc, kc, 1), Contains("[ptrain.gqa_attention.decode]"));
  CHECK_THROWS_WITH(ops::gqa_attention_decode(q, kc, kc, cap + 1), Contains("[ptrain.gqa_attention.decode]"));
}

TEST_CASE("GroupedQueryAttention with a sliding window: decode equals forward past the window",
          "[gqa_attention][nn][llama][generate]") {
  const std::int64_t S = 11;
  nn::GroupedQueryAttention<double> attn(16, 4, 2, ops::RotaryConfig{.theta = 100.0});
  Generator gen(51);
  for (auto& p : attn.named_parameters()) ops::uniform_(p.param->value, -0.5, 0.5, gen);
  attn.set_sliding_window(4);
  const auto x = random_tensor({1, S, 16}, 52);
  nn::Cache<double> cache;
  const auto full = attn.forward(x, cache);  // S > window: a true sliding window
  nn::KVCache<double> kv;
  std::vector<double> stepped;
  for (std::int64_t at = 0, s = 5; at < S; at += s, s = 1) {  // a 5-token prompt, then one token at a time
    const auto out = attn.decode(x.view(at * 16, {1, s, 16}), kv, S);
    for (double e : values(out)) stepped.push_back(e);
  }
  CHECK(max_abs_diff(stepped, values(full)) < 1e-12);
  // The window matters here: without it the last rows differ.
  nn::Cache<double> plain_cache;
  attn.set_sliding_window(0);
  CHECK(max_abs_diff(values(attn.forward(x, plain_cache)), values(full)) > 1e-6);
  CHECK_THROWS_WITH(attn.set_sliding_window(-1), Contains("[ptrain.gqa_attention.window]"));
}

TEST_CASE("gqa_attention refuses document starts outside 0..i", "[gqa_attention][nn][llama]") {
  auto q = random_tensor({1, 3, 2, 2}, 61);
  ops::GqaSaved<double> saved;
  CHECK_THROWS_WITH(ops::gqa_attention(q, q, q, saved, Tensor<std::int32_t>::from({0, 2, 0}, {1, 3})),
                    Contains("document start 2 of token 1"));
  CHECK_THROWS_WITH(ops::gqa_attention(q, q, q, saved, {}, -1), Contains("[ptrain.gqa_attention.window]"));
}

}  // namespace test_gqa_attention
