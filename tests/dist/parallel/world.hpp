#pragma once
// The world communicator of the parallel tests: created once per process (all
// test files share it), with a final barrier before teardown so that a fast
// rank does not close connections under a slow one.
#include <memory>
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

}  // namespace ptrain::testing
