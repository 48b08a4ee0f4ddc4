// Built by nvcc: the same calls as steps_cpp.cpp, so the same inline ops.
#include "steps.hpp"

#include <ptrain/ptrain.hpp>

StepResults steps_cu(ptrain::Device device) {
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
