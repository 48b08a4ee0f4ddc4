#pragma once
// The same training-step pieces, instantiated in a .cpp file (steps_cpp.cpp, g++)
// and in a .cu file (steps_cu.cu, nvcc): GELU, a Linear forward and backward, and
// one AdamW step of its weight. Both instantiate the same inline function and ops;
// with one definition of each, both must give the same results on each device.
#include <vector>

#include <ptrain/ptrain.hpp>

struct StepResults {
  std::vector<float> gelu;        // gelu(x), [2, 3]
  std::vector<float> y;           // x W^T + b, [2, 2]
  std::vector<float> dx, dw, db;  // linear_backward for dy
  std::vector<float> w_after;     // W after one AdamW step with gradient dw
};

// Inputs shared by both files and the reference.
inline const std::vector<float> kX{-2.0f, -0.5f, 0.0f, 0.25f, 1.0f, 3.0f};  // [2, 3]
inline const std::vector<float> kW{1.0f, 2.0f, 3.0f, -1.0f, 0.0f, 1.0f};    // [2, 3]
inline const std::vector<float> kB{0.5f, -0.5f};                            // [2]
inline const std::vector<float> kDy{1.0f, -2.0f, 0.5f, 4.0f};               // [2, 2]
inline constexpr double kLr = 0.1, kWeightDecay = 0.01;

inline StepResults run_steps(ptrain::Device device) {
  using namespace ptrain;
  const auto x = Tensor<float>::from(kX, {2, 3}).to(device);
  const auto w = Tensor<float>::from(kW, {2, 3}).to(device);
  const auto b = Tensor<float>::from(kB, {2}).to(device);
  const auto dy = Tensor<float>::from(kDy, {2, 2}).to(device);
  StepResults r;
  r.gelu = ops::gelu(x).to_vector();
  r.y = ops::linear(x, w, b).to_vector();
  auto dw = Tensor<float>::zeros({2, 3}, device);
  auto db = Tensor<float>::zeros({2}, device);
  r.dx = ops::linear_backward(x, w, dy, dw, &db).to_vector();
  r.dw = dw.to_vector();
  r.db = db.to_vector();
  auto values = w.clone().reshape({6});
  optim::AdamW<float> adamw(values, dw.reshape({6}), {}, {.lr = kLr, .weight_decay = kWeightDecay});
  adamw.step();
  r.w_after = values.to_vector();
  return r;
}

StepResults steps_cpp(ptrain::Device device);
StepResults steps_cu(ptrain::Device device);
