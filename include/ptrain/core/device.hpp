#pragma once
// Device: where a tensor's storage lives, "cpu" or "cuda:N".

#include <cstdint>
#include <cstdlib>
#include <ostream>
#include <string>

#include "ptrain/core/error.hpp"

namespace ptrain {

/// A runtime device: Device::cpu() or Device::cuda(n).
struct Device {
  enum class Kind : std::uint8_t { CPU, CUDA };
  Kind kind = Kind::CPU;
  int index = 0;

  static constexpr Device cpu() { return {Kind::CPU, 0}; }
  static constexpr Device cuda(int n = 0) { return {Kind::CUDA, n}; }

  /// Parses "cpu", "cuda" or "cuda:N".
  static Device parse(const std::string& s) {
    if (s == "cpu") return cpu();
    if (s == "cuda") return cuda(0);
    if (s.rfind("cuda:", 0) == 0 && s.size() > 5) {
      char* end = nullptr;
      long n = std::strtol(s.c_str() + 5, &end, 10);
      if (*end == '\0' && n >= 0 && n < 1024) return cuda(static_cast<int>(n));
    }
    PTRAIN_THROW(Error, "[ptrain.device] cannot parse device '", s, "'; use cpu, cuda or cuda:N");
  }

  bool is_cpu() const { return kind == Kind::CPU; }
  bool is_cuda() const { return kind == Kind::CUDA; }
  std::string str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }
  friend bool operator==(const Device&, const Device&) = default;
};

inline std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace ptrain
