#pragma once
// Checkpoint manager: atomic, verified, rotating checkpoints of a training run.
//
//   ckpt::CheckpointManager mgr("ckpt", comm.get(), {.keep_last = 3});
//   if (auto last = mgr.latest(); last.found()) {
//     auto state = mgr.load(last.path, params, &opt);          // model + AdamW state
//     ckpt::restore_sampler(sampler, *state.sampler, comm->size());
//   }
//   ...
//   ckpt::TrainerState ts{.step = step};
//   ts.sampler = ckpt::sampler_state(sampler, comm->size());
//   mgr.save(step, params, &opt, ts);                          // every rank calls it
//
// Note [Checkpoint layout]
//   DIR/step-00001234/
//     model.safetensors       parameters, named as the module names them ("0.weight")
//     optimizer.safetensors   optimizer state ("0.weight.exp_avg", ...)
//     model-00001-of-00004.safetensors       save_sharded: each rank's model part
//     optimizer-00001-of-00004.safetensors   and optimizer part (FSDP, pipeline stages)
//     index.json              tensor -> file, per file its size and CRC-32, pieces
//     trainer.json            step, sampler, RNG, LR schedule, user metadata
//     COMMITTED               written last; holds the CRC-32 of index.json and trainer.json
// Data-parallel ranks hold identical parameters and optimizer state, so save()
// lets rank 0 write them (as PyTorch users do with `if rank == 0: torch.save`);
// save_sharded() has every rank write its own files.
//
// Note [Sharded checkpoints]
// A rank saves pieces of logical tensors: elements [offset, offset + n) of a
// tensor in row-major order (an FSDP shard cuts parameters anywhere). A piece
// that is the whole tensor is stored under the tensor's name with its shape
// (a pipeline stage's files read like any safetensors file); a partial one
// under "name@offset", 1-D, and index.json's "pieces" records its tensor, whole
// shape, offset and length. The commit checks that each tensor's pieces tile
// it exactly. Readers see logical tensors only: read_into() assembles a whole
// tensor and read_range() any range of one, so a checkpoint saved on N ranks
// loads on M ranks with any other sharding, or in one process, and
// export_model() writes one unsharded file.
//
// Note [Commit protocol]
// 1. prepare (collective): rank 0 removes an uncommitted directory of this
//    step and creates it (a committed one is renamed .replaced-step-N until
//    the new one commits, and moved back by the next prepare if it never does);
//    one all-reduce makes every rank agree that this worked and that no earlier
//    asynchronous save failed.
// 2. write: each writing rank writes its files (fsync) and a manifest
//    rank-RRRRR.json with their sizes, CRC-32 and tensor names (temporary
//    name, fsync, rename).
// 3. commit (rank 0): waits for the manifests of all writers, writes
//    index.json and trainer.json (temporary name, fsync, rename), fsyncs the
//    directory, then writes COMMITTED the same way and fsyncs the directory
//    and its parent. Only then is the checkpoint visible to latest().
// 4. rotate (rank 0): deletes checkpoints without a marker, committed ones
//    beyond the newest keep_last, and any with a larger step (an abandoned
//    timeline: the run resumed from an older checkpoint).
// A synchronous save() adds an all-reduce after step 2 and a broadcast after
// step 3, so every rank returns (or throws) together once the marker is on disk.
//
// Note [Checksums]
// CRC-32 (zlib's polynomial; Python's zlib.crc32 gives the same value) over
// each whole file and over each tensor's bytes, computed while writing.
// latest() and load() recompute the files' before trusting any value; the
// tensors' name the damaged tensor in the error. CRC-32 detects all burst errors
// up to 32 bits and other corruption with probability 1 - 2^-32; it is not a
// defence against deliberate tampering.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "ptrain/ckpt/safetensors.hpp"
#include "ptrain/core/random.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/nn/flat_parameters.hpp"
#include "ptrain/optim/optimizer.hpp"
#include "ptrain/optim/schedule.hpp"

