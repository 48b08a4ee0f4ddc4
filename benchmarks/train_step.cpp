// One training step of an MLP (forward, cross-entropy, backward, AdamW) on one
// process; prints one JSON line. benchmarks/train_step.py is its PyTorch twin
// and benchmarks/run_train_step.sh runs both side by side.

#include <cstdio>

#include "mlp_bench.hpp"

using namespace ptrain;

// Throughput of one large float GEMM: the practical peak of this CPU core.
static double gemm_peak_gflops() {
  const std::int64_t n = 1024;
  auto a = Tensor<float>::full({n, n}, 0.5f), b = Tensor<float>::full({n, n}, 0.25f), c = Tensor<float>::zeros({n, n});
  auto t = bench::time_runs(2, 9, [&] { ops::matmul_into(a, b, c); });
  return 2.0 * static_cast<double>(n * n * n) / (bench::median(t) * 1e6);
}

int main(int argc, char** argv) {
  CLI::App app{"ptrain MLP training-step benchmark (one process)"};
  bench::MlpOptions o;
  o.add_to(app);
  CLI11_PARSE(app, argc, argv);

  manual_seed(0);
  bench::MlpStep s(o, 1);
  auto times = bench::time_runs(o.warmup, o.steps, [&] { s.step(s.model, [] {}); });
  auto j = bench::mlp_record("train_step", o, times, 1, s.loss);
  const double peak = gemm_peak_gflops();
  j["gemm_peak_gflops"] = peak;
  j["fraction_of_gemm_peak"] = j["gflops"].get<double>() / peak;
  std::printf("%s\n", j.dump().c_str());
}
