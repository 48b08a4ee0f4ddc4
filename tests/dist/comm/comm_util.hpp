#pragma once
// Shared helpers of the multi-process communicator tests. Every process runs
// every test case in the same order, so collectives line up across ranks;
// value checks use CHECK (not REQUIRE) so a wrong value never makes one rank
// skip collectives the others still call.

#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <vector>

#include "ptrain/dist/process_group.hpp"

namespace comm_test {

using namespace ptrain;
using namespace ptrain::dist;

// The world communicator, created once per process; a final barrier before
// teardown keeps a fast rank from closing connections under a slow one.
struct WorldHolder {
  std::unique_ptr<Communicator> comm;
  ~WorldHolder() {
    try {
      if (comm) comm->barrier();
    } catch (...) {
    }
  }
};

inline Communicator& world() {
  static WorldHolder h{init_process_group()};
  return *h.comm;
}

inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> d{DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64};
  return d;
}
inline const std::vector<ReduceOp>& all_ops() {
  static const std::vector<ReduceOp> o{ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max};
  return o;
}

// Deterministic input of rank r at index i: small integers (exact in bf16 and
// in every summation order), negative ones too so that Min/Max/Avg truncation matter.
inline double input(int r, std::size_t i, int salt = 0) {
  return static_cast<double>(static_cast<long>((r * 37 + i * 11 + salt * 5) % 23) - 11);
}

// Buffer of `n` elements of dtype dt, stored as bytes.
struct Buf {
  DType dt;
  std::vector<unsigned char> bytes;
  Buf(DType d, std::size_t n) : dt(d), bytes(n * dtype_size(d) + 1) {}  // +1: data() never null
  std::size_t size() const { return (bytes.size() - 1) / dtype_size(dt); }
  void* data() { return bytes.data(); }
  void set(std::size_t i, double v) {
    dist::detail::visit_dtype(dt, [&](auto t) {
      using T = decltype(t);
      T* p = reinterpret_cast<T*>(bytes.data());
      if constexpr (std::is_same_v<T, bf16>) p[i] = bf16(static_cast<float>(v));
      else p[i] = static_cast<T>(v);
      return 0;
    });
  }
  double get(std::size_t i) const {
    return dist::detail::visit_dtype(dt, [&](auto t) {
      using T = decltype(t);
      return to_double(reinterpret_cast<const T*>(bytes.data())[i]);
    });
  }
  template <class T>
  static double to_double(T v) {
    if constexpr (std::is_same_v<T, bf16>) return static_cast<double>(static_cast<float>(v));
    else return static_cast<double>(v);
  }
};

// Reference reduction over the ranks' inputs, computed in the element type the
// way the backends do: reduce, then (Avg) divide by n in that type.
inline double reference(DType dt, ReduceOp op, const std::vector<double>& xs) {
  double acc = xs[0];
  for (std::size_t k = 1; k < xs.size(); ++k)
    acc = op == ReduceOp::Min ? std::min(acc, xs[k]) : op == ReduceOp::Max ? std::max(acc, xs[k]) : acc + xs[k];
  if (op != ReduceOp::Avg) return acc;
  double n = static_cast<double>(xs.size());
  switch (dt) {
    case DType::F32: return static_cast<double>(static_cast<float>(acc) / static_cast<float>(n));
    case DType::F64: return acc / n;
    case DType::BF16: return static_cast<double>(static_cast<float>(bf16(static_cast<float>(acc) / static_cast<float>(n))));
    default: return static_cast<double>(static_cast<long long>(acc) / static_cast<long long>(n));  // truncation
  }
}

inline std::vector<double> column(int size, std::size_t i, int salt = 0) {
  std::vector<double> xs;
  for (int r = 0; r < size; ++r) xs.push_back(input(r, i, salt));
  return xs;
}

}  // namespace comm_test
