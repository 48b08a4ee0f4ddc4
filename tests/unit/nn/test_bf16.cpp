// bf16 mixed precision on the CPU (kernels/cpu/bf16.hpp, the GPU's contract):
// bf16 kernels against double kernels on the same bf16 inputs, and a bf16 GPT
// (bf16 parameters and activations, float statistics, fp32 master weights in
// AdamW) against the same GPT in double.
//
// Bounds. A bf16 result is rounded once to 8 significant bits, 2^-9 relative,
// so single kernels stay within 1e-2 of max |ref|. Through a whole model the
// roundings of every activation add up (two blocks, about twenty rounded
// tensors on the longest path); gradients are held to 5e-2 of their largest
// element and the loss to 1e-2. A wrong formula or a missed element is off by
// O(1), far outside either bound.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <unistd.h>
#include <string>
#include <vector>

#include "ptrain/ckpt/checkpoint.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/ops/vector.hpp"
#include "ptrain/optim/adamw.hpp"

namespace test_bf16 {

using namespace ptrain;
namespace kp = ptrain::kernels::cpu;

namespace {

std::vector<bf16> random_bf16(std::int64_t n, double lo, double hi, std::uint64_t seed) {
  std::vector<bf16> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = bf16(static_cast<float>(lo + (hi - lo) * random_uniform(seed, i)));
  return v;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(static_cast<double>(static_cast<float>(x)));
  return out;
}

/// max |got - ref| / max |ref|.
double rel_err(const std::vector<double>& got, const std::vector<double>& ref) {
  REQUIRE(got.size() == ref.size());
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::abs(got[i] - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

/// Copies every parameter of `from` (bf16) into `to` (double), by name.
void copy_weights(nn::GPT<bf16>& from, nn::GPT<double>& to) {
  std::map<std::string, nn::Parameter<bf16>*> src;
  for (auto& p : from.named_parameters()) src[p.name] = p.param;
  for (auto& p : to.named_parameters()) {
    const auto v = as_double(src.at(p.name)->value.to_vector());
    std::copy(v.begin(), v.end(), p.param->value.data());
  }
}

}  // namespace

TEST_CASE("bf16 CPU kernels match double kernels on the same inputs", "[bf16]") {
  SECTION("gemm with strides, beta and every transpose") {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const std::int64_t m = 19, n = 23, k = 37, lda = (ta ? m : k) + 2, ldb = (tb ? k : n) + 1, ldc = n + 3;
        const auto a = random_bf16((ta ? k : m) * lda, -1, 1, 1), b = random_bf16((tb ? n : k) * ldb, -1, 1, 2);
        auto c = random_bf16(m * ldc, -1, 1, 3);
        const auto ad = as_double(a), bd = as_double(b);
        auto ref = as_double(c);
        kp::gemm<double>(ta, tb, m, n, k, 0.5, ad.data(), lda, bd.data(), ldb, 0.25, ref.data(), ldc);
        const auto before = c;
        kp::gemm(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 0.25f, c.data(), ldc);
        std::vector<double> got_in, ref_in;
        bool padding_kept = true;
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t j = 0; j < ldc; ++j) {
            const std::size_t e = static_cast<std::size_t>(i * ldc + j);
            if (j < n) {
              got_in.push_back(static_cast<float>(c[e]));
              ref_in.push_back(ref[e]);
            } else {
              padding_kept &= c[e].bits == before[e].bits;
            }
          }
        INFO("ta " << ta << " tb " << tb);
        CHECK(rel_err(got_in, ref_in) <= 1e-2);
        CHECK(padding_kept);
      }
  }
  SECTION("layer_norm keeps float statistics") {
    const std::int64_t rows = 9, d = 48;
    const auto x = random_bf16(rows * d, 2, 4, 4), g = random_bf16(d, 0.5, 1.5, 5), b = random_bf16(d, -1, 1, 6);
    std::vector<bf16> y(x.size());
    std::vector<float> mean(rows), rstd(rows);
    kp::layer_norm_forward(rows, d, x.data(), g.data(), b.data(), 1e-5f, y.data(), mean.data(), rstd.data());
    const auto xd = as_double(x), gd = as_double(g), bd = as_double(b);
    std::vector<double> ry(xd.size()), rmean(rows), rrstd(rows);
    kp::layer_norm_forward<double>(rows, d, xd.data(), gd.data(), bd.data(), 1e-5, ry.data(), rmean.data(),
                                   rrstd.data());
    CHECK(rel_err(as_double(y), ry) <= 1e-2);
    CHECK(rel_err(as_double(mean), rmean) <= 1e-6);  // float, not rounded to bf16
    CHECK(rel_err(as_double(rstd), rrstd) <= 1e-5);
  }
  SECTION("cross-entropy: loss from bf16 logits in float arithmetic") {
    const std::int64_t rows = 7, cols = 300;
    const auto logits = random_bf16(rows * cols, -4, 4, 7);
    std::vector<std::int32_t> targets{0, 5, 299, -100, 17, 42, 3};
    std::vector<float> lse(rows);
    std::int64_t valid = 0, rvalid = 0;
    const double loss = kp::cross_entropy_forward(rows, cols, logits.data(), targets.data(), lse.data(), valid);
    const auto ld = as_double(logits);
    std::vector<double> rlse(rows);
    const double rloss = kp::cross_entropy_forward<double>(rows, cols, ld.data(), targets.data(), rlse.data(), rvalid);
    CHECK(valid == rvalid);
    CHECK(std::abs(loss - rloss) <= 1e-5 * std::abs(rloss));
    std::vector<bf16> d(logits.size());
    kp::cross_entropy_backward(rows, cols, logits.data(), lse.data(), targets.data(), valid, 1.0f, d.data());
    std::vector<double> rd(ld.size());
    kp::cross_entropy_backward<double>(rows, cols, ld.data(), rlse.data(), targets.data(), rvalid, 1.0, rd.data());
    CHECK(rel_err(as_double(d), rd) <= 1e-2);
  }
  SECTION("causal attention with dropout: the double kernel's masks and values") {
    const std::int64_t B = 2, S = 13, H = 2, D = 8, C = H * D;
    const auto qkv = random_bf16(B * S * 3 * C, -1, 1, 8), dy = random_bf16(B * S * C, -1, 1, 9);
    std::vector<bf16> probs(static_cast<std::size_t>(B * H * S * S)), drop(probs.size()), y(dy.size()),
        dqkv(qkv.size());
    const float scale = 1.0f / std::sqrt(8.0f);
    kp::causal_attention_forward(B, S, H, D, qkv.data(), scale, probs.data(), drop.data(), 0.2, 11, 5, y.data());
    kp::causal_attention_backward(B, S, H, D, qkv.data(), probs.data(), drop.data(), 0.2, 11, 5, dy.data(), scale,
                                  dqkv.data());
    const auto qd = as_double(qkv), dyd = as_double(dy);
    std::vector<double> rp(probs.size()), rdrop(probs.size()), ry(y.size()), rdq(qkv.size());
    kp::causal_attention_forward<double>(B, S, H, D, qd.data(), scale, rp.data(), rdrop.data(), 0.2, 11, 5,
                                         ry.data());
    kp::causal_attention_backward<double>(B, S, H, D, qd.data(), rp.data(), rdrop.data(), 0.2, 11, 5, dyd.data(),
                                          scale, rdq.data());
    std::int64_t mask_mismatches = 0;
    for (std::size_t i = 0; i < drop.size(); ++i) mask_mismatches += (static_cast<float>(drop[i]) == 0) != (rdrop[i] == 0);
    CHECK(mask_mismatches == 0);
    CHECK(rel_err(as_double(y), ry) <= 1e-2);
    CHECK(rel_err(as_double(probs), rp) <= 1e-2);
    CHECK(rel_err(as_double(dqkv), rdq) <= 1e-2);
  }
}

TEST_CASE("bf16 GPT step matches the double GPT with the same weights", "[bf16][gpt]") {
  nn::GPTConfig cfg{.vocab_size = 37, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32, .dropout = 0.1};
  for (bool tied : {true, false}) {
    cfg.tie_weights = tied;
    Generator g16(7), g64(8);
    nn::GPT<bf16> m16(cfg, g16);
    nn::GPT<double> m64(cfg, g64);
    copy_weights(m16, m64);
    const std::int64_t B = 3, S = 16;
    std::vector<std::int32_t> id_values(B * S), target_values(B * S);
    for (std::int64_t i = 0; i < B * S; ++i) {
      id_values[i] = static_cast<std::int32_t>((i * 7 + 3) % cfg.vocab_size);
      target_values[i] = static_cast<std::int32_t>((i * 5 + 1) % cfg.vocab_size);
    }
    const auto ids = Tensor<std::int32_t>::from(id_values, {B, S});
    const auto targets = Tensor<std::int32_t>::from(target_values, {B * S});
    nn::CrossEntropyLoss<bf16> l16;
    nn::CrossEntropyLoss<double> l64;
    nn::Cache<bf16> c16, lc16;
    nn::Cache<double> c64, lc64;
    // Training mode: both models draw the same dropout masks (counter-based streams).
    const double loss16 = l16.forward(m16.forward_tokens(ids, c16), targets, lc16);
    const double loss64 = l64.forward(m64.forward_tokens(ids, c64), targets, lc64);
    m16.backward(l16.backward(lc16), c16);
    m64.backward(l64.backward(lc64), c64);
    INFO("tied " << tied << " loss bf16 " << loss16 << " double " << loss64);
    CHECK(std::abs(loss16 - loss64) <= 1e-2 * std::abs(loss64));

    std::map<std::string, nn::Parameter<double>*> ref;
    for (auto& p : m64.named_parameters()) ref[p.name] = p.param;
    for (auto& p : m16.named_parameters()) {
      const auto got = as_double(p.param->grad.to_vector()), want = ref.at(p.name)->grad.to_vector();
      const double err = rel_err(got, want);
      INFO(p.name << " gradient relative error " << err);
      CHECK(err <= 5e-2);
    }
  }
}

TEST_CASE("AdamW on bf16 parameters keeps fp32 master weights that follow the double run", "[bf16][optim]") {
  nn::GPTConfig cfg{.vocab_size = 29, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 16};
  Generator g16(3), g64(4);
  nn::GPT<bf16> m16(cfg, g16);
  nn::GPT<double> m64(cfg, g64);
  copy_weights(m16, m64);
  nn::FlatParameters<bf16> f16(m16);
  nn::FlatParameters<double> f64(m64);
  const optim::AdamWOptions o{.lr = 1e-2, .weight_decay = 0.1};
  optim::AdamW<bf16> opt16(f16, o, nn::gpt_decay_filter());
  optim::AdamW<double> opt64(f64, o, nn::gpt_decay_filter());
  auto ids = Tensor<std::int32_t>::from(std::vector<std::int32_t>{1, 5, 9, 2, 28, 0, 3, 3}, {1, 8});
  auto targets = Tensor<std::int32_t>::from(std::vector<std::int32_t>{5, 9, 2, 28, 0, 3, 3, 7}, {8});
  nn::CrossEntropyLoss<bf16> l16;
  nn::CrossEntropyLoss<double> l64;
  double first = 0, last16 = 0, last64 = 0;
  for (int step = 0; step < 30; ++step) {
    nn::Cache<bf16> c16, lc16;
    nn::Cache<double> c64, lc64;
    f16.zero_grad();
    f64.zero_grad();
    last16 = l16.forward(m16.forward_tokens(ids, c16), targets, lc16);
    last64 = l64.forward(m64.forward_tokens(ids, c64), targets, lc64);
    if (step == 0) first = last64;
    m16.backward(l16.backward(lc16), c16);
    m64.backward(l64.backward(lc64), c64);
    opt16.step();
    opt64.step();
  }
  INFO("loss: first " << first << ", after 30 steps bf16 " << last16 << " double " << last64);
  CHECK(last64 < 0.5 * first);  // the run learns, so the comparison below means something
  CHECK(std::abs(last16 - last64) <= 0.05 * first);

  // State is float; the parameters are the bf16 rounding of the master weights, exactly.
  Tensor<float> master;
  for (const auto& [kind, buf] : opt16.flat_state())
    if (kind == "master") master = buf;
  REQUIRE(master.defined());
  const auto mv = master.to_vector();
  const auto pv = f16.values().to_vector();
  std::int64_t off_by_rounding = 0;
  for (std::size_t i = 0; i < mv.size(); ++i) off_by_rounding += pv[i].bits != bf16(mv[i]).bits;
  CHECK(off_by_rounding == 0);
}

TEST_CASE("AdamW's master weights keep updates smaller than bf16's spacing", "[bf16][optim]") {
  // Near 1, bf16 values are 2^-7 apart; a step of 1e-3 rounds back to 1 every
  // time in bf16 alone, but adds up in the fp32 master copy.
  auto values = Tensor<bf16>::from(std::vector<bf16>(4, bf16(1.0f)), {4});
  auto grads = Tensor<bf16>::from(std::vector<bf16>(4, bf16(0.5f)), {4});
  optim::AdamW<bf16> opt(values, grads, {}, {.lr = 1e-3, .weight_decay = 0.0});
  for (int i = 0; i < 10; ++i) opt.step();  // constant gradient: each Adam step is lr
  const Tensor<float>& master = opt.flat_state().back().second;
  REQUIRE(opt.flat_state().back().first == "master");
  for (float m : master.to_vector()) CHECK(std::abs(m - 0.99f) <= 1e-6f);
  for (bf16 v : values.to_vector()) CHECK(v.bits == bf16(0.99f).bits);  // 0.98828125, no longer 1
}

// ops::cast_into (what mixed precision and bf16 gradient compression use):
// against bit patterns rounded by hand (nearest even on the top 16 bits of the
// float: 1 + 2^-8 is a tie that stays 1, 65504 rounds up to 65536).
TEST_CASE("cast_into: float and double to bf16 and back; same type copies", "[bf16]") {
  const std::vector<double> d{1.0, -0.0, 1.0 + 1.0 / 256, 1.0 + 3.0 / 512, 3.14159265358979, -1e-30, 65504.0, 1e30};
  const std::vector<std::uint16_t> bits{0x3F80, 0x8000, 0x3F80, 0x3F81, 0x4049, 0x8DA2, 0x4780, 0x714A};
  const std::vector<double> want{1.0, -0.0, 1.0, 1.0078125, 3.140625, -9.98402083170343e-31, 65536.0,
                                 1.0002555517425873e+30};
  std::vector<float> f;
  for (double x : d) f.push_back(static_cast<float>(x));
  auto to16 = Tensor<bf16>::empty({8});
  ops::cast_into(Tensor<double>::from(d, {8}), to16);
  auto back = Tensor<double>::empty({8});
  ops::cast_into(to16, back);
  std::vector<std::uint16_t> got;
  for (bf16 v : to16.to_vector()) got.push_back(v.bits);
  CHECK(got == bits);
  const auto wide = back.to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(static_cast<float>(wide[i]) == static_cast<float>(want[i]));
  CHECK(std::signbit(wide[1]));
  auto from_float = Tensor<bf16>::empty({8});
  ops::cast_into(Tensor<float>::from(f, {8}), from_float);
  CHECK(as_double(from_float.to_vector()) == as_double(to16.to_vector()));
  auto copy = Tensor<float>::empty({8});
  ops::cast_into(Tensor<float>::from(f, {8}), copy);
  CHECK(copy.to_vector() == f);
  auto wrong = Tensor<bf16>::empty({7});
  CHECK_THROWS_WITH(ops::cast_into(Tensor<float>::from(f, {8}), wrong), Catch::Contains("cast destination"));
}

TEST_CASE("Token ids: int32 input equals float ids, and bf16 ids are refused", "[bf16][embedding]") {
  nn::GPTConfig cfg{.vocab_size = 300, .block_size = 4, .n_layer = 1, .n_head = 1, .n_embd = 8};
  nn::GPT<float> model(cfg);
  nn::Cache<float> a, b;
  const auto from_float = model.forward(Tensor<float>::from({257, 3, 299, 0}, {1, 4}), a).to_vector();
  const auto from_int = model.forward_tokens(Tensor<std::int32_t>::from(std::vector<std::int32_t>{257, 3, 299, 0}, {1, 4}), b)
                            .to_vector();
  CHECK(from_float == from_int);
  CHECK_THROWS_WITH(model.forward_tokens(Tensor<std::int32_t>::from(std::vector<std::int32_t>{1, 300}, {1, 2}), b),
                    Catch::Contains("[ptrain.embedding.id]") && Catch::Contains("300"));

  nn::GPT<bf16> m16(cfg);
  nn::Cache<bf16> c;
  CHECK_THROWS_WITH(m16.forward(Tensor<bf16>::from(std::vector<bf16>{bf16(1.0f), bf16(2.0f)}, {1, 2}), c),
                    Catch::Contains("[ptrain.embedding.bf16_ids]") && Catch::Contains("int32"));
}

// A bf16 run saved at step 3 and resumed into fresh objects continues with the
// same bits as the uninterrupted run: the checkpoint holds the bf16 parameters
// (BF16 in model.safetensors) and the optimizer's fp32 master weights and moments.
TEST_CASE("bf16 training resumes bitwise from a checkpoint", "[bf16][ckpt]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("ptrain_bf16_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  nn::GPTConfig cfg{.vocab_size = 23, .block_size = 8, .n_layer = 1, .n_head = 2, .n_embd = 16};
  struct Run {
    Generator gen;
    nn::GPT<bf16> model;
    nn::FlatParameters<bf16> flat;
    optim::AdamW<bf16> opt;
    explicit Run(const nn::GPTConfig& c) : gen(9), model(c, gen), flat(model), opt(flat, {.lr = 1e-2}) {}
  };
  auto ids = Tensor<std::int32_t>::from(std::vector<std::int32_t>{1, 5, 9, 2, 22, 0, 3, 3}, {1, 8});
  auto targets = Tensor<std::int32_t>::from(std::vector<std::int32_t>{5, 9, 2, 22, 0, 3, 3, 7}, {8});
  auto step = [&](Run& r) {
    nn::CrossEntropyLoss<bf16> ce;
    nn::Cache<bf16> c, lc;
    r.flat.zero_grad();
    ce.forward(r.model.forward_tokens(ids, c), targets, lc);
    r.model.backward(ce.backward(lc), c);
    r.opt.step();
  };
  Run a(cfg), b(cfg);
  ckpt::CheckpointManager mgr(dir);
  for (int s = 0; s < 3; ++s) step(a);
  mgr.save(3, a.flat, &a.opt, {});
  for (int s = 0; s < 3; ++s) step(a);

  mgr.load(mgr.latest().path, b.flat, &b.opt);
  CHECK(b.opt.steps() == 3);
  for (int s = 0; s < 3; ++s) step(b);
  std::int64_t differ = 0;
  const auto va = a.flat.values().to_vector(), vb = b.flat.values().to_vector();
  for (std::size_t i = 0; i < va.size(); ++i) differ += va[i].bits != vb[i].bits;
  CHECK(differ == 0);
  CHECK(a.opt.flat_state().back().second.to_vector() == b.opt.flat_state().back().second.to_vector());  // master

  // The file stores the parameters as BF16 and the optimizer state as F32.
  ckpt::Checkpoint c(mgr.latest().path);
  const auto first = a.model.named_parameters().front();
  CHECK_NOTHROW(c.check(first.name, first.param->value.shape(), DType::BF16));
  CHECK_NOTHROW(c.check(first.name + ".master", first.param->value.shape(), DType::F32));
  CHECK_THROWS_AS(c.check(first.name, first.param->value.shape(), DType::F32), CheckpointError);
  fs::remove_all(dir);
}

}  // namespace test_bf16
