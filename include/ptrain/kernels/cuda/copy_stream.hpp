#pragma once
// A side stream for host -> device copies of the data loader (data/loader.hpp,
// Note [Prefetching loader]). Host code only, like stream.hpp and graph.hpp;
// src/cuda_register.cu puts these functions in the kernel table
// (kernels::CudaCopyStreamCalls), through which code built without the
// toolkit's headers reaches them. Gated as prefetch_copy_stream.
//
//   begin(): waits (host) until this side stream's previous copies are done, so that
//            their pinned sources may be written again, and makes the side stream
//            current: blocks allocated now are keyed by it (Note [Streams and cached blocks])
//   ...      the caller fills its pinned buffers, allocates the device tensors and
//            queues the copies on the current stream (CudaGraphCalls::upload)
//   end():   records the event after the copies and restores the previous stream
//   wait():  makes the device's current (compute) stream wait for that event; returns
//            the compute stream's key, which the caller passes to record_stream

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

class CopyStream {
 public:
  explicit CopyStream(int device) : device_(device), stream_(device), event_(make_event(device)) {}

  void begin() {
    DeviceGuard guard(device_);
    if (recorded_) event_.synchronize();
    previous_ = current_stream(device_);
    set_current_stream(device_, stream_.get());
  }
  void end() {
    DeviceGuard guard(device_);
    set_current_stream(device_, previous_);
    event_.record(stream_);
    recorded_ = true;
  }
  /// Blocks the host until the copies queued so far are done; never throws.
  void drain() noexcept {
    if (recorded_) (void)cudaEventSynchronize(event_.get());
  }
  std::uintptr_t wait() {
    DeviceGuard guard(device_);
    const cudaStream_t compute = current_stream(device_);
    PTRAIN_CHECK_CUDA(cudaStreamWaitEvent(compute, event_.get(), 0));
    return reinterpret_cast<std::uintptr_t>(compute);
  }

 private:
  static Event make_event(int device) {
    DeviceGuard guard(device);
    return Event(false);
  }
  int device_;
  Stream stream_;
  Event event_;
  cudaStream_t previous_ = nullptr;
  bool recorded_ = false;
};

/// The kernel table's CudaCopyStreamCalls (src/cuda_register.cu).
template <class Calls>
void fill_copy_stream_calls(Calls& c) {
  c.create = [](int device) -> void* { return new CopyStream(device); };
  c.destroy = [](void* p) noexcept {
    // Queued copies finish first: their pinned sources are freed after this.
    auto* s = static_cast<CopyStream*>(p);
    s->drain();
    delete s;
  };
  c.begin = [](void* p) { static_cast<CopyStream*>(p)->begin(); };
  c.end = [](void* p) { static_cast<CopyStream*>(p)->end(); };
  c.wait = [](void* p) { return static_cast<CopyStream*>(p)->wait(); };
}

}  // namespace ptrain::kernels::cuda
