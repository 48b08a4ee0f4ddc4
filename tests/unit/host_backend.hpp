#pragma once
// cuda:N backed by the CPU allocator and memcpy, for unit tests that run the ops'
// CUDA dispatch (the kernel table, the verification gate) on a machine without a GPU.
#include <cstddef>
#include <cstring>

#include <ptrain/core/allocator.hpp>
#include <ptrain/core/device.hpp>

namespace ptrain_test {

class HostBackend final : public ptrain::detail::DeviceBackend {
 public:
  ptrain::Allocator& allocator(int) override { return ptrain::allocator_for(ptrain::Device::cpu()); }
  void copy(void* dst, ptrain::Device, const void* src, ptrain::Device, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void memset_zero(void* dst, ptrain::Device, std::size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }
};

}  // namespace ptrain_test
