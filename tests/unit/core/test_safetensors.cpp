// safetensors writer and validating reader. References: a file laid out by
// hand byte for byte, and hand-written headers for every defect the reader
// must reject (Note [Validate before use]).
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <ptrain/core/safetensors.hpp>
#include <string>
#include <unistd.h>

namespace test_safetensors {

using namespace ptrain;
using namespace ptrain::ckpt;

namespace {

struct TmpDir {
  std::filesystem::path path;
  TmpDir() {
    char t[] = "/tmp/ptrain_st_XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TmpDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& n) const { return (path / n).string(); }
};

std::string read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
void write_bytes(const std::string& p, const std::string& b) { std::ofstream(p, std::ios::binary) << b; }

// A safetensors image from a header text (unpadded) and raw data bytes.
std::string image(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const std::uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

// Message of the CheckpointError thrown by opening `bytes` as a file, or "" if none.
std::string open_error(const TmpDir& d, const std::string& bytes, const std::string& name = "bad.safetensors") {
  write_bytes(d.file(name), bytes);
  try {
    SafetensorsReader r(d.file(name));
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("safetensors writer produces the exact bytes of the format", "[ckpt][safetensors]") {
  TmpDir d;
  const float v[2] = {1.0f, -2.0f};
  auto digest = write_safetensors(d.file("a.safetensors"), {{"a", DType::F32, Shape{2}, v}});
  // Built by hand: JSON of 54 bytes padded to 56, then 1.0f and -2.0f little-endian.
  std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE(json.size() == 54);
  std::string expected = std::string("\x38\0\0\0\0\0\0\0", 8) + json + "  " + std::string("\0\0\x80\x3f\0\0\0\xc0", 8);
  const std::string got = read_bytes(d.file("a.safetensors"));
  CHECK(got == expected);
  CHECK(digest.bytes == expected.size());
  CHECK(digest.crc32 == ::crc32(0, reinterpret_cast<const Bytef*>(expected.data()), expected.size()));
}

TEST_CASE("safetensors round trip of every dtype, metadata, scalars and empty tensors", "[ckpt][safetensors]") {
  TmpDir d;
  const float f32[6] = {0.5f, -1.25f, 3.0f, 1e-30f, -0.0f, 7.0f};
  const double f64[3] = {1.0 / 3.0, -2.5, 1e300};
  const std::uint16_t b16[2] = {bf16(1.5f).bits, bf16(-3.0f).bits};
  const std::uint16_t f16[3] = {0x3c00, 0xc000, 0x7bff};
  const std::int32_t i32[4] = {-7, 0, 2147483647, 5};
  const std::int64_t i64[1] = {-(std::int64_t{1} << 40)};
  const std::uint8_t u8[5] = {0, 1, 2, 254, 255};
  std::vector<TensorRef> ts = {{"w.f32", DType::F32, Shape{2, 3}, f32}, {"u8", DType::U8, Shape{5}, u8},
                               {"f64", DType::F64, Shape{3}, f64},      {"bf16", DType::BF16, Shape{2}, b16},
                               {"f16", DType::F16, Shape{3, 1}, f16},   {"i32", DType::I32, Shape{2, 2}, i32},
                               {"scalar", DType::I64, Shape{}, i64},    {"empty", DType::F32, Shape{0, 4}, f32}};
  write_safetensors(d.file("all.safetensors"), ts, {{"format", "pt"}, {"step", "12"}});
  SafetensorsReader r(d.file("all.safetensors"));
  CHECK(r.metadata().at("format") == "pt");
  CHECK(r.metadata().at("step") == "12");
  REQUIRE(r.tensors().size() == ts.size());
  std::uint64_t header_len;
  std::memcpy(&header_len, r.file_bytes(), 8);
  CHECK((8 + header_len) % 8 == 0);  // data section aligned
  for (const auto& t : ts) {
    const TensorEntry& e = r.entry(t.name);
    CHECK(e.dtype == t.dtype);
    CHECK(e.shape == t.shape);
    CHECK(e.nbytes() == t.nbytes());
    CHECK(std::memcmp(r.data(e), t.data, t.nbytes()) == 0);
  }
  auto w = r.tensor<float>("w.f32");
  CHECK(w.at({1, 2}) == 7.0f);
  CHECK(r.tensor<std::int64_t>("scalar").data()[0] == i64[0]);
  CHECK(r.tensor<float>("empty").numel() == 0);
}

TEST_CASE("safetensors reader names file and tensor on dtype and shape mismatch", "[ckpt][safetensors]") {
  TmpDir d;
  const float v[6] = {};
  write_safetensors(d.file("m.safetensors"), {{"layer.weight", DType::F32, Shape{2, 3}, v}});
  SafetensorsReader r(d.file("m.safetensors"));
  auto wrong_shape = Tensor<float>::zeros({3, 2});
  auto wrong_dtype = Tensor<double>::zeros({2, 3});
  CHECK_THROWS_WITH(r.read_into("layer.weight", wrong_shape),
                    Catch::Contains("m.safetensors") && Catch::Contains("'layer.weight'") && Catch::Contains("[2, 3]"));
  CHECK_THROWS_WITH(r.read_into("layer.weight", wrong_dtype),
                    Catch::Contains("m.safetensors") && Catch::Contains("'layer.weight'") && Catch::Contains("F64"));
  CHECK_THROWS_WITH(r.tensor<float>("nope"), Catch::Contains("m.safetensors") && Catch::Contains("'nope'"));
}

TEST_CASE("safetensors reader rejects every malformed header", "[ckpt][safetensors]") {
  TmpDir d;
  const std::string ok = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\1');
  REQUIRE(open_error(d, image(ok, data8)).empty());

  struct Case {
    const char* what;
    std::string bytes;
    const char* expect;  // part of the message
  };
  std::string huge(8, '\0');
  const std::uint64_t big = 200'000'000;
  std::memcpy(huge.data(), &big, 8);
  std::string beyond = image(ok, data8);
  const std::uint64_t past = beyond.size();
  std::memcpy(beyond.data(), &past, 8);
  const std::vector<Case> cases = {
      {"empty file", "", "truncated"},
      {"length only", image("", "").substr(0, 5), "truncated"},
      {"header > 100 MB", huge + "{}", "limit"},
      {"header past end", beyond, "past the end"},
      {"not JSON", image("{\"x\":", ""), "not valid JSON"},
      {"not an object", image("[1,2]", ""), "not a JSON object"},
      {"duplicate", image(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", "ab"), "'x' appears twice"},
      {"unknown dtype", image(R"({"x":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", "ab"), "unknown dtype"},
      {"negative dim", image(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", ""), "'x'"},
      {"9 dims", image(R"({"x":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})", "a"), "at most 8"},
      {"offsets past data", image(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", data8), "outside"},
      {"begin > end", image(R"({"x":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})", data8), "outside"},
      {"size mismatch", image(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8), "different size"},
      {"overflowing shape", image(R"({"x":{"dtype":"F64","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})", data8), "different size"},
      {"overlap", image(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8), "overlap"},
      {"hole", image(R"({"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", data8), "hole"},
      {"trailing bytes", image(ok, data8 + "zz"), "trailing"},
      {"truncated data", image(ok, data8.substr(0, 5)), "outside"},
      {"extra key", image(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"foo":1}})", "a"), "exactly"},
      {"metadata not strings", image(R"({"__metadata__":{"a":1}})", ""), "not a string"},
      {"float offsets", image(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0.0,1]}})", "a"), "data_offsets"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    const std::string msg = open_error(d, c.bytes, "case.safetensors");
    CHECK_THAT(msg, Catch::Contains("case.safetensors") && Catch::Contains(c.expect));
  }
}

TEST_CASE("safetensors reader survives every truncation and single-byte flip", "[ckpt][safetensors]") {
  TmpDir d;
  const float v[4] = {1, 2, 3, 4};
  const std::int64_t w[2] = {5, 6};
  write_safetensors(d.file("g.safetensors"), {{"a", DType::F32, Shape{2, 2}, v}, {"b", DType::I64, Shape{2}, w}},
                    {{"format", "pt"}});
  const std::string good = read_bytes(d.file("g.safetensors"));
  // Every proper prefix is rejected (the data section must be covered exactly).
  for (std::size_t n = 0; n < good.size(); ++n) {
    INFO("prefix of " << n << " bytes");
    CHECK_FALSE(open_error(d, good.substr(0, n)).empty());
  }
  // Flipping any header byte either still gives a valid file whose entries
  // stay inside the data section, or a CheckpointError; never a crash.
  std::uint64_t header_len;
  std::memcpy(&header_len, good.data(), 8);
  int rejected = 0;
  for (std::size_t i = 0; i < 8 + header_len; ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    write_bytes(d.file("f.safetensors"), bad);
    try {
      SafetensorsReader r(d.file("f.safetensors"));
      for (const auto& e : r.tensors()) CHECK(e.end <= r.file_size());
    } catch (const CheckpointError&) {
      ++rejected;
    }
  }
  CHECK(rejected > static_cast<int>(header_len) / 2);
}

}  // namespace test_safetensors
