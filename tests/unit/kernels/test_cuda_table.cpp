// The CUDA kernel table (kernels/cuda_table.hpp) without CUDA: this binary does
// not link ptrain::cuda, so the table is empty and a cuda tensor must fail with
// [ptrain.cuda.unavailable] naming the fix. Then a stand-in table and device
// backend (host memory posing as cuda:0, kernels that count their calls and run
// the CPU kernel) check that ops/ and optim/ reach the table for cuda tensors,
// pass their arguments through unchanged, and refuse missing entries.
#include <catch2/catch.hpp>

#include "unit/host_backend.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <ptrain/core/tensor.hpp>
#include <ptrain/kernels/cuda_table.hpp>
#include <ptrain/nn/flat_parameters.hpp>
#include <ptrain/nn/linear.hpp>
#include <ptrain/ops/activation.hpp>
#include <ptrain/ops/attention.hpp>
#include <ptrain/ops/gqa_attention.hpp>
#include <ptrain/ops/linear.hpp>
#include <ptrain/ops/loss.hpp>
#include <ptrain/ops/norm.hpp>
#include <ptrain/ops/optimizer.hpp>
#include <ptrain/ops/rotary.hpp>
#include <ptrain/ops/vocab_parallel.hpp>
#include <ptrain/optim/adamw.hpp>
#include <ptrain/optim/sgd.hpp>

namespace test_cuda_table {

using namespace ptrain;

namespace {

using ptrain_test::HostBackend;

struct Calls {
  int gelu = 0, gemm = 0, bias_add = 0, adamw = 0, cast = 0, rms_norm = 0, rotary = 0, vocab_embedding = 0,
      gqa_forward = 0, gqa_backward = 0, gqa_decode = 0, adamw_ranges = 0, sum_squares_to = 0, fused_classifier = 0;
  // the row kernels: verified, and read once
  int ln = 0, ln_backward = 0, ln_one_read = 0, ln_backward_one_read = 0, residual_ln = 0, residual_ln_backward = 0,
      softmax = 0, softmax_backward = 0, softmax_one_read = 0, softmax_backward_one_read = 0;
};
Calls& calls() {
  static Calls c;
  return c;
}

void fake_gelu(std::int64_t n, const float* x, float* y) {
  ++calls().gelu;
  kernels::cpu::gelu_forward(n, x, y);
}
void fake_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
               std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  ++calls().gemm;
  kernels::cpu::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
bool no_epilogue(std::int64_t, std::int64_t, std::int64_t, const float*, const float*, const float*, float*, float*,
                 bool) {
  return false;
}
void fake_bias_add(std::int64_t rows, std::int64_t cols, float* y, const float* b) {
  ++calls().bias_add;
  kernels::cpu::bias_add(rows, cols, y, b);
}
void fake_adamw(std::int64_t n, double* p, const double* g, double* m, double* v, double lr, double b1, double b2,
                double eps, double wd, std::int64_t step) {
  ++calls().adamw;
  kernels::cpu::adamw_update(n, p, g, m, v, lr, b1, b2, eps, wd, step);
}
void fake_cast(std::int64_t n, const float* x, bf16* y) {
  ++calls().cast;
  kernels::cpu::cast(n, x, y);
}

void fake_rms_norm(std::int64_t rows, std::int64_t d, const float* x, const float* w, float eps, float* y,
                   float* rstd) {
  ++calls().rms_norm;
  kernels::cpu::rms_norm_forward(rows, d, x, w, eps, y, rstd);
}
void fake_rotary(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D, const std::int32_t* positions,
                 std::int64_t stride, const kernels::RotaryFreqs& freqs, bool inverse, float* x) {
  ++calls().rotary;
  kernels::cpu::rotary_apply(B, S, H, D, positions, stride, freqs, inverse, x);
}
void fake_vocab_embedding(std::int64_t rows, std::int64_t dim, const std::int32_t* ids, std::int64_t lo,
                          std::int64_t local, const float* table, const float* pos, std::int64_t seq, float* out) {
  ++calls().vocab_embedding;
  kernels::cpu::vocab_parallel_embedding_forward(rows, dim, ids, lo, local, table, pos, seq, out);
}

void fake_gqa_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D, const float* q,
                      std::int64_t ldq, const float* k, const float* v, std::int64_t ldkv, const std::int32_t* starts,
                      std::int64_t window, float scale, float* y, float* lse) {
  ++calls().gqa_forward;
  kernels::cpu::gqa_flash_forward(B, S, H, Hkv, D, q, ldq, k, v, ldkv, starts, window, scale, y, lse);
}
void fake_gqa_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t D,
                       const float* q, std::int64_t ldq, const float* k, const float* v, std::int64_t ldkv,
                       const std::int32_t* starts, std::int64_t window, const float* y, const float* lse,
                       const float* dy, float scale, float* dq, float* dk, float* dv) {
  ++calls().gqa_backward;
  kernels::cpu::gqa_flash_backward(B, S, H, Hkv, D, q, ldq, k, v, ldkv, starts, window, y, lse, dy, scale, dq, dk, dv);
}
void fake_gqa_decode(std::int64_t s, std::int64_t n, std::int64_t H, std::int64_t Hkv, std::int64_t D, const float* q,
                     const float* k, const float* v, std::int64_t window, double scale, float* y) {
  ++calls().gqa_decode;
  kernels::cpu::gqa_attention_decode(s, n, H, Hkv, D, q, k, v, window, scale, y);
}

