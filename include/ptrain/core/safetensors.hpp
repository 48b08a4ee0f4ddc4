#pragma once
// safetensors files: a validating, mmap-based reader and a writer.
//
// A file format for tensors, so it sits in core/ beside the tensor and the
// mapped file it reads through: checkpoints (ckpt/) and pretrained weights
// (nn/models/gpt2_weights.hpp) both build on it. Its names keep the ckpt::
// namespace they have always had (ckpt::SafetensorsReader, ckpt::write_safetensors).
//
// Layout (the format of huggingface/safetensors, read by PyTorch and HF tools):
//
//   [u64 little-endian N][N bytes of JSON header][data]
//   header: {"__metadata__": {"format": "pt", ...},
//            "0.weight": {"dtype": "F32", "shape": [256, 784], "data_offsets": [0, 802816]}, ...}
//
// Offsets are relative to the start of the data section. The writer pads the
// header with spaces so that the data starts at a multiple of 8 bytes, and lays
// tensors out contiguously in the order given.
//
// Note [Validate before use]
// A checkpoint file may be truncated, bit-flipped or hostile. The reader
// checks, before handing out any pointer: the file holds the 8-byte length;
// the header length is <= 100 MB and within the file; the header is one JSON
// object with no duplicate names; every entry has a known dtype, a shape of at
// most 8 non-negative dimensions, and data_offsets [begin, end] with
// end - begin == numel * dtype size (computed without overflow); sorted by
// offset the tensors start at 0, leave no hole, do not overlap, and end exactly
// at the end of the file. Every failure is a CheckpointError naming the file
// and, where there is one, the tensor.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <zlib.h>

#include "ptrain/core/error.hpp"
#include "ptrain/core/mapped_file.hpp"
#include "ptrain/core/tensor.hpp"

namespace ptrain::ckpt {

static_assert(std::endian::native == std::endian::little,
              "ptrain: safetensors data is little-endian; big-endian hosts are not supported");

/// Largest header the reader accepts (the safetensors reference limit).
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

/// One tensor of a safetensors file; offsets are relative to the data section.
struct TensorEntry {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  std::uint64_t begin = 0, end = 0;
  std::uint64_t nbytes() const { return end - begin; }
};

/// A parsed and validated header.
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  ///< sorted by data offset
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  ///< 8 + header length
};

/// A tensor to write: host memory that stays valid until the write returns.
struct TensorRef {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  const void* data = nullptr;
  std::size_t nbytes() const { return static_cast<std::size_t>(shape.numel()) * dtype_size(dtype); }
};

/// A reference to a CPU tensor's elements under `name`.
template <class T>
TensorRef tensor_ref(std::string name, const Tensor<T>& t) {
  PTRAIN_CHECK(t.device().is_cpu(), CheckpointError, "[ptrain.ckpt.device] tensor '", name, "' is on ", t.device(),
               "; copy it to the cpu before writing (the checkpoint manager does this for you)");
  return {std::move(name), dtype_of<T>(), t.shape(), t.data()};
}

/// Size and CRC-32 (zlib polynomial, as Python's zlib.crc32) of a written file,
/// and the CRC-32 of each tensor's bytes (to name the tensor a corruption hit).
struct FileDigest {
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
  std::vector<std::uint32_t> tensor_crc32;  ///< in the order written
};

namespace detail {
using ::ptrain::detail::cat;

/// CRC-32 of n bytes continuing from `crc` (zlib; 0 starts a new checksum).
inline std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t n) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), n));
}

// Product of dims, or false when it exceeds `limit` (so a hostile shape cannot overflow).
inline bool checked_numel(const Shape& s, std::uint64_t limit, std::uint64_t& out) {
  std::uint64_t n = 1;
  for (std::int64_t d : s) {
    const auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > limit / u) return false;
    n *= u;
  }
  out = n;
  return true;
}

inline std::uint64_t read_le64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

