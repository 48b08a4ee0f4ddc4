#pragma once
// CUDA devices, streams and events on the host: device_count, DeviceGuard, the
// per-thread current stream of each device, and move-only Stream, Event and
// StreamGuard. No device code: g++ compiles this header (with the toolkit's
// include directory) as well as nvcc, so host-only translation units (the NCCL
// communicator, a user's .cpp) follow the same streams as the kernels.
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

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "ptrain/core/error.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/kernels/cuda/check.hpp"

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

}  // namespace ptrain::kernels::cuda
