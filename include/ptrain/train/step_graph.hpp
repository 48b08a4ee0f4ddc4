#pragma once
// The pieces of a training step that never waits for the host: the loss kept
// on the device (LossWindow), the decision when to capture the step in a CUDA
// graph and when to replay it (StepGraphPlan), and the graph itself
// (CudaStepGraph, through the kernel table). train/trainer.hpp puts them
// together; a program with its own loop can use them the same way.
//
// Note [Loss on the device]
// A step's loss stays where it was computed: the engine's loss
// (parallel::device_cross_entropy) adds grad_scale * loss of each micro-batch to
// LossWindow::step(), which begin_step() zeroed; end_step() adds that step's sum
// to the window, on the device, without waiting. The host reads the window only
// when it reports (every log_every steps, at checkpoints, at the end): one
// device-to-host copy for all the steps since the last read, and the check that
// every target lay in [0, classes). The sums are taken in the order the host loop
// took them (micro-batches from zero, then steps from zero), so on the CPU the
// numbers are those of the loop that reads each step's loss, bit for bit.
//
// Note [CUDA graphs of the step]
// On a GPU a small model's step is a few hundred kernel launches whose host cost
// exceeds their run time. A CUDA graph records the whole step (zero_grad,
// forward, loss, backward, optimizer update) once and replays it with one launch,
// as torch.cuda.graphs does. What that needs:
// - Fixed shapes and settings. StepGraphPlan keys the graph on the batch's shapes
//   and the settings that change the recorded work (StepGraphKey); a new key runs
//   `warmup` eager steps again and captures again. The learning rate and the step
//   count are not settings: the optimizer reads them from device memory
//   (Optimizer::use_device_scalars, AdamWStep::lr_step), written before each
//   replay without waiting, so the schedule is followed exactly.
// - Warm-up before capture: at least one eager step (PyTorch's recipe), which
//   makes every lazily created buffer (optimizer state, range tables, the loss
//   accumulators, cuBLAS workspaces) outside the graph.
// - Static inputs: the graph reads the addresses it was captured with, so each
//   batch is copied into input tensors that the caller keeps for the graph's life.
// - Memory: blocks allocated while capturing come from a pool of the graph's own
//   capture stream (kernels/cuda/graph.hpp), which no other stream's work is
//   given; the allocator's live and peak counters stay exact (the pool is
//   counted as reserved).
// - No host reads inside the step: a copy that waits for the device throws
//   [ptrain.cuda.graph_host_sync] naming the capture (CudaBackend::copy asks
//   cudaStreamIsCapturing); the Trainer then turns graphs off for the run and
//   runs the step eagerly, with a note in the log. So do dropout (its masks come
//   from host-side random streams whose offsets a replay would repeat), grad_clip
//   through Engine::clip_grad_norm_ (a host read of the norm; AdamW's
//   max_grad_norm clips on the device), an engine whose collectives go through
//   host memory (MPI, Gloo: Communicator::graph_capturable), and a loss that is
//   read on the host.
// - Collectives: NCCL's are captured (Note [NCCL in a CUDA graph] in
//   dist/nccl_work.hpp: a wait joins the communicator's stream into the capture
//   instead of polling). Every rank keeps its capture or none does (one host
//   all-reduce after each capture), so that the ranks' collectives match.
// - The gate: the captured step is "cuda_graph_step" on kUnverifiedCuda; while
//   it is gated the Trainer runs eagerly.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda_table.hpp"
#include "ptrain/kernels/cuda_unverified.hpp"
#include "ptrain/ops/device_loss.hpp"
#include "ptrain/ops/vector.hpp"

namespace ptrain::train {

/// The loss of the steps since the last read, on the device (Note [Loss on the device]).
class LossWindow {
 public:
  /// The accumulator of the current step's micro-batch losses (the engine's loss adds here).
  ops::DeviceLoss& step() { return step_; }
  /// Zeroes the step's accumulator (on the device: queued, no wait).
  void begin_step() { step_.reset(); }
  /// Adds the step's sum to the window (on the device: queued, no wait).
  void end_step() {
    host_ += step_.host_sum();
    if (step_.bound()) {
      Tensor<double>& acc = step_.bind(step_.device());
      ops::axpy_(1.0, acc, window_.bind(step_.device()));
    }
  }
  /// The sum of the steps' losses since the last reset: reads the device (waits for it).
  double sum() const {
    ++reads_;
    return host_ + window_.sum();
  }
  /// How many times sum() read the window (the host reads of the loss).
  std::int64_t reads() const { return reads_; }
  /// Starts a new window (zeroes the device sum in place: a graph's kernels keep adding there).
  void reset() {
    window_.reset();
    host_ = 0;
  }

