#pragma once
// The per-thread current stream of each CUDA device (Note [Stream semantics] in
// device.cuh), in a header without device code, so host-only translation units
// (the NCCL communicator compiled by g++) follow the same stream as the kernels.

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>

#include "ptrain/core/error.hpp"

namespace ptrain::kernels::cuda {

/// Most CUDA devices one process can address through ptrain.
inline constexpr int kMaxDevices = 64;

namespace detail {
// The per-thread current stream of each device; null is the default stream.
inline cudaStream_t& current_stream_slot(int device) {
  thread_local std::array<cudaStream_t, kMaxDevices> streams{};
  PTRAIN_CHECK(device >= 0 && device < kMaxDevices, CudaError, "[ptrain.cuda.device] device index ", device,
               " is out of range [0, ", kMaxDevices, ")");
  return streams[static_cast<std::size_t>(device)];
}
}  // namespace detail

/// The stream ptrain's kernels use on `device` from this thread (see Note [Stream semantics]).
inline cudaStream_t current_stream(int device) { return detail::current_stream_slot(device); }
/// Makes `stream` (which must belong to `device`) current on `device` for this thread.
inline void set_current_stream(int device, cudaStream_t stream) { detail::current_stream_slot(device) = stream; }

}  // namespace ptrain::kernels::cuda