/// Parses and validates the header of a safetensors image of `size` bytes
/// (Note [Validate before use]); `what` names the file in errors.
inline SafetensorsHeader parse_safetensors(const std::uint8_t* data, std::size_t size, const std::string& what) {
  using nlohmann::json;
  PTRAIN_CHECK(size >= 8, CheckpointError, "[ptrain.ckpt.truncated] ", what, ": ", size,
               " bytes, too short for the 8-byte header length; the file is truncated, write it again");
  const std::uint64_t n = read_le64(data);
  PTRAIN_CHECK(n <= kMaxHeaderBytes, CheckpointError, "[ptrain.ckpt.header] ", what, ": header length ", n,
               " exceeds the ", kMaxHeaderBytes, "-byte limit; the file is corrupt or not safetensors");
  PTRAIN_CHECK(n <= size - 8, CheckpointError, "[ptrain.ckpt.header] ", what, ": header length ", n,
               " runs past the end of the ", size, "-byte file; the file is truncated or corrupt");
  SafetensorsHeader h;
  h.data_start = 8 + n;
  const std::uint64_t data_bytes = size - h.data_start;

  // Duplicate names: nlohmann keeps the last of equal keys, so catch them
  // while parsing (depth 1 = keys of the top-level object).
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && parsed.is_string()) {
      const auto& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  json j;
  const char* hb = reinterpret_cast<const char*>(data + 8);
  try {
    j = json::parse(hb, hb + n, cb);
  } catch (const json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.header] ", what, ": header is not valid JSON (", e.what(),
                 "); the file is corrupt or not safetensors");
  }
  PTRAIN_CHECK(duplicate.empty(), CheckpointError, "[ptrain.ckpt.header] ", what, ": tensor '", duplicate,
               "' appears twice in the header; the file is corrupt");
  PTRAIN_CHECK(j.is_object(), CheckpointError, "[ptrain.ckpt.header] ", what,
               ": header is not a JSON object; the file is corrupt or not safetensors");

  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      PTRAIN_CHECK(v.is_object(), CheckpointError, "[ptrain.ckpt.header] ", what, ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        PTRAIN_CHECK(m.value().is_string(), CheckpointError, "[ptrain.ckpt.header] ", what, ": __metadata__ value '",
                     m.key(), "' is not a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const auto bad = [&](const std::string& why) {
      PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.header] ", what, ": tensor '", name, "': ", why,
                   "; the file is corrupt");
    };
    if (!v.is_object() || v.size() != 3 || !v.contains("dtype") || !v.contains("shape") ||
        !v.contains("data_offsets"))
      bad("entry must be an object with exactly dtype, shape and data_offsets");
    TensorEntry e;
    e.name = name;
    if (!v["dtype"].is_string()) bad("dtype is not a string");
    try {
      e.dtype = dtype_from_name(v["dtype"].get<std::string>());
    } catch (const Error&) {
      bad("unknown dtype '" + v["dtype"].get<std::string>() + "'");
    }
    const json& shape = v["shape"];
    if (!shape.is_array() || shape.size() > static_cast<std::size_t>(Shape::kMaxDims))
      bad("shape must be an array of at most 8 dimensions");
    std::vector<std::int64_t> dims;
    for (const json& d : shape) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (std::uint64_t{1} << 62))
        bad("shape has a dimension that is not a non-negative integer");
      dims.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
    }
    e.shape = Shape(dims);
    const json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      bad("data_offsets must be two non-negative integers");
    e.begin = off[0].get<std::uint64_t>();
    e.end = off[1].get<std::uint64_t>();
    if (e.begin > e.end || e.end > data_bytes)
      bad(detail::cat("data_offsets [", e.begin, ", ", e.end, "] are outside the ", data_bytes, "-byte data section"));
    std::uint64_t numel = 0;
    if (!checked_numel(e.shape, data_bytes, numel) || numel * dtype_size(e.dtype) != e.nbytes())
      bad(detail::cat("shape ", e.shape, " of ", dtype_name(e.dtype), " needs a different size than the ",
                      e.nbytes(), " bytes of data_offsets"));
    h.tensors.push_back(std::move(e));
  }

  // Sorted by offset, tensors must tile the data section exactly.
  std::sort(h.tensors.begin(), h.tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t expect = 0;
  for (const auto& e : h.tensors) {
    PTRAIN_CHECK(e.begin == expect, CheckpointError, "[ptrain.ckpt.offsets] ", what, ": tensor '", e.name,
                 "' starts at ", e.begin, " but the previous tensor ends at ", expect,
                 e.begin < expect ? " (overlap)" : " (hole)", "; the file is corrupt");
    expect = e.end;
  }
  PTRAIN_CHECK(expect == data_bytes, CheckpointError, "[ptrain.ckpt.offsets] ", what, ": tensors cover ", expect,
               " bytes but the data section has ", data_bytes,
               expect < data_bytes ? " (trailing bytes)" : "", "; the file is truncated or corrupt");
  return h;
}

