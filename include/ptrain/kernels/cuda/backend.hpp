#pragma once
// The cuda:N half of the device abstraction (core/allocator.hpp's
// DeviceBackend): a caching allocator per device over cudaMalloc/cudaFree and
// synchronous copies. Host code only; the CUDA translation unit of
// ptrain::cuda (src/cuda_register.cu) stores the backend in
// detail::cuda_backend_slot() during static initialisation. Registering it
// touches no device, so a program linked with ptrain::cuda runs on a machine
// without a GPU until it asks for cuda:N, which then throws
// [ptrain.cuda.device] naming the number of visible devices.

#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/device.hpp"
#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"
#include "ptrain/kernels/cuda_table.hpp"

namespace ptrain::kernels::cuda {

/// Caching allocator of one CUDA device: cudaMalloc/cudaFree behind the byte
/// counters and the per-stream exact-size block cache of
/// detail::CachingAllocator, with CUDA events as the markers of record_stream.
/// One per device, owned by CudaBackend; see Note [Stream semantics].
class CudaAllocator final : public ::ptrain::detail::CachingAllocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  int device() const { return device_; }

 protected:
  std::uintptr_t current_stream_key() const override {
    return reinterpret_cast<std::uintptr_t>(current_stream(device_));
  }
  void* record_marker(std::uintptr_t stream) noexcept override {
    // Switches device without DeviceGuard, which may throw: this runs in a tensor's destructor.
    int previous = device_;
    (void)cudaGetDevice(&previous);
    if (previous != device_) (void)cudaSetDevice(device_);
    cudaEvent_t e = nullptr;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream)) != cudaSuccess) {
      // No event (a failing device): wait for the stream instead, so the block is free now.
      if (e) (void)cudaEventDestroy(e);
      e = nullptr;
      (void)cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream));
      (void)cudaGetLastError();
    }
    if (previous != device_) (void)cudaSetDevice(previous);
    return e;
  }
  bool marker_done(void* marker) noexcept override {
    auto e = static_cast<cudaEvent_t>(marker);
    const cudaError_t r = cudaEventQuery(e);
    if (r == cudaErrorNotReady) return false;
    // An error other than "not ready" is sticky and surfaces at the next CUDA call.
    (void)cudaEventDestroy(e);
    return true;
  }
  void* raw_allocate(std::size_t bytes) override {
    DeviceGuard guard(device_);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e == cudaErrorMemoryAllocation) {
      // Cached blocks of other sizes may add up to the request: return them to
      // the driver and try once more before giving up.
      (void)cudaGetLastError();
      empty_cache();
      e = cudaMalloc(&p, bytes);
    }
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      const MemoryStats s = stats();
      PTRAIN_THROW(CudaError, "[ptrain.cuda.oom] out of memory on cuda:", device_, " allocating ", bytes,
                   " bytes (ptrain holds ", s.live_bytes, " live and ", s.reserved_bytes, " reserved bytes; the device has ",
                   free_bytes, " of ", total_bytes,
                   " bytes free); lower the batch size or shard the model (FSDP), or check for other processes "
                   "on this GPU with nvidia-smi");
    }
    PTRAIN_CHECK_CUDA(e);
    return p;
  }
  void raw_free(void* p) override {
    DeviceGuard guard(device_);
    // cudaFree waits for the device, so blocks still used by queued kernels are safe to release.
    PTRAIN_CHECK_CUDA(cudaFree(p));
  }

 private:
  int device_;
};

/// The cuda:N half of the device abstraction: allocators and copies.
class CudaBackend final : public ::ptrain::detail::DeviceBackend {
 public:
  Allocator& allocator(int index) override {
    if (index >= 0 && index < kMaxDevices) {
      if (CudaAllocator* a = allocators_[static_cast<std::size_t>(index)].load(std::memory_order_acquire)) return *a;
    }
    detail::check_device_index(index);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = allocators_[static_cast<std::size_t>(index)];
    CudaAllocator* a = slot.load(std::memory_order_relaxed);
    if (!a) {
      // Never deleted, like the backend itself: tensors in static storage may
      // be freed after main() returns, and cudaFree must not run while the
      // CUDA runtime tears itself down.
      a = new CudaAllocator(index);
      slot.store(a, std::memory_order_release);
    }
    return *a;
  }

