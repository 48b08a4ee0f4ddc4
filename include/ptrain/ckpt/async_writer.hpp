#pragma once
// Asynchronous checkpoints: training stalls only for a copy to host memory;
// the files are written and committed by a background thread.
//
//   ckpt::CheckpointManager mgr(dir, comm.get());
//   ckpt::AsyncCheckpointer saver(mgr);
//   for (...) {
//     ...
//     if (step % every == 0) saver.save(step, params, &opt, state);   // collective, returns after the copy
//   }
//   saver.wait();                                                    // before exit: the last save is committed
//
// Note [One save in flight]
// save() first waits for the previous save's thread, so at most one is in
// flight and the host buffers (one per file, reused across saves: no page
// faults in steady state) can be overwritten. A failure of the previous save
// is not lost: save() reports it on every rank (the prepare all-reduce of Note
// [Commit protocol] carries it), wait() rethrows it locally, and the
// destructor prints it to stderr because it cannot throw.
//
// The background thread does no collectives (they would interleave with the
// training thread's; Note [Collective order contract]): rank 0 learns that the
// other ranks' files are complete from their manifests on the shared file
// system, and commits.

#include <atomic>
#include <cstdio>
#include <exception>
#include <thread>

#include "ptrain/ckpt/checkpoint.hpp"

namespace ptrain::ckpt {

class AsyncCheckpointer {
 public:
  /// Saves through `mgr` (which must outlive this object).
  explicit AsyncCheckpointer(CheckpointManager& mgr) : mgr_(mgr) {}
  ~AsyncCheckpointer() {
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ptrain: asynchronous checkpoint failed: %s\n", e.what());
    }
  }
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Data-parallel save (collective, like CheckpointManager::save): copies the
  /// tensors to host memory and returns; rank 0 writes and commits in the background.
  template <class T>
  void save(std::int64_t step, nn::FlatParameters<T>& params, optim::Optimizer<T>* opt, TrainerState state) {
    const std::string failed = finish_previous();
    launch(mgr_.replicated_job(step, params, opt, std::move(state), true, buffers_), failed);
  }

  /// Sharded save (collective, like CheckpointManager::save_sharded).
  void save_sharded(std::int64_t step, const ShardedState& mine, TrainerState state) {
    const std::string failed = finish_previous();
    launch(mgr_.sharded_job(step, mine, std::move(state), true, buffers_), failed);
  }

  /// Blocks until the save in flight (if any) is written and, on rank 0,
  /// committed; rethrows its failure. Local: no collective.
  void wait() {
    const std::string failed = finish_previous();
    PTRAIN_CHECK(failed.empty(), CheckpointError, failed);
  }

  /// True while a save is being written.
  bool in_flight() const { return thread_.joinable() && !done_.load(); }

 private:
  // Joins the previous save; returns (and clears) its failure message.
  std::string finish_previous() {
    if (thread_.joinable()) thread_.join();
    std::string msg;
    if (error_) {
      try {
        std::rethrow_exception(std::exchange(error_, nullptr));
      } catch (const std::exception& e) {
        msg = detail::cat("[ptrain.ckpt.async] the previous asynchronous save failed: ", e.what());
      }
    }
    return msg;
  }

  void launch(detail::SaveJob job, const std::string& failed) {
    mgr_.prepare(job, failed);  // collective; throws on every rank if any rank's last save failed
    done_ = false;
    thread_ = std::thread([this, job = std::move(job)] {
      try {
        mgr_.write_files(job);
        if (mgr_.rank() == 0) mgr_.commit(job);
      } catch (...) {
        error_ = std::current_exception();
      }
      done_ = true;
    });
  }

  CheckpointManager& mgr_;
  std::thread thread_;
  std::exception_ptr error_;  // written by the thread, read after join()
  std::atomic<bool> done_{true};
  std::vector<std::uint8_t> buffers_[2];  // host copies: model, optimizer
};

}  // namespace ptrain::ckpt
