#pragma once
// CUDA devices for ptrain: the caching allocator, the device backend that gives
// Tensor its cuda:N path, and move-only streams and events.
//
// Including this header in a translation unit compiled by nvcc registers the
// CUDA backend (see `cuda_backend_registered` at the end): from then on
// Tensor<T>::empty(shape, Device::cuda(n)) allocates with cudaMalloc through a
// per-device caching allocator, and to()/copy_()/zeros() move bytes with the
// CUDA runtime. Translation units compiled by g++ share the same registration
// (detail::cuda_backend_slot() is one inline function across the program).
//
// Note [Stream semantics]
//   * Every kernel, copy and memset ptrain issues for device d goes to
//     current_stream(d). The current stream is per host thread and per device;
//     it starts as the default stream (stream 0, the legacy default stream
//     unless the TU is compiled with --default-stream per-thread).
//   * StreamGuard makes a Stream current for a scope, like torch.cuda.stream().
//     Work on one stream runs in issue order; work on two streams is ordered
//     only by Events (Stream::wait(event)) or by synchronising.
//   * The allocator hands a freed block to the next request of the same size on
//     the stream that allocated it, at once, without waiting for the GPU: the
//     next user's work is queued behind the previous user's (Note [Streams and
//     cached blocks] in core/allocator.hpp). A tensor also used by another
//     stream (a side stream, a copy on a communication stream) is announced with
//     record_stream(t, stream), as in PyTorch; its block is then reused only
//     after that stream's work queued before the free has finished.
//   * copy() (Tensor::to, copy_, to_vector) is synchronous: it queues on the
//     current stream and waits for it, so the host sees finished data.
//     memset_zero() only queues, which is enough for later work on that stream.
//   * Nothing here synchronises the whole device; synchronize_device() exists
//     for tests and benchmarks, not for hot paths.

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/device.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.cuh"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

/// Number of visible CUDA devices; 0 when there is no device or no driver (never throws).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: no device is an answer here, not an error
    return 0;
  }
  return n;
}

/// The CUDA device the calling thread uses.
inline int current_device() {
  int d = 0;
  PTRAIN_CHECK_CUDA(cudaGetDevice(&d));
  return d;
}

/// Makes `device` current for a scope and restores the previous one. Not movable.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : previous_(current_device()) {
    if (device != previous_) PTRAIN_CHECK_CUDA(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_;
};

namespace detail {
inline void check_device_index(int device) {
  const int n = device_count();
  PTRAIN_CHECK(device >= 0 && device < n && device < kMaxDevices, CudaError, "[ptrain.cuda.device] cuda:", device,
               " was requested but this process sees ", n,
               " CUDA device(s); check CUDA_VISIBLE_DEVICES, or pick a device from LOCAL_RANK");
}
}  // namespace detail

/// The current stream of the current device.
inline cudaStream_t current_stream() { return current_stream(current_device()); }

/// Announces that work on `stream` uses t's memory (Note [Stream semantics]): call it
/// after queuing that work, before t's last reference goes.
template <class T>
void record_stream(const Tensor<T>& t, cudaStream_t stream) {
  t.record_stream(reinterpret_cast<std::uintptr_t>(stream));
}

/// Waits for all work on the device; for tests and benchmarks only (stalls every stream).
inline void synchronize_device(int device) {
  DeviceGuard guard(device);
  PTRAIN_CHECK_CUDA(cudaDeviceSynchronize());
}

class Event;

