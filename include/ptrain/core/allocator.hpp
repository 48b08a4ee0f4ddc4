#pragma once
// Allocators with byte counters.
//
// Every tensor allocation goes through the allocator of its device, which keeps
// live and peak bytes. Memory claims (FSDP's 1/N, pipeline activations) are
// tested with these counters exactly, so they count the bytes tensors asked
// for, not what the allocator keeps cached for reuse.
//
// The CPU allocator caches freed blocks by exact size: a training step asks for
// the same sizes every iteration, so after the first step no call reaches
// malloc (large mallocs are mmaps, and each fresh mmap page faults on first touch).

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "ptrain/core/device.hpp"
#include "ptrain/core/error.hpp"

namespace ptrain {

/// Byte counters of one device's allocator.
struct MemoryStats {
  std::int64_t live_bytes = 0;      ///< bytes held by live tensors
  std::int64_t peak_bytes = 0;      ///< maximum of live_bytes since the last reset_peak()
  std::int64_t reserved_bytes = 0;  ///< live bytes plus freed blocks kept for reuse
  std::int64_t allocations = 0;     ///< number of allocate() calls
};

/// Interface of a device allocator. Thread-safe.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) = 0;
  /// Returns cached blocks to the system.
  virtual void empty_cache() {}

  MemoryStats stats() const {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    return stats_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.peak_bytes = stats_.live_bytes;
  }

 protected:
  void record_allocate(std::size_t bytes, std::int64_t newly_reserved) {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.live_bytes += static_cast<std::int64_t>(bytes);
    stats_.reserved_bytes += newly_reserved;
    stats_.allocations += 1;
    if (stats_.live_bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.live_bytes;
  }
  void record_deallocate(std::size_t bytes, std::int64_t released) {
    std::lock_guard<std::mutex> lock(stats_mutex_);
    stats_.live_bytes -= static_cast<std::int64_t>(bytes);
    stats_.reserved_bytes -= released;
  }

 private:
  mutable std::mutex stats_mutex_;
  MemoryStats stats_;
};

namespace detail {

/// Caching allocator over a raw allocate/free pair; blocks are reused by exact
/// (rounded) size. Subclasses provide raw_allocate and raw_free.
class CachingAllocator : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;  // one cache line; enough for AVX-512 loads

  void* allocate(std::size_t bytes) override {
    const std::size_t size = round_up(bytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
      }
    }
    std::int64_t fresh = 0;
    if (!p) {
      p = raw_allocate(size);
      fresh = static_cast<std::int64_t>(size);
    }
    record_allocate(bytes, fresh);
    return p;
  }

  void deallocate(void* p, std::size_t bytes) override {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      free_[round_up(bytes)].push_back(p);
    }
    record_deallocate(bytes, 0);
  }

  void empty_cache() override {
    std::unordered_map<std::size_t, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      blocks.swap(free_);
    }
    for (auto& [size, list] : blocks)
      for (void* p : list) {
        raw_free(p);
        record_deallocate(0, static_cast<std::int64_t>(size));
      }
  }

 protected:
  virtual void* raw_allocate(std::size_t bytes) = 0;
  virtual void raw_free(void* p) = 0;
  static std::size_t round_up(std::size_t bytes) {
    return bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
};

class CpuAllocator final : public CachingAllocator {
 public:
 protected:
  void* raw_allocate(std::size_t bytes) override {
    void* p = std::aligned_alloc(kAlignment, bytes);
    PTRAIN_CHECK(p != nullptr, Error, "[ptrain.alloc] out of host memory allocating ", bytes, " bytes");
    return p;
  }
  void raw_free(void* p) override { std::free(p); }
};

/// What a non-CPU device provides: its allocator and copies between devices.
/// The CUDA backend (kernels/cuda/device.cuh) registers itself here when a
/// translation unit compiled by nvcc includes it.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual Allocator& allocator(int index) = 0;
  /// Copies bytes between any two of {cpu, this device}; synchronous.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) = 0;
  virtual void memset_zero(void* dst, Device dev, std::size_t bytes) = 0;
};

inline DeviceBackend*& cuda_backend_slot() {
  static DeviceBackend* backend = nullptr;
  return backend;
}

inline DeviceBackend& cuda_backend() {
  DeviceBackend* b = cuda_backend_slot();
  PTRAIN_CHECK(b != nullptr, CudaError,
               "[ptrain.cuda.unavailable] a cuda device was requested but this program was built without CUDA; "
               "compile the translation unit that includes ptrain with nvcc (a .cu file) or use Device::cpu()");
  return *b;
}

}  // namespace detail

/// The allocator of a device.
inline Allocator& allocator_for(Device d) {
  if (d.is_cpu()) {
    // Never destroyed, so tensors in static storage may outlive main().
    static detail::CpuAllocator* cpu = new detail::CpuAllocator;
    return *cpu;
  }
  return detail::cuda_backend().allocator(d.index);
}

/// Byte counters of a device's allocator.
inline MemoryStats memory_stats(Device d = Device::cpu()) { return allocator_for(d).stats(); }
/// Sets the peak counter of a device to its live bytes.
inline void reset_peak_memory(Device d = Device::cpu()) { allocator_for(d).reset_peak(); }

}  // namespace ptrain