namespace ptrain::ckpt {

namespace fs = std::filesystem;

/// Position of a random stream (see core/random.hpp: (seed, offset) resumes it exactly).
struct GeneratorState {
  std::uint64_t seed = 0;
  std::uint64_t offset = 0;
  static GeneratorState of(const Generator& g) { return {g.seed(), g.offset()}; }
  Generator generator() const { return Generator(seed, offset); }
};

/// Where the data-parallel sampler stood, independent of the world size.
///
/// Note [Sampler reshape]
/// DistributedSampler gives rank r positions r, r + W, r + 2W, ... of one
/// epoch order that does not depend on W. When all W ranks have consumed p
/// samples (they step together under DDP), exactly positions [0, p*W) of that
/// order are done. `consumed` = p*W is saved; on M ranks each rank restarts at
/// p' = consumed / M, so the new ranks continue with positions [consumed, ...)
/// and no sample is skipped or repeated. This needs consumed % M == 0;
/// otherwise restore_sampler throws, unless allow_repeat, in which case it
/// rounds down and at most M - 1 samples are seen twice (none skipped).
/// A position past the data (padding) means the epoch is over.
struct SamplerState {
  std::uint64_t epoch = 0;
  std::int64_t consumed = 0;  ///< global samples consumed in `epoch` (all ranks)
  int world_size = 1;         ///< ranks at save time (for messages)
};

/// The sampler's state, assuming every rank is at the same position (DDP).
template <class Sampler>
SamplerState sampler_state(const Sampler& s, int world_size) {
  return {s.epoch(), s.position() * world_size, world_size};
}

/// Position on one of `world_size` ranks that continues `st` (Note [Sampler reshape]);
/// per_rank_samples is the sampler's num_samples() at the new world size.
inline std::int64_t resume_position(const SamplerState& st, int world_size, std::int64_t per_rank_samples,
                                    bool allow_repeat = false) {
  PTRAIN_CHECK(world_size > 0 && st.consumed >= 0, CheckpointError, "[ptrain.ckpt.reshape] invalid sampler state");
  PTRAIN_CHECK(allow_repeat || st.consumed % world_size == 0, CheckpointError, "[ptrain.ckpt.reshape] the checkpoint "
               "was taken after ", st.consumed, " samples of epoch ", st.epoch, " on ", st.world_size,
               " ranks, which ", world_size, " ranks cannot continue exactly (", st.consumed, " % ", world_size,
               " != 0); resume on a world size that divides ", st.consumed,
               ", or pass allow_repeat to repeat up to ", world_size - 1, " samples");
  return std::min(st.consumed / world_size, per_rank_samples);
}

/// Restarts `s` (a DistributedSampler of the new world) where `st` stopped.
template <class Sampler>
void restore_sampler(Sampler& s, const SamplerState& st, int world_size, bool allow_repeat = false) {
  s.set_epoch(st.epoch);  // computes this world's num_samples() for the epoch
  s.set_epoch(st.epoch, resume_position(st, world_size, s.num_samples(), allow_repeat));
}

/// Everything besides tensors that a resumed run needs: written to trainer.json.
struct TrainerState {
  std::int64_t step = 0;       ///< optimizer steps completed
  int world_size = 1;          ///< filled in by save()
  std::optional<SamplerState> sampler;
  std::map<std::string, GeneratorState> rng;  ///< named generators ("default", "dropout", ...)
  std::int64_t optimizer_steps = 0;           ///< filled in by save() when an optimizer is given
  double lr = 0.0;                            ///< likewise
  std::optional<optim::WarmupCosine> schedule;
  nlohmann::json user = nlohmann::json::object();  ///< free-form metadata (config, metrics)
};

inline nlohmann::json to_json(const TrainerState& s) {
  nlohmann::json j = {{"format", "ptrain.trainer/1"}, {"step", s.step}, {"world_size", s.world_size},
                      {"optimizer", {{"steps", s.optimizer_steps}, {"lr", s.lr}}}, {"user", s.user}};
  if (s.sampler)
    j["sampler"] = {{"epoch", s.sampler->epoch}, {"consumed", s.sampler->consumed},
                    {"world_size", s.sampler->world_size}};
  j["rng"] = nlohmann::json::object();
  for (const auto& [k, g] : s.rng) j["rng"][k] = {{"seed", g.seed}, {"offset", g.offset}};
  if (s.schedule)
    j["schedule"] = {{"type", "warmup_cosine"}, {"base_lr", s.schedule->base_lr}, {"warmup", s.schedule->warmup},
                     {"total", s.schedule->total}, {"min_lr", s.schedule->min_lr}};
  return j;
}

/// Parses trainer.json; `what` names the file in errors.
inline TrainerState trainer_state_from_json(const nlohmann::json& j, const std::string& what) {
  try {
    PTRAIN_CHECK(j.value("format", "") == "ptrain.trainer/1", CheckpointError, "[ptrain.ckpt.trainer] ", what,
                 ": unknown format '", j.value("format", ""), "'; expected ptrain.trainer/1");
    TrainerState s;
    s.step = j.at("step").get<std::int64_t>();
    s.world_size = j.at("world_size").get<int>();
    s.optimizer_steps = j.at("optimizer").at("steps").get<std::int64_t>();
    s.lr = j.at("optimizer").at("lr").get<double>();
    s.user = j.at("user");
    if (j.contains("sampler")) {
      const auto& sj = j["sampler"];
      s.sampler = SamplerState{sj.at("epoch").get<std::uint64_t>(), sj.at("consumed").get<std::int64_t>(),
                               sj.at("world_size").get<int>()};
    }
    for (auto it = j.at("rng").begin(); it != j.at("rng").end(); ++it)
      s.rng[it.key()] = {it.value().at("seed").get<std::uint64_t>(), it.value().at("offset").get<std::uint64_t>()};
    if (j.contains("schedule")) {
      const auto& c = j["schedule"];
      s.schedule = optim::WarmupCosine{c.at("base_lr").get<double>(), c.at("warmup").get<std::int64_t>(),
                                       c.at("total").get<std::int64_t>(), c.at("min_lr").get<double>()};
    }
    return s;
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.trainer] ", what, ": ", e.what(),
                 "; the file is corrupt or from another program");
  }
}

