#pragma once
// The files of a checkpoint directory: their names (step-NNNNNNNN, COMMITTED,
// index.json, trainer.json, rank manifests, shard files), durable writes
// (temporary name, fsync, rename; directory fsync), reads and checksums.
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
// Note [Checksums]
// CRC-32 (zlib's polynomial; Python's zlib.crc32 gives the same value) over
// each whole file and over each tensor's bytes, computed while writing.
// latest() and load() recompute the files' before trusting any value; the
// tensors' name the damaged tensor in the error. CRC-32 detects all burst errors
// up to 32 bits and other corruption with probability 1 - 2^-32; it is not a
// defence against deliberate tampering.

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "ptrain/core/safetensors.hpp"
#include "ptrain/core/error.hpp"

namespace ptrain::ckpt {

namespace fs = std::filesystem;

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

}  // namespace detail

}  // namespace ptrain::ckpt