/// An owned, non-blocking CUDA stream on one device. Move-only.
class Stream {
 public:
  /// Creates a stream on `device`. Non-blocking: it does not synchronise with the legacy default stream.
  /// Lower `priority` values run first (cudaDeviceGetStreamPriorityRange); 0 is the default.
  explicit Stream(int device, int priority = 0) : device_(device) {
    DeviceGuard guard(device);
    PTRAIN_CHECK_CUDA(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
  }
  /// A stream on the current device.
  Stream() : Stream(current_device()) {}
  ~Stream() { reset(); }
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
  Stream& operator=(Stream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = std::exchange(o.stream_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  /// Blocks the host until all work queued so far has finished.
  void synchronize() const { PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream_)); }
  /// True when all queued work has finished; never blocks.
  bool query() const {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaErrorNotReady) return false;
    PTRAIN_CHECK_CUDA(e);
    return true;
  }
  /// Makes later work on this stream wait for `event` (recorded on any stream); the host does not wait.
  inline void wait(const Event& event) const;

 private:
  void reset() noexcept {
    // The destructor may run while work is still queued: CUDA releases the
    // stream once that work completes, so no synchronisation is needed here.
    if (stream_) (void)cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

/// An owned CUDA event on one device. Move-only. Events order streams without
/// involving the host ("record on the producer, wait on the consumer").
class Event {
 public:
  /// An event on the current device; `timing` enables elapsed_ms (costs a little on record).
  explicit Event(bool timing = false) : device_(current_device()) {
    PTRAIN_CHECK_CUDA(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() { reset(); }
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)), device_(o.device_) {}
  Event& operator=(Event&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
      device_ = o.device_;
    }
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }
  /// Captures the work queued so far on `stream` (a stream of this event's device).
  void record(cudaStream_t stream) {
    DeviceGuard guard(device_);
    PTRAIN_CHECK_CUDA(cudaEventRecord(event_, stream));
  }
  void record(const Stream& stream) { record(stream.get()); }
  /// Captures the work queued so far on this device's current stream.
  void record() { record(current_stream(device_)); }
  /// Blocks the host until the captured work has finished.
  void synchronize() const { PTRAIN_CHECK_CUDA(cudaEventSynchronize(event_)); }
  /// True when the captured work has finished; never blocks.
  bool query() const {
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    PTRAIN_CHECK_CUDA(e);
    return true;
  }
  /// Milliseconds between `start` and this event; both need timing = true and must have completed.
  float elapsed_ms(const Event& start) const {
    float ms = 0;
    PTRAIN_CHECK_CUDA(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  void reset() noexcept {
    if (event_) (void)cudaEventDestroy(event_);
    event_ = nullptr;
  }
  cudaEvent_t event_ = nullptr;
  int device_ = 0;
};

inline void Stream::wait(const Event& event) const {
  PTRAIN_CHECK_CUDA(cudaStreamWaitEvent(stream_, event.get(), 0));
}

/// Makes a stream (and its device) current for a scope, then restores both. Not movable.
///   Stream comm(0);
///   { StreamGuard g(comm); /* kernels here run on comm */ }
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream) : StreamGuard(stream.device(), stream.get()) {}
  StreamGuard(int device, cudaStream_t stream)
      : device_guard_(device), device_(device), previous_(current_stream(device)) {
    set_current_stream(device, stream);
  }
  ~StreamGuard() { set_current_stream(device_, previous_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  DeviceGuard device_guard_;
  int device_;
  cudaStream_t previous_;
};

namespace detail {
/// Threads per block of the elementwise kernels (grid-stride loops).
inline constexpr int kBlock = 256;

/// Blocks for a grid-stride loop over n elements: enough to fill the GPU several
/// times over, capped so that each thread handles a few elements for large n.
inline unsigned grid_for(std::int64_t n, int block = kBlock) {
  const std::int64_t blocks = (n + block - 1) / block;
  return static_cast<unsigned>(blocks < 8192 ? (blocks < 1 ? 1 : blocks) : 8192);
}

/// Threads per block of a one-block-per-row kernel: a warp for short rows,
/// up to 512 threads (a few elements each) for long ones.
inline int block_for_cols(std::int64_t cols) {
  int b = 32;
  while (b < 512 && b < cols) b *= 2;
  return b;
}

/// Column sums (bias_grad, LayerNorm's dgamma/dbeta; detail::column_sums in
/// reduce.cuh): a block owns 32 adjacent columns, one per lane, so each warp
/// reads 32 consecutive elements of a row, and its 16 warps split the rows of
/// one chunk of at least kColChunkRows rows; chunks add up in a second pass.
inline constexpr int kColTile = 32;
inline constexpr int kColRows = 16;
inline constexpr std::int64_t kColChunkRows = 256;
inline constexpr std::int64_t kColTargetBlocks = 1024;

/// Blocks for a one-block-per-row kernel; kernels loop when rows exceed the grid.
inline unsigned grid_for_rows(std::int64_t rows) {
  return static_cast<unsigned>(rows < 65535 ? (rows < 1 ? 1 : rows) : 65535);
}

// Index of this thread in a 1-D grid, and the stride of a grid-stride loop;
// 64-bit so that arrays over 2^31 elements are covered.
__device__ __forceinline__ std::int64_t global_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() { return static_cast<std::int64_t>(blockDim.x) * gridDim.x; }

// Device math by element type. The float forms are the accurate ones (expf,
// not __expf), so results stay within a few ulp of the CPU; do not build with
// --use_fast_math if the gpu tests' 1e-5 bounds matter to you.
__device__ __forceinline__ float dev_exp(float x) { return expf(x); }
__device__ __forceinline__ double dev_exp(double x) { return exp(x); }
__device__ __forceinline__ float dev_log(float x) { return logf(x); }
__device__ __forceinline__ double dev_log(double x) { return log(x); }
__device__ __forceinline__ float dev_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double dev_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }

template <class T>
inline constexpr bool is_float_or_double = std::is_same_v<T, float> || std::is_same_v<T, double>;

// Element types of the kernels: float and double, and bf16 as a storage type
// (Note [bf16 kernels]).
template <class T>
void check_element_type() {
  static_assert(is_float_or_double<T> || std::is_same_v<T, bf16>,
                "ptrain::kernels::cuda: element type must be float, double or bf16");
}
}  // namespace detail

// Note [bf16 kernels]
// A bf16 kernel reads bf16, computes in float and rounds once when it stores
// (to nearest even, as the CPU's bf16 does). Reductions (sums, means, the
// softmax denominator) accumulate in float. What a kernel keeps for backward
// beside its output (LayerNorm's mean and rstd, cross-entropy's log-sum-exp) is
// float, and so are scalars (eps, scale, dloss): acc_t<T> in the signatures,
// which is T itself for float and double.

using ::ptrain::acc_t;

namespace detail {
/// x converted to its arithmetic type (exact).
template <class T>
__device__ __forceinline__ acc_t<T> ld(T x) {
  return static_cast<acc_t<T>>(x);
}
/// v rounded to element type T (bf16: to nearest even; float, double: unchanged).
template <class T>
__device__ __forceinline__ T st(acc_t<T> v) {
  return T(v);
}
}  // namespace detail

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
    // cudaMemcpyDefault lets unified addressing find the direction; queueing on
    // the current stream orders the copy after the kernels that produced src.
    PTRAIN_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
    PTRAIN_CHECK_CUDA(cudaStreamSynchronize(stream));
  }

  void memset_zero(void* dst, Device dev, std::size_t bytes) override {
    if (bytes == 0) return;
    PTRAIN_CHECK(dev.is_cuda(), Error, "[ptrain.cuda.memset] memset_zero on ", dev, " reached the CUDA backend");
    DeviceGuard guard(dev.index);
    PTRAIN_CHECK_CUDA(cudaMemsetAsync(dst, 0, bytes, current_stream(dev.index)));
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

/// Registers the CUDA backend during static initialisation of every TU that
/// includes this header; touches no device, so it is harmless without a GPU.
inline const bool cuda_backend_registered =
    (::ptrain::detail::cuda_backend_slot() = &detail::cuda_backend_instance(), true);

}  // namespace ptrain::kernels::cuda
