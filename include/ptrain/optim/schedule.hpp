#pragma once
// Learning-rate schedules.

#include <cmath>
#include <cstdint>

#include "ptrain/core/error.hpp"

namespace ptrain::optim {

/// Linear warmup from 0 to base_lr over `warmup` steps, then cosine decay to
/// min_lr at step `total` (constant min_lr after). lr(0) = base_lr / warmup.
struct WarmupCosine {
  double base_lr;
  std::int64_t warmup;
  std::int64_t total;
  double min_lr = 0.0;

  double operator()(std::int64_t step) const {
    PTRAIN_CHECK(warmup >= 0 && total > 0, Error, "[ptrain.schedule] need warmup >= 0 and total > 0");
    if (step < warmup) return base_lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
    if (step >= total) return min_lr;
    const double span = static_cast<double>(total - warmup);
    const double progress = span > 0 ? static_cast<double>(step - warmup) / span : 1.0;
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + std::cos(3.141592653589793 * progress));
  }
};

}  // namespace ptrain::optim
