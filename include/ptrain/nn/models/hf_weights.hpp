#pragma once
// Hugging Face weight folders: the part that every model's converter shares
// (gpt2_weights.hpp, llama_weights.hpp). HfTensors finds and validates the
// safetensors file(s) of a folder and reads a tensor of any float dtype into T;
// write_hf_folder writes one back (one file or shards, the index, config.json)
// so that each file appears whole. Internals, in ckpt::detail: the converters
// decide the names and shapes, this header only moves bytes.
//
// Note [Hugging Face folders]
// transformers' save_pretrained writes config.json and either model.safetensors
// or, above max_shard_size, shards model-00001-of-0000N.safetensors ... with
//   model.safetensors.index.json: {"metadata": {"total_size": <data bytes>},
//                                  "weight_map": {"<tensor>": "<shard file>", ...}}
// A folder is read as transformers reads it: model.safetensors when present,
// else the index. The index is checked before any shard is trusted: valid JSON,
// a weight_map of plain file names inside the folder (no '/', no ".."), every
// named shard present and a valid safetensors file (Note [Validate before use]),
// every tensor in the shard the index names and no shard tensor the index does
// not name. The writer splits as save_pretrained does (tensors in order, a new
// shard when the next tensor would pass the limit), writes each file under a
// temporary name and renames it, the index after its shards, and then removes
// the files of the other layout left by an earlier save, so that a reader sees
// an old or a new model, never half of one.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ptrain/core/safetensors.hpp"

namespace ptrain::ckpt::detail {

/// IEEE half (F16) bits to float, subnormals, infinities and NaN included.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: shift the mantissa up until its leading one is the implicit bit
    exp = 113;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    u = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// n elements of dtype `dt` at p, converted to T (through double, exact for F32/BF16/F16 into float).
template <class T>
void convert_stored(const std::uint8_t* p, DType dt, std::int64_t n, T* out) {
  const auto put = [&](auto load, std::size_t size) {
    for (std::int64_t i = 0; i < n; ++i)
      out[i] = static_cast<T>(static_cast<acc_t<T>>(static_cast<double>(load(p + static_cast<std::size_t>(i) * size))));
  };
  switch (dt) {
    case DType::F32: return put([](const std::uint8_t* q) { float v; std::memcpy(&v, q, 4); return v; }, 4);
    case DType::F64: return put([](const std::uint8_t* q) { double v; std::memcpy(&v, q, 8); return v; }, 8);
    case DType::BF16:
      return put([](const std::uint8_t* q) { std::uint16_t b; std::memcpy(&b, q, 2); return bf16::to_float(b); }, 2);
    case DType::F16:
      return put([](const std::uint8_t* q) { std::uint16_t b; std::memcpy(&b, q, 2); return half_to_float(b); }, 2);
    default: break;
  }
  PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.dtype] dtype ", dtype_name(dt),
               " is not a float type; model weights are read from F32, F64, BF16 or F16");
}

inline constexpr const char* kHfWeights = "model.safetensors";
inline constexpr const char* kHfIndex = "model.safetensors.index.json";

