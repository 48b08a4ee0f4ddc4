#pragma once
// Device dispatch: ops call PTRAIN_DISPATCH(device, T, kernel, args...) and get
// kernels::cpu::kernel(args...) on the CPU, or the CUDA kernel table's entry for
// element type T (kernels/cuda_table.hpp) on cuda:N. The body is the same in
// every translation unit, whichever compiler builds it (Note [One definition of
// dispatch]); a program that is not linked with ptrain::cuda throws
// [ptrain.cuda.unavailable] when it reaches a CUDA tensor.

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cpu/activation.hpp"
#include "ptrain/kernels/cpu/adamw_ranges.hpp"
#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/batch_norm.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"
#include "ptrain/kernels/cpu/conv.hpp"
#include "ptrain/kernels/cpu/elementwise.hpp"
#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/kernels/cpu/fused_classifier.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/layer_norm.hpp"
#include "ptrain/kernels/cpu/loss.hpp"
#include "ptrain/kernels/cpu/optimizer.hpp"
#include "ptrain/kernels/cpu/reduce.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"
#include "ptrain/kernels/cuda_table.hpp"

/// kernels::cpu::fn(args...) or, for a cuda device, the table's fn for element type T.
#define PTRAIN_DISPATCH(dev, T, fn, ...)                                                                 \
  ((dev).is_cuda() ? ::ptrain::kernels::cuda_kernel<T>(&::ptrain::kernels::CudaKernels<T>::fn, #fn)(__VA_ARGS__) \
                   : ::ptrain::kernels::cpu::fn(__VA_ARGS__))

namespace ptrain::ops::detail {

/// Throws ShapeError unless every tensor is on `d`.
inline void check_device(const char* op, Device expected, Device got) {
  PTRAIN_CHECK(got == expected, ShapeError, "[ptrain.device.mismatch] ", op, ": tensors on ", expected, " and ", got,
               "; move them to one device with .to()");
}
template <class... Ts>
void check_devices(const char* op, Device d, const Ts&... ts) {
  (check_device(op, d, ts.device()), ...);
}

/// A frozen parameter's gradient is undefined (Note [Frozen parameters] in
/// nn/flat_parameters.hpp): ops skip it. Kernels that compute a small weight
/// gradient in the same pass as dx (norms) write it into this zero scratch instead.
template <class T>
Tensor<T> grad_or_scratch(const Tensor<T>& grad, const Shape& shape, Device device) {
  return grad.defined() ? grad : Tensor<T>::zeros(shape, device);
}


/// True for a CUDA device whose table has `fn` for T and whose gate lets it run: an op
/// then takes `fn` instead of its verified kernel (Note [The verification gate]).
template <class T, class Fn>
bool use_cuda_kernel(Device dev, Fn kernels::CudaKernels<T>::*fn, const char* name) {
  return dev.is_cuda() && kernels::cuda_kernel_usable(fn, name);
}

}  // namespace ptrain::ops::detail
