#pragma once
// One process, no communication: the Engine (parallel/engine.hpp) of a program
// that runs alone. Its world is a dist::SelfCommunicator, so checkpoints,
// averages and the training loop take the same path as in a launched job.
//
//   parallel::Local<float> engine(model);
//   optim::AdamW<float> opt(engine.parameters(), {.lr = 1e-3});
//   engine.zero_grad();
//   double loss = engine.forward_backward(x, y);
//   engine.step(opt);

#include <memory>

#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/parallel/engine.hpp"

namespace ptrain::parallel {

template <class T>
class Local : public Engine<T> {
 public:
  /// Trains `model` (which must outlive the engine); its parameters are packed into flat buffers.
  explicit Local(nn::Module<T>& model) : model_(model), params_(model), world_(params_.values().device()) {}

  Mode mode() const override { return Mode::Local; }
  nn::FlatParameters<T>& parameters() override { return params_; }
  nn::Module<T>& local_module() override { return model_; }
  dist::Communicator& communicator() override { return world_; }
  dist::Communicator* data_parallel_group() override { return nullptr; }
  void zero_grad() override { params_.zero_grad(); }
  void finish_gradient_sync() override {}

 private:
  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
             bool training) override {
    return this->run_module(model_, in, targets, grad_scale, training);
  }

  nn::Module<T>& model_;
  nn::FlatParameters<T> params_;
  dist::SelfCommunicator world_;
};

}  // namespace ptrain::parallel