/// "model-00002-of-00003.safetensors" (Hugging Face's shard names).
inline std::string hf_shard_name(std::size_t i, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

/// The tensors of a Hugging Face weights folder or of one safetensors file
/// (Note [Hugging Face folders]). `id` prefixes the errors: "[<id>.index] ...".
class HfTensors {
 public:
  HfTensors(const std::string& path, const std::string& id) : path_(path), id_(id) {
    namespace fs = std::filesystem;
    if (!fs::is_directory(path)) {
      add_file(path, "");
    } else if (fs::exists(fs::path(path) / kHfWeights)) {
      add_file((fs::path(path) / kHfWeights).string(), "");
    } else {
      read_index(fs::path(path) / kHfIndex);
    }
  }

  const std::string& path() const { return path_; }
  std::size_t files() const { return readers_.size(); }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  /// Every tensor name, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [name, _] : where_) out.push_back(name);
    return out;
  }
  /// The entry of `name`; "[<id>.missing]" naming it when absent.
  const TensorEntry& entry(const std::string& name) const {
    auto it = where_.find(name);
    PTRAIN_CHECK(it != where_.end(), CheckpointError, "[", id_, ".missing] ", path_, ": no tensor '", name,
                 "'; the weights belong to a different model (build the model with the folder's config.json)");
    return readers_[it->second]->entry(name);
  }
  /// The entry of `name` after checking that its dtype is one values() converts.
  const TensorEntry& float_entry(const std::string& name) const {
    const TensorEntry& e = entry(name);
    PTRAIN_CHECK(e.dtype == DType::F32 || e.dtype == DType::F64 || e.dtype == DType::BF16 || e.dtype == DType::F16,
                 CheckpointError, "[", id_, ".dtype] ", path_, ": tensor '", name, "' is ", dtype_name(e.dtype),
                 "; model weights are read from F32, F64, BF16 or F16");
    return e;
  }
  /// Tensor `name` converted to T into out[0, numel), row-major in its own shape.
  template <class T>
  void read_into(const std::string& name, T* out) const {
    const TensorEntry& e = float_entry(name);
    convert_stored(readers_[where_.at(name)]->data(e), e.dtype, e.shape.numel(), out);
  }
  /// Tensor `name` as T.
  template <class T>
  std::vector<T> values(const std::string& name) const {
    std::vector<T> out(static_cast<std::size_t>(entry(name).shape.numel()));
    read_into(name, out.data());
    return out;
  }

 private:
  void add_file(const std::string& file, const std::string& shard) {
    try {
      readers_.push_back(std::make_unique<SafetensorsReader>(file));
    } catch (const CheckpointError& e) {
      PTRAIN_THROW(CheckpointError, "[", id_, ".file] ", file, " cannot be read: ", e.what());
    }
    for (const TensorEntry& e : readers_.back()->tensors()) {
      if (!shard.empty()) {
        auto it = index_->find(e.name);
        PTRAIN_CHECK(it != index_->end() && it->second == shard, CheckpointError, "[", id_, ".index] ", file,
                     " holds tensor '", e.name, "' that ", kHfIndex, it == index_->end() ? " does not name" :
                     " places in another file", "; the folder is inconsistent, save it again");
      }
      where_[e.name] = readers_.size() - 1;
    }
  }

  void read_index(const std::filesystem::path& index) {
    namespace fs = std::filesystem;
    PTRAIN_CHECK(fs::exists(index), CheckpointError, "[", id_, ".folder] ", path_, " holds neither ", kHfWeights,
                 " nor ", kHfIndex, "; give a Hugging Face model folder or a .safetensors file");
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(CheckpointError, "[", id_, ".index] ", index.string(), " is not valid JSON (", e.what(),
                   "); the folder is corrupt, download or save it again");
    }
    PTRAIN_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object() &&
                     !j["weight_map"].empty(),
                 CheckpointError, "[", id_, ".index] ", index.string(),
                 " has no \"weight_map\" object of tensor names to shard files; the folder is corrupt");
    index_ = std::make_unique<std::map<std::string, std::string>>();
    std::set<std::string> shards;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const auto& f = it.value();
      PTRAIN_CHECK(f.is_string() && !f.get<std::string>().empty() &&
                       f.get<std::string>().find('/') == std::string::npos && f.get<std::string>() != "." &&
                       f.get<std::string>() != "..",
                   CheckpointError, "[", id_, ".index] ", index.string(), ": tensor '", it.key(), "' maps to ",
                   f.dump(), ", not a file name in the folder; the index is corrupt");
      (*index_)[it.key()] = f.get<std::string>();
      shards.insert(f.get<std::string>());
    }
    for (const std::string& s : shards) {
      const fs::path file = index.parent_path() / s;
      PTRAIN_CHECK(fs::is_regular_file(file), CheckpointError, "[", id_, ".shard] ", index.string(), " names '", s,
                   "', which is not in ", index.parent_path().string(),
                   "; the download or save is incomplete, fetch the missing shard");
      add_file(file.string(), s);
    }
    for (const auto& [name, shard] : *index_)
      PTRAIN_CHECK(where_.count(name), CheckpointError, "[", id_, ".index] ", index.string(), " places tensor '",
                   name, "' in ", shard, ", which does not hold it; the folder is inconsistent, save it again");
  }

  std::string path_, id_;
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
  std::map<std::string, std::size_t> where_;                  // tensor -> reader
  std::unique_ptr<std::map<std::string, std::string>> index_;  // the index's weight_map, if read
};

