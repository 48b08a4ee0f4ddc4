#pragma once
// The same training-step pieces, written out once in a .cpp file (steps_cpp.cpp,
// g++) and once in a .cu file (steps_cu.cu, nvcc): GELU, a Linear forward and
// backward, and one AdamW step of its weight. Both call the same inline ops;
// with one definition of each, both must give the same results on each device.
#include <vector>

#include <ptrain/core/device.hpp>

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

StepResults steps_cpp(ptrain::Device device);
StepResults steps_cu(ptrain::Device device);
