#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ptrain/data/idx.hpp"

namespace test_idx {

namespace fs = std::filesystem;
using ptrain::DataError;

namespace {

// A fresh directory per test case (ctest runs cases as parallel processes), removed at the end.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("ptrain_idx_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// IDX bytes written by hand: 0 0 type ndims, big-endian int32 dims, data.
std::vector<unsigned char> idx_bytes(const std::vector<std::uint32_t>& dims, const std::vector<unsigned char>& data,
                                     unsigned char type = 0x08) {
  std::vector<unsigned char> b = {0, 0, type, static_cast<unsigned char>(dims.size())};
  for (std::uint32_t d : dims) {
    b.push_back(static_cast<unsigned char>(d >> 24));
    b.push_back(static_cast<unsigned char>(d >> 16));
    b.push_back(static_cast<unsigned char>(d >> 8));
    b.push_back(static_cast<unsigned char>(d));
  }
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

void write_plain(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

void write_gz(const std::string& path, const std::vector<unsigned char>& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  if (!bytes.empty()) REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == int(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

std::vector<unsigned char> pattern(std::size_t n, unsigned mul = 37, unsigned add = 11) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>((i * mul + add) % 256);
  return v;
}

// The DataError message `fn` throws; fails the test when it throws nothing or something else.
template <class F>
std::string data_error(F&& fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected DataError, got: " << e.what());
  }
  FAIL("expected DataError, nothing was thrown");
  return {};
}

}  // namespace

TEST_CASE("read_idx reads a plain 3-D ubyte file", "[data][idx]") {
  TempDir dir("plain3");
  const auto data = pattern(4 * 3 * 5);
  const std::string path = dir.file("images-idx3-ubyte");
  write_plain(path, idx_bytes({4, 3, 5}, data));

  const auto t = ptrain::read_idx(path);
  CHECK(t.shape() == ptrain::Shape{4, 3, 5});
  REQUIRE(t.numel() == 60);
  for (std::int64_t n = 0; n < 4; ++n)
    for (std::int64_t r = 0; r < 3; ++r)
      for (std::int64_t c = 0; c < 5; ++c) CHECK(t.at({n, r, c}) == data[static_cast<std::size_t>((n * 3 + r) * 5 + c)]);
}

TEST_CASE("read_idx reads gzip files directly", "[data][idx]") {
  TempDir dir("gz");
  // Larger than zlib's buffer and the reader's chunking, to cross several reads.
  const auto data = pattern(70000 * 3, 7, 3);
  const std::string path = dir.file("labels-idx1-ubyte.gz");
  write_gz(path, idx_bytes({70000 * 3}, data));
  const auto t = ptrain::read_idx(path);
  CHECK(t.shape() == ptrain::Shape{70000 * 3});
  CHECK(t.to_vector() == std::vector<std::uint8_t>(data.begin(), data.end()));

  SECTION("an empty data set is read as shape [0, ...]") {
    const std::string empty = dir.file("empty.gz");
    write_gz(empty, idx_bytes({0, 28, 28}, {}));
    const auto e = ptrain::read_idx(empty);
    CHECK(e.shape() == ptrain::Shape{0, 28, 28});
  }
}

TEST_CASE("read_idx rejects bad files with the file named", "[data][idx]") {
  TempDir dir("bad");
  const auto data = pattern(2 * 2 * 3);

  SECTION("missing file") {
    const std::string path = dir.file("nope-idx3-ubyte.gz");
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.missing]") && Catch::Contains(path));
  }
  SECTION("wrong magic: not an IDX file") {
    const std::string path = dir.file("wrong-magic");
    auto bytes = idx_bytes({2, 2, 3}, data);
    bytes[0] = 0x1f;
    bytes[1] = 0x9d;
    write_plain(path, bytes);
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.magic]") && Catch::Contains(path));
  }
  SECTION("wrong magic: unsupported element type") {
    const std::string path = dir.file("float-idx.gz");
    write_gz(path, idx_bytes({2, 2, 3}, data, 0x0D));
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.type]") && Catch::Contains(path) && Catch::Contains("float32"));
  }
  SECTION("zero dimensions") {
    const std::string path = dir.file("zero-dims");
    write_plain(path, idx_bytes({}, data));
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.dims]") && Catch::Contains(path));
  }
  SECTION("shorter than a header") {
    const std::string path = dir.file("tiny");
    write_plain(path, {0, 0});
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(path));
  }
  SECTION("truncated inside the dimensions") {
    const std::string path = dir.file("cut-header");
    auto bytes = idx_bytes({2, 2, 3}, {});
    bytes.resize(9);
    write_plain(path, bytes);
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(path));
  }
  SECTION("truncated data, plain") {
    const std::string path = dir.file("cut-data");
    auto bytes = idx_bytes({2, 2, 3}, data);
    bytes.pop_back();
    write_plain(path, bytes);
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(path) &&
                        Catch::Contains("holds only 11"));
  }
  SECTION("truncated data, complete gzip stream") {
    const std::string path = dir.file("cut-data.gz");
    auto bytes = idx_bytes({2, 2, 3}, data);
    bytes.resize(bytes.size() - 5);
    write_gz(path, bytes);
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(path));
  }
  SECTION("gzip stream cut short or damaged") {
    const std::string whole = dir.file("whole.gz");
    write_gz(whole, idx_bytes({1000}, pattern(1000)));
    std::ifstream in(whole, std::ios::binary);
    std::vector<unsigned char> gz((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string half = dir.file("half.gz");
    write_plain(half, std::vector<unsigned char>(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2)));
    const auto msg = data_error([&] { ptrain::read_idx(half); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(half));

    // The last 8 bytes of a gzip file are CRC-32 and length; a flipped CRC bit is damage, not truncation.
    gz[gz.size() - 6] ^= 0x55;
    const std::string bad_crc = dir.file("crc.gz");
    write_plain(bad_crc, gz);
    const auto crc_msg = data_error([&] { ptrain::read_idx(bad_crc); });
    CHECK_THAT(crc_msg, Catch::Contains("[ptrain.data.idx.corrupt]") && Catch::Contains(bad_crc));
  }
  SECTION("trailing garbage") {
    const std::string path = dir.file("trailing.gz");
    auto bytes = idx_bytes({2, 2, 3}, data);
    bytes.push_back(0xAB);
    write_gz(path, bytes);
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.trailing]") && Catch::Contains(path));
  }
  SECTION("header dims far too large for the file") {
    // 2^31-1 cubed would be ~10^28 bytes: rejected from the header, without allocating.
    const std::string path = dir.file("huge");
    write_plain(path, idx_bytes({0x7fffffff, 0x7fffffff, 0x7fffffff}, data));
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.dims]") && Catch::Contains(path));
  }
  SECTION("header dims larger than the file holds (plausible size)") {
    // 64 MiB claimed, 12 bytes present: the reader must not trust the header for its allocation.
    const std::string path = dir.file("big.gz");
    write_gz(path, idx_bytes({1 << 20, 8, 8}, data));
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.truncated]") && Catch::Contains(path) &&
                        Catch::Contains("[1048576, 8, 8]"));
  }
  SECTION("negative dimension") {
    const std::string path = dir.file("negative");
    write_plain(path, idx_bytes({0xfffffffe, 2}, data));
    const auto msg = data_error([&] { ptrain::read_idx(path); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.idx.dims]") && Catch::Contains(path));
  }
}