bool no_flash(std::int64_t, const float*) { return false; }

// Sets PTRAIN_UNVERIFIED_CUDA to `value` (nullptr: unsets it) for a scope, then restores it.
struct ScopedGate {
  std::optional<std::string> was;
  explicit ScopedGate(const char* value) {
    if (const char* v = std::getenv("PTRAIN_UNVERIFIED_CUDA")) was = v;
    if (value) ::setenv("PTRAIN_UNVERIFIED_CUDA", value, 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
  ~ScopedGate() {
    if (was) ::setenv("PTRAIN_UNVERIFIED_CUDA", was->c_str(), 1);
    else ::unsetenv("PTRAIN_UNVERIFIED_CUDA");
  }
};

void fake_adamw_ranges(std::int64_t n, std::int64_t k, const std::int64_t* ends, const std::uint8_t* decay, double* p,
                       const double* g, double* m, double* v, bf16* param, const kernels::AdamWStep& s) {
  ++calls().adamw_ranges;
  kernels::cpu::adamw_update_ranges(n, k, ends, decay, p, g, m, v, param, s);
}
void fake_sum_squares_to(std::int64_t n, const double* x, double* out) {
  ++calls().sum_squares_to;
  kernels::cpu::sum_squares_to(n, x, out);
}
void fake_fused_classifier(std::int64_t rows, std::int64_t cols, float* logits, const std::int32_t* targets,
                           std::int32_t ignore, float eps, float dloss, double w, double* loss) {
  ++calls().fused_classifier;
  kernels::cpu::fused_classifier(rows, cols, logits, targets, ignore, eps, dloss, w, loss);
}

void fake_ln(std::int64_t rows, std::int64_t d, const float* x, const float* g, const float* b, float eps, float* y,
             float* mean, float* rstd) {
  ++calls().ln;
  kernels::cpu::layer_norm_forward(rows, d, x, g, b, eps, y, mean, rstd);
}
void fake_ln_one_read(std::int64_t rows, std::int64_t d, const float* x, const float* g, const float* b, float eps,
                      float* y, float* mean, float* rstd) {
  ++calls().ln_one_read;
  kernels::cpu::layer_norm_forward(rows, d, x, g, b, eps, y, mean, rstd);
}
void fake_ln_backward(std::int64_t rows, std::int64_t d, const float* x, const float* mean, const float* rstd,
                      const float* g, const float* dy, float* dx, float* dg, float* db) {
  ++calls().ln_backward;
  kernels::cpu::layer_norm_backward(rows, d, x, mean, rstd, g, dy, dx, dg, db);
}
void fake_ln_backward_one_read(std::int64_t rows, std::int64_t d, const float* x, const float* mean, const float* rstd,
                               const float* g, const float* dy, float* dx, float* dg, float* db) {
  ++calls().ln_backward_one_read;
  kernels::cpu::layer_norm_backward(rows, d, x, mean, rstd, g, dy, dx, dg, db);
}
void fake_residual_ln(std::int64_t rows, std::int64_t d, const float* x, const float* r, const float* g,
                      const float* b, float eps, float* h, float* y, float* mean, float* rstd) {
  ++calls().residual_ln;
  kernels::cpu::residual_layer_norm_forward(rows, d, x, r, g, b, eps, h, y, mean, rstd);
}
void fake_residual_ln_backward(std::int64_t rows, std::int64_t d, const float* h, const float* mean, const float* rstd,
                               const float* g, const float* dy, const float* dr, float* dh, float* dg, float* db) {
  ++calls().residual_ln_backward;
  kernels::cpu::residual_layer_norm_backward(rows, d, h, mean, rstd, g, dy, dr, dh, dg, db);
}
void fake_softmax(std::int64_t rows, std::int64_t cols, const float* x, float* y) {
  ++calls().softmax;
  kernels::cpu::softmax_rows(rows, cols, x, y);
}
void fake_softmax_one_read(std::int64_t rows, std::int64_t cols, const float* x, float* y) {
  ++calls().softmax_one_read;
  kernels::cpu::softmax_rows(rows, cols, x, y);
}
void fake_softmax_backward(std::int64_t rows, std::int64_t cols, const float* y, const float* dy, float* dx) {
  ++calls().softmax_backward;
  kernels::cpu::softmax_rows_backward(rows, cols, y, dy, dx);
}
void fake_softmax_backward_one_read(std::int64_t rows, std::int64_t cols, const float* y, const float* dy, float* dx) {
  ++calls().softmax_backward_one_read;
  kernels::cpu::softmax_rows_backward(rows, cols, y, dy, dx);
}

// Installs the stand-ins for a scope and empties both slots again afterwards.
struct FakeCuda {
  HostBackend backend;
  kernels::CudaKernelTable table;
  FakeCuda() {
    calls() = {};
    table.f32.gelu_forward = &fake_gelu;
    table.f32.gemm = &fake_gemm;
    table.f32.linear_epilogue = &no_epilogue;
    table.f32.bias_add = &fake_bias_add;
    table.f32.cast_to_bf16 = &fake_cast;
    table.f64.adamw_update = &fake_adamw;
    table.f32.rms_norm_forward = &fake_rms_norm;
    table.f32.rotary_apply = &fake_rotary;
    table.f32.vocab_parallel_embedding_forward = &fake_vocab_embedding;
    table.f32.gqa_flash_forward = &fake_gqa_forward;
    table.f32.gqa_flash_backward = &fake_gqa_backward;
    table.f32.gqa_attention_decode = &fake_gqa_decode;
    table.f32.flash_attention_supported = &no_flash;
    table.f64.adamw_update_ranges = &fake_adamw_ranges;
    table.f64.sum_squares_to = &fake_sum_squares_to;
    table.f32.fused_classifier = &fake_fused_classifier;
    table.f32.layer_norm_forward = &fake_ln;
    table.f32.layer_norm_backward = &fake_ln_backward;
    table.f32.layer_norm_forward_one_read = &fake_ln_one_read;
    table.f32.layer_norm_backward_one_read = &fake_ln_backward_one_read;
    table.f32.residual_layer_norm_forward = &fake_residual_ln;
    table.f32.residual_layer_norm_backward = &fake_residual_ln_backward;
    table.f32.softmax_rows = &fake_softmax;
    table.f32.softmax_rows_backward = &fake_softmax_backward;
    table.f32.softmax_rows_one_read = &fake_softmax_one_read;
    table.f32.softmax_rows_backward_one_read = &fake_softmax_backward_one_read;
    kernels::detail::cuda_kernel_table_slot() = &table;
    ptrain::detail::cuda_backend_slot() = &backend;
  }
  ~FakeCuda() {
    kernels::detail::cuda_kernel_table_slot() = nullptr;
    ptrain::detail::cuda_backend_slot() = nullptr;
  }
};

const Device kFakeGpu = Device::cuda(0);

}  // namespace

TEST_CASE("cuda table: a program without ptrain::cuda says what to link", "[kernels][cuda_table]") {
  REQUIRE_FALSE(kernels::cuda_kernels_linked());
  CHECK_THROWS_WITH(kernels::cuda_kernels<float>(),
                    Catch::Contains("[ptrain.cuda.unavailable]") && Catch::Contains("ptrain::cuda"));
  CHECK_THROWS_WITH(Tensor<float>::empty({2}, Device::cuda(0)),
                    Catch::Contains("[ptrain.cuda.unavailable]") && Catch::Contains("ptrain::cuda"));
}

TEST_CASE("cuda table: ops on cuda tensors call the table's kernels", "[kernels][cuda_table]") {
  FakeCuda fake;
  REQUIRE(kernels::cuda_kernels_linked());
  const std::vector<float> xs{-2.0f, -0.5f, 0.0f, 0.25f, 1.0f, 3.0f};
  const auto x_cpu = Tensor<float>::from(xs, {2, 3});
  const auto x_gpu = x_cpu.to(kFakeGpu);
  REQUIRE(x_gpu.device() == kFakeGpu);

  SECTION("elementwise: the CPU path does not touch the table, the cuda path does") {
    const auto y_cpu = ops::gelu(x_cpu);
    CHECK(calls().gelu == 0);
    const auto y_gpu = ops::gelu(x_gpu);
    CHECK(calls().gelu == 1);
    CHECK(y_gpu.device() == kFakeGpu);
    // gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), by hand in double.
    const auto got = y_gpu.to_vector();
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double v = xs[i];
      const double want = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      CHECK(got[i] == Approx(want).margin(1e-6));
    }
    CHECK(got == y_cpu.to_vector());
  }
  SECTION("a linear layer: GEMM and bias from the table") {
    const auto w = Tensor<float>::from({1.0f, 2.0f, 3.0f, -1.0f, 0.0f, 1.0f}, {2, 3}).to(kFakeGpu);
    const auto b = Tensor<float>::from({0.5f, -0.5f}, {2}).to(kFakeGpu);
    const auto y = ops::linear(x_gpu, w, b).to_vector();
    CHECK(calls().gemm == 1);
    CHECK(calls().bias_add == 1);
    // rows of x times rows of w, plus b
    CHECK(y == std::vector<float>{-2.0f + -1.0f + 0.0f + 0.5f, 2.0f + 0.0f + 0.0f - 0.5f,
                                  0.25f + 2.0f + 9.0f + 0.5f, -0.25f + 0.0f + 3.0f - 0.5f});
  }
  SECTION("casts go through the float table's bf16 entry") {
    auto out = Tensor<bf16>::empty({2, 3}, kFakeGpu);
    ops::cast_into(x_gpu, out);
    CHECK(calls().cast == 1);
    const auto got = out.to_vector();
    for (std::size_t i = 0; i < xs.size(); ++i) CHECK(static_cast<float>(got[i]) == xs[i]);  // exact in bf16
  }
  SECTION("optimizers step through ops:: and the table") {
    nn::Linear<double> lin(2, 1, false);
    lin.weight().value.data()[0] = 1.0;
    lin.weight().value.data()[1] = -1.0;
    lin.to(kFakeGpu);
    nn::FlatParameters<double> flat(lin);
    lin.weight().grad.copy_(Tensor<double>::from({0.5, -2.0}, {1, 2}));  // a view into flat.grads()
    optim::AdamW<double> adamw(flat, {.lr = 0.1, .weight_decay = 0.0});
    adamw.step();
    CHECK(calls().adamw + calls().adamw_ranges == 1);  // the one-launch kernel once the gate lets it
    // First AdamW step without decay: p -= lr * g / (|g| + eps'), i.e. lr * sign(g) up to eps.
    const auto p = lin.weight().value.to_vector();
    CHECK(p[0] == Approx(1.0 - 0.1).epsilon(1e-6));
    CHECK(p[1] == Approx(-1.0 + 0.1).epsilon(1e-6));
  }
  SECTION("rms_norm and rotary: the Llama ops reach the table") {
    {
      ScopedGate off(nullptr);  // refused by the gate (Note [The verification gate]) unless allowed
      const auto w = Tensor<float>::from({1.0f, 2.0f, 0.5f}, {3}).to(kFakeGpu);
      Tensor<float> rstd;
      CHECK_THROWS_WITH(ops::rms_norm(x_gpu, w, 1e-6f, rstd),
                        Catch::Contains("[ptrain.cuda.unverified]") && Catch::Contains("rms_norm_forward"));
      CHECK(calls().rms_norm == 0);
    }
    ScopedGate allow("1");
    const auto w_cpu = Tensor<float>::from({1.0f, 2.0f, 0.5f}, {3});
    Tensor<float> rstd_cpu, rstd_gpu;
    const auto y_cpu = ops::rms_norm(x_cpu, w_cpu, 1e-6f, rstd_cpu);
    CHECK(calls().rms_norm == 0);
    const auto y_gpu = ops::rms_norm(x_gpu, w_cpu.to(kFakeGpu), 1e-6f, rstd_gpu);
    CHECK(calls().rms_norm == 1);
    CHECK(y_gpu.device() == kFakeGpu);
    CHECK(rstd_gpu.device() == kFakeGpu);
    CHECK(y_gpu.to_vector() == y_cpu.to_vector());
    CHECK(rstd_gpu.to_vector() == rstd_cpu.to_vector());
    // q [1, 2, 1, 2]: D = 2 has the one frequency theta^0 = 1, so position 1 rotates
    // (lo, hi) by 1 radian and position 0 leaves it as it is.
    auto q = Tensor<float>::from({1.0f, 2.0f, 3.0f, 4.0f}, {1, 2, 1, 2}).to(kFakeGpu);
    const auto positions = Tensor<std::int32_t>::from({0, 1}, {2}).to(kFakeGpu);
    ops::rotary_(q, {.theta = 1.0}, positions);
    CHECK(calls().rotary == 1);
    const auto got = q.to_vector();
    CHECK(got[0] == 1.0f);
    CHECK(got[1] == 2.0f);
    CHECK(got[2] == Approx(-4.0 * std::sin(1.0) + 3.0 * std::cos(1.0)).margin(1e-6));
    CHECK(got[3] == Approx(4.0 * std::cos(1.0) + 3.0 * std::sin(1.0)).margin(1e-6));
  }
  SECTION("the vocabulary-parallel lookup reaches the table, behind the verification gate") {
    // Rows [2, 4) of a 5-row vocabulary on this rank: ids 2 and 3 are its rows 0 and 1, the rest zero rows.
    const auto table = Tensor<float>::from({1.0f, 2.0f, 3.0f, 4.0f}, {2, 2}).to(kFakeGpu);
    const auto ids = Tensor<std::int32_t>::from({0, 2, 3, 4}, {2, 2}).to(kFakeGpu);
    {
      ScopedGate off(nullptr);
      CHECK_THROWS_WITH(ops::vocab_parallel_embedding(ids, 2, table, Tensor<float>()),
                        Catch::Contains("[ptrain.cuda.unverified]") &&
                            Catch::Contains("vocab_parallel_embedding_forward"));
      CHECK(calls().vocab_embedding == 0);
    }
    ScopedGate allow("1");
    const auto out = ops::vocab_parallel_embedding(ids, 2, table, Tensor<float>());
    CHECK(calls().vocab_embedding == 1);
    CHECK(out.device() == kFakeGpu);
    CHECK(out.to_vector() == std::vector<float>{0, 0, 1, 2, 3, 4, 0, 0});
  }
  SECTION("grouped-query attention: the flash entries, gated, with the saved state on the device") {
    const std::int64_t B = 1, S = 5, H = 2, Hkv = 1, D = 2;
    std::vector<float> qs, ks;
    for (int i = 0; i < B * S * H * D; ++i) qs.push_back(0.1f * static_cast<float>(i % 7) - 0.3f);
    for (int i = 0; i < B * S * Hkv * D; ++i) ks.push_back(0.2f * static_cast<float>(i % 5) - 0.4f);
    const auto q_cpu = Tensor<float>::from(qs, {B, S, H, D}), k_cpu = Tensor<float>::from(ks, {B, S, Hkv, D});
    const auto q = q_cpu.to(kFakeGpu), k = k_cpu.to(kFakeGpu);
    ops::GqaSaved<float> saved;
    if (kernels::cuda_unverified("gqa_flash_forward")) {  // while gated, refused without the variable
      ScopedGate gated(nullptr);
      CHECK_THROWS_WITH(ops::gqa_attention(q, k, k, saved),
                        Catch::Contains("[ptrain.cuda.unverified]") && Catch::Contains("gqa_flash_forward"));
      CHECK(calls().gqa_forward == 0);
    }
    ScopedGate allowed("1");
    const auto starts = Tensor<std::int32_t>::from({0, 0, 2, 2, 2}, {B, S});
    CHECK_THROWS_WITH(ops::gqa_attention(q, k, k, saved, starts), Catch::Contains("[ptrain.device.mismatch]"));
    const auto y = ops::gqa_attention(q, k, k, saved, starts.to(kFakeGpu), 2);
    CHECK(calls().gqa_forward == 1);
    CHECK(y.device() == kFakeGpu);
    CHECK(saved.lse.device() == kFakeGpu);
    CHECK(saved.lse.shape() == Shape{B, H, S});
    CHECK_FALSE(saved.probs.defined());
    ops::GqaSaved<float> cpu_saved;
    const auto y_cpu = ops::gqa_attention(q_cpu, k_cpu, k_cpu, cpu_saved, starts, 2);
    CHECK(calls().gqa_forward == 1);  // the CPU path keeps the materialised kernel
    const auto got = y.to_vector(), want = y_cpu.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-6));
    Tensor<float> dq, dk, dv, dq_cpu, dk_cpu, dv_cpu;
    ops::gqa_attention_backward(q, k, k, saved, y, dq, dk, dv);
    ops::gqa_attention_backward(q_cpu, k_cpu, k_cpu, cpu_saved, y_cpu, dq_cpu, dk_cpu, dv_cpu);
    CHECK(calls().gqa_backward == 1);
    CHECK(dk.device() == kFakeGpu);
    const auto gk = dk.to_vector(), wk = dk_cpu.to_vector();
    for (std::size_t i = 0; i < gk.size(); ++i) CHECK(gk[i] == Approx(wk[i]).margin(1e-6));
    const auto yd = ops::gqa_attention_decode(q.view(3 * H * D, {1, 2, H, D}), k, k, S, 2);
    CHECK(calls().gqa_decode == 1);
    const auto gd = yd.to_vector();
    for (std::size_t i = 0; i < gd.size(); ++i) CHECK(gd[i] == Approx(want[3 * H * D + i]).margin(1e-6));
  }
  SECTION("GPT's packed attention in float without dropout reaches the grouped-query entries") {
    const std::int64_t B = 1, S = 4, H = 2, D = 2, C = H * D;
    std::vector<float> vals;
    for (int i = 0; i < B * S * 3 * C; ++i) vals.push_back(0.05f * static_cast<float>((i * 7) % 13) - 0.3f);
    const auto qkv_cpu = Tensor<float>::from(vals, {B, S, 3 * C});
    ScopedGate allowed("1");
    ops::AttentionSaved<float> saved, cpu_saved;
    const auto y = ops::causal_attention(qkv_cpu.to(kFakeGpu), H, 0.0, 0, 0, saved);
    CHECK(calls().gqa_forward == 1);
    CHECK(saved.lse.defined());
    const auto y_cpu = ops::causal_attention(qkv_cpu, H, 0.0, 0, 0, cpu_saved);
    const auto got = y.to_vector(), want = y_cpu.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-6));
    const auto dqkv = ops::causal_attention_backward(qkv_cpu.to(kFakeGpu), saved, H, y).to_vector();
    const auto dqkv_cpu = ops::causal_attention_backward(qkv_cpu, cpu_saved, H, y_cpu).to_vector();
    CHECK(calls().gqa_backward == 1);
    for (std::size_t i = 0; i < dqkv.size(); ++i) CHECK(dqkv[i] == Approx(dqkv_cpu[i]).margin(1e-6));
  }
  SECTION("AdamW takes the one-launch kernel once the gate lets it, the per-range kernel before") {
    auto run = [](optim::AdamWOptions o) {
      nn::Linear<double> lin(2, 2, true);
      for (int i = 0; i < 4; ++i) lin.weight().value.data()[i] = 0.25 * i - 0.5;
      for (int i = 0; i < 2; ++i) lin.bias()->value.data()[i] = 0.125 * i + 0.5;
      lin.to(kFakeGpu);
      nn::FlatParameters<double> flat(lin);
      lin.weight().grad.copy_(Tensor<double>::from({0.5, -2.0, 1.0, 0.25}, {2, 2}));  // views into flat.grads()
      lin.bias()->grad.copy_(Tensor<double>::from({3.0, -1.0}, {2}));
      optim::AdamW<double> adamw(flat, o, [](const std::string& name) { return name != "bias"; });
      adamw.step();
      return flat.values().to_vector();
    };
    const optim::AdamWOptions o{.lr = 0.1, .weight_decay = 0.5};
    const auto per_range = run(o);
    if (!kernels::cuda_kernel_enabled("adamw_update_ranges")) {
      CHECK(calls().adamw == 2);  // two ranges: the weight decays, the bias does not
      CHECK(calls().adamw_ranges == 0);
    }
    calls() = {};
    ScopedGate allow("1");
    CHECK(run(o) == per_range);  // the same arithmetic
    CHECK(calls().adamw_ranges == 1);
    CHECK(calls().adamw == 0);
    CHECK(calls().sum_squares_to == 0);
    auto clipped = o;
    clipped.max_grad_norm = 0.1;
    const auto c = run(clipped);
    CHECK(calls().sum_squares_to == 1);
    CHECK(calls().adamw_ranges == 2);
    CHECK(c != per_range);
  }
  SECTION("the fused classifier reaches the table once the gate lets it") {
    auto logits = x_gpu.clone();
    const auto targets = Tensor<std::int32_t>::from({2, 0}, {2}).to(kFakeGpu);
    ops::DeviceLoss loss;
    if (!kernels::cuda_kernel_enabled("fused_classifier")) {
      // Gated: the verified kernels run, which this stand-in table lacks.
      CHECK_THROWS_WITH(ops::fused_classifier_(logits, targets, loss),
                        Catch::Contains("[ptrain.cuda.unsupported]") && Catch::Contains("cross_entropy_forward"));
    }
    ScopedGate allow("1");
    ops::fused_classifier_(logits, targets, loss);
    CHECK(calls().fused_classifier == 1);
    CHECK(loss.device() == kFakeGpu);
    auto cpu_logits = x_cpu.clone();
    ops::DeviceLoss cpu_loss;
    ops::fused_classifier_(cpu_logits, targets.to(Device::cpu()), cpu_loss);
    CHECK(logits.to_vector() == cpu_logits.to_vector());
    CHECK(loss.mean() == cpu_loss.mean());
    CHECK(loss.mean() > 0);
  }
  SECTION("LayerNorm and softmax take the one-read kernels once the gate lets them, the verified ones before") {
    const auto gamma = Tensor<float>::from({0.5f, 1.0f, 2.0f}, {3}).to(kFakeGpu);
    const auto beta = Tensor<float>::from({0.0f, -1.0f, 1.0f}, {3}).to(kFakeGpu);
    auto run = [&] {
      Tensor<float> mean, rstd;
      auto dg = Tensor<float>::zeros({3}, kFakeGpu), db = Tensor<float>::zeros({3}, kFakeGpu);
      auto y = ops::layer_norm(x_gpu, gamma, beta, 1e-5f, mean, rstd);
      ops::layer_norm_backward(x_gpu, mean, rstd, gamma, y, dg, db);
      ops::softmax_backward(ops::softmax(x_gpu), x_gpu);
    };
    if (!kernels::cuda_kernel_enabled("layer_norm_forward_one_read")) {
      run();
      CHECK(calls().ln == 1);
      CHECK(calls().ln_backward == 1);
      CHECK(calls().softmax == 1);
      CHECK(calls().softmax_backward == 1);
      CHECK(calls().ln_one_read + calls().ln_backward_one_read + calls().softmax_one_read +
                calls().softmax_backward_one_read == 0);
      // GPT's block keeps the add and the verified LayerNorm; the fused op itself is refused.
      CHECK_FALSE(ops::residual_layer_norm_usable<float>(kFakeGpu));
      Tensor<float> h, mean, rstd;
      CHECK_THROWS_WITH(ops::residual_layer_norm(x_gpu, x_gpu, gamma, beta, 1e-5f, h, mean, rstd),
                        Catch::Contains("[ptrain.cuda.unverified]") && Catch::Contains("residual_layer_norm_forward"));
    }
    CHECK(ops::residual_layer_norm_usable<float>(Device::cpu()));
    calls() = {};
    ScopedGate allow("1");
    run();
    CHECK(calls().ln_one_read == 1);
    CHECK(calls().ln_backward_one_read == 1);
    CHECK(calls().softmax_one_read == 1);
    CHECK(calls().softmax_backward_one_read == 1);
    CHECK(calls().ln + calls().ln_backward + calls().softmax + calls().softmax_backward == 0);
    CHECK(ops::residual_layer_norm_usable<float>(kFakeGpu));
    Tensor<float> h, mean, rstd;
    auto dg = Tensor<float>::zeros({3}, kFakeGpu), db = Tensor<float>::zeros({3}, kFakeGpu);
    const auto y = ops::residual_layer_norm(x_gpu, x_gpu, gamma, beta, 1e-5f, h, mean, rstd);
    ops::residual_layer_norm_backward(h, mean, rstd, gamma, y, x_gpu, dg, db);
    CHECK(calls().residual_ln == 1);
    CHECK(calls().residual_ln_backward == 1);
    CHECK(h.device() == kFakeGpu);
  }
  SECTION("an entry the table lacks is refused, not called") {
    CHECK_THROWS_WITH(ops::relu(x_gpu),
                      Catch::Contains("[ptrain.cuda.unsupported]") && Catch::Contains("relu_forward"));
    auto p = x_gpu.clone();
    Tensor<float> none;
    CHECK_THROWS_WITH(ops::sgd_update_(p, x_gpu, none, 0.1f, 0.0f, 0.0f, false, 0.0f, true),
                      Catch::Contains("[ptrain.cuda.unsupported]") && Catch::Contains("sgd_update"));
  }
}

}  // namespace test_cuda_table
