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
//
// Note [Streams and cached blocks]
// A device with streams (CUDA) queues work instead of running it: a block freed
// by the host may still be read by queued kernels. The caching allocator tags
// each block with the stream that was current when it was allocated and hands
// a freed block only to a later request on that same stream, whose work queues
// behind every earlier use. A block also used on other streams (a collective on
// a communication stream, a side stream) is announced with record_stream(); when
// it is freed, a marker (a CUDA event) is recorded on each of those streams and
// the block waits in a pending list until every marker has completed. The host
// never waits: pending blocks are checked, without blocking, on each allocation.
// This is the contract of PyTorch's caching allocator and record_stream().

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <map>
#include <unordered_map>
#include <utility>
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
  /// Announces that block p (from allocate) is also used on `stream` (an opaque
  /// stream handle; Note [Streams and cached blocks]). No-op without streams.
  virtual void record_stream(void* p, std::uintptr_t stream) {
    (void)p;
    (void)stream;
  }

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
/// (rounded) size on the stream that allocated them (Note [Streams and cached
/// blocks]). Subclasses provide raw_allocate and raw_free, and a device with
/// streams the stream and marker hooks.
class CachingAllocator : public Allocator {
 public:
  static constexpr std::size_t kAlignment = 64;  // one cache line; enough for AVX-512 loads

