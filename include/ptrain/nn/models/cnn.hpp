#pragma once
// A small convolutional network for images: conv blocks (3x3 convolution,
// batch norm, ReLU, 2x2 max-pool) and a linear head.

#include <vector>

#include "ptrain/nn/activation.hpp"
#include "ptrain/nn/batch_norm.hpp"
#include "ptrain/nn/conv.hpp"
#include "ptrain/nn/linear.hpp"
#include "ptrain/nn/sequential.hpp"

namespace ptrain::nn {

/// CNN(1, 28, 28, {16, 32}, 10) on flat images [N, 784]:
///   Unflatten(1, (1, 28, 28)),
///   Conv2d(1, 16, 3, padding=1, bias=False), BatchNorm2d(16), ReLU, MaxPool2d(2),   -> [N, 16, 14, 14]
///   Conv2d(16, 32, 3, padding=1, bias=False), BatchNorm2d(32), ReLU, MaxPool2d(2),  -> [N, 32, 7, 7]
///   Flatten, Linear(32 * 7 * 7, 10).
/// With sync_bn the norms are SyncBatchNorm (statistics over every
/// data-parallel replica's batch). Names follow torch.nn.Sequential ("1.weight",
/// "2.running_mean", ...); every layer is a unit (FSDP wraps, pipelines cut).
template <class T>
class CNN : public Sequential<T> {
 public:
  CNN(std::int64_t in_channels, std::int64_t height, std::int64_t width, const std::vector<std::int64_t>& channels,
      std::int64_t classes, bool sync_bn = false, Generator& gen = default_generator()) {
    PTRAIN_CHECK(!channels.empty() && classes > 0, ShapeError, "[ptrain.cnn.config] give at least one block and a "
                 "positive class count");
    this->add(std::make_shared<Unflatten<T>>(std::vector<std::int64_t>{in_channels, height, width}));
    std::int64_t c = in_channels, h = height, w = width;
    bool first = true;
    for (std::int64_t out : channels) {
      PTRAIN_CHECK(h >= 2 && w >= 2, ShapeError, "[ptrain.cnn.config] ", channels.size(), " blocks halve a ",
                   height, "x", width, " image below 1x1; use fewer blocks");
      // No conv bias: the norm right after subtracts the channel mean, so a bias would
      // get a zero gradient (only rounding noise, which Adam would amplify).
      auto conv = this->add(
          std::make_shared<Conv2d<T>>(c, out, 3, Conv2dOptions{.padding = {1, 1}, .bias = false}, gen));
      if (first) conv->set_need_input_grad(false);  // its input is data
      first = false;
      if (sync_bn) this->add(std::make_shared<SyncBatchNorm<T>>(out));
      else this->add(std::make_shared<BatchNorm2d<T>>(out));
      this->add(std::make_shared<ReLU<T>>());
      this->add(std::make_shared<MaxPool2d<T>>(2));
      c = out;
      h /= 2;
      w /= 2;
    }
    this->add(std::make_shared<Flatten<T>>());
    this->add(std::make_shared<Linear<T>>(c * h * w, classes, true, gen));
  }
};

}  // namespace ptrain::nn
