#pragma once
// A world of one rank: every collective is the identity (a copy when out of
// place), so a single process runs the same training code as a launched job,
// with no null communicator to branch on. init_process_group() returns it when
// the launch environment says the world has one rank (backend "self").

#include <memory>
#include <string>

#include "ptrain/dist/communicator.hpp"

namespace ptrain::dist {

class SelfCommunicator : public Communicator {
 public:
  /// Buffers passed to collectives live on `device` (out-of-place copies use it).
  explicit SelfCommunicator(Device device = Device::cpu(),
                            std::chrono::milliseconds timeout = default_comm_timeout())
      : Communicator(timeout), device_(device) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "self"; }
  bool serves(Device d) const override { return d == device_ || d.is_cpu(); }

  std::shared_ptr<Work> all_reduce_async(const void* send, void* recv, std::size_t count, DType dt,
                                         ReduceOp op) override {
    copy(recv, send, count, dt);
    return done(detail::op_desc("all_reduce", count, dt, reduce_op_name(op)));
  }
  std::shared_ptr<Work> reduce_scatter_async(const void* send, void* recv, std::size_t recv_count, DType dt,
                                             ReduceOp op) override {
    copy(recv, send, recv_count, dt);
    return done(detail::op_desc("reduce_scatter", recv_count, dt, reduce_op_name(op)));
  }
  std::shared_ptr<Work> all_gather_async(const void* send, void* recv, std::size_t send_count, DType dt) override {
    copy(recv, send, send_count, dt);
    return done(detail::op_desc("all_gather", send_count, dt));
  }
  std::shared_ptr<Work> broadcast_async(void*, std::size_t count, DType dt, int root) override {
    check_root(root, "broadcast");
    detail::check_dtype(dt);
    return done(detail::op_desc("broadcast", count, dt));
  }
  std::shared_ptr<Work> all_to_all_async(const void* send, void* recv, std::size_t count_per_rank, DType dt) override {
    check_no_overlap(send, count_per_rank * dtype_size(dt), recv, count_per_rank * dtype_size(dt), "all_to_all");
    copy(recv, send, count_per_rank, dt);
    return done(detail::all_to_all_desc(count_per_rank, dt));
  }
  std::shared_ptr<Work> all_to_all_v_async(const void* send, const std::size_t* send_counts, void* recv,
                                           const std::size_t* recv_counts, DType dt) override {
    const detail::AllToAllLayout l = all_to_all_layout(send_counts, recv_counts);
    check_no_overlap(send, l.send_total * dtype_size(dt), recv, l.recv_total * dtype_size(dt), "all_to_all_v");
    copy(recv, send, l.send_total, dt);
    return done(detail::all_to_all_v_desc(l, dt));
  }
  std::shared_ptr<Work> send_async(const void*, std::size_t, DType, int peer, int) override {
    check_peer(peer, "send");  // always throws: a world of one has no peer
    return nullptr;
  }
  std::shared_ptr<Work> recv_async(void*, std::size_t, DType, int peer, int) override {
    check_peer(peer, "recv");
    return nullptr;
  }
  std::shared_ptr<Work> barrier_async() override { return done("barrier"); }
  std::unique_ptr<Communicator> split(int color, int) override {
    if (color < 0) return nullptr;
    return std::make_unique<SelfCommunicator>(device_, timeout());
  }

 private:
  // A Work that is complete when it is made.
  class DoneWork : public Work {
   public:
    explicit DoneWork(std::string what) : Work(std::move(what), 0, -1, std::chrono::milliseconds(0)) {
      mark_enqueued();
      set_single_stage();
    }
  };
  static std::shared_ptr<Work> done(std::string what) { return std::make_shared<DoneWork>(std::move(what)); }

  // Checks the dtype as every backend does, then copies when out of place.
  void copy(void* dst, const void* src, std::size_t count, DType dt) const {
    detail::check_dtype(dt);
    if (dst != src) ::ptrain::detail::copy_bytes(dst, device_, src, device_, count * dtype_size(dt));
  }

  Device device_;
};

}  // namespace ptrain::dist