/// Options of CheckpointManager.
struct CheckpointOptions {
  /// Committed checkpoints kept (older ones are deleted after each commit); 0 keeps all.
  int keep_last = 3;
  /// How long rank 0 waits for the other ranks' files before failing the commit.
  std::chrono::milliseconds commit_timeout{600'000};
};

/// A checkpoint directory that latest() passed over, and why.
struct SkippedCheckpoint {
  fs::path path;
  std::string reason;
};

/// Result of latest(): the newest verified checkpoint (if any) and the newer ones skipped.
struct LatestCheckpoint {
  fs::path path;  ///< empty when none was found
  std::int64_t step = -1;
  std::vector<SkippedCheckpoint> skipped;
  bool found() const { return !path.empty(); }
};

/// Part of a logical tensor that one rank saves (Note [Sharded checkpoints]):
/// elements [offset, offset + numel) of tensor `name`, whose whole shape is `shape`.
struct TensorPiece {
  std::string name;
  Shape shape;              ///< of the whole tensor
  std::int64_t offset = 0;  ///< first element of the piece, row-major
  TensorRef data;           ///< the piece's elements (contiguous)
  Device device = Device::cpu();
  bool whole() const { return offset == 0 && data.shape.numel() == shape.numel(); }
  /// Name in the shard file: `name` for a whole tensor, "name@offset" for a part.
  std::string key() const { return whole() ? name : name + "@" + std::to_string(offset); }
};

/// The piece of tensor `name` (whole shape `whole_shape`) that starts at element
/// `offset` and holds part's elements; part may live on any device.
template <class T>
TensorPiece piece(std::string name, Shape whole_shape, std::int64_t offset, const Tensor<T>& part) {
  PTRAIN_CHECK(name.find('@') == std::string::npos && !name.empty(), CheckpointError, "[ptrain.ckpt.name] tensor "
               "name '", name, "' is empty or contains '@' (reserved for pieces)");
  PTRAIN_CHECK(offset >= 0 && offset + part.numel() <= whole_shape.numel(), CheckpointError, "[ptrain.ckpt.piece] "
               "piece [", offset, ", ", offset + part.numel(), ") of '", name, "' lies outside its ", whole_shape.numel(),
               " elements");
  const bool all = offset == 0 && part.numel() == whole_shape.numel();
  TensorPiece p{std::move(name), whole_shape, offset, {}, part.device()};
  p.data = {"", dtype_of<T>(), all ? whole_shape : Shape{part.numel()}, part.data()};
  return p;
}
/// All of tensor t, saved under `name`.
template <class T>
TensorPiece whole(std::string name, const Tensor<T>& t) {
  return piece(std::move(name), t.shape(), 0, t);
}

/// What one rank writes with save_sharded(): model tensors go to
/// model-RRRRR-of-WWWWW.safetensors, optimizer state to optimizer-RRRRR-of-WWWWW.safetensors.
struct ShardedState {
  std::vector<TensorPiece> model, optimizer;
  std::int64_t optimizer_steps = -1;  ///< with lr: saved in trainer.json when >= 0
  double lr = 0.0;
  /// Records opt's step count and learning rate.
  template <class T>
  void record(const optim::Optimizer<T>& opt) {
    optimizer_steps = opt.steps();
    lr = opt.lr();
  }
};

/// Every tensor of `params` and of opt's state, whole: what a rank that holds
/// its own distinct tensors (a pipeline stage) passes to save_sharded().
template <class T>
ShardedState whole_tensors(nn::FlatParameters<T>& params, std::type_identity_t<optim::Optimizer<T>>* opt) {
  ShardedState s;
  for (const auto& e : params.entries()) s.model.push_back(whole(e.name, e.param->value));
  if (opt) {
    for (const auto& [n, t] : opt->state_tensors()) s.optimizer.push_back(whole(n, t));
    s.record(*opt);
  }
  return s;
}

/// Options of CheckpointManager::load().
struct LoadOptions {
  /// Read only the given parameters' tensors and ignore others in the checkpoint
  /// (a pipeline stage loading its part); missing ones are still an error.
  bool partial = false;
};

namespace detail {

inline constexpr const char* kMarker = "COMMITTED";
// A committed checkpoint whose step is being saved again waits under this prefix
// until the new one is committed (Note [Commit protocol], step 1).
inline constexpr const char* kReplaced = ".replaced-";
inline constexpr const char* kIndex = "index.json";
inline constexpr const char* kTrainer = "trainer.json";

inline std::string step_dir_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}
/// Step of "step-00001234", or -1 for any other name.
inline std::int64_t parse_step_dir(const std::string& name) {
  if (name.size() < 6 || name.rfind("step-", 0) != 0) return -1;
  std::int64_t v = 0;
  for (std::size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}
inline std::string rank_name(const char* prefix, int rank, const char* suffix) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s%05d%s", prefix, rank, suffix);
  return buf;
}
/// "model-00001-of-00004.safetensors": rank 1's file of role "model" (named like Hugging Face's shards).
inline std::string shard_file(const char* role, int rank, int world) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%s-%05d-of-%05d.safetensors", role, rank, world);
  return buf;
}
/// Role of a checkpoint file: "model" for model.safetensors and model-00001-of-00004.safetensors.
inline std::string file_role(const std::string& file) { return file.substr(0, file.find_first_of(".-")); }

/// Where the elements of one logical tensor are stored.
struct PieceRef {
  std::int64_t offset, numel;
  std::string key;  // tensor name in the file
};
struct LogicalTensor {
  Shape shape;
  std::vector<PieceRef> pieces;  // sorted by offset, tiling [0, shape.numel())
};

