#pragma once
// AdamW over every range of a flat parameter buffer in one call (the ranges
// differ only in whether weight decay applies), with fp32 master weights for
// bf16 parameters, optional stochastic rounding of the bf16 copy, and
// global-norm clipping from a sum of squares that sum_squares_to left in the
// buffers' memory (on a GPU: no host read; kernels/cuda/adamw_ranges.cuh).
//
// Each range is kernels::cpu::adamw_update with the scalars optim::AdamW passes
// it (adamw_update_mixed's arithmetic for bf16), so without clipping and
// stochastic rounding the results are the bits of one adamw_update call per range.

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "ptrain/core/dtype.hpp"
#include "ptrain/kernels/adamw_step.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/optimizer.hpp"
#include "ptrain/kernels/cpu/reduce.hpp"
#include "ptrain/kernels/stochastic_round.hpp"

namespace ptrain::kernels::cpu {

/// *out = sum of x[i]^2 in double, written to memory rather than returned (on a GPU
/// it stays on the device for adamw_update_ranges' clipping).
template <class T>
void sum_squares_to(std::int64_t n, const T* x, double* out) {
  *out = sum_squares(n, x);
}

namespace detail {
/// The gradient scale of global-norm clipping: max_norm / (sqrt(sumsq) + 1e-6) when below 1, else 1.
template <class A>
A clip_coefficient(const AdamWStep& s) {
  if (!s.grad_sumsq) return A(1);
  const double c = s.max_norm / (std::sqrt(*s.grad_sumsq) + 1e-6);
  return c < 1.0 ? static_cast<A>(c) : A(1);
}
}  // namespace detail

/// AdamW (adamw_update's formula) on the n elements of p (T's arithmetic type: the
/// parameters for float and double, the fp32 master copy for bf16) from the gradient g
/// times the clipping coefficient (AdamWStep::grad_sumsq), with moments m and v. The buffer is split into nranges
/// consecutive ranges, range r ending at ends[r] (ends[nranges - 1] == n); weight decay
/// applies where decay[r] != 0. When param is non-null (bf16 parameters) it receives
/// the bf16 rounding of the updated p: to nearest, or stochastic (s.stochastic_rounding).
template <class T>
void adamw_update_ranges(std::int64_t n, std::int64_t nranges, const std::int64_t* ends, const std::uint8_t* decay,
                         acc_t<T>* p, const T* g, acc_t<T>* m, acc_t<T>* v, bf16* param, const AdamWStep& step) {
  using A = acc_t<T>;
  AdamWStep s = step;
  if (s.lr_step) {
    s.lr = s.lr_step[0];
    s.step = static_cast<std::int64_t>(s.lr_step[1]);
  }
  const A coef = detail::clip_coefficient<A>(s);
  const A lr = static_cast<A>(s.lr), b1 = static_cast<A>(s.beta1), b2 = static_cast<A>(s.beta2),
          eps = static_cast<A>(s.eps);
  Scratch<A> scaled;
  std::int64_t begin = 0;
  for (std::int64_t r = 0; r < nranges && begin < n; ++r) {
    const std::int64_t end = ends[r] < n ? ends[r] : n, len = end - begin;
    const A wd = static_cast<A>(decay[r] ? s.weight_decay : 0.0);
    const A* gr = nullptr;
    if constexpr (std::is_same_v<T, A>) gr = g + begin;
    if (!gr || coef != A(1)) {
      scaled.resize(static_cast<std::size_t>(len));
      for (std::int64_t i = 0; i < len; ++i) scaled[i] = static_cast<A>(g[begin + i]) * coef;
      gr = scaled.data();
    }
    adamw_update<A>(len, p + begin, gr, m + begin, v + begin, lr, b1, b2, eps, wd, s.step);
    if (param) {
      for (std::int64_t i = begin; i < end; ++i)
        param[i] = s.stochastic_rounding ? bf16_round_stochastic(static_cast<float>(p[i]), s.seed,
                                                                 static_cast<std::uint64_t>(s.step),
                                                                 static_cast<std::uint64_t>(i))
                                         : bf16(static_cast<float>(p[i]));
    }
    begin = end;
  }
}

}  // namespace ptrain::kernels::cpu
