#pragma once
// Element types: the runtime DType tag and the bf16 storage type.
//
// bf16 is storage only: arithmetic converts to float. Conversion rounds to
// nearest even, the same rule CUDA's __float2bfloat16 uses, so CPU and GPU
// agree bit for bit.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "ptrain/config.hpp"
#include "ptrain/core/error.hpp"

namespace ptrain {

/// bfloat16: the top 16 bits of an IEEE float.
struct bf16 {
  std::uint16_t bits = 0;

  bf16() = default;
  PTRAIN_HOST_DEVICE explicit bf16(float f) : bits(from_float(f)) {}
  PTRAIN_HOST_DEVICE explicit operator float() const { return to_float(bits); }

  PTRAIN_HOST_DEVICE static std::uint16_t from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return static_cast<std::uint16_t>(u >> 16);
  }
  PTRAIN_HOST_DEVICE static float to_float(std::uint16_t b) {
    std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

/// The arithmetic type of element type T: float for bf16 (Note [bf16 kernels]
/// in kernels/cuda/device.cuh), T itself otherwise.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, bf16>, float, T>;

/// The conversions of the cast kernels: float or double to bf16 (through float,
/// rounding to nearest even) and bf16 to float or double (exact).
template <class From, class To>
inline constexpr bool is_bf16_cast =
    (std::is_same_v<To, bf16> && (std::is_same_v<From, float> || std::is_same_v<From, double>)) ||
    (std::is_same_v<From, bf16> && (std::is_same_v<To, float> || std::is_same_v<To, double>));

/// Runtime tag of an element type; names follow safetensors.
enum class DType : std::uint8_t { F32, F64, BF16, F16, I32, I64, U8 };

/// Size in bytes of one element.
inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U8: return 1;
  }
  return 0;
}

/// Name as written in safetensors headers ("F32", "BF16", ...).
inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
    case DType::I64: return "I64";
    case DType::U8: return "U8";
  }
  return "?";
}

/// Inverse of dtype_name; throws Error for an unknown name.
inline DType dtype_from_name(const std::string& name) {
  for (DType d : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8})
    if (name == dtype_name(d)) return d;
  PTRAIN_THROW(Error, "[ptrain.dtype] unknown dtype '", name, "'; expected one of F32 F64 BF16 F16 I32 I64 U8");
}

/// DType of a C++ element type: dtype_of<float> == DType::F32.
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::F32;
  else if constexpr (std::is_same_v<T, double>) return DType::F64;
  else if constexpr (std::is_same_v<T, bf16>) return DType::BF16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::I32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::I64;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::U8;
  else static_assert(sizeof(T) == 0, "ptrain: unsupported element type; use float, double, bf16, int32_t, int64_t or uint8_t");
}

}  // namespace ptrain
