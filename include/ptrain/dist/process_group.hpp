#pragma once
// init_process_group: the world communicator for this launch, with the backend
// picked from the device and the launch environment.
//
//   backend "auto" (default, or $PTRAIN_BACKEND):
//     a world of one rank                  -> self (no peers: collectives are copies)
//     device cuda:N                        -> NCCL (unique id via MPI under mpirun, else the store),
//                                             unless the GPUs are shared (below)
//     launched by mpirun/mpiexec or srun   -> MPI, when ptrain was built with MPI
//     torchrun, ptrun, Kubernetes, none    -> Gloo, rendezvous through the TCP store
//                                             (MPI when built without Gloo)
//   "self", "mpi", "gloo", "nccl" force a backend; an error names what is missing.
//
// Device cuda:N with MPI or Gloo (forced, or chosen by "auto" when this node runs
// more ranks than it has visible GPUs, which NCCL refuses, or when ptrain was
// built without NCCL): the communicator is wrapped in a StagedCommunicator, which
// moves device buffers through host memory (Note [Staged device buffers]).

#include <memory>
#include <optional>
#include <string>

#include "ptrain/core/device.hpp"
#include "ptrain/dist/checked.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/dist/flight_recorder.hpp"
#include "ptrain/dist/launch_env.hpp"
#include "ptrain/dist/self_communicator.hpp"
#include "ptrain/dist/staged_communicator.hpp"
#include "ptrain/dist/store.hpp"
#ifdef PTRAIN_MPI
#include "ptrain/dist/mpi.hpp"
#endif
#ifdef PTRAIN_GLOO
#include "ptrain/dist/gloo.hpp"
#endif
#ifdef PTRAIN_NCCL
#include "ptrain/dist/nccl.hpp"
#endif

