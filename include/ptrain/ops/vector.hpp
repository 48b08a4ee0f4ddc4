#pragma once
// Whole-tensor vector operations: element type casts, y += alpha x, x *= alpha,
// sums and sums of squares, and the index of each row's largest element.

#include <cstdint>
#include <type_traits>

#include "ptrain/ops/dispatch.hpp"

namespace ptrain::ops {

/// dst = src converted element by element (float or double <-> bf16; to bf16 rounds
/// to nearest even); a plain copy when the types are the same.
template <class From, class To>
void cast_into(const Tensor<From>& src, Tensor<To>& dst) {
  check_shape(dst, src.shape(), "cast destination");
  detail::check_devices("cast", src.device(), dst);
  if constexpr (std::is_same_v<From, To>) {
    dst.copy_(src);
  } else if (src.device().is_cuda()) {
    // The table keeps casts under their float or double side: T -> bf16 and bf16 -> T.
    if constexpr (std::is_same_v<To, bf16>)
      kernels::cuda_kernel<From>(&kernels::CudaKernels<From>::cast_to_bf16, "cast")(src.numel(), src.data(),
                                                                                   dst.data());
    else
      kernels::cuda_kernel<To>(&kernels::CudaKernels<To>::cast_from_bf16, "cast")(src.numel(), src.data(),
                                                                                 dst.data());
  } else {
    kernels::cpu::cast(src.numel(), src.data(), dst.data());
  }
}

/// y += alpha * x
template <class T>
void axpy_(acc_t<T> alpha, const Tensor<T>& x, Tensor<T>& y) {
  PTRAIN_CHECK(x.numel() == y.numel(), ShapeError, "[ptrain.axpy] ", x.shape(), " vs ", y.shape());
  detail::check_devices("axpy", x.device(), y);
  PTRAIN_DISPATCH(x.device(), T, axpy, x.numel(), alpha, x.data(), y.data());
}

/// x *= alpha
template <class T>
void scale_(Tensor<T>& x, acc_t<T> alpha) {
  PTRAIN_DISPATCH(x.device(), T, scale, x.numel(), alpha, x.data());
}

/// Sum of all elements, accumulated in double.
template <class T>
double sum(const Tensor<T>& x) {
  return PTRAIN_DISPATCH(x.device(), T, sum, x.numel(), x.data());
}

/// Sum of squares of all elements, accumulated in double.
template <class T>
double sum_squares(const Tensor<T>& x) {
  return PTRAIN_DISPATCH(x.device(), T, sum_squares, x.numel(), x.data());
}

/// Index of the largest element of each row of a [rows, cols] tensor.
template <class T>
Tensor<std::int32_t> argmax_rows(const Tensor<T>& x) {
  PTRAIN_CHECK(x.dim() == 2, ShapeError, "[ptrain.argmax] needs a 2-D tensor, got ", x.shape());
  PTRAIN_CHECK(x.size(1) >= 1 || x.size(0) == 0, ShapeError, "[ptrain.argmax] the rows of ", x.shape(),
               " are empty and have no largest element");
  auto out = Tensor<std::int32_t>::empty({x.size(0)}, x.device());
  PTRAIN_DISPATCH(x.device(), T, argmax_rows, x.size(0), x.size(1), x.data(), out.data());
  return out;
}

}  // namespace ptrain::ops
