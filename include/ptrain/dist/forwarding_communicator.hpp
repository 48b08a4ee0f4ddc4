#pragma once
// ForwardingCommunicator: a Communicator that passes every call to the
// communicator it wraps. Wrappers (CheckedCommunicator, RecordingCommunicator)
// derive from it and override only the calls they change.

#include <chrono>
#include <memory>
#include <string>

#include "ptrain/dist/communicator.hpp"

namespace ptrain::dist {

/// Forwards every virtual of Communicator to `inner()`; set_timeout() sets both.
/// split() returns the inner communicator's child unwrapped, so a wrapper that
/// should also wrap its children overrides it.
class ForwardingCommunicator : public Communicator {
 public:
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  void set_timeout(std::chrono::milliseconds t) override {
    Communicator::set_timeout(t);
    inner_->set_timeout(t);
  }
  /// The wrapped communicator.
  Communicator& inner() { return *inner_; }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    return inner_->all_reduce_async(send, recv, count, dt, op);
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    return inner_->reduce_scatter_async(send, recv, recv_count, dt, op);
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    return inner_->all_gather_async(send, recv, send_count, dt);
  }
  std::shared_ptr<Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    return inner_->broadcast_async(buf, count, dt, root);
  }
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    return inner_->all_to_all_async(send, recv, count_per_rank, dt);
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    return inner_->all_to_all_v_async(send, send_counts, recv, recv_counts, dt);
  }
  std::shared_ptr<Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return inner_->send_async(buf, count, dt, peer, tag);
  }
  std::shared_ptr<Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return inner_->recv_async(buf, count, dt, peer, tag);
  }
  std::shared_ptr<Work> barrier_async() override { return inner_->barrier_async(); }
  std::unique_ptr<Communicator> split(int color, int key) override { return inner_->split(color, key); }
  void group_start() override { inner_->group_start(); }
  void group_end() override { inner_->group_end(); }
  bool serves(Device d) const override { return inner_->serves(d); }
  bool graph_capturable() const override { return inner_->graph_capturable(); }

 protected:
  /// Takes the inner communicator's timeout. `inner` may be null here so that the
  /// derived class can throw its own error for it; every other call needs one.
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner)
      : Communicator(inner ? inner->timeout() : std::chrono::milliseconds(0)), inner_(std::move(inner)) {}

  std::unique_ptr<Communicator> inner_;
};

}  // namespace ptrain::dist
