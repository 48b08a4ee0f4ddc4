#pragma once
// Check macros for CUDA runtime and cuBLAS calls. Host code only: g++ compiles
// this header (with the toolkit's include directory) as well as nvcc, so the
// NCCL communicator and the device backend use the same checks as the kernels.
//
//   PTRAIN_CHECK_CUDA(cudaMalloc(&p, bytes));
//   PTRAIN_CHECK_CUBLAS(cublasCreate(&handle));
//   kernel<<<grid, block, 0, stream>>>(...); PTRAIN_CHECK_CUDA_LAUNCH();
//
// A failure throws ptrain::CudaError whose message holds a stable id, the call
// as written, the backend's error name and string, the current device, the rank
// once a process group has set it (cuda_error_rank), a hint for the common
// failures, and file:line of the call.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "ptrain/core/error.hpp"

namespace ptrain::detail {

// Rank shown in CUDA and NCCL error messages; -1 (not shown) until a
// communicator sets it (the NCCL backend does, when it is created).
inline std::atomic<int>& cuda_error_rank() {
  static std::atomic<int> r{-1};
  return r;
}

// " on rank r" once a communicator has set the rank, else nothing.
inline std::string cuda_rank_suffix() {
  const int r = cuda_error_rank().load(std::memory_order_relaxed);
  return r >= 0 ? cat(" on rank ", r) : std::string();
}

// What to try for the errors users meet most; empty when there is no general advice.
inline const char* cuda_error_hint(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return "; the device is out of memory: lower the batch size, or free cached blocks with "
             "allocator_for(Device::cuda(n)).empty_cache()";
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
      return "; no usable CUDA device: check nvidia-smi, the driver version and CUDA_VISIBLE_DEVICES";
    case cudaErrorInvalidDevice:
      return "; the device index is not visible to this process: check CUDA_VISIBLE_DEVICES and LOCAL_RANK";
    case cudaErrorInvalidConfiguration:
      return "; bad launch configuration (grid or block size): this is a ptrain bug, please report it";
    case cudaErrorIllegalAddress:
      return "; a kernel touched memory it does not own (a wrong pointer, size or device); the CUDA context "
             "is now unusable and the process must restart; rerun with CUDA_LAUNCH_BLOCKING=1 to find the kernel";
    default:
      return "";
  }
}

// The device the calling thread uses, or -1 when even that query fails.
inline int cuda_current_device_or_minus_one() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return d;
}

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  // Non-sticky errors stay as the thread's "last error" and would be reported
  // again by the next unrelated check; clear it so each failure is reported once.
  (void)cudaGetLastError();
  throw_at<CudaError>(file, line,
                      cat("[ptrain.cuda] ", call, " failed", cuda_rank_suffix(), ": ", cudaGetErrorName(e), ": ",
                          cudaGetErrorString(e),
                          " (device ", cuda_current_device_or_minus_one(), ")", cuda_error_hint(e)));
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t s, const char* call, const char* file, int line) {
  const char* hint = s == CUBLAS_STATUS_NOT_INITIALIZED
                         ? "; cuBLAS could not start: check that a device is visible and has free memory"
                         : s == CUBLAS_STATUS_ALLOC_FAILED ? "; the device is out of memory" : "";
  throw_at<CudaError>(file, line,
                      cat("[ptrain.cublas] ", call, " failed", cuda_rank_suffix(), ": ", cublasGetStatusName(s), ": ",
                          cublasGetStatusString(s),
                          " (device ", cuda_current_device_or_minus_one(), ")", hint));
}

}  // namespace ptrain::detail

/// Throws ptrain::CudaError when a CUDA runtime call does not return cudaSuccess.
#define PTRAIN_CHECK_CUDA(call)                                                         \
  do {                                                                                  \
    const cudaError_t ptrain_cuda_status_ = (call);                                     \
    if (ptrain_cuda_status_ != cudaSuccess)                                             \
      ::ptrain::detail::throw_cuda_error(ptrain_cuda_status_, #call, __FILE__, __LINE__); \
  } while (0)

/// Throws ptrain::CudaError when a cuBLAS call does not return CUBLAS_STATUS_SUCCESS.
#define PTRAIN_CHECK_CUBLAS(call)                                                          \
  do {                                                                                     \
    const cublasStatus_t ptrain_cublas_status_ = (call);                                   \
    if (ptrain_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::ptrain::detail::throw_cublas_error(ptrain_cublas_status_, #call, __FILE__, __LINE__); \
  } while (0)

/// Checks the kernel launch just made (bad configuration, no device). Errors
/// inside the kernel surface later, at the next synchronising call.
#define PTRAIN_CHECK_CUDA_LAUNCH() PTRAIN_CHECK_CUDA(cudaGetLastError())