  void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) override {
    if (bytes == 0) return;
    if (dst_dev.is_cpu() && src_dev.is_cpu()) {
      std::memcpy(dst, src, bytes);
      return;
    }
    if (dst_dev.is_cuda() && src_dev.is_cuda() && dst_dev.index != src_dev.index) {
      // Peer copy on the destination's stream, after the source's producers finish.
      {
        DeviceGuard guard(src_dev.index);
        PTRAIN_CHECK_CUDA(cudaStreamSynchronize(current_stream(src_dev.index)));
      }
      DeviceGuard guard(dst_dev.index);
      const cudaStream_t stream = current_stream(dst_dev.index);
      PTRAIN_CHECK_CUDA(cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, bytes, stream));
      PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
      return;
    }
    const int device = dst_dev.is_cuda() ? dst_dev.index : src_dev.index;
    DeviceGuard guard(device);
    const cudaStream_t stream = current_stream(device);
    if (capturing(stream)) {
      // A graph's device-to-device copy (Tensor::clone, copy_) is a node that nothing has to
      // wait for: the capture runs nothing. A copy from or to the host would wait for it.
      if (dst_dev.is_cuda() && src_dev.is_cuda()) {
        PTRAIN_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
        return;
      }
      throw_capturing(dst_dev.is_cpu() ? "a device-to-host copy (a host read: Tensor::to, to_vector, a loss read)"
                                       : "a host-to-device copy (Tensor::to, copy_ from host memory)",
                      bytes);
    }
    // cudaMemcpyDefault lets unified addressing find the direction; queueing on
    // the current stream orders the copy after the kernels that produced src.
    PTRAIN_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
    PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  }

  // Note [CUDA graphs of the step] in train/step_graph.hpp: a copy that waits for the
  // device cannot be captured; say which operation tried, instead of CUDA's bare error.
  static bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
      (void)cudaGetLastError();  // not an error of the copy; the copy itself reports its own
      return false;
    }
    return status != cudaStreamCaptureStatusNone;
  }
  [[noreturn]] static void throw_capturing(const char* what, std::size_t bytes) {
    const char* in = ::ptrain::kernels::detail::graph_capture_what();
    PTRAIN_THROW(CudaError, "[ptrain.cuda.graph_host_sync] ", what, " of ", bytes, " bytes inside a captured CUDA "
                 "graph (", in ? in : "a capture", "): it waits for the device, which a graph cannot; keep the "
                 "step's values on the device (ops::DeviceLoss, AdamW's max_grad_norm), or turn CUDA graphs off");
  }

  void memset_zero(void* dst, Device dev, std::size_t bytes) override {
    if (bytes == 0) return;
    PTRAIN_CHECK(dev.is_cuda(), Error, "[ptrain.cuda.memset] memset_zero on ", dev, " reached the CUDA backend");
    DeviceGuard guard(dev.index);
    PTRAIN_CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, current_stream(dev.index)));
  }

  int device_count() override { return ::ptrain::kernels::cuda::device_count(); }

  bool is_host_pointer(const void* p) override {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      // Older runtimes fail on pointers CUDA never saw: plain host memory.
      (void)cudaGetLastError();
      return true;
    }
    return a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered;
  }

  void* allocate_pinned_host(std::size_t bytes) override {
    void* p = nullptr;
    // Portable: pinned for every device's context, so any cuda:N copies from it at full speed.
    if (cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable) != cudaSuccess) {
      (void)cudaGetLastError();  // no pinned memory (limit reached, no driver): the caller uses pageable memory
      return nullptr;
    }
    return p;
  }
  void free_pinned_host(void* p) override {
    if (p) PTRAIN_CHECK_CUDA(cudaFreeHost(p));
  }

 private:
  std::mutex mutex_;
  std::array<std::atomic<CudaAllocator*>, kMaxDevices> allocators_{};
};

namespace detail {
/// The process's CUDA backend; never destroyed (see CudaBackend::allocator).
inline CudaBackend& cuda_backend_instance() {
  static CudaBackend* backend = new CudaBackend;
  return *backend;
}
}  // namespace detail

/// Stores the CUDA backend in detail::cuda_backend_slot(); the same backend every
/// time, so calling it again (two registering translation units) changes nothing.
inline void register_backend() { ::ptrain::detail::cuda_backend_slot() = &detail::cuda_backend_instance(); }

}  // namespace ptrain::kernels::cuda
