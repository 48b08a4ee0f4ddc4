#pragma once
// Shape: up to 8 dimensions stored inline (no heap allocation per tensor view).

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "ptrain/core/error.hpp"

namespace ptrain {

/// Dimensions of a row-major tensor, e.g. Shape{128, 784}.
class Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims.begin(), dims.end()); }

  int size() const { return n_; }
  std::int64_t operator[](int i) const { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t back() const { return d_[static_cast<std::size_t>(n_ - 1)]; }
  const std::int64_t* begin() const { return d_.data(); }
  const std::int64_t* end() const { return d_.data() + n_; }

  /// Number of elements: the product of the dimensions (1 for a scalar shape {}).
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < n_; ++i) n *= d_[static_cast<std::size_t>(i)];
    return n;
  }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < n_; ++i) s += (i ? ", " : "") + std::to_string(d_[static_cast<std::size_t>(i)]);
    return s + "]";
  }
  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.n_ != b.n_) return false;
    for (int i = 0; i < a.n_; ++i)
      if (a[i] != b[i]) return false;
    return true;
  }

 private:
  template <class It>
  void assign(It first, It last) {
    for (; first != last; ++first) {
      PTRAIN_CHECK(n_ < kMaxDims, ShapeError, "[ptrain.shape] at most ", kMaxDims, " dimensions are supported");
      PTRAIN_CHECK(*first >= -1, ShapeError, "[ptrain.shape] negative dimension ", *first);
      d_[static_cast<std::size_t>(n_++)] = *first;
    }
  }
  std::array<std::int64_t, kMaxDims> d_{};
  int n_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

}  // namespace ptrain
