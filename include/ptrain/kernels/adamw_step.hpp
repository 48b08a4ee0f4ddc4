#pragma once
// The settings of one AdamW update over a flat buffer's ranges
// (kernels::cpu::adamw_update_ranges and its CUDA twin): the hyperparameters,
// the step, device clipping and stochastic rounding.

#include <cstdint>

namespace ptrain::kernels {

struct AdamWStep {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;  ///< applied to the ranges whose decay flag is set
  std::int64_t step = 1;       ///< counts from 1 (bias corrections)
  /// Global-norm clipping without a host read: when non-null, *grad_sumsq (in the
  /// buffers' memory) is the sum of squares of the gradients, and every gradient is
  /// multiplied by max_norm / (sqrt(*grad_sumsq) + 1e-6) when that is below 1
  /// (torch.nn.utils.clip_grad_norm_'s coefficient) before the update.
  const double* grad_sumsq = nullptr;
  double max_norm = 0;
  /// bf16 parameters: round the updated fp32 master value to bf16 stochastically
  /// (kernels/stochastic_round.hpp, hashed from (seed, step, flat index)) instead
  /// of to nearest.
  bool stochastic_rounding = false;
  std::uint64_t seed = 0;
  /// CUDA graphs (Note [CUDA graphs of the step] in train/step_graph.hpp): when non-null,
  /// the update reads the learning rate from lr_step[0] and the step from lr_step[1] (a
  /// whole number), in the buffers' memory, when it runs, instead of lr and step above, so
  /// that a replayed graph follows the schedule.
  const double* lr_step = nullptr;
};

}  // namespace ptrain::kernels
