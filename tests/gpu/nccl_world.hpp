#pragma once
// An NCCL process group of this process alone on cuda:0: world size 1, whatever
// launcher variables this machine's environment holds.
#include <chrono>
#include <memory>

#include "ptrain/dist/process_group.hpp"

namespace ptrain::testing {

inline std::unique_ptr<dist::Communicator> nccl_world() {
  dist::ProcessGroupOptions o;
  o.backend = "nccl";
  o.device = Device::cuda(0);
  o.env = dist::LaunchEnv{};
  o.timeout = std::chrono::seconds(60);
  return dist::init_process_group(o);
}

}  // namespace ptrain::testing