/// Groups the "pieces" of an index ({key: {tensor, shape, offset, numel}}) by
/// tensor and checks that each tensor's pieces tile it exactly, with one shape
/// and no tensor also stored whole; `what` names the index in errors.
inline std::map<std::string, LogicalTensor> group_pieces(const nlohmann::json& pieces,
                                                         const std::map<std::string, std::string>& weight_map,
                                                         const std::string& what) {
  std::map<std::string, LogicalTensor> out;
  try {
    for (auto it = pieces.begin(); it != pieces.end(); ++it) {
      const auto& v = it.value();
      const std::string name = v.at("tensor").get<std::string>();
      const Shape shape(v.at("shape").get<std::vector<std::int64_t>>());
      PTRAIN_CHECK(!weight_map.count(name), CheckpointError, "[ptrain.ckpt.index] ", what, ": tensor '", name,
                   "' is stored whole and in pieces");
      auto [lt, fresh] = out.try_emplace(name, LogicalTensor{shape, {}});
      PTRAIN_CHECK(lt->second.shape == shape, CheckpointError, "[ptrain.ckpt.index] ", what, ": pieces of '", name,
                   "' disagree on its shape (", lt->second.shape, " and ", shape, ")");
      lt->second.pieces.push_back({v.at("offset").get<std::int64_t>(), v.at("numel").get<std::int64_t>(), it.key()});
    }
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.index] ", what, ": bad piece entry: ", e.what());
  } catch (const ShapeError& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.index] ", what, ": bad piece shape: ", e.what());
  }
  for (auto& [name, lt] : out) {
    std::sort(lt.pieces.begin(), lt.pieces.end(), [](const PieceRef& a, const PieceRef& b) { return a.offset < b.offset; });
    std::int64_t next = 0;
    for (const auto& p : lt.pieces) {
      PTRAIN_CHECK(p.offset == next && p.numel > 0, CheckpointError, "[ptrain.ckpt.pieces] ", what, ": the pieces of '",
                   name, "' ", p.offset < next ? "overlap" : "leave a gap", " at element ", std::min(p.offset, next),
                   "; every element must be saved by exactly one rank (with replicas, let one of them write)");
      next += p.numel;
    }
    PTRAIN_CHECK(next == lt.shape.numel(), CheckpointError, "[ptrain.ckpt.pieces] ", what, ": the pieces of '", name,
                 "' cover ", next, " of its ", lt.shape.numel(), " elements; a rank's part is missing");
  }
  return out;
}

inline void fsync_dir(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  PTRAIN_CHECK(fd >= 0, CheckpointError, "[ptrain.ckpt.io] cannot open directory ", dir.string(), ": ",
               std::strerror(errno));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  PTRAIN_CHECK(r == 0, CheckpointError, "[ptrain.ckpt.io] fsync of directory ", dir.string(), " failed: ",
               std::strerror(err));
}

/// Writes `text` under a temporary name, fsyncs it (unless !sync) and renames it to `path`
/// (the directory is fsynced by the caller once all renames are done).
inline void write_file_atomic(const fs::path& path, const std::string& text, bool sync = true) {
  const fs::path tmp = path.string() + ".tmp";
  {
    WriteFd f(tmp.string());
    f.write_all(text.data(), text.size());
    if (sync) f.sync_close();
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] renaming ", tmp.string(), " to ", path.string(),
               " failed: ", ec.message());
}

inline std::string read_text(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  PTRAIN_CHECK(f.good(), CheckpointError, "[ptrain.ckpt.missing] ", path.string(), " is missing or unreadable");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline nlohmann::json parse_json(const std::string& text, const fs::path& path) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.json] ", path.string(), " is not valid JSON (", e.what(),
                 "); the checkpoint is corrupt");
  }
}

inline std::uint32_t crc_of(const std::string& s) { return crc32_update(0, s.data(), s.size()); }

/// Local result of writing one rank's files.
struct FileRecord {
  std::string file;
  FileDigest digest;
  std::vector<std::string> tensors;
};

/// What one rank saves at one step: files of host tensors, and (rank 0) trainer.json.
struct SaveJob {
  std::int64_t step = 0;
  struct File {
    std::string name;
    std::vector<TensorRef> tensors;
    nlohmann::json pieces = nlohmann::json::object();  // key -> {tensor, shape, offset, numel} of partial pieces
  };
  std::vector<File> files;     // this rank's files
  std::vector<int> writers;    // ranks whose manifests rank 0 waits for
  std::string trainer_json;    // used by rank 0
  std::vector<std::shared_ptr<void>> keep_alive;  // host copies for asynchronous saves
};

}  // namespace detail

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

class AsyncCheckpointer;

