#pragma once
// Elementwise CUDA kernels: bias, activations, dropout, axpy, and the float <-> bf16
// casts of mixed precision. Float, double and bf16 (Note [bf16 kernels]).
//
// Same names and arguments as kernels/cpu/elementwise.hpp, on device pointers
// of the current device; each launches on current_stream() and returns without
// waiting. Grid-stride loops, so any n runs with a bounded grid; the pointwise
// ones share one loop (Note [Elementwise loops]).

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"
#include "ptrain/kernels/cuda/reduce.cuh"

namespace ptrain::kernels::cuda {

namespace detail {

// Note [Elementwise loops]
// y[i] = op(i, x0[i], x1[i], ...) over n elements, each thread taking kUnroll<T>
// elements per pass (indices first, first + stride, ... with stride the grid's
// thread count, so a warp's accesses stay contiguous) and issuing every load of
// a pass before its first store. That keeps 16 bytes per input in flight per
// thread (4 floats, 8 bf16, 2 doubles): with one element per pass, a kernel
// that reads one bf16 array has 2 bytes in flight per thread, far from the
// ~9 bytes per thread (bandwidth x latency / resident threads) that H100's
// memory needs to run at speed. Loads and stores of an element stay in one
// thread, so y may be one of the inputs (in-place axpy, scale, GELU backward).
// Any alignment works (no vector types). pointwise_elements is the loop of one
// thread, host-callable so that the [nogpu] test runs it over emulated threads.
template <class T>
inline constexpr int kUnroll = 16 / static_cast<int>(sizeof(T));

template <class X, int NIn>
struct Inputs {
  const X* p[NIn];
};

template <class Y, class X, int NIn, class Op, std::size_t... J>
PTRAIN_HOST_DEVICE void pointwise_elements_impl(std::int64_t n, std::int64_t first, std::int64_t stride,
                                                const Inputs<X, NIn>& in, Y* y, const Op& op,
                                                std::index_sequence<J...>) {
  constexpr int U = kUnroll<X>;
  for (std::int64_t base = first; base < n; base += U * stride) {
    X v[NIn][U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const std::int64_t i = base + k * stride;
      if (i < n) ((v[J][k] = in.p[J][i]), ...);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const std::int64_t i = base + k * stride;
      if (i < n) y[i] = op(i, v[J][k]...);
    }
  }
}

/// The elements of n that the thread with global index `first` of `stride` threads owns.
template <class Y, class X, int NIn, class Op>
PTRAIN_HOST_DEVICE void pointwise_elements(std::int64_t n, std::int64_t first, std::int64_t stride,
                                           const Inputs<X, NIn>& in, Y* y, const Op& op) {
  pointwise_elements_impl(n, first, stride, in, y, op, std::make_index_sequence<NIn>{});
}

template <class Y, class X, int NIn, class Op>
__global__ void pointwise_kernel(std::int64_t n, Inputs<X, NIn> in, Y* y, Op op) {
  pointwise_elements(n, global_index(), grid_stride(), in, y, op);
}

/// Launches y[i] = op(i, x[i], xs[i]...) on the current stream (Note [Elementwise
/// loops]); the inputs share one element type.
template <class Y, class X, class Op, class... Xs>
void pointwise(std::int64_t n, Y* y, Op op, const X* x, const Xs*... xs) {
  static_assert((std::is_same_v<X, Xs> && ...), "pointwise: the inputs share one element type");
  check_element_type<Y>();
  check_element_type<X>();
  if (n <= 0) return;
  constexpr int NIn = 1 + sizeof...(Xs), U = kUnroll<X>;
  pointwise_kernel<Y, X, NIn, Op><<<grid_for((n + U - 1) / U), kBlock, 0, current_stream()>>>(
      n, Inputs<X, NIn>{{x, xs...}}, y, op);
  PTRAIN_CHECK_CUDA_LAUNCH();
}

template <class T>
struct BiasAddOp {
  const T* bias;
  std::int64_t cols;
  __device__ T operator()(std::int64_t i, T y) const { return st<T>(ld(y) + ld(bias[i % cols])); }
};

// The bias gradient's term for column sums (reduce.cuh): dy[r, c].
template <class T>
struct BiasGradTerm {
  static constexpr int K = 1;
  const T* dy;
  std::int64_t cols;
  __device__ void operator()(std::int64_t r, std::int64_t c, acc_t<T>* out) const { out[0] = ld(dy[r * cols + c]); }
};

template <class T>
struct ReluOp {
  __device__ T operator()(std::int64_t, T x) const { return ld(x) > 0 ? x : T(0); }
};

template <class T>
struct ReluBackwardOp {
  __device__ T operator()(std::int64_t, T x, T dy) const { return ld(x) > 0 ? dy : T(0); }
};

template <class T>
struct GeluOp {
  __device__ T operator()(std::int64_t, T x) const {
    using A = acc_t<T>;
    const A k0 = A(0.7978845608028654), k1 = A(0.044715), v = ld(x);
    return st<T>(A(0.5) * v * (A(1) + dev_tanh(k0 * (v + k1 * v * v * v))));
  }
};

template <class T>
struct GeluBackwardOp {
  __device__ T operator()(std::int64_t, T x, T dy) const {
    using A = acc_t<T>;
    const A k0 = A(0.7978845608028654), k1 = A(0.044715), v = ld(x);
    const A t = dev_tanh(k0 * (v + k1 * v * v * v));
    return st<T>(ld(dy) * (A(0.5) * (A(1) + t) + A(0.5) * v * (A(1) - t * t) * k0 * (A(1) + A(3) * k1 * v * v)));
  }
};

// The mask comes from random_uniform(seed, offset + i), the CPU's formula, in
// double as on the CPU, so both devices drop exactly the same elements.
template <class T>
struct DropoutOp {
  double p;
  acc_t<T> scale;
  std::uint64_t seed, offset;
  __device__ T operator()(std::int64_t i, T x) const {
    return random_uniform(seed, offset + static_cast<std::uint64_t>(i)) >= p ? st<T>(ld(x) * scale) : T(0);
  }
};

template <class T>
struct AxpyOp {
  acc_t<T> alpha;
  __device__ T operator()(std::int64_t, T x, T y) const { return st<T>(ld(y) + alpha * ld(x)); }
};

template <class T>
struct ScaleOp {
  acc_t<T> alpha;
  __device__ T operator()(std::int64_t, T x) const { return st<T>(ld(x) * alpha); }
};

}  // namespace detail

/// y[r, :] += bias for each of `rows` rows of width `cols`.
template <class T>
void bias_add(std::int64_t rows, std::int64_t cols, T* y, const T* bias) {
  if (rows <= 0 || cols <= 0) return;
  detail::pointwise(rows * cols, y, detail::BiasAddOp<T>{bias, cols}, static_cast<const T*>(y));
}

/// dbias += sum over rows of dy (column sums of a [rows, cols] array).
template <class T>
void bias_grad(std::int64_t rows, std::int64_t cols, const T* dy, T* dbias) {
  detail::check_element_type<T>();
  detail::column_sums<T>(rows, cols, detail::BiasGradTerm<T>{dy, cols}, detail::ColumnOutputs<T, 1>{{dbias}});
}

template <class T>
void relu_forward(std::int64_t n, const T* x, T* y) {
  detail::pointwise(n, y, detail::ReluOp<T>{}, x);
}

/// dx = dy where x > 0, else 0 (x is the forward input).
template <class T>
void relu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  detail::pointwise(n, dx, detail::ReluBackwardOp<T>{}, x, dy);
}

