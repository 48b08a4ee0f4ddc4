// GPU benchmarks on cuda:0: GEMM throughput, memory-bound kernels against the
// device's copy bandwidth, and a GPT training step. One JSON line per
// measurement on stdout, a readable table on stderr. benchmarks/gpu_bench.py is
// the PyTorch twin (same shapes, same JSON fields, "impl": "pytorch") and
// tools/gpu/run.sh runs both side by side.
//
// Timing: CUDA events on the current stream around `reps` back-to-back calls,
// reps chosen so that one sample lasts about --sample-ms; the median (and min)
// over --samples samples, after warmup. Events measure GPU time, so host-side
// launch overhead shows only where the GPU runs dry.
//
// Shapes follow the GPT flags (default GPT-2 small at batch 8: M = 8 * 1024
// tokens, width C = 768, vocab V = 50304):
//   gemm       Y[M,N] = X[M,K] W[N,K]^T for each linear layer (K, N) and its two
//              backward products, in FP32, TF32 and bf16 (fp32 accumulation);
//              FLOPs = 2 M N K each. In bf16 also the backward with its
//              cuBLASLt epilogues against the same work apart (GEMM, then the
//              bias gradient, and for the MLP's second layer the GELU's gradient).
//   bandwidth  bytes moved counted by hand per kernel (the minimum each must
//              read and write once); GB/s and the fraction of the measured
//              device-to-device copy bandwidth.
//   gpt        forward, cross-entropy, backward, AdamW on nn::GPT<float> with
//              TF32 GEMMs, then on nn::GPT<bf16> (bf16 parameters and
//              activations, fp32 master weights, fused attention unless
//              --no-flash; --no-bf16 skips it); --no-epilogues runs both
//              without cuBLASLt's fused epilogues; FLOPs
//              per token from GPTConfig::flops_per_token.
//   llama      the same step on nn::Llama<bf16> in Llama 3.2 1B's shape (grouped-
//              query attention, RMSNorm, rotary, SwiGLU) at batch 4 x 2048 tokens.
//   attention  the fused causal attention alone, forward and forward +
//              backward, head widths 64 and 128, sequence 1024 to 8192;
//              TFLOP/s on the causal half of the products. Then the
//              tensor-core kernels (flash_tc_attention.cuh, backend
//              "ptrain_flash_tc"), causal and not, on the same shapes.
//   moe        the experts' GEMMs of one projection in bf16 (forward, input and
//              weight gradients), one grouped cuBLAS call against one GEMM per
//              expert, 8 and 64 experts (no PyTorch twin).
//
// A section that throws (out of memory, say) prints a "gpu_error" line and the
// others still run; the exit code is then 1.

#include <cuda_runtime.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/all.cuh"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/llama.hpp"
#include "ptrain/ops/linear.hpp"
#include "ptrain/optim/adamw.hpp"
#include "ptrain/train/step_graph.hpp"

using namespace ptrain;
namespace kc = ptrain::kernels::cuda;

