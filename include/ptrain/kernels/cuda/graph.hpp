#pragma once
// CUDA graphs on the host: capture the work ptrain queues on a device into a
// graph and replay it (Note [CUDA graphs of the step] in train/step_graph.hpp).
// Host code only, like stream.hpp; src/cuda_register.cu puts these functions in
// the kernel table (kernels::CudaGraphCalls), through which code built without
// the toolkit's headers reaches them.
//
// A StepGraph owns a non-blocking stream that exists only for capturing: every
// block the caching allocator hands out during a capture is keyed by that stream
// (Note [Streams and cached blocks] in core/allocator.hpp), so blocks freed
// during the capture are reused only by later work of the same capture, and
// blocks the graph's kernels write are never handed to work on another stream:
// that is the graph's memory pool. A capture again on the same StepGraph (a new
// shape) replaces the graph and reuses the pool; the stream is destroyed with the
// StepGraph, and its blocks stay in the allocator's cache, counted as reserved,
// until empty_cache(). Captures use cudaStreamCaptureModeRelaxed: the
// allocator may call cudaMalloc while capturing (a size the capture stream has
// not seen), which the stricter modes refuse.

#include <cuda_runtime_api.h>

#include <cstddef>

#include "ptrain/kernels/cuda/check.hpp"
#include "ptrain/kernels/cuda/stream.hpp"

namespace ptrain::kernels::cuda {

class StepGraph {
 public:
  explicit StepGraph(int device) : device_(device) {
    DeviceGuard guard(device_);
    PTRAIN_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~StepGraph() {
    DeviceGuard guard(device_);
    if (exec_) {
      // A replay may still run: the graph and its stream's blocks stay untouched until it ends.
      (void)cudaStreamSynchronize(current_stream(device_));
      (void)cudaGraphExecDestroy(exec_);
    }
    (void)cudaStreamDestroy(stream_);
  }
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  void begin() {
    DeviceGuard guard(device_);
    previous_ = current_stream(device_);
    // The capture records; it runs nothing. The work queued before it on the
    // current stream is ordered before every replay by the replay's stream.
    set_current_stream(device_, stream_);
    const cudaError_t e = cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed);
    if (e != cudaSuccess) set_current_stream(device_, previous_);
    PTRAIN_CHECK_CUDA(e);
  }

  void end() {
    DeviceGuard guard(device_);
    cudaGraph_t graph = nullptr;
    const cudaError_t e = cudaStreamEndCapture(stream_, &graph);
    set_current_stream(device_, previous_);
    PTRAIN_CHECK(e == cudaSuccess && graph, CudaError, "[ptrain.cuda.graph] capturing the step failed: ",
                 cudaGetErrorName(e), ": ", cudaGetErrorString(e),
                 " (work outside ptrain's current stream, or a call that waits for the device, joined the "
                 "capture); train with cuda_graphs off");
    if (exec_) {
      (void)cudaStreamSynchronize(previous_);
      (void)cudaGraphExecDestroy(exec_);
      exec_ = nullptr;
    }
    const cudaError_t ie = cudaGraphInstantiate(&exec_, graph, 0);
    (void)cudaGraphDestroy(graph);
    PTRAIN_CHECK_CUDA(ie);
  }

  void abort() noexcept {
    int previous = device_;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device_);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream_, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
      cudaGraph_t graph = nullptr;
      if (cudaStreamEndCapture(stream_, &graph) == cudaSuccess && graph) (void)cudaGraphDestroy(graph);
    }
    (void)cudaGetLastError();  // an invalidated capture's error is answered by the caller's exception
    set_current_stream(device_, previous_);
    (void)cudaSetDevice(previous);
  }

  void launch() {
    PTRAIN_CHECK(exec_ != nullptr, CudaError, "[ptrain.cuda.graph] replay of a graph that was never captured");
    DeviceGuard guard(device_);
    PTRAIN_CHECK_CUDA(cudaGraphLaunch(exec_, current_stream(device_)));
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t previous_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// Whether `device`'s current stream (of this thread) is capturing a graph.
inline bool stream_capturing(int device) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  PTRAIN_CHECK_CUDA(cudaStreamIsCapturing(current_stream(device), &status));
  return status != cudaStreamCaptureStatusNone;
}

/// Host -> device copy on the current stream, without waiting for the device.
inline void upload_async(void* dst, const void* src, std::size_t bytes, int device) {
  DeviceGuard guard(device);
  PTRAIN_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, current_stream(device)));
}

/// The kernel table's CudaGraphCalls (src/cuda_register.cu).
template <class Calls>
void fill_graph_calls(Calls& g) {
  g.create = [](int device) -> void* { return new StepGraph(device); };
  g.begin = [](void* p) { static_cast<StepGraph*>(p)->begin(); };
  g.end = [](void* p) { static_cast<StepGraph*>(p)->end(); };
  g.abort = [](void* p) noexcept { static_cast<StepGraph*>(p)->abort(); };
  g.launch = [](void* p) { static_cast<StepGraph*>(p)->launch(); };
  g.destroy = [](void* p) noexcept { delete static_cast<StepGraph*>(p); };
  g.capturing = &stream_capturing;
  g.upload = &upload_async;
}

}  // namespace ptrain::kernels::cuda