 private:
  ops::DeviceLoss step_, window_;
  double host_ = 0;  // losses a verified kernel read on the host (a gated fused classifier)
  mutable std::int64_t reads_ = 0;
};

/// What a captured step depends on besides its data: the shapes of its inputs and the
/// settings that change the recorded work (Note [CUDA graphs of the step]).
struct StepGraphKey {
  std::vector<std::int64_t> shapes;  ///< each input's rank followed by its sizes
  std::string settings;              ///< e.g. "accum=2"

  void add_shape(const Shape& s) {
    shapes.push_back(static_cast<std::int64_t>(s.size()));
    for (std::int64_t d : s) shapes.push_back(d);
  }
  bool operator==(const StepGraphKey&) const = default;
};

/// When to run a step eagerly, capture it or replay it (Note [CUDA graphs of the step]).
/// Device-free, so its decisions are tested on the CPU.
class StepGraphPlan {
 public:
  enum class Action { Eager, Capture, Replay };

  /// `warmup` eager steps (>= 1) run after every change of key before the capture.
  explicit StepGraphPlan(int warmup = 1) : warmup_(warmup) {
    PTRAIN_CHECK(warmup >= 1, Error, "[ptrain.trainer.graph] warm-up steps before a capture must be >= 1, got ",
                 warmup);
  }

  /// What to do with the next step, whose inputs and settings are `key`.
  Action next(const StepGraphKey& key) {
    if (off_) return Action::Eager;
    if (!(key == key_) || !seen_) {
      key_ = key;
      seen_ = true;
      eager_ = 0;
      captured_ = false;
    }
    if (captured_) return Action::Replay;
    if (eager_ < warmup_) {
      ++eager_;
      return Action::Eager;
    }
    return Action::Capture;
  }
  /// The capture next() asked for succeeded: later steps of the same key replay it.
  void captured() {
    captured_ = true;
    ++captures_;
  }
  /// Graphs off for good (a capture failed, or the step cannot be captured): every step eager.
  void turn_off(std::string why) {
    off_ = true;
    why_ = std::move(why);
  }
  bool off() const { return off_; }
  const std::string& why_off() const { return why_; }
  /// Captures so far (1 + recaptures).
  int captures() const { return captures_; }

 private:
  int warmup_;
  StepGraphKey key_;
  bool seen_ = false, captured_ = false, off_ = false;
  int eager_ = 0, captures_ = 0;
  std::string why_;
};

/// A CUDA graph of one device, captured from the work ptrain queues between
/// begin() and end() and replayed by launch() (kernels/cuda/graph.hpp, through the
/// kernel table: this header builds without the CUDA toolkit).
class CudaStepGraph {
 public:
  CudaStepGraph() = default;
  explicit CudaStepGraph(int device) : g_(kernels::cuda_graph_calls().create(device)) {}
  ~CudaStepGraph() {
    if (g_) kernels::cuda_graph_calls().destroy(g_);
  }
  CudaStepGraph(CudaStepGraph&& o) noexcept : g_(std::exchange(o.g_, nullptr)) {}
  CudaStepGraph& operator=(CudaStepGraph&& o) noexcept {
    if (this != &o) {
      if (g_) kernels::cuda_graph_calls().destroy(g_);
      g_ = std::exchange(o.g_, nullptr);
    }
    return *this;
  }

  bool defined() const { return g_ != nullptr; }

  /// Captures what `body` queues on the device; `what` names the capture in the error of
  /// an operation that cannot be captured. On an exception the capture is discarded.
  template <class F>
  void capture(const char* what, F&& body) {
    kernels::check_cuda_verified("cuda_graph_step");  // Note [The verification gate]: refused until a GPU run passes it
    const auto& calls = kernels::cuda_graph_calls();
    const char*& label = kernels::detail::graph_capture_what();
    calls.begin(g_);
    label = what;
    try {
      body();
      label = nullptr;
      calls.end(g_);
    } catch (...) {
      label = nullptr;
      calls.abort(g_);
      throw;
    }
  }
  /// Replays the last capture on the device's current stream.
  void launch() { kernels::cuda_graph_calls().launch(g_); }

 private:
  void* g_ = nullptr;
};

}  // namespace ptrain::train
