#pragma once
// A loss accumulated where it is computed. ops::fused_classifier_ adds each
// batch's loss to a DeviceLoss instead of returning it, so on a GPU a training
// step queues its work and goes on without waiting for the device; the program
// reads the sum when it reports it (every N steps for a progress line), one
// device-to-host copy for all the steps since the last reset.
//
//   ops::DeviceLoss window;
//   for (step ...) {
//     ... logits = model forward ...
//     ops::fused_classifier_(logits, targets, window);   // logits now hold dlogits
//     ... backward from logits, optimizer step ...
//     if (step % 100 == 0) { std::printf("loss %.4f\n", window.mean()); window.reset(); }
//   }

#include <cstdint>

#include "ptrain/core/tensor.hpp"

namespace ptrain::ops {

class DeviceLoss {
 public:
  DeviceLoss() = default;
  /// An accumulator on `device` (without one it takes the device of the first loss added).
  explicit DeviceLoss(Device device) { bind(device); }

  bool bound() const { return acc_.defined(); }
  Device device() const { return acc_.defined() ? acc_.device() : Device::cpu(); }

  /// The accumulator on `device`, made (zero) on first use; [0] the sum of the weighted
  /// losses added there, [1] the number of targets seen outside [0, classes) (not
  /// ignore_index). Throws when it already lives on another device.
  Tensor<double>& bind(Device device) {
    if (!acc_.defined()) acc_ = Tensor<double>::zeros({2}, device);
    PTRAIN_CHECK(acc_.device() == device, ShapeError, "[ptrain.device.mismatch] a DeviceLoss on ", acc_.device(),
                 " got a loss computed on ", device, "; keep one DeviceLoss per device");
    return acc_;
  }

  /// Adds a loss that was computed on the host (the CUDA path that reads the loss each step).
  void add_host(double weighted_loss) { host_ += weighted_loss; }
  /// Adds a loss's weight to the total that mean() divides by.
  void add_weight(double w) { weight_ += w; }
  /// The total weight of the losses added since the last reset (one per unweighted loss).
  double weight() const { return weight_; }
  /// The part of sum() added on the host (add_host), without reading the device.
  double host_sum() const { return host_; }

  /// The weighted sum of the losses added since the last reset. Reads the device (it
  /// waits for the work queued before it); throws ShapeError [ptrain.cross_entropy]
  /// when a target lay outside [0, classes).
  double sum() const {
    double device_part = 0;
    if (acc_.defined()) {
      const auto v = acc_.to_vector();
      PTRAIN_CHECK(v[1] == 0, ShapeError, "[ptrain.cross_entropy] ", static_cast<std::int64_t>(v[1]),
                   " target(s) lay outside [0, classes) and were not ignore_index; their rows got no gradient; "
                   "check the labels and the number of classes");
      device_part = v[0];
    }
    return host_ + device_part;
  }
  /// sum() / weight(): the mean loss since the last reset (0 when nothing was added).
  double mean() const { return weight_ > 0 ? sum() / weight_ : 0.0; }

  /// Starts a new window (on the device: a memset queued on the stream, no wait).
  void reset() {
    if (acc_.defined()) acc_.zero_();
    host_ = 0;
    weight_ = 0;
  }

 private:
  Tensor<double> acc_;
  double host_ = 0;
  double weight_ = 0;
};

}  // namespace ptrain::ops
