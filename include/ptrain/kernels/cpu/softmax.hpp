#pragma once
// Row softmax and softmax cross-entropy, numerically stable (max subtracted
// before exp, log-sum-exp kept per row).

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ptrain::kernels::cpu {

/// y[r, :] = softmax(x[r, :]) for a [rows, cols] array.
template <class T>
void softmax_rows(std::int64_t rows, std::int64_t cols, const T* x, T* y) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T mx = xr[0];
    for (std::int64_t c = 1; c < cols; ++c) mx = std::max(mx, xr[c]);
    T s = 0;
    for (std::int64_t c = 0; c < cols; ++c) s += (yr[c] = std::exp(xr[c] - mx));
    const T inv = T(1) / s;
    for (std::int64_t c = 0; c < cols; ++c) yr[c] *= inv;
  }
}

/// dx = y * (dy - sum(dy * y)) row by row, y being the softmax output.
template <class T>
void softmax_rows_backward(std::int64_t rows, std::int64_t cols, const T* y, const T* dy, T* dx) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* yr = y + r * cols;
    const T* dyr = dy + r * cols;
    T* dxr = dx + r * cols;
    T dot = 0;
    for (std::int64_t c = 0; c < cols; ++c) dot += yr[c] * dyr[c];
    for (std::int64_t c = 0; c < cols; ++c) dxr[c] = yr[c] * (dyr[c] - dot);
  }
}

/// Mean cross-entropy of logits [rows, cols] against integer targets [rows].
/// Rows whose target equals ignore_index do not count. Writes each row's
/// log-sum-exp to lse (the backward pass needs it) and returns the mean loss
/// and, through valid, the number of counted rows. With label smoothing eps a
/// row's loss is (1 - eps) (lse - x[t]) + eps * mean over c of (lse - x[c])
/// (torch.nn.CrossEntropyLoss(label_smoothing=eps)).
template <class T>
double cross_entropy_forward(std::int64_t rows, std::int64_t cols, const T* logits, const std::int32_t* targets,
                             T* lse, std::int64_t& valid, std::int32_t ignore_index = -100, T smoothing = T(0)) {
  double total = 0;
  valid = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = logits + r * cols;
    T mx = xr[0];
    for (std::int64_t c = 1; c < cols; ++c) mx = std::max(mx, xr[c]);
    T s = 0;
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(xr[c] - mx);
    lse[r] = mx + std::log(s);
    if (targets[r] == ignore_index) continue;
    T row = lse[r] - xr[targets[r]];
    if (smoothing != T(0)) {
      T sum = 0;
      for (std::int64_t c = 0; c < cols; ++c) sum += xr[c];
      row = (T(1) - smoothing) * row + smoothing * (lse[r] - sum / static_cast<T>(cols));
    }
    total += static_cast<double>(row);
    ++valid;
  }
  return valid ? total / static_cast<double>(valid) : 0.0;
}

/// dlogits = dloss * (softmax(logits) - (1 - eps) onehot(target) - eps / cols) / valid
/// (eps: label smoothing); ignored rows get 0.
template <class T>
void cross_entropy_backward(std::int64_t rows, std::int64_t cols, const T* logits, const T* lse,
                            const std::int32_t* targets, std::int64_t valid, T dloss, T* dlogits,
                            std::int32_t ignore_index = -100, T smoothing = T(0)) {
  const T scale = valid ? dloss / static_cast<T>(valid) : T(0);
  const T uniform = scale * smoothing / static_cast<T>(cols);
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = logits + r * cols;
    T* dr = dlogits + r * cols;
    if (targets[r] == ignore_index) {
      std::fill(dr, dr + cols, T(0));
      continue;
    }
    for (std::int64_t c = 0; c < cols; ++c) dr[c] = scale * std::exp(xr[c] - lse[r]) - uniform;
    dr[targets[r]] -= scale * (T(1) - smoothing);
  }
}

}  // namespace ptrain::kernels::cpu
