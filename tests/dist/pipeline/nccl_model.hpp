#pragma once
// NcclModel: a communicator that follows NCCL's point-to-point rules on the
// CPU, over a private MPI communicator, so that code written for NCCL
// (pipelines, Note [Communication order] in parallel/pipeline.hpp) is tested
// without GPUs; NCCL itself refuses two ranks on one GPU.
//
// The rules, each as strict as NCCL's or stricter:
//  - no tags: anything but tag 0 is refused; transfers pair by order per peer;
//  - one stream per rank: operations (a transfer, a group, a collective) run one
//    after another in posting order on one worker thread, each only after the
//    previous one finished;
//  - rendezvous: a send finishes only when the peer's matching recv has the data
//    (the receiver acknowledges with a one-int message, tag 1, on the private
//    communicator). NCCL may finish small sends earlier; code that does not
//    deadlock here does not deadlock there for that reason;
//  - group_start() / group_end(): the transfers in between start together and the
//    group finishes when all of them have.
// A deadlock under these rules ends, after timeout(), in CommError
// [nccl_model.deadlock] for the operations in flight; the model is then
// aborted (dist::detail::OpQueue fails later operations at once). Their transfers stay posted on
// inner() until the caller completes them (the test that provokes a deadlock
// does).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ptrain/dist/communicator.hpp>

namespace pipeline_test {

using namespace ptrain;

class NcclModel final : public dist::Communicator {
 public:
  /// Collective over `world` (MPI: its requests complete independently of each other).
  explicit NcclModel(dist::Communicator& world) : NcclModel(world.split(0, world.rank())) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return "nccl-model"; }
  /// The private MPI communicator underneath (data on tag 0, acknowledgements on tag 1).
  dist::Communicator& inner() { return *inner_; }

  std::shared_ptr<dist::Work> send_async(const void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return transfer(true, const_cast<void*>(buf), count, dt, peer, tag);
  }
  std::shared_ptr<dist::Work> recv_async(void* buf, std::size_t count, DType dt, int peer, int tag) override {
    return transfer(false, buf, count, dt, peer, tag);
  }
  void group_start() override {
    PTRAIN_CHECK(!in_group_, CommError, "[nccl_model.group] nested group_start()");
    in_group_ = true;
  }
  void group_end() override {
    PTRAIN_CHECK(in_group_, CommError, "[nccl_model.group] group_end() without group_start()");
    in_group_ = false;
    launch(std::exchange(group_, {}));
  }

