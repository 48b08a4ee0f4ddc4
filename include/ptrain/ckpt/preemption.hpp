#pragma once
// Preemption: turn SIGTERM / SIGINT / SIGUSR1 into a checkpoint and a clean exit.
//
//   ckpt::PreemptionHandler preempt;                 // installs the handlers (sigaction)
//   for (...) {
//     train_step();
//     if (preempt.should_stop(comm.get())) {         // every rank, every step: one all-reduce
//       mgr.save(step, params, &opt, state);
//       return 0;                                    // all ranks exit 0
//     }
//   }
//
// Kubernetes sends SIGTERM to every container of a pod being evicted and
// SIGKILL terminationGracePeriodSeconds (default 30) later; Slurm sends
// the signal given by --signal=USR1@60 sixty seconds before the time limit;
// ptrun and torchrun forward SIGTERM/SIGINT to every rank, ptrun SIGUSR1 too
// (its default --signals-to-handle). A signal often
// reaches only some ranks (one node is evicted), so the decision is collective:
// should_stop() all-reduces the local flag with MAX, and every rank sees the
// same answer at the same step, saves the same checkpoint and stops.
//
// The handler only stores the signal number in a sig_atomic_t (all that is
// async-signal-safe); SA_RESTART keeps blocking reads and writes going. A
// second SIGINT while the first is pending terminates at once (Ctrl-C twice).

#include <signal.h>

#include <csignal>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/dist/communicator.hpp"

namespace ptrain::ckpt {

namespace detail {
inline volatile std::sig_atomic_t g_preempt_signal = 0;
inline int g_preempt_handlers = 0;

inline void on_preempt_signal(int sig) {
  if (sig == SIGINT && g_preempt_signal != 0) {  // Ctrl-C twice: stop now
    ::signal(SIGINT, SIG_DFL);
    ::raise(SIGINT);
    return;
  }
  g_preempt_signal = sig;
}
}  // namespace detail

/// Installs handlers for the given signals while it lives (one instance per process).
class PreemptionHandler {
 public:
  explicit PreemptionHandler(std::vector<int> signals = {SIGTERM, SIGINT, SIGUSR1}) : signals_(std::move(signals)) {
    PTRAIN_CHECK(detail::g_preempt_handlers == 0, Error, "[ptrain.preempt.twice] a PreemptionHandler already "
                 "exists in this process; create one and share it");
    ++detail::g_preempt_handlers;
    detail::g_preempt_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = detail::on_preempt_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    old_.resize(signals_.size());
    for (std::size_t i = 0; i < signals_.size(); ++i)
      PTRAIN_CHECK(::sigaction(signals_[i], &sa, &old_[i]) == 0, Error, "[ptrain.preempt.sigaction] cannot install "
                   "a handler for signal ", signals_[i]);
  }
  ~PreemptionHandler() {
    for (std::size_t i = 0; i < signals_.size(); ++i) ::sigaction(signals_[i], &old_[i], nullptr);
    detail::g_preempt_signal = 0;
    --detail::g_preempt_handlers;
  }
  PreemptionHandler(const PreemptionHandler&) = delete;
  PreemptionHandler& operator=(const PreemptionHandler&) = delete;

  /// The signal this process received (0 = none). Local, never blocks.
  int local_signal() const { return detail::g_preempt_signal; }

  /// Collective (every rank, same step): true on every rank when any rank
  /// received a signal. One all-reduce (MAX) of one int; without `comm`, local.
  bool should_stop(dist::Communicator* comm) {
    std::int32_t sig = detail::g_preempt_signal;
    if (comm && comm->size() > 1) comm->all_reduce(&sig, 1, DType::I32, dist::ReduceOp::Max);
    agreed_ = sig;
    return sig != 0;
  }
  /// The signal agreed by the last should_stop() (the largest number if ranks got different ones).
  int signal() const { return agreed_; }
  /// Forgets a received signal (for tests and for runs that choose to continue).
  void reset() {
    detail::g_preempt_signal = 0;
    agreed_ = 0;
  }

 private:
  std::vector<int> signals_;
  std::vector<struct sigaction> old_;
  int agreed_ = 0;
};

}  // namespace ptrain::ckpt