/// Saves, finds and loads checkpoints under one directory (Note [Checkpoint layout]).
/// `comm` may be null for a single process; with one, save() is collective.
class CheckpointManager {
 public:
  explicit CheckpointManager(fs::path dir, dist::Communicator* comm = nullptr, CheckpointOptions opt = {})
      : dir_(std::move(dir)), comm_(comm), opt_(opt) {
    std::error_code ec;
    PTRAIN_CHECK(!fs::exists(dir_, ec) || fs::is_directory(dir_, ec), CheckpointError, "[ptrain.ckpt.path] ",
                 dir_.string(), " is not a directory; choose another checkpoint directory");
  }
  ~CheckpointManager() { join_cleaner(); }
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const fs::path& dir() const { return dir_; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  int world_size() const { return comm_ ? comm_->size() : 1; }
  dist::Communicator* communicator() const { return comm_; }
  const CheckpointOptions& options() const { return opt_; }
  /// DIR/step-00001234.
  fs::path step_path(std::int64_t step) const { return dir_ / detail::step_dir_name(step); }

  /// Data-parallel save (collective): rank 0 writes parameters, optimizer state
  /// (when `opt` is given) and `state`; returns when the checkpoint is committed.
  /// Fills in state.step, world_size, optimizer steps and lr, and rng["default"]
  /// (rank 0's default_generator()) unless given.
  template <class T>
  void save(std::int64_t step, nn::FlatParameters<T>& params, std::type_identity_t<optim::Optimizer<T>>* opt,
            TrainerState state) {
    auto job = replicated_job(step, params, opt, std::move(state), false);
    run_sync(job);
  }

  /// Sharded save (collective; Note [Sharded checkpoints]): every rank writes
  /// its own part, possibly empty; over all ranks the pieces must cover each
  /// tensor exactly once. Fills in state.step, world_size and rng["default"].
  void save_sharded(std::int64_t step, const ShardedState& mine, TrainerState state) {
    auto job = sharded_job(step, mine, std::move(state), false);
    run_sync(job);
  }

  /// The newest checkpoint whose marker, index and checksums verify; newer
  /// ones that fail are listed in `skipped` with the reason. Local (no collective).
  LatestCheckpoint latest(bool verify_data = true) const {
    LatestCheckpoint out;
    for (const auto& [step, path] : list_steps()) {
      try {
        Checkpoint c(path, verify_data);
        out.path = path;
        out.step = step;
        return out;
      } catch (const std::exception& e) {  // CheckpointError, or a file system error
        out.skipped.push_back({path, e.what()});
      }
    }
    return out;
  }

  /// Opens a committed checkpoint (verifies it first).
  Checkpoint open(const fs::path& path) const { return Checkpoint(path); }

  /// Loads parameters (and optimizer state, steps and lr when `opt` is given)
  /// from a checkpoint written by save() or save_sharded() at any world size,
  /// restores default_generator() from rng["default"], and returns the trainer
  /// state. Every model tensor must be present with the same dtype and shape,
  /// and (unless lo.partial) the checkpoint may hold no other model tensors (as
  /// PyTorch's strict load_state_dict).
  template <class T>
  TrainerState load(const fs::path& path, nn::FlatParameters<T>& params,
                    std::type_identity_t<optim::Optimizer<T>>* opt = nullptr, LoadOptions lo = {}) const {
    Checkpoint c(path);
    // Check every tensor first, so a mismatch leaves the model untouched. The
    // optimizer's state is acc_t<T> (float for a bf16 model), so a list of its own.
    std::vector<std::pair<std::string, Tensor<T>>> targets;
    std::vector<std::pair<std::string, Tensor<acc_t<T>>>> state;
    std::map<std::string, int> known;
    for (const auto& e : params.entries()) {
      targets.emplace_back(e.name, e.param->value);
      known[e.name] = 1;
    }
    if (!lo.partial)
      for (const auto& n : c.tensor_names("model"))
        PTRAIN_CHECK(known.count(n), CheckpointError, "[ptrain.ckpt.unexpected] ", path.string(), ": tensor '", n,
                     "' is not a parameter of the model; the checkpoint is from a different model");
    if (opt) state = opt->state_tensors();
    for (const auto& [name, t] : targets) c.check_matches(name, t);
    for (const auto& [name, t] : state) c.check_matches(name, t);
    for (auto& [name, t] : targets) c.read_into(name, t);
    for (auto& [name, t] : state) c.read_into(name, t);
    return restore_trainer_state(c, opt);
  }

 private:
  friend class AsyncCheckpointer;

  static std::int64_t checked_step(std::int64_t step) {
    PTRAIN_CHECK(step >= 0, CheckpointError, "[ptrain.ckpt.step] step ", step,
                 " is negative; checkpoints are saved at steps 0, 1, 2, ...");
    return step;
  }

  // Step directories, newest first; a set-aside copy (.replaced-step-N) right
  // after step-N, which it stands in for when that rewrite never committed.
  std::vector<std::pair<std::int64_t, fs::path>> list_steps() const {
    std::vector<std::pair<std::int64_t, fs::path>> v;
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) return v;
    for (const auto& d : fs::directory_iterator(dir_, ec)) {
      std::string name = d.path().filename().string();
      if (name.rfind(detail::kReplaced, 0) == 0) name.erase(0, std::strlen(detail::kReplaced));
      const std::int64_t s = detail::parse_step_dir(name);
      if (s >= 0 && d.is_directory()) v.emplace_back(s, d.path());
    }
    std::sort(v.begin(), v.end(), [](auto& a, auto& b) {
      return a.first != b.first ? a.first > b.first : a.second.filename() > b.second.filename();  // 's' > '.'
    });
    return v;
  }
  static bool set_aside(const fs::path& p) { return p.filename().string().rfind(detail::kReplaced, 0) == 0; }

  // Tensors for save(): views of the parameters and optimizer state. With
  // `copy` (asynchronous saves, or tensors on a GPU) they are first copied into
  // one host buffer per file, so training may change the originals meanwhile.
  template <class T>
  detail::SaveJob replicated_job(std::int64_t step, nn::FlatParameters<T>& params, optim::Optimizer<T>* opt,
                                 TrainerState state, bool copy, std::vector<std::uint8_t>* reuse = nullptr) {
    detail::SaveJob job;
    job.step = checked_step(step);
    job.writers = {0};
    state.step = step;
    state.world_size = world_size();
    if (!state.rng.count("default")) state.rng["default"] = GeneratorState::of(default_generator());
    if (opt) {
      state.optimizer_steps = opt->steps();
      state.lr = opt->lr();
    }
    job.trainer_json = to_json(state).dump(2);
    if (rank() != 0) return job;
    std::vector<std::pair<std::string, Tensor<T>>> model;
    for (const auto& e : params.entries()) model.emplace_back(e.name, e.param->value);
    add_file(job, "model.safetensors", model, copy || !params.values().device().is_cpu(), reuse);
    if (opt) add_file(job, "optimizer.safetensors", opt->state_tensors(), copy || !params.values().device().is_cpu(),
                      reuse ? reuse + 1 : nullptr);
    return job;
  }