TEST_CASE("load_mnist reads a split, scales images and checks counts", "[data][idx]") {
  TempDir dir("mnist");
  const std::int64_t n = 5, rows = 4, cols = 3;
  const auto pixels = pattern(static_cast<std::size_t>(n * rows * cols), 53, 200);
  const std::vector<unsigned char> labels = {3, 0, 9, 1, 7};
  // Images gzipped, labels plain: both spellings of the file names are accepted.
  write_gz(dir.file("train-images-idx3-ubyte.gz"), idx_bytes({5, 4, 3}, pixels));
  write_plain(dir.file("train-labels-idx1-ubyte"), idx_bytes({5}, labels));

  const auto split = ptrain::load_mnist(dir.path.string(), true);
  CHECK(split.images.shape() == ptrain::Shape{n, rows * cols});
  CHECK(split.labels.shape() == ptrain::Shape{n});
  for (std::int64_t i = 0; i < n * rows * cols; ++i)
    CHECK(split.images.data()[i] == static_cast<float>(pixels[static_cast<std::size_t>(i)]) / 255.0f);
  for (std::int64_t i = 0; i < n; ++i) CHECK(split.labels.data()[i] == labels[static_cast<std::size_t>(i)]);
  CHECK(*std::min_element(split.images.data(), split.images.data() + split.images.numel()) >= 0.0f);
  CHECK(*std::max_element(split.images.data(), split.images.data() + split.images.numel()) <= 1.0f);

  SECTION("image and label counts differ") {
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_bytes({5, 4, 3}, pixels));
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_bytes({4}, {1, 2, 3, 4}));
    const auto msg = data_error([&] { ptrain::load_mnist(dir.path.string(), false); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.mnist.count]") &&
                        Catch::Contains(dir.file("t10k-images-idx3-ubyte.gz")) &&
                        Catch::Contains(dir.file("t10k-labels-idx1-ubyte.gz")));
  }
  SECTION("a label outside the classes") {
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_bytes({5, 4, 3}, pixels));
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_bytes({5}, {1, 2, 10, 4, 5}));
    const auto msg = data_error([&] { ptrain::load_mnist(dir.path.string(), false); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.mnist.label]") && Catch::Contains("label 10 at index 2") &&
                        Catch::Contains(dir.file("t10k-labels-idx1-ubyte.gz")));
    CHECK(ptrain::load_mnist(dir.path.string(), false, 11).labels.data()[2] == 10);
  }
  SECTION("labels and images swapped") {
    write_gz(dir.file("t10k-images-idx3-ubyte.gz"), idx_bytes({5}, labels));
    write_gz(dir.file("t10k-labels-idx1-ubyte.gz"), idx_bytes({5}, labels));
    const auto msg = data_error([&] { ptrain::load_mnist(dir.path.string(), false); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.mnist.shape]") &&
                        Catch::Contains(dir.file("t10k-images-idx3-ubyte.gz")));
  }
  SECTION("split missing from the directory") {
    const auto msg = data_error([&] { ptrain::load_mnist(dir.path.string(), false); });
    CHECK_THAT(msg, Catch::Contains("[ptrain.data.mnist.missing]") &&
                        Catch::Contains(dir.file("t10k-images-idx3-ubyte.gz")) &&
                        Catch::Contains(dir.file("t10k-images-idx3-ubyte'")));
  }
}

TEST_CASE("default_fashion_mnist_dir honours PTRAIN_FASHION_MNIST_DIR", "[data][idx]") {
  const char* old = std::getenv("PTRAIN_FASHION_MNIST_DIR");
  const std::string saved = old ? old : "";
  ::unsetenv("PTRAIN_FASHION_MNIST_DIR");
  CHECK(ptrain::default_fashion_mnist_dir() == "/usr/share/datasets/fashion-mnist");
  ::setenv("PTRAIN_FASHION_MNIST_DIR", "/data/fmnist", 1);
  CHECK(ptrain::default_fashion_mnist_dir() == "/data/fmnist");
  if (old) ::setenv("PTRAIN_FASHION_MNIST_DIR", saved.c_str(), 1);
  else ::unsetenv("PTRAIN_FASHION_MNIST_DIR");
}

}  // namespace test_idx