/// GELU, tanh form (GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
template <class T>
void gelu_forward(std::int64_t n, const T* x, T* y) {
  detail::pointwise(n, y, detail::GeluOp<T>{}, x);
}

template <class T>
void gelu_backward(std::int64_t n, const T* x, const T* dy, T* dx) {
  detail::pointwise(n, dx, detail::GeluBackwardOp<T>{}, x, dy);
}

/// Inverted dropout: y = x * mask / (1 - p), mask[i] = uniform(seed, offset + i) >= p.
/// The same mask as kernels::cpu::dropout for the same (seed, offset).
template <class T>
void dropout(std::int64_t n, const T* x, T* y, double p, std::uint64_t seed, std::uint64_t offset) {
  const acc_t<T> scale = acc_t<T>(1.0 / (1.0 - p));  // rounded as the CPU rounds it
  detail::pointwise(n, y, detail::DropoutOp<T>{p, scale, seed, offset}, x);
}

/// y += alpha * x
template <class T>
void axpy(std::int64_t n, acc_t<T> alpha, const T* x, T* y) {
  detail::pointwise(n, y, detail::AxpyOp<T>{alpha}, x, static_cast<const T*>(y));
}

template <class T>
void scale(std::int64_t n, acc_t<T> alpha, T* x) {
  detail::pointwise(n, x, detail::ScaleOp<T>{alpha}, static_cast<const T*>(x));
}

namespace detail {
template <class To>
struct CastOp {
  template <class From>
  __device__ To operator()(std::int64_t, From x) const {
    return static_cast<To>(static_cast<float>(x));
  }
};
}  // namespace detail

/// y[i] = x[i] converted: to bf16 through float, rounding to nearest even (NaN stays
/// NaN) with bf16's own conversion, so the bits equal the CPU's; from bf16 exactly.
template <class From, class To>
void cast(std::int64_t n, const From* x, To* y) {
  static_assert(is_bf16_cast<From, To>, "ptrain::kernels::cuda::cast: float or double <-> bf16");
  detail::pointwise(n, y, detail::CastOp<To>{}, x);
}

}  // namespace ptrain::kernels::cuda