  detail::SaveJob sharded_job(std::int64_t step, const ShardedState& mine, TrainerState state, bool copy,
                              std::vector<std::uint8_t>* reuse = nullptr) {
    detail::SaveJob job;
    job.step = checked_step(step);
    for (int r = 0; r < world_size(); ++r) job.writers.push_back(r);
    state.step = step;
    state.world_size = world_size();
    if (!state.rng.count("default")) state.rng["default"] = GeneratorState::of(default_generator());
    if (mine.optimizer_steps >= 0) {
      state.optimizer_steps = mine.optimizer_steps;
      state.lr = mine.lr;
    }
    job.trainer_json = to_json(state).dump(2);
    int k = 0;
    for (const auto& [role, pieces] : {std::pair{"model", &mine.model}, std::pair{"optimizer", &mine.optimizer}}) {
      if (pieces->empty()) continue;
      detail::SaveJob::File f{detail::shard_file(role, rank(), world_size()), {}};
      std::vector<Device> devices;
      for (const auto& p : *pieces) {
        TensorRef t = p.data;
        t.name = p.key();
        f.tensors.push_back(t);
        devices.push_back(p.device);
        if (!p.whole())
          f.pieces[t.name] = {{"tensor", p.name}, {"shape", p.shape.vec()}, {"offset", p.offset},
                              {"numel", t.shape.numel()}};
      }
      const bool on_device = std::any_of(devices.begin(), devices.end(), [](Device d) { return !d.is_cpu(); });
      if (copy || on_device) copy_to_host(job, f, reuse ? reuse + k : nullptr, &devices);
      job.files.push_back(std::move(f));
      ++k;
    }
    return job;
  }

  template <class T>
  void add_file(detail::SaveJob& job, const std::string& name, const std::vector<std::pair<std::string, Tensor<T>>>& ts,
                bool copy, std::vector<std::uint8_t>* reuse) {
    detail::SaveJob::File f{name, {}};
    std::vector<Device> devices;
    for (const auto& [n, t] : ts) {
      f.tensors.push_back({n, dtype_of<T>(), t.shape(), t.data()});
      devices.push_back(t.device());
    }
    if (copy) copy_to_host(job, f, reuse, &devices);
    job.files.push_back(std::move(f));
  }

  // Packs the file's tensors into one host buffer (reused across saves when
  // given, so a steady-state asynchronous save costs one memcpy, no page faults).
  static void copy_to_host(detail::SaveJob& job, detail::SaveJob::File& f, std::vector<std::uint8_t>* reuse,
                           const std::vector<Device>* devices = nullptr) {
    std::size_t total = 0;
    for (const auto& t : f.tensors) total += t.nbytes();
    std::shared_ptr<std::vector<std::uint8_t>> owned;
    std::vector<std::uint8_t>* buf = reuse;
    if (!buf) {
      owned = std::make_shared<std::vector<std::uint8_t>>();
      buf = owned.get();
      job.keep_alive.push_back(owned);
    }
    if (buf->size() != total) buf->resize(total);
    // Host-to-host copies of large files are split over two threads: the
    // copy is the whole stall of an asynchronous save.
    struct Piece {
      std::uint8_t* dst;
      const std::uint8_t* src;
      std::size_t n;
    };
    std::vector<Piece> host;
    std::size_t off = 0;
    for (std::size_t i = 0; i < f.tensors.size(); ++i) {
      auto& t = f.tensors[i];
      const Device d = devices ? (*devices)[i] : Device::cpu();
      if (d.is_cpu()) host.push_back({buf->data() + off, static_cast<const std::uint8_t*>(t.data), t.nbytes()});
      else ptrain::detail::copy_bytes(buf->data() + off, Device::cpu(), t.data, d, t.nbytes());
      t.data = buf->data() + off;
      off += t.nbytes();
    }
    parallel_copy(host);
  }

  template <class Piece>
  static void parallel_copy(const std::vector<Piece>& pieces) {
    std::size_t total = 0;
    for (const auto& p : pieces) total += p.n;
    const unsigned threads = std::min(4u, std::max(1u, std::thread::hardware_concurrency()));
    if (threads == 1 || total < (std::size_t{32} << 20)) {
      for (const auto& p : pieces) std::memcpy(p.dst, p.src, p.n);
      return;
    }
    // Thread k copies bytes [k * total / threads, (k + 1) * total / threads) of the concatenation.
    auto copy_range = [&](std::size_t lo, std::size_t hi) {
      std::size_t base = 0;
      for (const auto& p : pieces) {
        const std::size_t a = std::max(lo, base), b = std::min(hi, base + p.n);
        if (a < b) std::memcpy(p.dst + (a - base), p.src + (a - base), b - a);
        base += p.n;
      }
    };
    std::vector<std::thread> pool;
    for (unsigned k = 1; k < threads; ++k) pool.emplace_back(copy_range, total * k / threads, total * (k + 1) / threads);
    copy_range(0, total / threads);
    for (auto& t : pool) t.join();
  }

