#pragma once
// Raw little-endian arrays exchanged with the Python references beside the tests
// (numpy's tofile / np.fromfile), and whether Debian's python3 has torch.

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

namespace ptrain::testing {

template <class V>
void write_raw(const std::filesystem::path& path, const V* data, std::size_t n) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n * sizeof(V)));
  REQUIRE(out.good());
}

/// The whole file as V values.
template <class V>
std::vector<V> read_raw(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<V> v(bytes.size() / sizeof(V));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(V));
  return v;
}

/// Exactly n doubles.
inline std::vector<double> read_raw(const std::filesystem::path& path, std::size_t n) {
  auto v = read_raw<double>(path);
  REQUIRE(v.size() == n);
  return v;
}

inline bool torch_available() { return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0; }

}  // namespace ptrain::testing
