#pragma once
// The world communicator of the multi-rank tests: created once per process (all
// test files of an executable share it), with a final barrier before teardown
// so that a fast rank does not close connections under a slow one.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <ptrain/dist/process_group.hpp>

namespace ptrain::testing {

inline dist::Communicator& world() {
  struct Holder {
    std::unique_ptr<dist::Communicator> comm;
    ~Holder() {
      try {
        if (comm) comm->barrier();
      } catch (...) {
      }
    }
  };
  static Holder h{dist::init_process_group()};
  return *h.comm;
}

/// A directory path all ranks of `comm` agree on: `prefix` and rank 0's pid under
/// the temporary directory (the ranks share a machine in these tests).
inline std::filesystem::path shared_tmp_dir(dist::Communicator& comm, const std::string& prefix) {
  std::int64_t id = ::getpid();
  comm.broadcast(&id, 1, DType::I64, 0);
  return std::filesystem::temp_directory_path() / (prefix + std::to_string(id));
}

}  // namespace ptrain::testing