  // Note [Commit protocol], step 1. `failed_before` is this rank's pending
  // asynchronous failure, if any; every rank throws when any rank failed.
  void prepare(const detail::SaveJob& job, const std::string& failed_before) {
    std::string err = failed_before;
    if (rank() == 0 && err.empty()) {
      try {
        const fs::path p = step_path(job.step);
        restore_set_aside();
        check_resumed(job.step);
        std::error_code ec;
        if (fs::exists(p / detail::kMarker)) {  // kept until the new one is committed
          const fs::path aside = dir_ / (detail::kReplaced + p.filename().string());
          fs::rename(p, aside, ec);
          PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] cannot move ", p.string(), " aside to save step ",
                       job.step, " again: ", ec.message(), "; check that the checkpoint directory is writable");
          detail::fsync_dir(dir_);
        }
        fs::remove_all(p, ec);
        fs::create_directories(p, ec);
        PTRAIN_CHECK(!ec && fs::is_directory(p), CheckpointError, "[ptrain.ckpt.io] cannot create ", p.string(), ": ",
                     ec.message(), "; check that the checkpoint directory is writable");
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    agree(err, "[ptrain.ckpt.prepare] ");
  }

  // A set-aside checkpoint whose rewrite was not committed (the save failed, or
  // the process died) goes back in place; one whose rewrite was committed goes.
  // Runs only between saves (one is in flight at a time). Rank 0.
  void restore_set_aside() {
    std::error_code ec;
    for (const auto& [step, path] : list_steps()) {
      if (!set_aside(path)) continue;
      const fs::path original = step_path(step);
      if (fs::exists(original / detail::kMarker)) {
        fs::remove_all(path, ec);
        continue;
      }
      fs::remove_all(original, ec);
      fs::rename(path, original, ec);
      PTRAIN_CHECK(!ec, CheckpointError, "[ptrain.ckpt.io] cannot move ", path.string(), " back to ",
                   original.string(), ": ", ec.message(), "; rename it by hand");
    }
  }

  // Committed checkpoints of larger steps are deleted once this step commits
  // (rotate), which is right after resuming from an older one. Without any
  // committed checkpoint at or before `step`, this run cannot have resumed from
  // this directory: deleting them would throw away another run's work. Rank 0.
  void check_resumed(std::int64_t step) const {
    std::int64_t newest = -1;
    for (const auto& [s, path] : list_steps()) {
      if (!fs::exists(path / detail::kMarker)) continue;
      if (s <= step) return;
      newest = std::max(newest, s);
    }
    PTRAIN_CHECK(newest < 0, CheckpointError, "[ptrain.ckpt.newer] ", dir_.string(),
                 " holds committed checkpoints up to step ", newest, " but none at or before step ", step,
                 ", so this run did not resume from it, and saving would delete them. Resume from latest() "
                 "(e.g. --resume), use another checkpoint directory, or delete those checkpoints to start over");
  }

  // Throws on every rank when any rank has a non-empty error (one all-reduce).
  void agree(const std::string& err, const char* id) {
    std::int32_t failed = err.empty() ? 0 : rank() + 1;
    if (comm_ && comm_->size() > 1) comm_->all_reduce(&failed, 1, DType::I32, dist::ReduceOp::Max);
    if (failed == 0) return;
    if (!err.empty()) PTRAIN_THROW(CheckpointError, id, err);
    PTRAIN_THROW(CheckpointError, id, "rank ", failed - 1, " failed to save its part of the checkpoint (its log has "
                 "the reason); this checkpoint is not committed and the previous one stays valid");
  }

  // Note [Commit protocol], step 2: this rank's files and its manifest.
  void write_files(const detail::SaveJob& job) {
    const fs::path dir = step_path(job.step);
    try {
      nlohmann::json man = {{"rank", rank()}, {"files", nlohmann::json::object()}};
      const std::map<std::string, std::string> meta = {{"format", "pt"}, {"ptrain.step", std::to_string(job.step)}};
      for (const auto& f : job.files) {
        const FileDigest d = write_safetensors((dir / f.name).string(), f.tensors, meta);
        nlohmann::json names = nlohmann::json::object();
        for (std::size_t i = 0; i < f.tensors.size(); ++i) names[f.tensors[i].name] = d.tensor_crc32[i];
        man["files"][f.name] = {{"bytes", d.bytes}, {"crc32", d.crc32}, {"tensors", names}, {"pieces", f.pieces}};
      }
      // Only rank 0's commit reads the manifest, so it needs an atomic rename but no fsync.
      if (std::find(job.writers.begin(), job.writers.end(), rank()) != job.writers.end())
        detail::write_file_atomic(dir / detail::rank_name("rank-", rank(), ".json"), man.dump(), false);
    } catch (const std::exception& e) {
      // Lets rank 0 fail the commit at once instead of waiting for the timeout.
      std::ofstream(dir / detail::rank_name("rank-", rank(), ".failed")) << e.what();
      throw;
    }
  }

