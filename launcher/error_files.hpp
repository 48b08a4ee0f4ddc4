#pragma once
// Note [Error files]
// As torchrun, ptrun gives every rank TORCHELASTIC_ERROR_FILE =
// <log folder>/attempt_<k>/<local rank>/error.json, where a failing rank may write why
// it failed (ptrain::dist::record_error, include/ptrain/dist/error_file.hpp). The log
// folder is the job's folder under --log-dir (<log dir>/<run id>_<random>, kept, as
// torchrun's); with --redirects or --tee but no --log-dir one under TMPDIR, kept for the
// logs; with none of these a folder of ptrun's own under TMPDIR that ptrun removes at exit
// unless a rank wrote an error file there (ptrun then says where it is).
//
// When the job fails and ptrun's own environment has TORCHELASTIC_ERROR_FILE (a
// Kubeflow PyTorchJob, an outer launcher), ptrun writes there the root cause:
//   - a failed rank (the first one this node's ptrun saw fail in the last round): its
//     error.json when it wrote one that is a torchrun error record, with message.errorCode
//     set to its exit code (-signal when a signal killed it), as torchrun's
//     ErrorHandler.dump_error_file does; else (no file, or not a valid record) a record of
//     ptrun's own in the same shape naming the rank, its exit code or signal, the node and
//     its host, with the time in extraInfo.timestamp. torchrun writes nothing when the
//     rank wrote no file; ptrun always leaves the scheduler a cause;
//   - any other failure (a signal to ptrun that ends the job with a non-zero status, a
//     program that cannot start, another node's failure, a rendezvous error): a record of
//     ptrun's own saying so, as torchrun records its own exceptions.
// A usage error (exit 2) and a job that ends with status 0 write nothing, as under torchrun.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>

#include "output.hpp"
#include "ptrain/dist/error_file.hpp"

namespace ptrun {

/// Creates <attempt_dir>/<local_rank>/ and returns the rank's error file path there,
/// with any file of that name left from before removed.
inline std::string rank_error_file(const std::string& attempt_dir, int local_rank) {
  const std::string dir = attempt_dir + "/" + std::to_string(local_rank);
  make_dirs(dir);
  const std::string path = dir + "/error.json";
  ::unlink(path.c_str());
  return path;
}

/// This machine's host name ("unknown" when it cannot be read).
inline std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

/// Whether `j` has the shape torchrun reads back: an object whose "message" is a string
/// or an object.
inline bool is_error_record(const nlohmann::json& j) {
  return j.is_object() && j.contains("message") && (j["message"].is_string() || j["message"].is_object());
}

/// The root cause for a rank that failed with `code` (its exit code, or -signal):
/// the record it wrote to `file` when that is one, with message.errorCode = code; else
/// ptrun's own record, `what` (the rank, its exit, its node) and why its file was not used.
inline nlohmann::json rank_root_cause(const std::string& file, int code, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    nlohmann::json own = ptrain::dist::error_record(what + "; it wrote no error file (TORCHELASTIC_ERROR_FILE)");
    own["message"]["errorCode"] = code;
    return own;
  }
  std::ifstream in(file, std::ios::binary);
  nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!is_error_record(j)) {
    nlohmann::json own = ptrain::dist::error_record(what + "; its error file " + file + " is not a torchrun error "
                                                    "record (JSON with a \"message\")");
    own["message"]["errorCode"] = code;
    return own;
  }
  if (code != 0 && j["message"].is_object()) j["message"]["errorCode"] = code;
  return j;
}

/// Writes `record` to ptrun's own TORCHELASTIC_ERROR_FILE, when its environment has one.
inline void write_launcher_error(const nlohmann::json& record) {
  const std::string path = ptrain::dist::error_file_path();
  if (!path.empty()) ptrain::dist::write_error_file(path, record);
}

/// Whether any rank wrote an error file under `dir`.
inline bool holds_error_files(const std::string& dir) {
  std::error_code ec;
  for (std::filesystem::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename() == "error.json") return true;
  return false;
}

}  // namespace ptrun
