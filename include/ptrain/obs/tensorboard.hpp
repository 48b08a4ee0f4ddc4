#pragma once
// TensorBoardWriter: scalar summaries in a TensorBoard event file, without a
// protobuf or TensorFlow dependency.
//
//   obs::TensorBoardWriter tb("runs/exp1");   // runs/exp1/events.out.tfevents.<time>.<host>.ptrain
//   tb.scalar("loss", step, 0.42);            // one Event, flushed
//
// Note [Event file format]
// An event file is a TFRecord stream: each record is
//   uint64 length (little endian) | uint32 masked_crc32c(length bytes) | data | uint32 masked_crc32c(data)
// with masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8, c = CRC-32C
// (Castagnoli, reflected polynomial 0x82f63b78) of x. Each record's data is a
// serialized tensorflow.Event protobuf, encoded here by hand; the fields used:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
// The first record carries file_version "brain.Event:2", as TensorFlow writes it.
// Records are flushed one by one, so a killed run keeps every complete one.

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "ptrain/core/error.hpp"

namespace ptrain::obs {

namespace detail {

/// CRC-32C (Castagnoli) of n bytes, bitwise over a 256-entry table.
inline std::uint32_t crc32c(const void* data, std::size_t n) {
  static const auto table = [] {
    std::array<std::uint32_t, 256> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  std::uint32_t c = 0xffffffffu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

inline std::uint32_t masked_crc32c(const void* data, std::size_t n) {
  const std::uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protobuf wire format pieces (little-endian hosts: the build targets x86-64 and aarch64 Linux).
inline void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void put_tag(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<std::uint64_t>(field) << 3 | static_cast<std::uint64_t>(wire_type));
}
template <class T>
void put_fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
inline void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

/// A serialized Event (Note [Event file format]); `summary` may be empty.
inline std::string event_bytes(double wall_time, std::int64_t step, const std::string& file_version,
                               const std::string& summary) {
  std::string e;
  put_tag(e, 1, 1);
  put_fixed(e, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<std::uint64_t>(step));
  if (!file_version.empty()) put_bytes(e, 3, file_version);
  if (!summary.empty()) put_bytes(e, 5, summary);
  return e;
}

/// A serialized Summary with one simple_value.
inline std::string scalar_summary(const std::string& tag, float value) {
  std::string v;
  put_bytes(v, 1, tag);
  put_tag(v, 2, 5);
  put_fixed(v, value);
  std::string s;
  put_bytes(s, 1, v);
  return s;
}

}  // namespace detail

/// Writes scalars to a new event file in a directory (Note [Event file format]).
class TensorBoardWriter {
 public:
  /// Disabled writer.
  TensorBoardWriter() = default;
  /// Creates <dir>/events.out.tfevents.<seconds>.<host>.ptrain (and dir, as SummaryWriter does); "" disables.
  explicit TensorBoardWriter(const std::string& dir) {
    if (dir.empty()) return;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);  // a failure shows as the open's error below
    char host[256] = "localhost";
    ::gethostname(host, sizeof(host) - 1);
    const auto secs = static_cast<long long>(wall_time());
    path_ = dir + "/events.out.tfevents." + std::to_string(secs) + "." + host + ".ptrain";
    out_.open(path_, std::ios::binary | std::ios::trunc);
    PTRAIN_CHECK(out_.is_open(), Error, "[ptrain.tensorboard.open] cannot create the TensorBoard event file '", path_,
                 "'; check that the directory is writable or pass another --tensorboard-dir");
    write_record(detail::event_bytes(wall_time(), 0, "brain.Event:2", {}));
  }
  TensorBoardWriter(TensorBoardWriter&&) = default;
  TensorBoardWriter& operator=(TensorBoardWriter&&) = default;

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }

  /// One scalar `tag` at `step`; no-op when disabled.
  void scalar(const std::string& tag, std::int64_t step, double value) {
    if (!enabled()) return;
    write_record(detail::event_bytes(wall_time(), step, {}, detail::scalar_summary(tag, static_cast<float>(value))));
  }

 private:
  static double wall_time() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  void write_record(const std::string& data) {
    std::string rec;
    const std::uint64_t len = data.size();
    detail::put_fixed(rec, len);
    detail::put_fixed(rec, detail::masked_crc32c(rec.data(), 8));
    rec += data;
    detail::put_fixed(rec, detail::masked_crc32c(data.data(), data.size()));
    out_.write(rec.data(), static_cast<std::streamsize>(rec.size()));
    out_.flush();
    PTRAIN_CHECK(out_.good(), Error, "[ptrain.tensorboard.write] writing '", path_, "' failed; the disk may be full");
  }

  std::string path_;
  std::ofstream out_;
};

}  // namespace ptrain::obs
