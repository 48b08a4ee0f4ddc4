// One program, two compilers: steps_cpp.cpp (C++ compiler) and steps_cu.cu
// (nvcc) call the same ops. Each runs on the CPU and, where a GPU is visible,
// on cuda:0; every result is compared with a reference worked out here in
// double with plain loops, and the devices and files with each other.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <ptrain/kernels/cuda/stream.hpp>  // device_count: host code, fine for the C++ compiler

#include "steps.hpp"

namespace {

StepResults reference() {
  StepResults r;
  for (double v : kX)
    r.gelu.push_back(static_cast<float>(0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))));
  // y[i][o] = sum_k x[i][k] W[o][k] + b[o]
  for (int i = 0; i < 2; ++i)
    for (int o = 0; o < 2; ++o) {
      double s = kB[o];
      for (int k = 0; k < 3; ++k) s += double(kX[i * 3 + k]) * kW[o * 3 + k];
      r.y.push_back(static_cast<float>(s));
    }
  // dx[i][k] = sum_o dy[i][o] W[o][k]; dW[o][k] = sum_i dy[i][o] x[i][k]; db[o] = sum_i dy[i][o]
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 3; ++k) r.dx.push_back(kDy[i * 2] * kW[k] + kDy[i * 2 + 1] * kW[3 + k]);
  for (int o = 0; o < 2; ++o)
    for (int k = 0; k < 3; ++k) r.dw.push_back(kDy[o] * kX[k] + kDy[2 + o] * kX[3 + k]);
  for (int o = 0; o < 2; ++o) r.db.push_back(kDy[o] + kDy[2 + o]);
  // First AdamW step (bias-corrected moments are g and g^2): decay, then lr * g / (|g| + eps).
  for (int j = 0; j < 6; ++j) {
    const double g = r.dw[j];
    r.w_after.push_back(static_cast<float>(kW[j] * (1 - kLr * kWeightDecay) - kLr * g / (std::abs(g) + 1e-8)));
  }
  return r;
}

int failures = 0;

void compare(const std::string& what, const std::vector<float>& got, const std::vector<float>& want, double tol) {
  double worst = got.size() == want.size() ? 0.0 : INFINITY;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]) / std::max(1.0, std::abs(double(want[i])));
    if (!(err <= worst)) worst = err;  // NaN counts as worst
  }
  const bool ok = worst <= tol;
  if (!ok) {
    ++failures;
    std::printf("  %s: error %g above %g\n", what.c_str(), worst, tol);
  }
}

void compare_all(const std::string& what, const StepResults& got, const StepResults& want, double tol) {
  compare(what + " gelu", got.gelu, want.gelu, tol);
  compare(what + " linear", got.y, want.y, tol);
  compare(what + " dx", got.dx, want.dx, tol);
  compare(what + " dw", got.dw, want.dw, tol);
  compare(what + " db", got.db, want.db, tol);
  compare(what + " adamw", got.w_after, want.w_after, tol);
}

}  // namespace

int main() {
  using ptrain::Device;
  const StepResults ref = reference();
  const StepResults cpu_cpp = steps_cpp(Device::cpu()), cpu_cu = steps_cu(Device::cpu());
  compare_all("cpu (.cpp)", cpu_cpp, ref, 1e-6);
  compare_all("cpu (.cu)", cpu_cu, ref, 1e-6);
  compare_all("cpu .cpp vs .cu", cpu_cpp, cpu_cu, 0.0);  // one definition of each op: the same code ran
  std::printf("cpu part: %s\n", failures == 0 ? "ok" : "WRONG");

  const int gpus = ptrain::kernels::cuda::device_count();
  if (gpus == 0) {
    std::printf("cuda part skipped: no CUDA device visible\n");
    return failures == 0 ? 0 : 1;
  }
  const StepResults gpu_cpp = steps_cpp(Device::cuda(0)), gpu_cu = steps_cu(Device::cuda(0));
  compare_all("cuda (.cpp)", gpu_cpp, ref, 1e-5);
  compare_all("cuda (.cu)", gpu_cu, ref, 1e-5);
  compare_all("cuda vs cpu (.cpp)", gpu_cpp, cpu_cpp, 1e-5);
  compare_all("cuda .cpp vs .cu", gpu_cpp, gpu_cu, 0.0);
  std::printf("cuda part (%d device(s), ran on cuda:0): %s\n", gpus, failures == 0 ? "ok" : "WRONG");
  return failures == 0 ? 0 : 1;
}