  void* allocate(std::size_t bytes) override {
    const std::size_t size = round_up(bytes);
    const std::uintptr_t stream = current_stream_key();
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      collect_pending();
      auto it = free_.find({size, stream});
      if (it != free_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        track(p, size, stream);
      }
    }
    std::int64_t fresh = 0;
    if (!p) {
      p = raw_allocate(size);
      fresh = static_cast<std::int64_t>(size);
      std::lock_guard<std::mutex> lock(mutex_);
      track(p, size, stream);
    }
    record_allocate(bytes, fresh);
    return p;
  }

  void deallocate(void* p, std::size_t bytes) override {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto node = live_.extract(p);
      PTRAIN_CHECK(!node.empty(), Error, "[ptrain.alloc] freeing a block this allocator did not hand out");
      Block& b = node.mapped();
      Pending pend{p, b.size, b.stream, {}};
      for (std::uintptr_t s : b.uses)
        if (void* m = record_marker(s)) pend.markers.push_back(m);
      if (pend.markers.empty()) free_[{b.size, b.stream}].push_back(p);
      else pending_.push_back(std::move(pend));
      spare_.push_back(std::move(node));
    }
    record_deallocate(bytes, 0);
  }

  void record_stream(void* p, std::uintptr_t stream) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(p);
    PTRAIN_CHECK(it != live_.end(), Error, "[ptrain.alloc] record_stream on a block this allocator did not hand out");
    Block& b = it->second;
    if (stream != b.stream && std::find(b.uses.begin(), b.uses.end(), stream) == b.uses.end()) b.uses.push_back(stream);
  }

  /// Returns the cached blocks that no stream still uses to the system.
  void empty_cache() override {
    std::map<std::pair<std::size_t, std::uintptr_t>, std::vector<void*>> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      collect_pending();
      blocks.swap(free_);
    }
    for (auto& [key, list] : blocks)
      for (void* p : list) {
        raw_free(p);
        record_deallocate(0, static_cast<std::int64_t>(key.first));
      }
  }

  /// Freed blocks still waiting for other streams (Note [Streams and cached blocks]).
  std::size_t pending_blocks() {
    std::lock_guard<std::mutex> lock(mutex_);
    collect_pending();
    return pending_.size();
  }

 protected:
  virtual void* raw_allocate(std::size_t bytes) = 0;
  virtual void raw_free(void* p) = 0;
  /// The calling thread's current stream (0: the default stream, or no streams at all).
  virtual std::uintptr_t current_stream_key() const { return 0; }
  /// Records a marker after the work queued so far on `stream`, done once that
  /// work has finished; null when that work has finished already. Must not throw
  /// (it runs when a tensor is destroyed).
  virtual void* record_marker(std::uintptr_t stream) noexcept {
    (void)stream;
    return nullptr;
  }
  /// True once the marker's work has finished (never blocks); destroys the marker
  /// then. Must not throw.
  virtual bool marker_done(void* marker) noexcept {
    (void)marker;
    return true;
  }
  static std::size_t round_up(std::size_t bytes) {
    return bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

 private:
  struct Block {
    std::size_t size;                  // rounded
    std::uintptr_t stream;             // the stream it was allocated on
    std::vector<std::uintptr_t> uses;  // other streams that use it (record_stream)
  };
  struct Pending {
    void* p;
    std::size_t size;
    std::uintptr_t stream;
    std::vector<void*> markers;  // one per other stream; the block is free when all are done
  };

  // Enters p in live_, reusing a node of a freed block: no malloc once the sizes
  // of a step have been seen. Holds mutex_.
  void track(void* p, std::size_t size, std::uintptr_t stream) {
    if (spare_.empty()) {
      live_.emplace(p, Block{size, stream, {}});
      return;
    }
    auto node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = p;
    node.mapped().size = size;
    node.mapped().stream = stream;
    node.mapped().uses.clear();
    live_.insert(std::move(node));
  }

  // Moves pending blocks whose markers all completed to the free lists. Holds mutex_.
  void collect_pending() {
    for (std::size_t i = 0; i < pending_.size();) {
      auto& m = pending_[i].markers;
      m.erase(std::remove_if(m.begin(), m.end(), [this](void* x) { return marker_done(x); }), m.end());
      if (!m.empty()) {
        ++i;
        continue;
      }
      free_[{pending_[i].size, pending_[i].stream}].push_back(pending_[i].p);
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    }
  }

  std::mutex mutex_;
  std::map<std::pair<std::size_t, std::uintptr_t>, std::vector<void*>> free_;  // (size, stream) -> blocks
  std::unordered_map<void*, Block> live_;
  std::vector<std::unordered_map<void*, Block>::node_type> spare_;  // nodes of freed blocks, for track()
  std::vector<Pending> pending_;
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
/// The CUDA backend (kernels/cuda/backend.hpp) is stored in cuda_backend_slot()
/// by the CUDA translation unit of the ptrain::cuda target (src/cuda_register.cu).
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  virtual Allocator& allocator(int index) = 0;
  /// Copies bytes between any two of {cpu, this device}; synchronous.
  virtual void copy(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes) = 0;
  virtual void memset_zero(void* dst, Device dev, std::size_t bytes) = 0;
  /// Number of devices of this kind the process sees; 0 when the backend cannot tell.
  virtual int device_count() { return 0; }
  /// True when host code may read and write `p` directly (pageable or pinned host
  /// memory). A backend that cannot tell answers false, and callers then move the
  /// bytes with copy() as if they were device memory.
  virtual bool is_host_pointer(const void* p) {
    (void)p;
    return false;
  }
  /// Page-locked host memory, which copy() moves to and from the device faster
  /// than pageable memory; null when the backend has none (use pageable memory then).
  /// Freed with free_pinned_host().
  virtual void* allocate_pinned_host(std::size_t bytes) {
    (void)bytes;
    return nullptr;
  }
  virtual void free_pinned_host(void* p) { (void)p; }
};

inline DeviceBackend*& cuda_backend_slot() {
  static DeviceBackend* backend = nullptr;
  return backend;
}

inline DeviceBackend& cuda_backend() {
  DeviceBackend* b = cuda_backend_slot();
  PTRAIN_CHECK(b != nullptr, CudaError,
               "[ptrain.cuda.unavailable] a cuda device was requested but this program does not contain ptrain's "
               "CUDA backend: link the ptrain::cuda CMake target (and call enable_language(CUDA)), or use "
               "Device::cpu()");
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