namespace {

const Device kGpu = Device::cuda(0);

struct Options {
  nn::GPTConfig cfg{.vocab_size = 50304, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768};
  std::int64_t batch = 8;
  // The Llama-shaped step: Llama 3.2 1B's shape (16 layers, width 2048, 32 query and
  // 8 key-value heads of width 64, SwiGLU 8192, vocabulary 128256, tied embeddings,
  // rope theta 500000) at batch 4 x sequence 2048.
  nn::LlamaConfig llama{.vocab_size = 128256, .n_layer = 16, .n_head = 32, .n_kv_head = 8, .n_embd = 2048,
                        .intermediate_size = 8192, .max_seq_len = 2048, .rope = {.theta = 500000.0},
                        .tie_weights = true};
  std::int64_t llama_batch = 4;
  int samples = 7;
  double sample_ms = 20.0;
  int steps = 10, warmup = 3;
  bool fp = true, tf32 = true, bf16 = true, flash = true, epilogues = true;
  bool graph = false;  // --cuda-graph: the GPT step captured once and replayed (Note [CUDA graphs of the step])
  double peak_tflops = 494.7, peak_tflops_bf16 = 989.4;
  std::string gpu_name;
};

// Uniform values in [lo, hi) from the Philox stream `seed`, so inputs are
// reproducible and no host copy of a multi-GB buffer is needed.
__global__ void fill_uniform_kernel(std::int64_t n, float* x, float lo, float hi, std::uint64_t seed) {
  for (std::int64_t i = kc::detail::global_index(); i < n; i += kc::detail::grid_stride()) {
    const std::uint32_t bits = ptrain::detail::philox(seed, static_cast<std::uint64_t>(i)).x[0];
    x[i] = lo + (hi - lo) * ptrain::detail::to_unit_float(bits);
  }
}

// Integers in [0, below): targets as int32, token ids as float (the model's input type).
template <class T>
__global__ void fill_index_kernel(std::int64_t n, T* x, std::uint32_t below, std::uint64_t seed) {
  for (std::int64_t i = kc::detail::global_index(); i < n; i += kc::detail::grid_stride())
    x[i] = static_cast<T>(ptrain::detail::philox(seed, static_cast<std::uint64_t>(i)).x[0] % below);
}

Tensor<float> uniform(const Shape& shape, float lo, float hi, std::uint64_t seed) {
  auto t = Tensor<float>::empty(shape, kGpu);
  fill_uniform_kernel<<<kc::detail::grid_for(t.numel()), kc::detail::kBlock, 0, kc::current_stream(0)>>>(
      t.numel(), t.data(), lo, hi, seed);
  PTRAIN_CHECK_CUDA_LAUNCH();
  return t;
}

template <class T>
Tensor<T> indices(const Shape& shape, std::int64_t below, std::uint64_t seed) {
  auto t = Tensor<T>::empty(shape, kGpu);
  const std::int64_t n = t.numel();
  fill_index_kernel<T><<<kc::detail::grid_for(n), kc::detail::kBlock, 0, kc::current_stream(0)>>>(
      n, t.data(), static_cast<std::uint32_t>(below), seed);
  PTRAIN_CHECK_CUDA_LAUNCH();
  return t;
}

struct Timing {
  double median_ms = 0, min_ms = 0;
  int reps = 0;
};

// Per-call GPU time of f(): one timed call sizes `reps` so that a sample lasts
// about sample_ms, then `samples` samples of reps back-to-back calls.
Timing time_gpu(const Options& o, const std::function<void()>& f) {
  const cudaStream_t stream = kc::current_stream(0);
  kc::Event start(true), stop(true);
  f();  // first call: lazy handles, cached allocator blocks
  start.record(stream);
  f();
  stop.record(stream);
  stop.synchronize();
  const double once = std::max(1e-3, static_cast<double>(stop.elapsed_ms(start)));
  Timing t;
  t.reps = static_cast<int>(std::clamp(std::ceil(o.sample_ms / once), 1.0, 10000.0));
  std::vector<double> per_call;
  for (int s = 0; s < o.samples; ++s) {
    start.record(stream);
    for (int r = 0; r < t.reps; ++r) f();
    stop.record(stream);
    stop.synchronize();
    per_call.push_back(static_cast<double>(stop.elapsed_ms(start)) / t.reps);
  }
  t.median_ms = bench::median(per_call);
  t.min_ms = *std::min_element(per_call.begin(), per_call.end());
  return t;
}

void emit(const nlohmann::json& j) {
  // An error message or device name that is not valid UTF-8 must not make dump() throw.
  std::printf("%s\n", j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  std::fflush(stdout);
}

// ------------------------------------------------------------------ GEMM ----

// The three products of a linear layer y = x W^T (x [M, k], W [n, k]), as
// ops::linear issues them (row-major, transposes in place), timed in element
// type T: float (FP32 or TF32, as set_tf32 says) or bf16 (fp32 accumulation).
template <class T>
void time_linear_products(const Options& o, const char* layer, const char* prec, std::int64_t M, std::int64_t k,
                          std::int64_t n, const T* x, const T* w, const T* dy, T* y, T* dx, T* dw) {
  struct Op {
    const char* name;
    bool ta, tb;
    std::int64_t m, n, k;
    const T *a, *b;
    std::int64_t lda, ldb;
    T* c;
    std::int64_t ldc;
  };
  const Op ops[] = {{"fwd", false, true, M, n, k, x, w, k, k, y, n},
                    {"bwd_data", false, false, M, k, n, dy, w, n, k, dx, k},
                    {"bwd_weight", true, false, n, k, M, dy, x, n, k, dw, k}};
  for (const Op& op : ops) {
    const Timing t = time_gpu(o, [&] {
      kc::gemm<T>(op.ta, op.tb, op.m, op.n, op.k, 1.0f, op.a, op.lda, op.b, op.ldb, 0.0f, op.c, op.ldc);
    });
    const double flops = 2.0 * static_cast<double>(op.m) * static_cast<double>(op.n) * static_cast<double>(op.k);
    const double tflops = flops / (t.median_ms * 1e-3) / 1e12;
    emit({{"bench", "gpu_gemm"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"layer", layer}, {"op", op.name},
          {"m", op.m}, {"n", op.n}, {"k", op.k}, {"trans_a", op.ta}, {"trans_b", op.tb}, {"precision", prec},
          {"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"reps", t.reps}, {"samples", o.samples},
          {"tflops", tflops}});
    std::fprintf(stderr, "%-10s %-10s %6lld %6lld %6lld %5s %10.3f %9.1f\n", layer, op.name,
                 static_cast<long long>(op.m), static_cast<long long>(op.n), static_cast<long long>(op.k), prec,
                 t.median_ms, tflops);
  }
}

Tensor<bf16> to_bf16(const Tensor<float>& t) {
  auto b = Tensor<bf16>::empty(t.shape(), kGpu);
  kc::cast<float, bf16>(t.numel(), t.data(), b.data());
  return b;
}

// A layer's backward in bf16 through ops:: with cuBLASLt's epilogues (Note
// [cuBLASLt epilogues]) and with them switched off, i.e. the same work apart:
// dW += dy^T x with the bias gradient (linear_backward without dx), and with
// `gelu` (the layer after the MLP's GELU, whose input x stands in for pre) also
// dpre = gelu'(pre) * (dy W) with the bias gradient of the layer before
// (linear_gelu_backward). `fused` says whether the epilogue applied.
void time_backward_epilogues(const Options& o, const char* layer, std::int64_t M, std::int64_t k, std::int64_t n,
                             const Tensor<bf16>& x, const Tensor<bf16>& w, const Tensor<bf16>& dy, Tensor<bf16>& dw,
                             bool gelu) {
  const auto x2 = x.reshape({M, k}), w2 = w.reshape({n, k}), dy2 = dy.reshape({M, n});
  auto dw2 = dw.reshape({n, k});
  auto db = Tensor<bf16>::zeros({n}, kGpu), db_pre = Tensor<bf16>::zeros({k}, kGpu);
  auto part = Tensor<bf16>::empty({gelu ? k : n}, kGpu), dpre = Tensor<bf16>::empty({M, k}, kGpu);
  const char* op = gelu ? "dgelu_wgrad_bias" : "wgrad_bias";
  const bool fused =
      gelu ? kc::linear_dgelu_epilogue<bf16>(M, n, k, dy.data(), w.data(), x.data(), dpre.data(), part.data())
           : kc::linear_weight_grad_epilogue<bf16>(M, n, k, dy.data(), x.data(), dw.data(), part.data());
  auto run = [&] {
    if (gelu) ops::linear_gelu_backward(x2, x2, w2, dy2, dw2, &db, db_pre);
    else ops::linear_backward(x2, w2, dy2, dw2, &db, false);
  };
  const bool was_on = kc::gemm_epilogues_enabled();
  Timing t[2];
  for (const bool on : {true, false}) {
    kc::set_gemm_epilogues(on);
    t[on ? 0 : 1] = time_gpu(o, run);
  }
  kc::set_gemm_epilogues(was_on);
  emit({{"bench", "gpu_epilogue"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"layer", layer}, {"op", op},
        {"m", M}, {"n", n}, {"k", k}, {"precision", "bf16"}, {"fused", fused}, {"fused_median_ms", t[0].median_ms},
        {"apart_median_ms", t[1].median_ms}, {"samples", o.samples}});
  std::fprintf(stderr, "%-10s %-16s fused %s %8.3f ms, apart %8.3f ms\n", layer, op, fused ? "yes" : "no ",
               t[0].median_ms, t[1].median_ms);
}

void bench_gemm(const Options& o) {
  const std::int64_t M = o.batch * o.cfg.block_size, C = o.cfg.n_embd, V = o.cfg.vocab_size;
  struct Layer {
    const char* name;
    std::int64_t k, n;  // in and out features: W is [n, k]
  };
  const Layer layers[] = {{"attn_qkv", C, 3 * C}, {"attn_proj", C, C}, {"mlp_fc", C, 4 * C},
                          {"mlp_proj", 4 * C, C}, {"lm_head", C, V}};
  std::fprintf(stderr, "\nGEMM, M = %lld tokens\n%-10s %-10s %6s %6s %6s %5s %10s %9s\n", static_cast<long long>(M),
               "layer", "op", "M", "N", "K", "prec", "median_ms", "TFLOP/s");
  for (const Layer& l : layers) {
    auto x = uniform({M, l.k}, -1, 1, 1), w = uniform({l.n, l.k}, -1, 1, 2), dy = uniform({M, l.n}, -1, 1, 3);
    auto y = Tensor<float>::empty({M, l.n}, kGpu), dx = Tensor<float>::empty({M, l.k}, kGpu);
    auto dw = Tensor<float>::empty({l.n, l.k}, kGpu);
    for (bool tf32 : {false, true}) {
      kc::set_tf32(tf32);
      time_linear_products<float>(o, l.name, tf32 ? "tf32" : "fp32", M, l.k, l.n, x.data(), w.data(), dy.data(),
                                  y.data(), dx.data(), dw.data());
    }
    // bf16 operands and results with fp32 accumulation (gemm_bf16): the bf16 GPT step's arithmetic.
    auto xb = to_bf16(x), wb = to_bf16(w), dyb = to_bf16(dy);
    auto yb = Tensor<bf16>::empty({M, l.n}, kGpu), dxb = Tensor<bf16>::empty({M, l.k}, kGpu);
    auto dwb = Tensor<bf16>::empty({l.n, l.k}, kGpu);
    time_linear_products<bf16>(o, l.name, "bf16", M, l.k, l.n, xb.data(), wb.data(), dyb.data(), yb.data(),
                               dxb.data(), dwb.data());
    time_backward_epilogues(o, l.name, M, l.k, l.n, xb, wb, dyb, dwb, false);
    if (std::string(l.name) == "mlp_proj") time_backward_epilogues(o, l.name, M, l.k, l.n, xb, wb, dyb, dwb, true);
  }
}

// ------------------------------------------------------------- bandwidth ----

Tensor<bf16> uniform_bf16(const Shape& shape, float lo, float hi, std::uint64_t seed) {
  auto f = uniform(shape, lo, hi, seed);
  auto b = Tensor<bf16>::empty(shape, kGpu);
  kc::cast<float, bf16>(f.numel(), f.data(), b.data());
  return b;
}

// The row kernels that read a row once (layer_norm.cuh, softmax.cuh; gated) in bf16,
// each after the verified kernel it replaces. Bytes: each bf16 array read or written
// once (2 per element), mean and rstd (4 per row), the backward's dgamma/dbeta partial
// rows (min(rows, 512) x C floats each, written and read); docs/cuda.md, "Row kernels:
// bytes and expected times", has the expected times from these counts. LayerNorm runs
// on the MLP activation's rows (4 M of width C: 201 MB for x, y, h and the residual
// together at GPT-2 small, four times H100's L2), softmax on the attention rows
// (batch x heads x block rows of width block) and on the logits (M x V).
template <class Report>
void bench_row_kernels(const Options& o, Report&& report) {
  const std::int64_t M = o.batch * o.cfg.block_size, C = o.cfg.n_embd, V = o.cfg.vocab_size;
  constexpr std::int64_t B2 = sizeof(bf16), F = sizeof(float);
  {
    const std::int64_t R = 4 * M, n = R * C;
    auto x = uniform_bf16({R, C}, -3, 3, 21), res = uniform_bf16({R, C}, -3, 3, 22);
    auto dy = uniform_bf16({R, C}, -1, 1, 23);
    auto gamma = uniform_bf16({C}, 0.5, 1.5, 24), beta = uniform_bf16({C}, -0.5, 0.5, 25);
    auto y = Tensor<bf16>::empty({R, C}, kGpu), h = Tensor<bf16>::empty({R, C}, kGpu);
    auto dx = Tensor<bf16>::empty({R, C}, kGpu);
    auto dgamma = Tensor<bf16>::zeros({C}, kGpu), dbeta = Tensor<bf16>::zeros({C}, kGpu);
    auto mean = Tensor<float>::empty({R}, kGpu), rstd = Tensor<float>::empty({R}, kGpu);
    const std::int64_t stats = 2 * R * F, params = 2 * C * B2;
    const std::int64_t partials = 2 * 2 * std::min<std::int64_t>(R, 512) * C * F + 2 * params;
    report("layer_norm_fwd_bf16", {R, C}, 2 * n * B2 + stats + params, time_gpu(o, [&] {
             kc::layer_norm_forward<bf16>(R, C, x.data(), gamma.data(), beta.data(), 1e-5f, y.data(), mean.data(),
                                          rstd.data());
           }));
    report("layer_norm_fwd_1read_bf16", {R, C}, 2 * n * B2 + stats + params, time_gpu(o, [&] {
             kc::layer_norm_forward_one_read<bf16>(R, C, x.data(), gamma.data(), beta.data(), 1e-5f, y.data(),
                                                   mean.data(), rstd.data());
           }));
    report("residual_ln_fwd_bf16", {R, C}, 4 * n * B2 + stats + params, time_gpu(o, [&] {
             kc::residual_layer_norm_forward<bf16>(R, C, x.data(), res.data(), gamma.data(), beta.data(), 1e-5f,
                                                   h.data(), y.data(), mean.data(), rstd.data());
           }));
    report("layer_norm_bwd_bf16", {R, C}, 3 * n * B2 + stats + partials, time_gpu(o, [&] {
             kc::layer_norm_backward<bf16>(R, C, x.data(), mean.data(), rstd.data(), gamma.data(), dy.data(),
                                           dx.data(), dgamma.data(), dbeta.data());
           }));
    report("layer_norm_bwd_1read_bf16", {R, C}, 3 * n * B2 + stats + partials, time_gpu(o, [&] {
             kc::layer_norm_backward_one_read<bf16>(R, C, x.data(), mean.data(), rstd.data(), gamma.data(), dy.data(),
                                                    dx.data(), dgamma.data(), dbeta.data());
           }));
    report("residual_ln_bwd_bf16", {R, C}, 4 * n * B2 + stats + partials, time_gpu(o, [&] {
             kc::residual_layer_norm_backward<bf16>(R, C, h.data(), mean.data(), rstd.data(), gamma.data(), dy.data(),
                                                    res.data(), dx.data(), dgamma.data(), dbeta.data());
           }));
  }
  allocator_for(kGpu).empty_cache();
  // Softmax: attention rows [batch * heads * block, block], then the logits [M, V],
  // where a row (100 KB in bf16) is wider than the registers and the online form
  // reads it twice (the second time mostly from L2).
  const std::int64_t att_rows = o.batch * o.cfg.n_head * o.cfg.block_size, S = o.cfg.block_size;
  for (const auto& shape : {std::pair{att_rows, S}, std::pair{M, V}}) {
    const std::int64_t R = shape.first, W = shape.second;
    auto x = uniform_bf16({R, W}, -4, 4, 26), y = Tensor<bf16>::empty({R, W}, kGpu);
    report("softmax_rows_bf16", {R, W}, 2 * R * W * B2,
           time_gpu(o, [&] { kc::softmax_rows<bf16>(R, W, x.data(), y.data()); }));
    report("softmax_1read_bf16", {R, W}, 2 * R * W * B2,
           time_gpu(o, [&] { kc::softmax_rows_one_read<bf16>(R, W, x.data(), y.data()); }));
    auto dy = uniform_bf16({R, W}, -1, 1, 27), dx = Tensor<bf16>::empty({R, W}, kGpu);
    report("softmax_bwd_bf16", {R, W}, 3 * R * W * B2,
           time_gpu(o, [&] { kc::softmax_rows_backward<bf16>(R, W, y.data(), dy.data(), dx.data()); }));
    report("softmax_bwd_1read_bf16", {R, W}, 3 * R * W * B2,
           time_gpu(o, [&] { kc::softmax_rows_backward_one_read<bf16>(R, W, y.data(), dy.data(), dx.data()); }));
    allocator_for(kGpu).empty_cache();
  }
}

void bench_bandwidth(const Options& o) {
  const std::int64_t M = o.batch * o.cfg.block_size, C = o.cfg.n_embd, V = o.cfg.vocab_size;
  // The MLP activation [M, 4C] (100 MB at GPT-2 small): twice H100's 50 MB L2,
  // so repeated calls stream from DRAM instead of hitting the cache.
  const std::int64_t n = M * 4 * C;
  const std::int64_t ln_rows = n / C;  // LayerNorm over the same elements, rows of width C
  const std::int64_t P = o.cfg.num_parameters();
  constexpr std::int64_t F = sizeof(float);
  double copy_gbps = 0;

  std::fprintf(stderr, "\nMemory-bound kernels\n%-22s %-18s %10s %10s %9s %8s\n", "op", "shape", "MB moved",
               "median_ms", "GB/s", "vs copy");
  auto report = [&](const char* op, const std::vector<std::int64_t>& shape, std::int64_t bytes, const Timing& t) {
    const double gbps = static_cast<double>(bytes) / (t.median_ms * 1e-3) / 1e9;
    if (copy_gbps == 0) copy_gbps = gbps;  // the copy runs first and is the reference
    emit({{"bench", "gpu_bandwidth"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"op", op}, {"shape", shape},
          {"bytes", bytes}, {"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"reps", t.reps},
          {"samples", o.samples}, {"GBps", gbps}, {"frac_of_copy", gbps / copy_gbps}});
    std::string s;
    for (auto d : shape) s += (s.empty() ? "" : "x") + std::to_string(d);
    std::fprintf(stderr, "%-22s %-18s %10.1f %10.3f %9.1f %8.2f\n", op, s.c_str(), static_cast<double>(bytes) / 1e6,
                 t.median_ms, gbps, gbps / copy_gbps);
  };

  {
    auto x = uniform({n}, -3, 3, 4), dy = uniform({n}, -1, 1, 5);
    auto y = Tensor<float>::empty({n}, kGpu), bias = uniform({4 * C}, -1, 1, 6);
    // copy: read n, write n.
    report("copy", {n}, 2 * n * F, time_gpu(o, [&] {
             PTRAIN_CHECK_CUDA(cudaMemcpyAsync(y.data(), x.data(), static_cast<std::size_t>(n) * sizeof(float),
                                               cudaMemcpyDeviceToDevice, kc::current_stream(0)));
           }));
    // gelu_forward: read x, write y.
    report("gelu_forward", {M, 4 * C}, 2 * n * F, time_gpu(o, [&] { kc::gelu_forward<float>(n, x.data(), y.data()); }));
    // gelu_backward: read x and dy, write dx.
    auto dx = Tensor<float>::empty({n}, kGpu);
    report("gelu_backward", {M, 4 * C}, 3 * n * F,
           time_gpu(o, [&] { kc::gelu_backward<float>(n, x.data(), dy.data(), dx.data()); }));
    // bias_add: y += bias, read and write y; the 4C bias stays in cache.
    report("bias_add", {M, 4 * C}, (2 * n + 4 * C) * F,
           time_gpu(o, [&] { kc::bias_add<float>(M, 4 * C, y.data(), bias.data()); }));
    // layer_norm_forward: read x once (the second and third passes over a row
    // hit L1/L2), write y, mean and rstd; gamma and beta stay in cache.
    auto gamma = uniform({C}, 0.5, 1.5, 7), beta = uniform({C}, -0.5, 0.5, 8);
    auto mean = Tensor<float>::empty({ln_rows}, kGpu), rstd = Tensor<float>::empty({ln_rows}, kGpu);
    report("layer_norm_forward", {ln_rows, C}, (2 * n + 2 * ln_rows + 2 * C) * F, time_gpu(o, [&] {
             kc::layer_norm_forward<float>(ln_rows, C, x.data(), gamma.data(), beta.data(), 1e-5f, y.data(),
                                           mean.data(), rstd.data());
           }));
  }
  allocator_for(kGpu).empty_cache();
  {
    // adamw_update over a flat buffer of the model's size: read p, g, m, v; write p, m, v.
    auto p = uniform({P}, -1, 1, 9), g = uniform({P}, -1, 1, 10), m = uniform({P}, -1, 1, 11);
    auto v = uniform({P}, 0, 1, 12);
    report("adamw_update", {P}, 7 * P * F, time_gpu(o, [&] {
             kc::adamw_update<float>(P, p.data(), g.data(), m.data(), v.data(), 3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, 1);
           }));
    // adamw_update_ranges: the same 28 bytes per parameter in one launch over two
    // ranges (decay on, off). GPT-2 small (P = 124.4M): 3.48 GB, 1.04 ms at H100's
    // 3.35 TB/s, 0.73 ms at H200's 4.8 TB/s; ~10 FLOPs per element (1.2 GFLOP) is noise.
    const auto ends = Tensor<std::int64_t>::from({P / 2, P}, {2}).to(kGpu);
    const auto flags = Tensor<std::uint8_t>::from({1, 0}, {2}).to(kGpu);
    kernels::AdamWStep st;
    st.lr = 3e-4;
    st.beta2 = 0.95;
    st.weight_decay = 0.1;
    report("adamw_update_ranges", {P}, 7 * P * F, time_gpu(o, [&] {
             kc::adamw_update_ranges<float>(P, 2, ends.data(), flags.data(), p.data(), g.data(), m.data(), v.data(),
                                            nullptr, st);
           }));
    // with clipping on the device: sum_squares_to reads g once more (4 bytes per
    // parameter): 3.98 GB, 1.19 ms on H100, 0.83 ms on H200; no host read.
    auto sumsq = Tensor<double>::zeros({1}, kGpu);
    report("adamw_ranges_clip", {P}, 8 * P * F, time_gpu(o, [&] {
             kc::sum_squares_to<float>(P, g.data(), sumsq.data());
             kernels::AdamWStep c = st;
             c.grad_sumsq = sumsq.data();
             c.max_norm = 1.0;
             kc::adamw_update_ranges<float>(P, 2, ends.data(), flags.data(), p.data(), g.data(), m.data(), v.data(),
                                            nullptr, c);
           }));
    // bf16 parameters with fp32 master weights and stochastic rounding: master, m, v
    // read and written (24 bytes), the bf16 gradient read and the bf16 copy written
    // (4 bytes): 28 bytes per parameter again, 1.04 ms on H100 if the Philox draw
    // (about 80 integer operations per element, ~0.6 ms of H100's integer issue)
    // stays hidden under the memory traffic.
    auto gb = Tensor<bf16>::empty({P}, kGpu), pb = Tensor<bf16>::empty({P}, kGpu);
    kc::cast<float, bf16>(P, g.data(), gb.data());
    kernels::AdamWStep sr = st;
    sr.stochastic_rounding = true;
    sr.seed = 17;
    report("adamw_ranges_bf16_sr", {P}, 7 * P * F, time_gpu(o, [&] {
             kc::adamw_update_ranges<bf16>(P, 2, ends.data(), flags.data(), p.data(), gb.data(), m.data(), v.data(),
                                           pb.data(), sr);
           }));
  }
  allocator_for(kGpu).empty_cache();
  {
    auto logits = uniform({M, V}, -4, 4, 13), out = Tensor<float>::empty({M, V}, kGpu);
    auto targets = indices<std::int32_t>({M}, V, 14);
    auto lse = Tensor<float>::empty({M}, kGpu);
    // softmax_rows: read x, write y.
    report("softmax_rows", {M, V}, 2 * M * V * F,
           time_gpu(o, [&] { kc::softmax_rows<float>(M, V, logits.data(), out.data()); }));
    // cross_entropy_forward: read logits and targets, write lse; returns the
    // loss to the host, so each call also waits for the stream.
    std::int64_t valid = 0;
    const std::int64_t ce_fwd = (M * V + 2 * M) * F;
    report("cross_entropy_forward", {M, V}, ce_fwd, time_gpu(o, [&] {
             kc::cross_entropy_forward<float>(M, V, logits.data(), targets.data(), lse.data(), valid);
           }));
    // forward, then cross_entropy_backward: read logits, lse and targets, write dlogits.
    report("cross_entropy_fwd_bwd", {M, V}, ce_fwd + (2 * M * V + 2 * M) * F, time_gpu(o, [&] {
             kc::cross_entropy_forward<float>(M, V, logits.data(), targets.data(), lse.data(), valid);
             kc::cross_entropy_backward<float>(M, V, logits.data(), lse.data(), targets.data(), valid, 1.0f,
                                               out.data());
           }));
    // fused_classifier: the loss and dlogits in one kernel, written over the logits,
    // the loss left on the device: read the logits (a row's second sweep comes from
    // L2) and the targets, write dlogits. At M = 8192, V = 50304: 3.30 GB in float,
    // 0.98 ms at H100's 3.35 TB/s and 0.69 ms at H200's 4.8 TB/s, against 4.95 GB and
    // a host wait per call for cross_entropy_fwd_bwd; two exponentials and ~10 FLOPs
    // per element (0.8 G exponentials) stay under the memory time. Calls after the
    // first run on gradients, as fast as on logits.
    auto dev_loss = Tensor<double>::zeros({2}, kGpu);
    PTRAIN_CHECK_CUDA(cudaMemcpyAsync(out.data(), logits.data(), static_cast<std::size_t>(M * V) * sizeof(float),
                                      cudaMemcpyDeviceToDevice, kc::current_stream(0)));
    report("fused_classifier", {M, V}, 2 * M * V * F + 4 * M, time_gpu(o, [&] {
             kc::fused_classifier<float>(M, V, out.data(), targets.data(), -100, 0.0f, 1.0f, 1.0, dev_loss.data());
           }));
    // bf16 logits: 1.65 GB, 0.49 ms on H100, 0.34 ms on H200.
    auto logits_b = Tensor<bf16>::empty({M, V}, kGpu);
    kc::cast<float, bf16>(M * V, logits.data(), logits_b.data());
    report("fused_classifier_bf16", {M, V}, 2 * M * V * 2 + 4 * M, time_gpu(o, [&] {
             kc::fused_classifier<bf16>(M, V, logits_b.data(), targets.data(), -100, 0.0f, 1.0f, 1.0,
                                        dev_loss.data());
           }));
  }
  allocator_for(kGpu).empty_cache();
  bench_row_kernels(o, report);
}

// ------------------------------------------------------------- GPT step ----

// GPU time of each of o.steps training steps after o.warmup untimed ones (the
// allocator's peak is reset after the warm-up).
std::vector<double> step_times(const Options& o, const std::function<void()>& step) {
  for (int i = 0; i < o.warmup; ++i) step();
  kc::synchronize_device(0);
  reset_peak_memory(kGpu);
  const cudaStream_t stream = kc::current_stream(0);
  kc::Event start(true), stop(true);
  std::vector<double> times;
  for (int i = 0; i < o.steps; ++i) {
    start.record(stream);
    step();
    stop.record(stream);
    stop.synchronize();
    times.push_back(stop.elapsed_ms(start));
  }
  return times;
}

// T = float (FP32 or TF32 GEMMs) or bf16 (mixed precision).
template <class T>
void bench_gpt(const Options& o) {
  constexpr bool is_bf16 = std::is_same_v<T, bf16>;
  const nn::GPTConfig& cfg = o.cfg;
  const std::int64_t B = o.batch, S = cfg.block_size;
  const char* precision = is_bf16 ? "bf16" : o.tf32 ? "tf32" : "fp32";
  kc::set_flash_attention(o.flash);
  kc::set_gemm_epilogues(o.epilogues);
  // The label asks ops::causal_attention's own question (bf16, head width, compute
  // capability, shared memory), so it names what runs. Its qkv is a fresh
  // allocation, 16-byte aligned like the null pointer passed here.
  const std::int64_t D = cfg.n_embd / cfg.n_head;
  const char* attention =
      kc::flash_attention_supported<T>(D, static_cast<const T*>(nullptr)) ? "flash" : "materialized";
  const double peak = is_bf16 ? o.peak_tflops_bf16 : o.peak_tflops;
  kc::set_tf32(o.tf32);
  manual_seed(0);
  nn::GPT<T> model(cfg);  // initialised on the host, as in the CPU benchmark, then moved
  model.to(kGpu);
  nn::FlatParameters<T> flat(model);
  optim::AdamW<T> opt(flat, {.lr = 3e-4, .weight_decay = 0.1}, nn::gpt_decay_filter());
  nn::CrossEntropyLoss<T> loss_fn;

  const auto x = indices<std::int32_t>({B, S}, cfg.vocab_size, 15);
  const auto y = indices<std::int32_t>({B * S}, cfg.vocab_size, 16);

  nn::Cache<T> cache, loss_cache;
  double loss = 0;
  // --cuda-graph: the loss stays on the device (the fused classifier) and AdamW reads
  // its learning rate and step from device memory, so the step can be captured.
  ops::DeviceLoss device_loss;
  auto step = [&] {
    flat.zero_grad();
    if (o.graph) {
      Tensor<T> logits = model.forward_tokens(x, cache);
      model.backward(loss_fn.forward_backward(logits, y, device_loss), cache);
    } else {
      loss = loss_fn.forward(model.forward_tokens(x, cache), y, loss_cache);
      model.backward(loss_fn.backward(loss_cache), cache);
    }
    opt.step();
  };
  train::CudaStepGraph graph;
  if (o.graph) {
    PTRAIN_CHECK(opt.use_device_scalars(true), Error, "gpu_bench --cuda-graph: AdamW's one-launch update is gated; "
                 "set PTRAIN_UNVERIFIED_CUDA=1");
    opt.stage_device_scalars();
    step();  // the eager warm-up step before the capture
    graph = train::CudaStepGraph(0);
    opt.stage_device_scalars();
    graph.capture("gpu_bench's GPT step", step);
  }
  auto run_step = [&] {
    if (!o.graph) return step();
    opt.stage_device_scalars();
    graph.launch();
    opt.count_replayed_step();
  };
  const std::vector<double> times = step_times(o, run_step);

  if (o.graph) {  // the last step's loss, read once
    device_loss.reset();
    run_step();
    loss = device_loss.sum();
  }
  const double ms = bench::median(times);
  const double tokens = static_cast<double>(B * S);
  const double fpt = cfg.flops_per_token(S);
  const double tflops = fpt * tokens / (ms * 1e-3) / 1e12;
  const double peak_gib = static_cast<double>(memory_stats(kGpu).peak_bytes) / (1024.0 * 1024.0 * 1024.0);
  const char* mixed = is_bf16 ? "bf16 parameters, gradients and activations; fp32 master weights and AdamW moments"
                              : "none";
  emit({{"bench", o.graph ? "gpu_gpt_step_graph" : "gpu_gpt_step"}, {"impl", "ptrain"}, {"gpu", o.gpu_name},
        {"cuda_graph", o.graph}, {"attention", attention},
        {"precision", precision}, {"gemm_epilogues", o.epilogues}, {"layers", cfg.n_layer}, {"heads", cfg.n_head},
        {"embd", cfg.n_embd}, {"block", S}, {"vocab", cfg.vocab_size}, {"batch", B}, {"steps", o.steps},
        {"warmup", o.warmup}, {"mixed_precision", mixed},
        {"adamw", "flat buffer, one kernel per contiguous decay range"}, {"dropout", cfg.dropout},
        {"parameters", model.num_parameters()}, {"step_ms_median", ms},
        {"step_ms_min", *std::min_element(times.begin(), times.end())}, {"tokens_per_s", 1000.0 * tokens / ms},
        {"mflop_per_token", fpt / 1e6}, {"tflops", tflops}, {"peak_tflops", peak},
        {"peak_note", "defaults: H100/H200 SXM dense, 494.7 TF32, 989.4 bf16; pass --peak-tflops(-bf16) for other parts"},
        {"mfu", tflops / peak}, {"peak_mem_GiB", peak_gib}, {"final_loss", loss}});
  std::fprintf(stderr, "\nGPT step%s (%lld layers, width %lld, %lld x %lld tokens, %s): %.1f ms median, %.0f tokens/s, "
               "%.1f TFLOP/s, MFU %.3f of %.1f, peak memory %.1f GiB, loss %.4f\n",
               o.graph ? " in a CUDA graph" : "", static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
               static_cast<long long>(B),
               static_cast<long long>(S), precision, ms, 1000.0 * tokens / ms, tflops, tflops / peak, peak, peak_gib,
               loss);
}

// ---------------------------------------------------------- Llama step ----

// forward, cross-entropy, backward, AdamW on nn::Llama<bf16> (bf16 parameters and
// activations, fp32 master weights): grouped-query flash attention, RMSNorm fused
// with the residual add, rotary, SwiGLU. FLOPs per token from
// LlamaConfig::flops_per_token; sequence = max_seq_len.
void bench_llama(const Options& o) {
  const nn::LlamaConfig& cfg = o.llama;
  const std::int64_t B = o.llama_batch, S = cfg.max_seq_len;
  manual_seed(0);
  nn::Llama<bf16> model(cfg);
  model.to(kGpu);
  nn::FlatParameters<bf16> flat(model);
  optim::AdamW<bf16> opt(flat, {.lr = 3e-4, .weight_decay = 0.1}, nn::llama_decay_filter());
  nn::CrossEntropyLoss<bf16> loss_fn;
  const auto x = indices<std::int32_t>({B, S}, cfg.vocab_size, 17);
  const auto y = indices<std::int32_t>({B * S}, cfg.vocab_size, 18);
  nn::Cache<bf16> cache, loss_cache;
  double loss = 0;
  const std::vector<double> times = step_times(o, [&] {
    flat.zero_grad();
    loss = loss_fn.forward(model.forward_tokens(x, cache), y, loss_cache);
    model.backward(loss_fn.backward(loss_cache), cache);
    opt.step();
  });
  const double ms = bench::median(times), tokens = static_cast<double>(B * S);
  const double fpt = cfg.flops_per_token(S), tflops = fpt * tokens / (ms * 1e-3) / 1e12;
  const double peak_gib = static_cast<double>(memory_stats(kGpu).peak_bytes) / (1024.0 * 1024.0 * 1024.0);
  emit({{"bench", "gpu_llama_step"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"precision", "bf16"},
        {"compile", "eager"}, {"layers", cfg.n_layer}, {"heads", cfg.n_head}, {"kv_heads", cfg.n_kv_head},
        {"embd", cfg.n_embd}, {"mlp", cfg.intermediate_size}, {"seq", S}, {"vocab", cfg.vocab_size}, {"batch", B},
        {"steps", o.steps}, {"warmup", o.warmup}, {"parameters", model.num_parameters()}, {"step_ms_median", ms},
        {"step_ms_min", *std::min_element(times.begin(), times.end())}, {"tokens_per_s", 1000.0 * tokens / ms},
        {"mflop_per_token", fpt / 1e6}, {"tflops", tflops}, {"peak_tflops", o.peak_tflops_bf16},
        {"mfu", tflops / o.peak_tflops_bf16}, {"peak_mem_GiB", peak_gib}, {"final_loss", loss}});
  std::fprintf(stderr, "\nLlama step (%lld layers, width %lld, %lld/%lld heads, %lld x %lld tokens, bf16): %.1f ms "
               "median, %.0f tokens/s, %.1f TFLOP/s, MFU %.3f, peak memory %.1f GiB, loss %.4f\n",
               static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
               static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.n_kv_head), static_cast<long long>(B),
               static_cast<long long>(S), ms, 1000.0 * tokens / ms, tflops, tflops / o.peak_tflops_bf16, peak_gib,
               loss);
}

// ------------------------------------------------------------ attention ----

// The fused causal attention alone (Note [Flash attention]), bf16, no dropout:
// forward, and forward + backward, for head widths 64 and 128 at sequence
// 1024, 4096 and 8192, with 16384 tokens (B = 16384 / S) and width 2048
// (H = 2048 / D) so that B * H blocks fill the GPU. FLOPs count only the causal
// half: forward 4 B H S^2 D / 2 (QK^T and PV), backward 2.5 times that (five
// products), as FlashAttention's benchmarks count them.
void bench_attention(const Options& o) {
  for (const std::int64_t D : {64, 128}) {
    for (const std::int64_t S : {1024, 4096, 8192}) {
      const std::int64_t B = 16384 / S, H = 2048 / D, C = H * D;
      const auto qkv = to_bf16(uniform({B, S, 3 * C}, -1.0f, 1.0f, 21));
      const auto dy = to_bf16(uniform({B, S, C}, -1.0f, 1.0f, 22));
      auto y = Tensor<bf16>::empty({B, S, C}, kGpu), dqkv = Tensor<bf16>::empty({B, S, 3 * C}, kGpu);
      auto lse = Tensor<float>::empty({B * H * S}, kGpu);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      auto forward = [&] {
        kc::flash_attention_forward<bf16>(B, S, H, D, qkv.data(), scale, 0.0, 0, 0, y.data(), lse.data());
      };
      const double fwd_flops = 2.0 * static_cast<double>(B * H) * static_cast<double>(S * S) * static_cast<double>(D);
      const struct {
        const char* pass;
        double flops;
        std::function<void()> run;
      } passes[] = {{"fwd", fwd_flops, forward},
                    {"fwd_bwd", 3.5 * fwd_flops, [&] {
                       forward();
                       kc::flash_attention_backward<bf16>(B, S, H, D, qkv.data(), y.data(), lse.data(), 0.0, 0, 0,
                                                          dy.data(), scale, dqkv.data());
                     }}};
      for (const auto& ps : passes) {
        const Timing t = time_gpu(o, ps.run);
        const double tflops = ps.flops / (t.median_ms * 1e-3) / 1e12;
        emit({{"bench", "gpu_attention"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"backend", "ptrain_flash"},
              {"pass", ps.pass}, {"batch", B}, {"seq", S}, {"heads", H}, {"head_dim", D}, {"causal", true},
              {"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"tflops", tflops}});
        std::fprintf(stderr, "attention %-8s B %2lld S %5lld H %2lld D %3lld %9.3f ms %7.1f TFLOP/s\n", ps.pass,
                     static_cast<long long>(B), static_cast<long long>(S), static_cast<long long>(H),
                     static_cast<long long>(D), t.median_ms, tflops);
      }
    }
  }
}

// The tensor-core kernels (Note [Tensor-core flash attention]), bf16, q, k, v
// [B, S, H, D] on bench_attention's shapes (H = 2048 / D, B = 16384 / S, so rows
// compare with SDPA's at the same shape): FLOPs as FlashAttention-2 counts them, 4 B H S^2 D forward (QK^T and PV), half
// of it causal, backward 2.5 times the forward (five products; these kernels
// compute seven, dq recomputing two to stay free of atomics).
void bench_attention_tc(const Options& o) {
  for (const std::int64_t D : {64, 128}) {
    for (const std::int64_t S : {1024, 4096, 8192}) {
      const std::int64_t B = 16384 / S, H = 2048 / D, C = H * D;
      const auto q = to_bf16(uniform({B, S, C}, -1.0f, 1.0f, 31)), k = to_bf16(uniform({B, S, C}, -1.0f, 1.0f, 32)),
                 v = to_bf16(uniform({B, S, C}, -1.0f, 1.0f, 33)), dy = to_bf16(uniform({B, S, C}, -1.0f, 1.0f, 34));
      auto y = Tensor<bf16>::empty({B, S, C}, kGpu), dq = Tensor<bf16>::empty({B, S, C}, kGpu),
           dk = Tensor<bf16>::empty({B, S, C}, kGpu), dv = Tensor<bf16>::empty({B, S, C}, kGpu);
      auto lse = Tensor<float>::empty({B * H * S}, kGpu);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      for (const bool causal : {true, false}) {
        auto forward = [&] {
          PTRAIN_CHECK(kc::flash_tc_forward<bf16>(B, S, H, H, D, q.data(), C, k.data(), v.data(), C, causal, scale,
                                                  y.data(), lse.data()),
                       Error, "[ptrain.bench] flash_tc_forward declined the case (needs compute capability 8.0+)");
        };
        auto backward = [&] {
          PTRAIN_CHECK(kc::flash_tc_backward<bf16>(B, S, H, H, D, q.data(), C, k.data(), v.data(), C, causal, y.data(),
                                                   lse.data(), dy.data(), scale, dq.data(), dk.data(), dv.data()),
                       Error, "[ptrain.bench] flash_tc_backward declined the case");
        };
        const double fwd_flops = 4.0 * static_cast<double>(B * H) * static_cast<double>(S * S) *
                                 static_cast<double>(D) * (causal ? 0.5 : 1.0);
        const struct {
          const char* pass;
          double flops;
          std::function<void()> run;
        } passes[] = {{"fwd", fwd_flops, forward}, {"fwd_bwd", 3.5 * fwd_flops, [&] {
                                                      forward();
                                                      backward();
                                                    }}};
        for (const auto& ps : passes) {
          const Timing t = time_gpu(o, ps.run);
          const double tflops = ps.flops / (t.median_ms * 1e-3) / 1e12;
          emit({{"bench", "gpu_attention"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"backend", "ptrain_flash_tc"},
                {"pass", ps.pass}, {"batch", B}, {"seq", S}, {"heads", H}, {"head_dim", D}, {"causal", causal},
                {"median_ms", t.median_ms}, {"min_ms", t.min_ms}, {"tflops", tflops}});
          std::fprintf(stderr, "attention_tc %-8s %-6s B %3lld S %5lld H %2lld D %3lld %9.3f ms %7.1f TFLOP/s\n",
                       ps.pass, causal ? "causal" : "full", static_cast<long long>(B), static_cast<long long>(S),
                       static_cast<long long>(H), static_cast<long long>(D), t.median_ms, tflops);
        }
      }
    }
  }
}

// ------------------------------------------------------------------- MoE ----

// The experts' GEMMs of one projection (Note [The grouped GEMM] in kernels/cuda/moe.cuh)
// in bf16, as one grouped cuBLAS call (grouped_gemm) and as one gemm per expert (what
// ops::grouped_matmul_into runs while grouped_gemm is gated), on 8192 tokens of width 2048:
// Mixtral-like (8 experts of width 5632, top 2) and fine-grained (64 experts of width 1408,
// top 6, DeepSeek-V2-Lite's shape). Expert e gets a share of the slots proportional to
// 1 + (7 e mod 5), so the segments differ in length as routed ones do.
void bench_moe(const Options& o) {
  struct Shape3 {
    const char* name;
    std::int64_t E, F, top_k;
  };
  const std::int64_t tokens = 8192, C = 2048;
  for (const Shape3& s : {Shape3{"moe_8x5632", 8, 5632, 2}, Shape3{"moe_64x1408", 64, 1408, 6}}) {
    const std::int64_t M = tokens * s.top_k, E = s.E, F = s.F;
    std::vector<std::int64_t> rows(static_cast<std::size_t>(E));
    std::int64_t share = 0, left = M;
    for (std::int64_t e = 0; e < E; ++e) share += 1 + (7 * e) % 5;
    for (std::int64_t e = 0; e < E; ++e)
      left -= rows[static_cast<std::size_t>(e)] = e + 1 < E ? M * (1 + (7 * e) % 5) / share : left;
    const auto x = to_bf16(uniform({M, C}, -1, 1, 1)), w = to_bf16(uniform({E, F, C}, -0.05f, 0.05f, 2));
    const auto dy = to_bf16(uniform({M, F}, -1, 1, 3));
    auto y = Tensor<bf16>::empty({M, F}, kGpu), dx = Tensor<bf16>::empty({M, C}, kGpu);
    auto dw = Tensor<bf16>::empty({E, F, C}, kGpu);
    struct Op {
      const char* name;
      bool ta, tb;
      std::int64_t lda, ldb, ldc;
    };
    for (const Op& op : {Op{"fwd", false, true, C, C, F}, Op{"bwd_data", false, false, F, C, C},
                         Op{"bwd_weight", true, false, F, C, C}}) {
      // Group e's sizes and operands (Op's products: y = x W^T, dx = dy W, dW = dy^T x).
      std::vector<std::int64_t> m, n, k;
      std::vector<const bf16*> a, b;
      std::vector<bf16*> c;
      std::int64_t lo = 0;
      for (std::int64_t e = 0; e < E; ++e) {
        const std::int64_t r = rows[static_cast<std::size_t>(e)];
        const bf16* we = w.data() + e * F * C;
        if (op.tb) {
          m.push_back(r), n.push_back(F), k.push_back(C);
          a.push_back(x.data() + lo * C), b.push_back(we), c.push_back(y.data() + lo * F);
        } else if (!op.ta) {
          m.push_back(r), n.push_back(C), k.push_back(F);
          a.push_back(dy.data() + lo * F), b.push_back(we), c.push_back(dx.data() + lo * C);
        } else {
          m.push_back(F), n.push_back(C), k.push_back(r);
          a.push_back(dy.data() + lo * F), b.push_back(x.data() + lo * C), c.push_back(dw.data() + e * F * C);
        }
        lo += r;
      }
      const Timing grouped = time_gpu(o, [&] {
        kc::grouped_gemm<bf16>(op.ta, op.tb, E, m.data(), n.data(), k.data(), 1.0f, a.data(), op.lda, b.data(),
                               op.ldb, 0.0f, c.data(), op.ldc);
      });
      const Timing loop = time_gpu(o, [&] {
        for (std::size_t g = 0; g < c.size(); ++g)
          kc::gemm<bf16>(op.ta, op.tb, m[g], n[g], k[g], 1.0f, a[g], op.lda, b[g], op.ldb, 0.0f, c[g], op.ldc);
      });
      const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(C) * static_cast<double>(F);
      const double tf_grouped = flops / (grouped.median_ms * 1e-3) / 1e12;
      const double tf_loop = flops / (loop.median_ms * 1e-3) / 1e12;
      emit({{"bench", "gpu_moe_gemm"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"layer", s.name}, {"op", op.name},
            {"experts", E}, {"rows", M}, {"n_embd", C}, {"expert_hidden", F}, {"precision", "bf16"},
            {"grouped_median_ms", grouped.median_ms}, {"loop_median_ms", loop.median_ms},
            {"grouped_tflops", tf_grouped}, {"loop_tflops", tf_loop}, {"samples", o.samples}});
      std::fprintf(stderr, "%-12s %-10s grouped %8.3f ms %7.1f TFLOP/s, per expert %8.3f ms %7.1f TFLOP/s\n",
                   s.name, op.name, grouped.median_ms, tf_grouped, loop.median_ms, tf_loop);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrain GPU benchmarks: GEMM, memory-bound kernels, GPT step (cuda:0)"};
  Options o;
  std::vector<std::string> only{"gemm", "bandwidth", "gpt", "llama", "attention", "moe"};
  app.add_option("--only", only, "sections to run")
      ->check(CLI::IsMember({"gemm", "bandwidth", "gpt", "llama", "attention", "moe"}));
  app.add_option("--layers", o.cfg.n_layer, "transformer blocks");
  app.add_option("--heads", o.cfg.n_head, "attention heads");
  app.add_option("--embd", o.cfg.n_embd, "embedding width (GEMM and kernel shapes follow it)");
  app.add_option("--block", o.cfg.block_size, "sequence length");
  app.add_option("--vocab", o.cfg.vocab_size, "vocabulary size");
  app.add_option("--batch", o.batch, "sequences per step; GEMM M = batch * block");
  app.add_option("--llama-layers", o.llama.n_layer, "blocks of the Llama-shaped step");
  app.add_option("--llama-batch", o.llama_batch, "sequences per Llama step (of 2048 tokens)");
  app.add_option("--samples", o.samples, "timed samples per kernel measurement (median reported)");
  app.add_option("--sample-ms", o.sample_ms, "target length of one kernel sample");
  app.add_option("--steps", o.steps, "timed GPT steps");
  app.add_option("--warmup", o.warmup, "untimed GPT steps first");
  app.add_flag("--float,!--no-float", o.fp, "run the GPT step in float (default on; --no-float: bf16 only)");
  app.add_flag("--tf32,!--no-tf32", o.tf32, "TF32 GEMMs in the GPT step (default on)");
  app.add_option("--peak-tflops", o.peak_tflops, "peak for MFU; 494.7 = H100/H200 SXM dense TF32");
  app.add_flag("--bf16,!--no-bf16", o.bf16, "also run the GPT step in bf16 mixed precision (default on)");
  app.add_flag("--flash,!--no-flash", o.flash, "fused attention in the bf16 GPT step (default on)");
  app.add_flag("--epilogues,!--no-epilogues", o.epilogues,
               "cuBLASLt's fused bias, GELU and bias-gradient epilogues in the GPT steps (default on)");
  app.add_flag("--cuda-graph", o.graph, "capture the GPT step in a CUDA graph and replay it, the loss kept on the "
               "device (fused classifier) and AdamW in one launch: gated kernels, so PTRAIN_UNVERIFIED_CUDA=1");
  app.add_option("--peak-tflops-bf16", o.peak_tflops_bf16, "peak for the bf16 MFU; 989.4 = H100/H200 SXM dense");
  CLI11_PARSE(app, argc, argv);

  if (kc::device_count() == 0) {
    std::fprintf(stderr, "gpu_bench: no CUDA device visible\n");
    return 77;
  }
  cudaDeviceProp prop{};
  PTRAIN_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  o.gpu_name = prop.name;
  PTRAIN_CHECK_CUDA(cudaSetDevice(0));
  std::fprintf(stderr, "gpu_bench on %s (%d SMs, %.1f GiB)\n", prop.name, prop.multiProcessorCount,
               static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));

  auto wanted = [&](const char* s) { return std::find(only.begin(), only.end(), s) != only.end(); };
  // One failing section (out of memory, a cuBLAS error) must not cost the others
  // their numbers: it reports, and the run goes on. A sticky CUDA error fails
  // every later section too, each with its own line.
  int failed = 0;
  auto section = [&](const char* name, void (*run)(const Options&)) {
    try {
      run(o);
    } catch (const std::exception& e) {
      ++failed;
      std::fprintf(stderr, "\ngpu_bench: section %s failed: %s\n", name, e.what());
      emit({{"bench", "gpu_error"}, {"impl", "ptrain"}, {"gpu", o.gpu_name}, {"section", name}, {"error", e.what()}});
    }
    kc::set_tf32(false);  // each section sets what it measures; none inherits it
    kc::set_gemm_epilogues(true);
    try {
      allocator_for(kGpu).empty_cache();  // what a failed section left cached goes back to the driver
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gpu_bench: empty_cache after %s: %s\n", name, e.what());
    }
  };
  if (wanted("gemm")) section("gemm", bench_gemm);
  if (wanted("bandwidth")) section("bandwidth", bench_bandwidth);
  if (wanted("gpt")) {
    if (o.fp) section(o.tf32 ? "gpt_tf32" : "gpt_fp32", bench_gpt<float>);
    if (o.bf16) section("gpt_bf16", bench_gpt<bf16>);
  }
  if (wanted("llama")) section("llama", bench_llama);
  if (wanted("attention")) section("attention", bench_attention);
  if (wanted("attention")) section("attention_tc", bench_attention_tc);
  if (wanted("moe")) section("moe", bench_moe);
  return failed ? 1 : 0;
}
