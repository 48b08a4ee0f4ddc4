#pragma once
// GEMM on row-major device buffers through cuBLAS.
//
//   C[M,N] = alpha * op(A) * op(B) + beta * C,  op(X) = X or X^T
//
// Same signature and meaning as kernels::cpu::gemm. cuBLAS is column-major; a
// row-major [M,N] matrix with leading dimension ldc is, read column-major, its
// transpose [N,M] with the same leading dimension. So C^T = op(B)^T op(A)^T is
// one column-major GEMM with the operands swapped and no copies:
//   cublas(op_b, op_a, N, M, K, B, ldb, A, lda, C, ldc).
//
// Float GEMMs use full FP32 arithmetic unless set_tf32(true): TF32 tensor cores
// are several times faster but keep only 10 mantissa bits of each input
// (relative error near 1e-3), which the training code opts into explicitly.
//
// gemm_bf16 is the mixed-precision product: bf16 operands (ptrain::bf16 has
// __nv_bfloat16's layout), fp32 accumulation, and a bf16 or float result.
// Products of two bf16 values are exact in fp32, so the only rounding is the
// fp32 accumulation and, for a bf16 result, the final rounding to 8 bits.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "ptrain/core/dtype.hpp"
#include "ptrain/core/error.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/device.cuh"

