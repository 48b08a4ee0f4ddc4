#pragma once
// Checkpoint: a verified, committed checkpoint opened for reading (marker,
// index, trainer.json and every file's size and CRC-32 checked first), with
// logical tensors read whole or by element range from whichever pieces hold
// them; and restore_trainer_state(), which puts a checkpoint's random streams,
// optimizer step count and learning rate back.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/ckpt/files.hpp"
#include "ptrain/ckpt/pieces.hpp"
#include "ptrain/core/safetensors.hpp"
#include "ptrain/ckpt/trainer_state.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/core/tensor.hpp"
#include "ptrain/optim/optimizer.hpp"

namespace ptrain::ckpt {

namespace fs = std::filesystem;

/// A verified, committed checkpoint opened for reading. Files are mapped on first use.
class Checkpoint {
 public:
  /// Opens `dir` after verify(): marker, index, trainer.json and every file's size and CRC-32.
  explicit Checkpoint(fs::path dir, bool verify_data = true) : dir_(std::move(dir)) { verify(verify_data); }

  const fs::path& path() const { return dir_; }
  std::int64_t step() const { return trainer_.step; }
  const TrainerState& trainer_state() const { return trainer_; }
  /// Tensor name -> file name, over all files.
  const std::map<std::string, std::string>& weight_map() const { return weight_map_; }
  bool contains(const std::string& name) const { return weight_map_.count(name) != 0; }

  /// The reader of file `file` (mapped once, validated).
  const SafetensorsReader& file(const std::string& file) const {
    auto it = readers_.find(file);
    if (it == readers_.end())
      it = readers_.emplace(file, std::make_shared<SafetensorsReader>((dir_ / file).string())).first;
    return *it->second;
  }
  /// Logical tensors (stored whole or in pieces), sorted; with a role ("model",
  /// "optimizer") only those in that role's files.
  std::vector<std::string> tensor_names(const std::string& role = "") const {
    std::vector<std::string> out;
    for (const auto& [name, lt] : logical_)
      if (role.empty() || detail::file_role(weight_map_.at(lt.pieces.front().key)) == role) out.push_back(name);
    return out;
  }
  /// Whole shape and dtype of logical tensor `name`.
  Shape shape_of(const std::string& name) const { return logical(name).shape; }
  DType dtype(const std::string& name) const {
    const auto& key = logical(name).pieces.front().key;
    return file(weight_map_.at(key)).entry(key).dtype;
  }

  /// Copies tensor `name` (whole, or assembled from its pieces) into dst,
  /// checking dtype and shape; errors name the file and tensor.
  template <class T>
  void read_into(const std::string& name, Tensor<T>& dst) const {
    check_matches(name, dst);
    read_range(name, 0, dst);
  }
  /// Checks, without copying, that read_into(name, dst) would succeed.
  template <class T>
  void check_matches(const std::string& name, const Tensor<T>& dst) const {
    check(name, dst.shape(), dtype_of<T>());
  }
  /// Throws CheckpointError unless tensor `name` is stored with this shape and dtype.
  void check(const std::string& name, const Shape& shape, DType dt) const {
    check_dtype(name, dt);
    PTRAIN_CHECK(shape_of(name) == shape, CheckpointError, "[ptrain.ckpt.shape] ", where(name), ": tensor '", name,
                 "' has shape ", shape_of(name), " but the model expects ", shape);
  }
  /// Copies elements [offset, offset + dst.numel()) of tensor `name` (row-major)
  /// into dst, from whichever pieces hold them: a rank of another world size
  /// reading its shard.
  template <class T>
  void read_range(const std::string& name, std::int64_t offset, Tensor<T>& dst) const {
    check_dtype(name, dtype_of<T>());
    copy_range(name, offset, dst.numel(), dst.data(), dst.device());
  }

  /// Writes every model tensor, whole, into one safetensors file at `path`
  /// (atomically) for inference or PyTorch (safetensors.torch.load_file).
  void export_model(const std::string& path) const {
    std::vector<std::vector<std::uint8_t>> bufs;
    std::vector<TensorRef> refs;
    const auto names = tensor_names("model");
    PTRAIN_CHECK(!names.empty(), CheckpointError, "[ptrain.ckpt.export] ", dir_.string(), " holds no model tensors");
    bufs.reserve(names.size());
    for (const auto& n : names) {
      const Shape shape = shape_of(n);
      const DType dt = dtype(n);
      bufs.emplace_back(static_cast<std::size_t>(shape.numel()) * dtype_size(dt));
      copy_range(n, 0, shape.numel(), bufs.back().data(), Device::cpu());
      refs.push_back({n, dt, shape, bufs.back().data()});
    }
    const std::string tmp = path + ".tmp";
    write_safetensors(tmp, refs, {{"format", "pt"}, {"ptrain.step", std::to_string(step())}});
    std::error_code ec;
    fs::rename(tmp, path, ec);
    PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] renaming ", tmp, " to ", path, " failed: ", ec.message());
  }

