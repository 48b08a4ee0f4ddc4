#pragma once
// Optimizer base: updates run over flat buffers (parameters, gradients and
// state share offsets), so one kernel call updates a whole model or a whole
// FSDP shard. Weight decay can be switched off per parameter; the buffer is
// then split into as few contiguous ranges as the decay pattern allows.
//
// State is reachable by name for checkpoints: state_tensors() gives one view
// per parameter and state kind ("0.weight.exp_avg"), and steps() the count.
// State is kept in acc_t<T>: float for bf16 parameters (mixed precision).

#include <cmath>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "ptrain/nn/flat_parameters.hpp"

namespace ptrain::optim {

/// Which parameters get weight decay; default: all (as torch.optim).
using DecayFilter = std::function<bool(const std::string& param_name)>;

template <class T>
class Optimizer {
 public:
  /// Optimizes the trainable parameters packed in `params` (which must outlive the
  /// optimizer); frozen ones get no state (Note [Frozen parameters] in nn/flat_parameters.hpp).
  explicit Optimizer(nn::FlatParameters<T>& params, double lr, DecayFilter decay = {})
      : Optimizer(params.values(), params.grads(), params.entries(), lr, std::move(decay)) {
    bind(params);
  }

  /// Optimizes a flat range given explicitly (FSDP passes its local shard).
  Optimizer(Tensor<T> values, Tensor<T> grads, std::vector<nn::FlatEntry<T>> entries, double lr,
            DecayFilter decay = {})
      : values_(std::move(values)), grads_(std::move(grads)), entries_(std::move(entries)), lr_(checked_lr(lr)) {
    PTRAIN_CHECK(values_.numel() == grads_.numel(), ShapeError, "[ptrain.optim] values ", values_.shape(),
                 " and grads ", grads_.shape(), " differ");
    build_ranges(decay);
  }
  virtual ~Optimizer() = default;

  /// One update from the current gradients.
  virtual void step() = 0;

  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = checked_lr(lr); }
  std::int64_t steps() const { return steps_; }
  void set_steps(std::int64_t s) { steps_ = s; }

  /// CUDA graphs of the step (Note [CUDA graphs of the step] in train/step_graph.hpp):
  /// on, step() reads the learning rate and the step count from device memory, where
  /// stage_device_scalars() writes them before each captured or replayed step, so that
  /// a replay follows set_lr(). Returns false when this optimizer cannot (a replay would
  /// repeat the captured values: the caller must not capture it); off always succeeds.
  virtual bool use_device_scalars(bool on) { return !on; }
  /// Writes lr() and steps() + 1 (the step the next update counts) to device memory,
  /// queued on the current stream without waiting for the device.
  virtual void stage_device_scalars() {}
  /// Counts a step that a replayed graph made (step() did not run on the host).
  void count_replayed_step() { ++steps_; }

  /// Per-parameter views of every state buffer, named "<param>.<state>".
  std::vector<std::pair<std::string, Tensor<acc_t<T>>>> state_tensors() {
    std::vector<std::pair<std::string, Tensor<acc_t<T>>>> out;
    for (auto& [kind, buf] : state_)
      for (auto& e : entries_) out.emplace_back(e.name + "." + kind, buf.view(e.offset, e.shape));
    return out;
  }
  /// The flat state buffers by kind ("exp_avg", "momentum_buffer", ...).
  const std::deque<std::pair<std::string, Tensor<acc_t<T>>>>& flat_state() const { return state_; }

 protected:
  static double checked_lr(double lr) {
    PTRAIN_CHECK(std::isfinite(lr) && lr >= 0, Error, "[ptrain.optim.lr] learning rate ", lr,
                 " must be finite and >= 0");
    return lr;
  }
  /// Throws naming `what` unless lo <= v < hi (hi excluded when open) and v is a number.
  static void check_option(const char* optimizer, const char* what, double v, double lo, double hi, bool open) {
    PTRAIN_CHECK(v >= lo && (open ? v < hi : v <= hi), Error, "[ptrain.optim.options] ", optimizer, " ", what, " ", v,
                 " must lie in [", lo, ", ", hi, open ? ")" : "]");
  }

  /// Called first by step(): the parameters must still be views into the flat buffers.
  void check_bound() const {
    if (bound_) nn::check_bound(entries_, values_, grads_, frozen_entries_, frozen_values_);
  }
  /// Built on FlatParameters: step() checks that its parameters, frozen ones too, are still its views.
  void bind(nn::FlatParameters<T>& params) {
    bound_ = true;
    frozen_entries_ = params.frozen_entries();
    frozen_values_ = params.frozen_values();
  }

  struct Range {
    std::int64_t begin, end;
    bool decay;
  };
  Tensor<acc_t<T>>& add_state(const std::string& kind) {
    state_.emplace_back(kind, Tensor<acc_t<T>>::zeros(values_.shape(), values_.device()));
    return state_.back().second;
  }

  Tensor<T> values_, grads_;
  std::vector<nn::FlatEntry<T>> entries_;
  std::vector<Range> ranges_;
  double lr_;
  std::int64_t steps_ = 0;
  bool bound_ = false;  // built on FlatParameters: entries_ are views into values_/grads_ (check_bound)
  std::vector<nn::FlatEntry<T>> frozen_entries_;  // and these into frozen_values_
  Tensor<T> frozen_values_;

 private:
  // Padding after an entry belongs to that entry; the first range starts at 0
  // and the last ends at the buffer's end, so every element is updated.
  void build_ranges(const DecayFilter& decay) {
    const std::int64_t n = values_.numel();
    if (!decay || entries_.empty()) {
      ranges_ = {{0, n, true}};
      return;
    }
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const bool d = decay(entries_[i].name);
      const std::int64_t begin = i == 0 ? 0 : entries_[i].offset;
      const std::int64_t end = i + 1 < entries_.size() ? entries_[i + 1].offset : n;
      if (!ranges_.empty() && ranges_.back().decay == d) ranges_.back().end = end;
      else ranges_.push_back({begin, end, d});
    }
  }

  std::deque<std::pair<std::string, Tensor<acc_t<T>>>> state_;  // deque: add_state() references stay valid
};

}  // namespace ptrain::optim