namespace ptrain::dist {

/// Options of init_process_group.
struct ProcessGroupOptions {
  /// "auto", "self", "mpi", "gloo" or "nccl"; empty reads $PTRAIN_BACKEND (default "auto").
  std::string backend = {};
  /// Where the buffers passed to collectives live; cuda:N selects NCCL under "auto" (MPI or
  /// Gloo staged through host memory when local ranks share GPUs), and makes a forced MPI or Gloo
  /// backend stage device buffers (dist/staged_communicator.hpp).
  Device device = Device::cpu();
  /// Timeout of every wait (the first rendezvous too, unless rdzv_timeout is set).
  std::chrono::milliseconds timeout = default_comm_timeout();
  /// Timeout of the first rendezvous through the store alone: reaching it and every rank
  /// joining it (Note [Rendezvous timeout]); default: $PTRAIN_RDZV_TIMEOUT_S, else `timeout`.
  std::optional<std::chrono::milliseconds> rdzv_timeout = rdzv_timeout_from_env();
  /// Launch environment; detected from the process environment when not given.
  std::optional<LaunchEnv> env = {};
  /// Check every collective across ranks before running it (Note [Collective checks]);
  /// default: $PTRAIN_DISTRIBUTED_DEBUG is DETAIL.
  bool check_collectives = collective_checks_from_env();
  /// Record the last operations, dump them on errors and SIGUSR2 (Note [Flight recorder]) and
  /// trace them; default: $PTRAIN_FLIGHT_RECORDER_DIR or $PTRAIN_TRACE_DIR is set.
  bool flight_recorder = !flight_recorder_dir().empty() || !obs::trace_options_from_env().dir.empty();
};

/// Backends this build of ptrain has, e.g. "mpi gloo".
inline std::string compiled_backends() {
  std::string s;
#ifdef PTRAIN_MPI
  s += "mpi ";
#endif
#ifdef PTRAIN_GLOO
  s += "gloo ";
#endif
#ifdef PTRAIN_NCCL
  s += "nccl ";
#endif
  if (s.empty()) return "none";
  s.pop_back();
  return s;
}

namespace detail {
/// True when this node runs more ranks than it has visible CUDA devices, so that some
/// ranks share a GPU (NCCL refuses that). False when the program has no CUDA backend,
/// or the backend cannot count its devices.
inline bool local_ranks_share_gpus(const LaunchEnv& env) {
  if (env.local_world_size < 2) return false;
  ::ptrain::detail::DeviceBackend* cuda = ::ptrain::detail::cuda_backend_slot();
  const int visible = cuda ? cuda->device_count() : 0;
  return visible > 0 && visible < env.local_world_size;
}
}  // namespace detail

/// The backend init_process_group would use for these options and environment ("self", "mpi", "gloo", "nccl").
/// With device cuda:N, "mpi" and "gloo" stage device buffers through host memory.
inline std::string select_backend(const ProcessGroupOptions& opts, const LaunchEnv& env) {
  std::string b = opts.backend;
  if (b.empty()) {
    const char* v = std::getenv("PTRAIN_BACKEND");
    b = v && *v ? v : "auto";
  }
  PTRAIN_CHECK(b == "auto" || b == "self" || b == "mpi" || b == "gloo" || b == "nccl", LaunchError, "[ptrain.pg.backend] backend '",
               b, "' is unknown; use auto, self, mpi, gloo or nccl (this build has: ", compiled_backends(), ")");
  bool has_mpi = false, has_gloo = false, has_nccl = false;
#ifdef PTRAIN_MPI
  has_mpi = true;
#endif
#ifdef PTRAIN_GLOO
  has_gloo = true;
#endif
#ifdef PTRAIN_NCCL
  has_nccl = true;
#endif
  if (b == "auto") {
    bool mpi_launch = env.launcher == Launcher::OpenMPI || env.launcher == Launcher::MPICH ||
                      env.launcher == Launcher::Slurm;
    // A GPU per rank for NCCL; otherwise a host backend stages device buffers.
    bool staged = opts.device.is_cuda() && (!has_nccl || detail::local_ranks_share_gpus(env)) && (has_mpi || has_gloo);
    if (env.world_size == 1) b = "self";
    else if (opts.device.is_cuda() && !staged) b = "nccl";
    else if (mpi_launch && has_mpi) b = "mpi";
    else if (has_gloo) b = "gloo";
    else if (has_mpi) b = "mpi";
    else
      PTRAIN_THROW(LaunchError, "[ptrain.pg.no_backend] no CPU communicator in this build (launcher: ",
                   env.launcher_name(), "); configure ptrain with -DPTRAIN_WITH_GLOO=ON (libgloo-dev) or "
                   "-DPTRAIN_WITH_MPI=ON (libopenmpi-dev)");
  }
  if (b == "mpi")
    PTRAIN_CHECK(has_mpi, LaunchError, "[ptrain.pg.no_mpi] backend 'mpi' needs ptrain built with MPI; install "
                 "libopenmpi-dev and configure with -DPTRAIN_WITH_MPI=ON (this build has: ", compiled_backends(), ")");
  if (b == "gloo")
    PTRAIN_CHECK(has_gloo, LaunchError, "[ptrain.pg.no_gloo] backend 'gloo' needs ptrain built with Gloo; install "
                 "libgloo-dev and configure with -DPTRAIN_WITH_GLOO=ON (this build has: ", compiled_backends(), ")");
  if (b == "nccl") {
    PTRAIN_CHECK(has_nccl, LaunchError, "[ptrain.pg.no_nccl] backend 'nccl' (device ", opts.device.str(),
                 ") needs ptrain built with NCCL and CUDA; configure with -DPTRAIN_WITH_NCCL=ON, or use "
                 "device cpu (this build has: ", compiled_backends(), ")");
    PTRAIN_CHECK(opts.device.is_cuda(), LaunchError, "[ptrain.pg.nccl_cpu] backend 'nccl' needs a CUDA device, "
                 "got ", opts.device.str(), "; pass device cuda:<local rank> or pick mpi/gloo for CPU buffers");
  }
  return b;
}

namespace detail {
// Note [Rendezvous timeout]
// Ranks of a job start minutes apart when a node must first pull the image, but once
// they all run, a peer that stops answering should be an error soon. With a
// rendezvous timeout, the store is reached with that timeout, and every rank then
// waits for all the others in one store barrier under the same timeout; only after
// that does the store take the communicator's timeout, so the backend's own
// connection (Gloo's mesh, NCCL's unique id) and every later wait use the short one.
// Without it the store is built with the communicator's timeout and no barrier is
// added, as before.
inline std::shared_ptr<Store> rendezvous_store(const LaunchEnv& env, std::chrono::milliseconds timeout,
                                               std::optional<std::chrono::milliseconds> rdzv_timeout) {
  if (!rdzv_timeout) return make_store(env, timeout);
  std::shared_ptr<Store> store = make_store(env, *rdzv_timeout);
  store->barrier("ptrain/pg/joined", env.world_size);
  store->set_timeout(timeout);
  return store;
}

#ifdef PTRAIN_MPI
// mpirun gave MPI its own world; it must agree with what the environment says.
inline void check_mpi_world(const Communicator& c, const LaunchEnv& env) {
  PTRAIN_CHECK(c.size() == env.world_size && c.rank() == env.rank, LaunchError,
               "[ptrain.pg.mpi_mismatch] MPI says rank ", c.rank(), " of ", c.size(), " but the launch environment (",
               env.launcher_name(), ") says rank ", env.rank, " of ", env.world_size,
               "; launch MPI programs with mpirun/srun --mpi=pmix, or force backend gloo");
}
#endif

// The backend's communicator, unwrapped.
inline std::unique_ptr<Communicator> init_backend(const ProcessGroupOptions& opts) {
  LaunchEnv env = opts.env ? *opts.env : detect_launch_env();
  std::string b = select_backend(opts, env);
  if (b == "self") {
    PTRAIN_CHECK(env.world_size == 1, LaunchError, "[ptrain.pg.self] backend 'self' is a world of one rank, but the "
                 "launch environment (", env.launcher_name(), ") says ", env.world_size, " ranks; use auto");
    return std::make_unique<SelfCommunicator>(opts.device, opts.timeout);
  }
#ifdef PTRAIN_MPI
  if (b == "mpi") {
    auto c = std::make_unique<MpiCommunicator>(opts.timeout);
    detail::check_mpi_world(*c, env);
    return c;
  }
#endif
#ifdef PTRAIN_GLOO
  if (b == "gloo") {
    std::shared_ptr<Store> store = rendezvous_store(env, opts.timeout, opts.rdzv_timeout);
    std::string host = detail::is_loopback(env.master_addr) || env.master_addr.empty() ? "127.0.0.1" : "";
    if (env.world_size > 1 && env.master_addr.empty()) host.clear();
    return std::make_unique<GlooCommunicator>(std::move(store), env.rank, env.world_size, opts.timeout, host);
  }
#endif
#ifdef PTRAIN_NCCL
  if (b == "nccl") {
#ifdef PTRAIN_MPI
    if (env.launcher == Launcher::OpenMPI || env.launcher == Launcher::MPICH) {
      MpiCommunicator boot(opts.timeout);
      detail::check_mpi_world(boot, env);
      return std::make_unique<NcclCommunicator>(boot, opts.device.index, opts.timeout);
    }
#endif
    auto store = rendezvous_store(env, opts.timeout, opts.rdzv_timeout);
    return std::make_unique<NcclCommunicator>(*store, env.rank, env.world_size, opts.device.index, opts.timeout);
  }
#endif
  PTRAIN_THROW(LaunchError, "[ptrain.pg.backend] backend '", b, "' is not available in this build (",
               compiled_backends(), ")");
}
}  // namespace detail

/// The world communicator of this launch; collective over every rank.
inline std::unique_ptr<Communicator> init_process_group(ProcessGroupOptions opts = {}) {
  auto c = detail::init_backend(opts);
  if (opts.device.is_cuda() && (c->backend() == "mpi" || c->backend() == "gloo"))
    c = std::make_unique<StagedCommunicator>(std::move(c), opts.device);
  if (opts.check_collectives) c = std::make_unique<CheckedCommunicator>(std::move(c));
  if (opts.flight_recorder) c = std::make_unique<RecordingCommunicator>(std::move(c));
  return c;
}

}  // namespace ptrain::dist