// Owned file descriptor for writing; close() reports errors, the destructor does not throw.
class WriteFd {
 public:
  explicit WriteFd(const std::string& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    PTRAIN_CHECK(fd_ >= 0, CheckpointError, "[ptrain.ckpt.io] cannot create ", path, ": ", std::strerror(errno),
                 "; check that the directory exists and is writable");
  }
  ~WriteFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  WriteFd(const WriteFd&) = delete;
  WriteFd& operator=(const WriteFd&) = delete;

  void write_all(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd_, b, std::min<std::size_t>(n, std::size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      PTRAIN_CHECK(w > 0, CheckpointError, "[ptrain.ckpt.io] writing ", path_, " failed: ",
                   w < 0 ? std::strerror(errno) : "no progress", "; check free space and quotas");
      b += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  /// fsync + close; the data is on stable storage when this returns.
  void sync_close() {
    PTRAIN_CHECK(::fsync(fd_) == 0, CheckpointError, "[ptrain.ckpt.io] fsync of ", path_, " failed: ",
                 std::strerror(errno), "; the storage may be full or failing");
    const int r = ::close(std::exchange(fd_, -1));
    PTRAIN_CHECK(r == 0, CheckpointError, "[ptrain.ckpt.io] closing ", path_, " failed: ", std::strerror(errno));
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace detail

/// The header bytes (length prefix + JSON padded with spaces to a multiple of 8)
/// for tensors laid out in the given order.
inline std::string safetensors_header(const std::vector<TensorRef>& tensors,
                                      const std::map<std::string, std::string>& metadata = {}) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::set<std::string> names;
  std::uint64_t off = 0;
  for (const auto& t : tensors) {
    PTRAIN_CHECK(t.name != "__metadata__" && names.insert(t.name).second, CheckpointError,
                 "[ptrain.ckpt.name] tensor name '", t.name, "' is reserved or used twice; names must be unique");
    const std::uint64_t n = t.nbytes();
    j[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape.vec()}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string body;
  try {
    body = j.dump();
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.name] cannot encode the header (", e.what(),
                 "); tensor names and metadata must be valid UTF-8");
  }
  body.append((8 - body.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t len = body.size();
  std::memcpy(out.data(), &len, 8);
  return out + body;
}

/// Writes `tensors` (in this order) to `path`, fsyncs it, and returns its size
/// and CRC-32. The file is created or truncated; callers that need atomic
/// visibility write to a temporary name or commit with a marker afterwards.
inline FileDigest write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                                    const std::map<std::string, std::string>& metadata = {}) {
  const std::string header = safetensors_header(tensors, metadata);
  detail::WriteFd f(path);
  FileDigest d;
  d.crc32 = detail::crc32_update(0, header.data(), header.size());
  f.write_all(header.data(), header.size());
  d.bytes = header.size();
  // Checksum each chunk just before writing it, while it is in cache; the
  // kernel writes earlier chunks back in the meantime.
  // The file's CRC is combined from the tensors' (zlib's crc32_combine), so
  // every byte is checksummed once.
  constexpr std::size_t kChunk = std::size_t{8} << 20;
  for (const auto& t : tensors) {
    const auto* p = static_cast<const std::uint8_t*>(t.data);
    std::uint32_t crc = 0;
    for (std::size_t done = 0, n = t.nbytes(); done < n; done += kChunk) {
      const std::size_t len = std::min(kChunk, n - done);
      crc = detail::crc32_update(crc, p + done, len);
      f.write_all(p + done, len);
    }
    d.tensor_crc32.push_back(crc);
    d.crc32 = static_cast<std::uint32_t>(::crc32_combine(d.crc32, crc, static_cast<z_off_t>(t.nbytes())));
    d.bytes += t.nbytes();
  }
  f.sync_close();
  return d;
}

/// A validated safetensors file mapped read-only (Note [Validate before use]).
///
///   SafetensorsReader r("model.safetensors");
///   r.read_into("0.weight", param.value);   // checks dtype and shape, copies (cpu or cuda)
class SafetensorsReader {
 public:
  /// Maps and validates `path`; throws CheckpointError naming the file (and tensor) on any defect.
  explicit SafetensorsReader(const std::string& path)
      : file_(std::make_shared<ptrain::detail::MappedFile<CheckpointError>>(
            path, "[ptrain.ckpt.open]", "check that the checkpoint is complete and readable")),
        header_(detail::parse_safetensors(file_->data(), file_->size(), path)) {
    for (std::size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
  }

  const std::string& path() const { return file_->path(); }
  std::uint64_t file_size() const { return file_->size(); }
  /// The whole file (for checksums).
  const std::uint8_t* file_bytes() const { return file_->data(); }
  /// Tensors sorted by offset.
  const std::vector<TensorEntry>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  /// The entry of `name`; CheckpointError naming file and tensor when absent.
  const TensorEntry& entry(const std::string& name) const {
    auto it = index_.find(name);
    PTRAIN_CHECK(it != index_.end(), CheckpointError, "[ptrain.ckpt.missing] ", path(), ": no tensor '", name,
                 "'; the checkpoint was written by a different model");
    return header_.tensors[it->second];
  }
  /// First byte of a tensor's data (inside the mapping).
  const std::uint8_t* data(const TensorEntry& e) const { return file_->data() + header_.data_start + e.begin; }

  /// Throws CheckpointError naming file and tensor unless `name` exists with dst's dtype and shape.
  template <class T>
  const TensorEntry& check_matches(const std::string& name, const Tensor<T>& dst) const {
    const TensorEntry& e = entry(name);
    PTRAIN_CHECK(e.dtype == dtype_of<T>(), CheckpointError, "[ptrain.ckpt.dtype] ", path(), ": tensor '", name,
                 "' is ", dtype_name(e.dtype), " but the model expects ", dtype_name(dtype_of<T>()));
    PTRAIN_CHECK(e.shape == dst.shape(), CheckpointError, "[ptrain.ckpt.shape] ", path(), ": tensor '", name,
                 "' has shape ", e.shape, " but the model expects ", dst.shape());
    return e;
  }
  /// Copies tensor `name` into dst after checking dtype and shape against it.
  template <class T>
  void read_into(const std::string& name, Tensor<T>& dst) const {
    const TensorEntry& e = check_matches(name, dst);
    ptrain::detail::copy_bytes(dst.data(), dst.device(), data(e), Device::cpu(), e.nbytes());
  }
  /// A new CPU tensor holding a copy of `name` (dtype must be T).
  template <class T>
  Tensor<T> tensor(const std::string& name) const {
    auto t = Tensor<T>::empty(entry(name).shape);
    read_into(name, t);
    return t;
  }

 private:
  std::shared_ptr<ptrain::detail::MappedFile<CheckpointError>> file_;
  SafetensorsHeader header_;
  std::map<std::string, std::size_t> index_;
};

}  // namespace ptrain::ckpt
