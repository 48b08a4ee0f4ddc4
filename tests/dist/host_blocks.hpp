#pragma once
// A caching allocator of host memory that knows which blocks it handed out: the
// allocator of the stand-in cuda:0 backends with which the staged-communicator
// tests run without a GPU (their is_host_pointer() asks holds()).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <map>
#include <mutex>

#include "ptrain/core/allocator.hpp"

namespace ptrain_test {

class HostBlocks final : public ptrain::detail::CachingAllocator {
 public:
  /// Whether p points into a block this allocator handed out.
  bool holds(const void* p) {
    std::lock_guard lock(m_);
    auto it = raw_.upper_bound(static_cast<const char*>(p));
    if (it == raw_.begin()) return false;
    --it;
    return static_cast<const char*>(p) < it->first + it->second;
  }

 protected:
  void* raw_allocate(std::size_t bytes) override {
    void* p = std::aligned_alloc(kAlignment, bytes);
    REQUIRE(p != nullptr);
    std::lock_guard lock(m_);
    raw_[static_cast<const char*>(p)] = bytes;
    return p;
  }
  void raw_free(void* p) override {
    {
      std::lock_guard lock(m_);
      raw_.erase(static_cast<const char*>(p));
    }
    std::free(p);
  }

 private:
  std::mutex m_;
  std::map<const char*, std::size_t> raw_;
};

}  // namespace ptrain_test