namespace ptrain::kernels::cuda {

/// An owned cuBLAS handle created on one device. Move-only.
class CublasHandle {
 public:
  explicit CublasHandle(int device) : device_(device) {
    DeviceGuard guard(device);
    PTRAIN_CHECK_CUBLAS(cublasCreate(&handle_));
  }
  ~CublasHandle() {
    if (handle_) (void)cublasDestroy(handle_);
  }
  CublasHandle(CublasHandle&& o) noexcept : handle_(std::exchange(o.handle_, nullptr)), device_(o.device_) {}
  CublasHandle& operator=(CublasHandle&& o) noexcept {
    if (this != &o) {
      if (handle_) (void)cublasDestroy(handle_);
      handle_ = std::exchange(o.handle_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;

  cublasHandle_t get() const { return handle_; }
  int device() const { return device_; }

 private:
  cublasHandle_t handle_ = nullptr;
  int device_ = 0;
};

namespace detail {

inline std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> enabled{false};
  return enabled;
}

/// What one cuBLAS call needs: the handle, and the call's workspace.
struct CublasCall {
  cublasHandle_t handle;
  Tensor<std::uint8_t> workspace;  // freed once the call is queued; later work of the stream may reuse it
};

/// The calling thread's cuBLAS handle for `device`, bound to that device's current
/// stream, with a workspace for one call from the caching allocator on that stream.
inline CublasCall cublas_call(int device) {
  // One handle per thread and device, as cuBLAS advises: a handle must not be
  // used by two threads at once, and rebinding a shared handle's stream would
  // race. Created on first use (cublasCreate costs milliseconds and device
  // memory), destroyed when the thread exits. The workspace (cuBLAS's default
  // size: 32 MiB from sm_90 on, 4 MiB before) is taken per call as cuBLASLt's is
  // (gemm_lt.cuh): stream-ordered, so two streams never share one, it counts in
  // the allocator's live and peak bytes, and a cached block makes it cheap.
  struct Entry {
    std::unique_ptr<CublasHandle> handle;
    cudaStream_t stream = nullptr;
    std::int64_t workspace_bytes = 0;
  };
  thread_local std::array<Entry, kMaxDevices> cache;
  PTRAIN_CHECK(device >= 0 && device < kMaxDevices, CudaError, "[ptrain.cuda.device] device index ", device,
               " is out of range [0, ", kMaxDevices, ")");
  Entry& e = cache[static_cast<std::size_t>(device)];
  const cudaStream_t stream = current_stream(device);
  if (!e.handle) {
    int major = 0;
    PTRAIN_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    e.workspace_bytes = std::int64_t{major >= 9 ? 32 : 4} << 20;
    e.handle = std::make_unique<CublasHandle>(device);
    PTRAIN_CHECK_CUBLAS(cublasSetStream(e.handle->get(), stream));
    e.stream = stream;
  } else if (e.stream != stream) {
    PTRAIN_CHECK_CUBLAS(cublasSetStream(e.handle->get(), stream));
    e.stream = stream;
  }
  CublasCall call{e.handle->get(), Tensor<std::uint8_t>::empty(Shape{e.workspace_bytes}, Device::cuda(device))};
  PTRAIN_CHECK_CUBLAS(cublasSetWorkspace(call.handle, call.workspace.data(),
                                         static_cast<std::size_t>(e.workspace_bytes)));
  return call;
}

// C = beta * C for the K == 0 case (op(A) op(B) is an empty sum). beta == 0
// writes zeros without reading C, as BLAS does, so NaN in C does not survive.
template <class T>
__global__ void scale_matrix_kernel(std::int64_t m, std::int64_t n, acc_t<T> beta, T* c, std::int64_t ldc) {
  for (std::int64_t i = global_index(); i < m * n; i += grid_stride()) {
    T& x = c[(i / n) * ldc + i % n];
    x = beta == acc_t<T>(0) ? T(0) : st<T>(beta * ld(x));
  }
}

}  // namespace detail

/// Lets float GEMMs use TF32 tensor cores (faster, ~1e-3 relative error); off by default.
inline void set_tf32(bool enabled) { detail::tf32_flag().store(enabled, std::memory_order_relaxed); }
/// Whether float GEMMs may use TF32.
inline bool tf32_enabled() { return detail::tf32_flag().load(std::memory_order_relaxed); }

/// C = alpha * op(A) op(B) + beta * C with bf16 A and B, fp32 accumulation and scalars,
/// and C in TC (bf16 or float); otherwise as gemm(). K == 0 is refused (no kernel
/// scales a bf16 C); callers never need it.
template <class TC>
void gemm_bf16(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bf16* a,
               std::int64_t lda, const bf16* b, std::int64_t ldb, float beta, TC* c, std::int64_t ldc) {
  static_assert(std::is_same_v<TC, bf16> || std::is_same_v<TC, float>,
                "ptrain::kernels::cuda::gemm_bf16: the result must be bf16 or float");
  if (m == 0 || n == 0) return;
  PTRAIN_CHECK(k > 0, ShapeError, "[ptrain.cuda.gemm] gemm_bf16 needs k > 0 (got ", k, ")");
  PTRAIN_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX,
               ShapeError, "[ptrain.cuda.gemm] sizes m=", m, " n=", n, " k=", k, " lda=", lda, " ldb=", ldb,
               " ldc=", ldc, " exceed cuBLAS's 32-bit limit; split the GEMM");
  const detail::CublasCall call = detail::cublas_call(current_device());
  const cublasHandle_t handle = call.handle;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cudaDataType_t c_type = std::is_same_v<TC, bf16> ? CUDA_R_16BF : CUDA_R_32F;
  // Swapped operands: see the header comment.
  PTRAIN_CHECK_CUBLAS(cublasGemmEx(handle, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                   &alpha, b, CUDA_R_16BF, static_cast<int>(ldb), a, CUDA_R_16BF,
                                   static_cast<int>(lda), &beta, c, c_type, static_cast<int>(ldc),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/// C = alpha * op(A) op(B) + beta * C on row-major device data with leading dimensions lda, ldb, ldc.
/// A is [M,K] (or [K,M] when trans_a), B is [K,N] (or [N,K] when trans_b). Runs on the
/// current device's current_stream(); float, double, or bf16 (gemm_bf16 with a bf16 C).
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, acc_t<T> alpha, const T* a,
          std::int64_t lda, const T* b, std::int64_t ldb, acc_t<T> beta, T* c, std::int64_t ldc) {
  detail::check_element_type<T>();
  if (m == 0 || n == 0) return;
  const int device = current_device();
  if (k == 0) {
    detail::scale_matrix_kernel<T>
        <<<detail::grid_for(m * n), detail::kBlock, 0, current_stream(device)>>>(m, n, beta, c, ldc);
    PTRAIN_CHECK_CUDA_LAUNCH();
    return;
  }
  if constexpr (std::is_same_v<T, bf16>) {
    gemm_bf16<bf16>(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    PTRAIN_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && lda <= INT_MAX && ldb <= INT_MAX && ldc <= INT_MAX,
                 ShapeError, "[ptrain.cuda.gemm] sizes m=", m, " n=", n, " k=", k, " lda=", lda, " ldb=", ldb,
                 " ldc=", ldc, " exceed cuBLAS's 32-bit limit; split the GEMM");
    const detail::CublasCall call = detail::cublas_call(device);
    const cublasHandle_t handle = call.handle;
    // Swapped operands: see the header comment.
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int cm = static_cast<int>(n), cn = static_cast<int>(m), ck = static_cast<int>(k);
    if constexpr (std::is_same_v<T, float>) {
      // The compute type, not the handle's math mode, selects TF32: set_tf32
      // applies from the next call on, and the handle is never changed.
      const cublasComputeType_t compute = tf32_enabled() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
      PTRAIN_CHECK_CUBLAS(cublasGemmEx(handle, op_b, op_a, cm, cn, ck, &alpha, b, CUDA_R_32F, static_cast<int>(ldb), a,
                                       CUDA_R_32F, static_cast<int>(lda), &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                       compute, CUBLAS_GEMM_DEFAULT));
    } else if constexpr (std::is_same_v<T, double>) {
      PTRAIN_CHECK_CUBLAS(cublasDgemm(handle, op_b, op_a, cm, cn, ck, &alpha, b, static_cast<int>(ldb), a,
                                      static_cast<int>(lda), &beta, c, static_cast<int>(ldc)));
    }
  }
}

}  // namespace ptrain::kernels::cuda
