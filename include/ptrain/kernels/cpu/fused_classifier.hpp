#pragma once
// The fused classifier: mean softmax cross-entropy and its gradient in one call
// that writes the gradient over the logits (no second [rows, cols] array) and
// adds the loss to an accumulator instead of returning it, so that on a GPU
// (kernels/cuda/fused_classifier.cuh) a training step never waits for the host.
//
// Row by row this is cross_entropy_forward followed by cross_entropy_backward
// (kernels/cpu/softmax.hpp) with the same arithmetic (up to the multiply-adds a
// compiler contracts differently where it inlines them); bf16 rows are widened to
// float and the gradient rounded back once (Note [bf16 kernels]).

#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"

namespace ptrain::kernels::cpu {

/// On entry logits [rows, cols]; on return the gradient of dloss * (mean loss over the
/// counted rows) with respect to them, written in place: dloss (softmax - (1 - eps)
/// onehot(target) - eps / cols) / counted (eps: label smoothing), 0 in rows whose target
/// is ignore_index or lies outside [0, cols). Rows whose target lies in [0, cols) and is
/// not ignore_index count. Adds loss_weight * (mean loss) to loss[0] (0 when no row
/// counts) and the number of targets outside [0, cols) that are not ignore_index to
/// loss[1]; loss is in the logits' memory.
template <class T>
void fused_classifier(std::int64_t rows, std::int64_t cols, T* logits, const std::int32_t* targets,
                      std::int32_t ignore_index, acc_t<T> smoothing, acc_t<T> dloss, double loss_weight,
                      double* loss) {
  using A = acc_t<T>;
  std::int64_t valid = 0, bad = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= cols) ++bad;
    else ++valid;
  }
  Scratch<A> wide(std::is_same_v<T, A> ? 0 : static_cast<std::size_t>(cols));
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    T* xr = logits + r * cols;
    A* row = nullptr;
    if constexpr (std::is_same_v<T, A>) {
      row = xr;
    } else {
      for (std::int64_t c = 0; c < cols; ++c) wide[c] = static_cast<A>(xr[c]);
      row = wide.data();
    }
    const std::int32_t t = targets[r] >= 0 && targets[r] < cols ? targets[r] : ignore_index;
    A lse = 0;
    std::int64_t counted = 0;
    total += cross_entropy_forward<A>(1, cols, row, &t, &lse, counted, ignore_index, smoothing);
    cross_entropy_backward<A>(1, cols, row, &lse, &t, valid, dloss, row, ignore_index, smoothing);
    if constexpr (!std::is_same_v<T, A>)
      for (std::int64_t c = 0; c < cols; ++c) xr[c] = T(row[c]);
  }
  loss[0] += loss_weight * (valid ? total / static_cast<double>(valid) : 0.0);
  loss[1] += static_cast<double>(bad);
}

}  // namespace ptrain::kernels::cpu