  // Note [Commit protocol], steps 3 and 4 (rank 0).
  void commit(const detail::SaveJob& job) {
    const fs::path dir = step_path(job.step);
    nlohmann::json index = {{"format", "ptrain.index/1"}, {"step", job.step}, {"world_size", world_size()},
                            {"checksum", "crc32"}, {"files", nlohmann::json::object()},
                            {"weight_map", nlohmann::json::object()}, {"tensor_crc32", nlohmann::json::object()},
                            {"pieces", nlohmann::json::object()}};
    const auto deadline = std::chrono::steady_clock::now() + opt_.commit_timeout;
    for (int r : job.writers) {
      const fs::path man = dir / detail::rank_name("rank-", r, ".json");
      const fs::path failed = dir / detail::rank_name("rank-", r, ".failed");
      while (!fs::exists(man)) {
        PTRAIN_CHECK(!fs::exists(failed), CheckpointError, "[ptrain.ckpt.commit] rank ", r, " failed to write its "
                     "files for step ", job.step, ": ", detail::read_text(failed));
        PTRAIN_CHECK(std::chrono::steady_clock::now() < deadline, CheckpointError, "[ptrain.ckpt.commit] rank ", r,
                     " did not finish its files for step ", job.step, " within ", opt_.commit_timeout.count(),
                     " ms; check that every rank sees the same checkpoint directory (shared file system)");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      const nlohmann::json m = detail::parse_json(detail::read_text(man), man);
      for (auto it = m.at("files").begin(); it != m.at("files").end(); ++it) {
        index["files"][it.key()] = {{"bytes", it.value().at("bytes")}, {"crc32", it.value().at("crc32")}};
        for (auto t = it.value().at("tensors").begin(); t != it.value().at("tensors").end(); ++t) {
          PTRAIN_CHECK(!index["weight_map"].contains(t.key()), CheckpointError, "[ptrain.ckpt.name] tensor '",
                       t.key(), "' is saved by two ranks (second: rank ", r,
                       "); sharded tensor names must be unique across ranks");
          index["weight_map"][t.key()] = it.key();
          index["tensor_crc32"][t.key()] = t.value();
        }
        for (auto p = it.value().at("pieces").begin(); p != it.value().at("pieces").end(); ++p)
          index["pieces"][p.key()] = p.value();
      }
    }
    // A bad sharding (a missing or doubly saved range) fails here, before anything is committed.
    detail::group_pieces(index["pieces"], index["weight_map"].get<std::map<std::string, std::string>>(), "step " +
                         std::to_string(job.step));
    const std::string index_text = index.dump(2);
    detail::write_file_atomic(dir / detail::kIndex, index_text);
    detail::write_file_atomic(dir / detail::kTrainer, job.trainer_json);
    detail::fsync_dir(dir);
    const nlohmann::json marker = {{"step", job.step}, {detail::kIndex, detail::crc_of(index_text)},
                                   {detail::kTrainer, detail::crc_of(job.trainer_json)}};
    detail::write_file_atomic(dir / detail::kMarker, marker.dump());
    detail::fsync_dir(dir);
    detail::fsync_dir(dir_);
    std::error_code ec;
    for (int r : job.writers) fs::remove(dir / detail::rank_name("rank-", r, ".json"), ec);
    rotate(job.step);
  }

  // Keeps the just-committed checkpoint and the keep_last - 1 newest older
  // committed ones; removes the rest, every newer one, and every directory
  // without a marker (one save is in flight at a time, so those can never
  // complete). Victims
  // are renamed to .deleting-* at once (invisible to latest()) and deleted by
  // a background thread: removing a large checkpoint takes a noticeable
  // fraction of writing it, and nobody needs to wait for it.
  void rotate(std::int64_t current) {
    join_cleaner();
    std::vector<fs::path> victims;
    std::error_code ec;
    for (const auto& d : fs::directory_iterator(dir_, ec))
      if (d.path().filename().string().rfind(".deleting-", 0) == 0) victims.push_back(d.path());  // from a crash
    int kept = 1;
    for (const auto& [step, path] : list_steps()) {
      // A set-aside copy goes: its step's new checkpoint is committed.
      if (step == current && !set_aside(path)) continue;
      const bool committed = fs::exists(path / detail::kMarker);
      // Newer steps belong to a timeline this run abandoned by resuming from an
      // older checkpoint; left in place, latest() would jump back to them.
      if (committed && step < current && !set_aside(path) && (opt_.keep_last <= 0 || kept < opt_.keep_last)) {
        ++kept;
        continue;
      }
      const fs::path trash = dir_ / (".deleting-" + path.filename().string());
      fs::remove_all(trash, ec);
      fs::rename(path, trash, ec);
      victims.push_back(ec ? path : trash);
    }
    if (victims.empty()) return;
    detail::fsync_dir(dir_);
    cleaner_ = std::thread([victims = std::move(victims)] {
      std::error_code e;
      for (const auto& v : victims) fs::remove_all(v, e);
    });
  }

  void join_cleaner() {
    if (cleaner_.joinable()) cleaner_.join();
  }

  void run_sync(detail::SaveJob& job) {
    prepare(job, "");
    std::string err;
    try {
      write_files(job);
    } catch (const std::exception& e) {
      err = e.what();
    }
    agree(err, "[ptrain.ckpt.write] ");
    std::int32_t ok = 1;
    std::string commit_err;
    if (rank() == 0) {
      try {
        commit(job);
      } catch (const std::exception& e) {
        ok = 0;
        commit_err = e.what();
      }
    }
    if (comm_ && comm_->size() > 1) comm_->broadcast(&ok, 1, DType::I32, 0);
    if (!commit_err.empty()) PTRAIN_THROW(CheckpointError, "[ptrain.ckpt.commit] ", commit_err);
    PTRAIN_CHECK(ok, CheckpointError, "[ptrain.ckpt.commit] rank 0 could not commit step ", job.step,
                 " (its log has the reason); the previous checkpoint stays valid");
  }

  fs::path dir_;
  dist::Communicator* comm_;
  CheckpointOptions opt_;
  std::thread cleaner_;  // deletes rotated-out checkpoints
};

}  // namespace ptrain::ckpt