  std::shared_ptr<dist::Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                               dist::ReduceOp op) override {
    return collective("all_reduce", [=, this] { inner_->all_reduce(send, recv, count, dt, op); });
  }
  std::shared_ptr<dist::Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                                   dist::ReduceOp op) override {
    return collective("reduce_scatter", [=, this] { inner_->reduce_scatter(send, recv, recv_count, dt, op); });
  }
  std::shared_ptr<dist::Work> all_gather_async(const void* send, void* recv, std::size_t count, DType dt) override {
    return collective("all_gather", [=, this] { inner_->all_gather(send, recv, count, dt); });
  }
  std::shared_ptr<dist::Work> broadcast_async(void* buf, std::size_t count, DType dt, int root) override {
    return collective("broadcast", [=, this] { inner_->broadcast(buf, count, dt, root); });
  }
  std::shared_ptr<dist::Work> all_to_all_async(const void* send, void* recv, std::size_t count, DType dt) override {
    return collective("all_to_all", [=, this] { inner_->all_to_all(send, recv, count, dt); });
  }
  std::shared_ptr<dist::Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                                 const std::size_t* recv_counts, DType dt) override {
    const std::vector<std::size_t> sc(send_counts, send_counts + size()), rc(recv_counts, recv_counts + size());
    return collective("all_to_all_v", [=, this] { inner_->all_to_all_v(send, sc.data(), recv, rc.data(), dt); });
  }
  std::shared_ptr<dist::Work> barrier_async() override {
    return collective("barrier", [this] { inner_->barrier(); });
  }
  std::unique_ptr<dist::Communicator> split(int color, int key) override {
    collective("split", [] {})->wait();  // after everything queued, as on a stream
    auto child = inner_->split(color, key);
    return child ? std::unique_ptr<dist::Communicator>(new NcclModel(std::move(child))) : nullptr;
  }

 private:
  static constexpr int kData = 0, kAck = 1;

  struct Transfer {
    bool send;
    void* buf;
    std::size_t count;
    DType dt;
    int peer;
    std::shared_ptr<dist::Work> work;       // the caller's
    std::shared_ptr<dist::Work> data, ack;  // on inner_, once started
    std::int32_t ack_value = 1;
  };

  explicit NcclModel(std::unique_ptr<dist::Communicator> inner)
      : Communicator(inner->timeout()), inner_(std::move(inner)) {
    PTRAIN_CHECK(inner_->backend() == "mpi", CommError, "[nccl_model.backend] NcclModel runs over MPI, not ",
                 inner_->backend());
  }

  std::shared_ptr<dist::Work> transfer(bool send, void* buf, std::size_t count, DType dt, int peer, int tag) {
    const char* op = send ? "send" : "recv";
    check_peer(peer, op);
    PTRAIN_CHECK(tag == 0, CommError, "[nccl_model.tag] ", op, ": NCCL has no tags (got ", tag, ")");
    auto t = std::make_shared<Transfer>(Transfer{send, buf, count, dt, peer, nullptr, nullptr, nullptr});
    t->work = std::make_shared<dist::detail::QueuedWork>(
        dist::detail::op_desc(op, count, dt, detail::cat(send ? "to " : "from ", peer).c_str()), rank(), peer,
        timeout());
    if (in_group_) group_.push_back(t);
    else launch({t});
    return t->work;
  }

  // The stream: the first transfer's task runs the whole group; the others complete
  // right after it, or fail with it (the queue fails everything after an error).
  void launch(std::vector<std::shared_ptr<Transfer>> group) {
    for (std::size_t i = 0; i < group.size(); ++i)
      queue_.submit(group[i]->work, i ? std::function<void()>([] {}) : [this, group] { run_group(group); });
  }

  std::shared_ptr<dist::Work> collective(const char* what, std::function<void()> f) {
    auto w = std::make_shared<dist::detail::QueuedWork>(what, rank(), -1, timeout());
    queue_.submit(w, std::move(f));
    return w;
  }

  // Starts the group's transfers together and polls until each has its data and acknowledgement.
  void run_group(const std::vector<std::shared_ptr<Transfer>>& group) {
    for (auto& t : group) {
      stuck_.push_back(t);  // until complete: inner_ may still use its buffers
      if (t->send) {
        t->data = inner_->send_async(t->buf, t->count, t->dt, t->peer, kData);
        t->ack = inner_->recv_async(&t->ack_value, 1, DType::I32, t->peer, kAck);
      } else {
        t->data = inner_->recv_async(t->buf, t->count, t->dt, t->peer, kData);
      }
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    for (;;) {
      bool all = true;
      for (auto& t : group) {
        if (!t->send && !t->ack && t->data->is_completed()) {
          t->data->wait();
          t->ack = inner_->send_async(&t->ack_value, 1, DType::I32, t->peer, kAck);
        }
        all = all && t->ack && t->data->is_completed() && t->ack->is_completed();
      }
      if (all) break;
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string ops;
        for (auto& t : group) ops += (ops.empty() ? "" : ", ") + t->work->what();
        PTRAIN_THROW(CommError, "[nccl_model.deadlock] ", ops, " on rank ", rank(), " did not complete within ",
                     timeout().count(), " ms under NCCL's rules (ordered stream, rendezvous sends)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    for (auto& t : group) {
      t->data->wait();
      t->ack->wait();
    }
    stuck_.clear();
  }

  // Destroyed in reverse: the queue's worker stops first, then what it may have left on inner_.
  std::unique_ptr<dist::Communicator> inner_;
  std::vector<std::shared_ptr<Transfer>> stuck_;  // worker only: transfers inner_ may still touch
  bool in_group_ = false;                         // caller's thread only
  std::vector<std::shared_ptr<Transfer>> group_;  // caller's thread only
  dist::detail::OpQueue queue_;
};

}  // namespace pipeline_test
