#pragma once
// Device dispatch: ops call PTRAIN_DISPATCH(device, kernel, args...) and get
// kernels::cpu::kernel or kernels::cuda::kernel with the same arguments. The
// CUDA kernels exist only in translation units compiled by nvcc; elsewhere a
// cuda device cannot hold tensors in the first place (its allocator throws).

#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cpu/attention.hpp"
#include "ptrain/kernels/cpu/bf16.hpp"
#include "ptrain/kernels/cpu/elementwise.hpp"
#include "ptrain/kernels/cpu/embedding.hpp"
#include "ptrain/kernels/cpu/gemm.hpp"
#include "ptrain/kernels/cpu/layer_norm.hpp"
#include "ptrain/kernels/cpu/optimizer.hpp"
#include "ptrain/kernels/cpu/reduce.hpp"
#include "ptrain/kernels/cpu/softmax.hpp"

#ifdef PTRAIN_CUDA
#include "ptrain/kernels/cuda/all.cuh"
#define PTRAIN_DISPATCH(dev, fn, ...) \
  ((dev).is_cuda() ? ::ptrain::kernels::cuda::fn(__VA_ARGS__) : ::ptrain::kernels::cpu::fn(__VA_ARGS__))
#else
#define PTRAIN_DISPATCH(dev, fn, ...) \
  (::ptrain::ops::detail::require_cpu(dev), ::ptrain::kernels::cpu::fn(__VA_ARGS__))
#endif

namespace ptrain::ops::detail {

inline void require_cpu(Device d) {
  PTRAIN_CHECK(d.is_cpu(), CudaError, "[ptrain.cuda.unavailable] ", d,
               " tensor in a translation unit not compiled by nvcc; compile it as a .cu file");
}

/// Throws ShapeError unless every tensor is on `d`.
inline void check_device(const char* op, Device expected, Device got) {
  PTRAIN_CHECK(got == expected, ShapeError, "[ptrain.device.mismatch] ", op, ": tensors on ", expected, " and ", got,
               "; move them to one device with .to()");
}
template <class... Ts>
void check_devices(const char* op, Device d, const Ts&... ts) {
  (check_device(op, d, ts.device()), ...);
}

}  // namespace ptrain::ops::detail
