#pragma once
// A folder a rank is about to write into, checked before training starts: created
// with its parents, then proved writable by a probe file written and removed, so
// that an unwritable checkpoint, trace or flight-recorder folder is an error at
// start-up that names the path, not after the steps it was meant to record.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace ptrain {

/// Creates `dir` and writes and removes a probe file in it; "" when that worked, else why not.
inline std::string make_writable_dir(const std::filesystem::path& dir, int rank) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::filesystem::path probe =
      dir / (".write-probe-rank" + std::to_string(rank) + "." + std::to_string(::getpid()));
  if (!ec) {
    std::ofstream f(probe);
    if (!(f << "ok") || !f.flush()) ec = std::make_error_code(std::errc::io_error);
  }
  std::string why = ec ? ec.message() : std::filesystem::exists(probe) ? "" : "no file appeared";
  std::filesystem::remove(probe, ec);
  return why;
}

}  // namespace ptrain