/// The first `rows` rows of a model's parameter as the host F32 tensor a file
/// holds, transposed when the file stores it so ([out, in] -> [in, out]).
template <class T>
Tensor<float> hf_f32(const Tensor<T>& value, std::int64_t rows, bool transposed = false) {
  const Tensor<T> v = value.to(Device::cpu());
  const std::int64_t all = v.dim() == 2 ? v.shape()[0] : 1, cols = v.numel() / all;
  Shape shape = v.shape();
  if (v.dim() == 2) shape[0] = rows;
  if (transposed) std::swap(shape[0], shape[1]);
  auto out = Tensor<float>::empty(shape);
  for (std::int64_t i = 0; i < (v.dim() == 2 ? rows : 1); ++i)
    for (std::int64_t j = 0; j < cols; ++j)
      out.data()[transposed ? j * rows + i : i * cols + j] =
          static_cast<float>(static_cast<acc_t<T>>(v.data()[i * cols + j]));
  return out;
}

// Renames `tmp` to `path`: a file appears whole or not at all.
inline void rename_into_place(const std::filesystem::path& tmp, const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.write] renaming ", tmp.string(), " to ", path.string(),
               " failed: ", ec.message());
}

inline void write_text_whole(const std::filesystem::path& path, const std::string& text) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    WriteFd f(tmp.string());
    f.write_all(text.data(), text.size());
    f.sync_close();
  }
  rename_into_place(tmp, path);
}

/// Writes a Hugging Face folder (Note [Hugging Face folders]): config.json (the text
/// config_json) and the
/// tensors, in this order, as model.safetensors, or as shards of at most
/// max_shard_bytes of data each (a larger tensor alone) plus the index when
/// max_shard_bytes > 0 and the tensors are larger. Returns the number of files
/// that hold the tensors.
inline std::size_t write_hf_folder(const std::string& folder, const std::vector<std::pair<std::string, Tensor<float>>>& tensors,
                                   const std::string& config_json, std::int64_t max_shard_bytes) {
  namespace fs = std::filesystem;
  PTRAIN_CHECK(max_shard_bytes >= 0, CheckpointError, "[ptrain.ckpt.write] max_shard_bytes ", max_shard_bytes,
               " must be >= 0 (0: one file)");
  std::error_code ec;
  fs::create_directories(folder, ec);
  PTRAIN_CHECK(fs::is_directory(folder), CheckpointError, "[ptrain.ckpt.write] cannot create folder '", folder,
               "': ", ec.message());
  std::vector<std::vector<TensorRef>> shards(1);
  std::uint64_t total = 0, in_shard = 0;
  for (const auto& [name, value] : tensors) {
    TensorRef ref = tensor_ref(name, value);
    const auto n = static_cast<std::uint64_t>(ref.nbytes());
    if (max_shard_bytes > 0 && !shards.back().empty() && in_shard + n > static_cast<std::uint64_t>(max_shard_bytes)) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(std::move(ref));
    in_shard += n;
    total += n;
  }
  write_text_whole(fs::path(folder) / "config.json", config_json + "\n");
  const std::map<std::string, std::string> meta = {{"format", "pt"}};  // transformers refuses files without it
  std::set<std::string> keep;
  if (shards.size() == 1) {
    const fs::path file = fs::path(folder) / kHfWeights;
    write_safetensors(file.string() + ".tmp", shards[0], meta);
    rename_into_place(file.string() + ".tmp", file);
    keep.insert(kHfWeights);
  } else {
    nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::ordered_json::object()}};
    for (std::size_t s = 0; s < shards.size(); ++s) {
      const std::string name = hf_shard_name(s + 1, shards.size());
      const fs::path file = fs::path(folder) / name;
      write_safetensors(file.string() + ".tmp", shards[s], meta);
      rename_into_place(file.string() + ".tmp", file);
      for (const TensorRef& r : shards[s]) index["weight_map"][r.name] = name;
      keep.insert(name);
    }
    write_text_whole(fs::path(folder) / kHfIndex, index.dump(2) + "\n");
    keep.insert(kHfIndex);
  }
  // The other layout of an earlier save would shadow (model.safetensors) or confuse this one.
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string f = entry.path().filename().string();
    const bool weights = f == kHfWeights || f == kHfIndex ||
                         (f.rfind("model-", 0) == 0 && f.size() == hf_shard_name(1, 1).size() &&
                          f.find("-of-") == 11 && f.ends_with(".safetensors"));
    if (weights && !keep.count(f)) fs::remove(entry.path(), ec);
  }
  return shards.size();
}

}  // namespace ptrain::ckpt::detail