  /// The file holding stored tensor `key` (a whole tensor's name or "name@offset").
  const std::string& file_of(const std::string& key) const {
    auto it = weight_map_.find(key);
    PTRAIN_CHECK(it != weight_map_.end(), CheckpointError, "[ptrain.ckpt.missing] ", (dir_ / detail::kIndex).string(),
                 ": no tensor '", key, "' in this checkpoint; it was written by a different model or optimizer");
    return it->second;
  }
  /// Names of the tensors stored in file `file`.
  std::vector<std::string> names_in(const std::string& f) const {
    std::vector<std::string> out;
    for (const auto& [n, file] : weight_map_)
      if (file == f) out.push_back(n);
    return out;
  }

 private:
  void verify(bool verify_data) {
    const fs::path marker = dir_ / detail::kMarker;
    std::error_code ec;
    PTRAIN_CHECK(fs::is_directory(dir_, ec), CheckpointError, "[ptrain.ckpt.path] ", dir_.string(),
                 fs::exists(dir_, ec) ? " is not a directory" : " does not exist",
                 "; pass a checkpoint's step directory, e.g. CheckpointManager(dir).latest().path");
    PTRAIN_CHECK(detail::parse_step_dir(dir_.filename().string()) >= 0 || fs::exists(dir_ / detail::kIndex, ec) ||
                     fs::exists(marker, ec),
                 CheckpointError, "[ptrain.ckpt.path] ", dir_.string(),
                 " is not a checkpoint step directory (step-NNNNNNNN); for a checkpoint directory, load "
                 "CheckpointManager(dir).latest().path");
    PTRAIN_CHECK(fs::exists(marker), CheckpointError, "[ptrain.ckpt.incomplete] ", marker.string(),
                 " is missing: the save did not finish (crash or preemption during the write)");
    const nlohmann::json m = detail::parse_json(detail::read_text(marker), marker);
    for (const char* f : {detail::kIndex, detail::kTrainer}) {
      const std::string text = detail::read_text(dir_ / f);
      const auto want = m.contains(f) && m[f].is_number_unsigned() ? m[f].get<std::uint32_t>() : 0u;
      PTRAIN_CHECK(detail::crc_of(text) == want, CheckpointError, "[ptrain.ckpt.checksum] ", (dir_ / f).string(),
                   ": CRC-32 ", detail::crc_of(text), " does not match ", want, " recorded in ", marker.string(),
                   "; the checkpoint is corrupt");
      if (std::string(f) == detail::kIndex) index_ = detail::parse_json(text, dir_ / f);
      else trainer_ = trainer_state_from_json(detail::parse_json(text, dir_ / f), (dir_ / f).string());
    }
    const std::string idx = (dir_ / detail::kIndex).string();
    try {
      for (auto it = index_.at("weight_map").begin(); it != index_.at("weight_map").end(); ++it)
        weight_map_[it.key()] = it.value().get<std::string>();
      for (auto it = index_.at("files").begin(); it != index_.at("files").end(); ++it)
        digests_[it.key()] = {it.value().at("bytes").get<std::uint64_t>(), it.value().at("crc32").get<std::uint32_t>(), {}};
    } catch (const nlohmann::json::exception& e) {
      PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.index] ", idx, ": ", e.what(), "; the checkpoint is corrupt");
    }
    for (const auto& [name, f] : weight_map_)
      PTRAIN_CHECK(digests_.count(f), CheckpointError, "[ptrain.ckpt.index] ", idx, ": tensor '", name,
                   "' maps to unknown file ", f);
    for (const auto& [f, d] : digests_) {
      const fs::path p = dir_ / f;
      PTRAIN_CHECK(f.find('/') == std::string::npos && fs::exists(p), CheckpointError, "[ptrain.ckpt.missing] ",
                   p.string(), " (listed in ", idx, ") is missing: a shard was lost; the checkpoint cannot be used");
      const SafetensorsReader& r = file(f);
      PTRAIN_CHECK(r.file_size() == d.bytes, CheckpointError, "[ptrain.ckpt.size] ", p.string(), ": ",
                   r.file_size(), " bytes, index says ", d.bytes, "; the file is truncated or was replaced");
      if (verify_data) {
        const std::uint32_t crc = detail::crc32_update(0, r.file_bytes(), r.file_size());
        if (crc != d.crc32)
          PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.checksum] ", p.string(), ": CRC-32 ", crc, " does not match ",
                       d.crc32, " in ", idx, "; ", corrupt_part(r), " is corrupt; the checkpoint cannot be used");
      }
      std::size_t listed = 0;
      for (const auto& e : r.tensors()) {
        auto it = weight_map_.find(e.name);
        PTRAIN_CHECK(it != weight_map_.end() && it->second == f, CheckpointError, "[ptrain.ckpt.index] ", p.string(),
                     ": tensor '", e.name, "' is not mapped to this file in ", idx);
        ++listed;
      }
      PTRAIN_CHECK(listed == names_in(f).size(), CheckpointError, "[ptrain.ckpt.index] ", idx, " lists ",
                   names_in(f).size(), " tensors in ", f, " but the file holds ", listed);
    }
    // Logical tensors: pieces (Note [Sharded checkpoints]) and whole tensors.
    std::map<std::string, std::string> whole;
    for (const auto& [key, f] : weight_map_)
      if (!index_.contains("pieces") || !index_["pieces"].contains(key)) whole.emplace(key, f);
    logical_ = detail::group_pieces(index_.value("pieces", nlohmann::json::object()), whole, idx);
    for (const auto& [name, lt] : logical_)
      for (const auto& p : lt.pieces) {
        PTRAIN_CHECK(weight_map_.count(p.key), CheckpointError, "[ptrain.ckpt.index] ", idx, ": piece '", p.key,
                     "' is in no file");
        const TensorEntry& e = file(weight_map_.at(p.key)).entry(p.key);
        PTRAIN_CHECK(e.shape.numel() == p.numel && e.dtype == file(weight_map_.at(lt.pieces.front().key))
                     .entry(lt.pieces.front().key).dtype, CheckpointError, "[ptrain.ckpt.index] ", idx, ": piece '",
                     p.key, "' does not match its file's header");
      }
    for (const auto& [key, f] : whole) {
      const Shape shape = file(f).entry(key).shape;
      logical_.emplace(key, detail::LogicalTensor{shape, {{0, shape.numel(), key}}});
    }
  }

  const detail::LogicalTensor& logical(const std::string& name) const {
    auto it = logical_.find(name);
    PTRAIN_CHECK(it != logical_.end(), CheckpointError, "[ptrain.ckpt.missing] ", (dir_ / detail::kIndex).string(),
                 ": no tensor '", name, "' in this checkpoint; it was written by a different model or optimizer");
    return it->second;
  }
  void check_dtype(const std::string& name, DType dt) const {
    PTRAIN_CHECK(dtype(name) == dt, CheckpointError, "[ptrain.ckpt.dtype] ", where(name), ": tensor '", name,
                 "' is ", dtype_name(dtype(name)), " but the model expects ", dtype_name(dt));
  }
  // The file holding (the first piece of) `name`, for error messages.
  std::string where(const std::string& name) const {
    return (dir_ / weight_map_.at(logical(name).pieces.front().key)).string();
  }

  // Elements [offset, offset + n) of `name` into dst, piece by piece.
  void copy_range(const std::string& name, std::int64_t offset, std::int64_t n, void* dst, Device dev) const {
    const auto& lt = logical(name);
    PTRAIN_CHECK(offset >= 0 && n >= 0 && offset + n <= lt.shape.numel(), CheckpointError, "[ptrain.ckpt.range] "
                 "elements [", offset, ", ", offset + n, ") of '", name, "' are outside its ", lt.shape.numel());
    const std::size_t es = dtype_size(dtype(name));
    for (const auto& p : lt.pieces) {
      const std::int64_t a = std::max(offset, p.offset), b = std::min(offset + n, p.offset + p.numel);
      if (a >= b) continue;
      const SafetensorsReader& r = file(weight_map_.at(p.key));
      const TensorEntry& e = r.entry(p.key);
      ptrain::detail::copy_bytes(static_cast<std::uint8_t*>(dst) + static_cast<std::size_t>(a - offset) * es, dev,
                                 r.data(e) + static_cast<std::size_t>(a - p.offset) * es, Device::cpu(),
                                 static_cast<std::size_t>(b - a) * es);
    }
  }

  // Which part of a file whose CRC failed: the first tensor whose own CRC-32
  // differs from the index, else the header.
  std::string corrupt_part(const SafetensorsReader& r) const {
    const auto& crcs = index_.value("tensor_crc32", nlohmann::json::object());
    for (const auto& e : r.tensors()) {
      const std::uint32_t want = crcs.contains(e.name) ? crcs[e.name].get<std::uint32_t>() : 0u;
      if (detail::crc32_update(0, r.data(e), e.nbytes()) != want) return "tensor '" + e.name + "'";
    }
    return "the header";
  }

  fs::path dir_;
  nlohmann::json index_;
  TrainerState trainer_;
  std::map<std::string, std::string> weight_map_;
  std::map<std::string, FileDigest> digests_;
  std::map<std::string, detail::LogicalTensor> logical_;
  mutable std::map<std::string, std::shared_ptr<SafetensorsReader>> readers_;
};

/// c's trainer state, after restoring default_generator() from rng["default"]
/// and (when given) the optimizer's step count and learning rate.
template <class T>
TrainerState restore_trainer_state(const Checkpoint& c, optim::Optimizer<T>* opt) {
  TrainerState s = c.trainer_state();
  if (auto g = s.rng.find("default"); g != s.rng.end()) default_generator() = g->second.generator();
  if (opt) {
    opt->set_steps(s.optimizer_steps);
    opt->set_lr(s.lr);
  }
  return s;
}

}  // namespace ptrain::ckpt
