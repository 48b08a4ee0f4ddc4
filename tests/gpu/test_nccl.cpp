// The NCCL communicator on one GPU (world size 1: the GPU machine has one
// device, and NCCL refuses two ranks on the same GPU). At world size 1 every
// collective is the identity, so each check compares the result with the input
// written into a separate, NaN-poisoned buffer: an operation that does not run,
// runs on the wrong bytes or never completes fails. Host buffers go through
// Note [Host buffers] in dist/nccl.hpp. Compiled by g++: nothing here launches
// a ptrain kernel. A DDP and an FSDP step through NCCL are in test_kernels.cu.
#include <catch2/catch.hpp>

#ifdef PTRAIN_NCCL

#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/dist/nccl.hpp"
#include "ptrain/dist/process_group.hpp"
#include "ptrain/dist/store.hpp"
#include "gpu/nccl_world.hpp"

using namespace ptrain;

namespace {

using testing::nccl_world;

std::vector<float> iota(std::size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

Tensor<float> device_nan(std::int64_t n) {
  return Tensor<float>::from(std::vector<float>(static_cast<std::size_t>(n), std::numeric_limits<float>::quiet_NaN()),
                             {n})
      .to(Device::cuda(0));
}

}  // namespace

TEST_CASE("nccl: world-size-1 collectives on device buffers", "[gpu][nccl]") {
  auto comm = nccl_world();
  REQUIRE(comm->backend() == "nccl");
  REQUIRE(comm->size() == 1);
  REQUIRE(comm->rank() == 0);
  const std::int64_t n = 1000;
  const auto values = iota(static_cast<std::size_t>(n), 1.0f);
  auto in = Tensor<float>::from(values, {n}).to(Device::cuda(0));

  SECTION("all_reduce, out of place and in place, sum and avg") {
    auto out = device_nan(n);
    comm->all_reduce(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    auto buf = in.clone();
    comm->all_reduce(buf, dist::ReduceOp::Avg);
    CHECK(buf.to_vector() == values);
  }
  SECTION("reduce_scatter and all_gather") {
    auto out = device_nan(n);
    comm->reduce_scatter(in, out, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    auto gathered = device_nan(n);
    comm->all_gather(in, gathered);
    CHECK(gathered.to_vector() == values);
  }
  SECTION("broadcast, barrier, async completion") {
    auto buf = in.clone();
    comm->broadcast(buf, 0);
    CHECK(buf.to_vector() == values);
    comm->barrier();
    auto out = device_nan(n);
    auto work = comm->all_reduce_async(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32,
                                       dist::ReduceOp::Max);
    work->wait();
    CHECK(work->is_completed());
    CHECK(out.to_vector() == values);
  }
  SECTION("split") {
    auto sub = comm->split(0, 0);
    REQUIRE(sub);
    CHECK(sub->size() == 1);
    auto out = device_nan(n);
    sub->all_reduce(in.data(), out.data(), static_cast<std::size_t>(n), DType::F32, dist::ReduceOp::Sum);
    CHECK(out.to_vector() == values);
    CHECK(comm->split(-1, 0) == nullptr);
  }
}

TEST_CASE("nccl: host buffers are staged through the device", "[gpu][nccl]") {
  auto comm = nccl_world();
  // A scalar, as DDP::average passes it.
  double loss = 2.5;
  comm->all_reduce(&loss, 1, DType::F64, dist::ReduceOp::Avg);
  CHECK(loss == 2.5);
  // Out of place, and a gather into a larger host buffer (the model check's pattern).
  const std::vector<std::int64_t> mine{7, -3, 1LL << 40};
  std::vector<std::int64_t> all(3, 0);
  comm->all_gather(mine.data(), all.data(), mine.size(), DType::I64);
  CHECK(all == mine);
  std::int64_t mx = 0;
  const std::int64_t five = 5;
  comm->all_reduce(&five, &mx, 1, DType::I64, dist::ReduceOp::Max);
  CHECK(mx == 5);
  // In place reduce_scatter keeps the result at the front.
  std::vector<float> buf = iota(4, 1.0f);
  comm->reduce_scatter(buf.data(), buf.data(), 4, DType::F32, dist::ReduceOp::Sum);
  CHECK(buf == iota(4, 1.0f));
  // Mixed: a host source into a device destination.
  auto dev = device_nan(4);
  comm->all_reduce(buf.data(), dev.data(), 4, DType::F32, dist::ReduceOp::Sum);
  CHECK(dev.to_vector() == iota(4, 1.0f));
  // A larger host buffer after small ones grows the staging buffer.
  std::vector<float> big = iota(1 << 20, 0.0f), big_out(1 << 20, -1.0f);
  comm->all_reduce(big.data(), big_out.data(), big.size(), DType::F32, dist::ReduceOp::Sum);
  CHECK(big_out == big);
}

TEST_CASE("nccl: PTRAIN_DISTRIBUTED_DEBUG=DETAIL checks calls through NCCL's host staging", "[gpu][nccl]") {
  dist::ProcessGroupOptions o;
  o.backend = "nccl";
  o.device = Device::cuda(0);
  o.env = dist::LaunchEnv{};
  o.timeout = std::chrono::seconds(60);
  o.check_collectives = true;
  auto comm = dist::init_process_group(o);
  auto* checked = dynamic_cast<dist::CheckedCommunicator*>(comm.get());
  REQUIRE(checked != nullptr);
  CHECK(comm->backend() == "nccl");
  auto in = Tensor<float>::from(iota(1000, 1.0f), {1000}).to(Device::cuda(0));
  auto out = device_nan(1000);
  comm->all_reduce_async(in.data(), out.data(), 1000, DType::F32, dist::ReduceOp::Sum)->wait();
  CHECK(out.to_vector() == iota(1000, 1.0f));
  comm->barrier();
  CHECK(checked->checked() == 2);
}

TEST_CASE("nccl: bad calls throw at once", "[gpu][nccl]") {
  auto comm = nccl_world();
  std::uint8_t b = 0;
  CHECK_THROWS_WITH(comm->all_reduce(&b, 1, DType::U8, dist::ReduceOp::Sum), Catch::Contains("[ptrain.comm.dtype]"));
  float x = 0;
  CHECK_THROWS_WITH(comm->send(&x, 1, DType::F32, 0), Catch::Contains("[ptrain.comm.peer]"));
  CHECK_THROWS_WITH(comm->broadcast(&x, 1, DType::F32, 1), Catch::Contains("[ptrain.comm.root]"));
  // The communicator still works after refused calls.
  double v = 1.0;
  comm->all_reduce(&v, 1, DType::F64, dist::ReduceOp::Sum);
  CHECK(v == 1.0);
}

TEST_CASE("nccl: a call on another communicator, or from another thread, while a group is open is refused", "[gpu][nccl]") {
  auto a = nccl_world(), b = nccl_world();
  auto& na = dynamic_cast<dist::NcclCommunicator&>(*a);
  auto in = Tensor<float>::from(iota(8, 1.0f), {8}).to(Device::cuda(0));
  auto out = device_nan(8);
  na.group_start();
  auto w = a->all_reduce_async(in.data(), out.data(), 8, DType::F32, dist::ReduceOp::Sum);
  CHECK_THROWS_WITH(b->all_reduce(in.data(), 8, DType::F32, dist::ReduceOp::Sum),
                    Catch::Contains("[ptrain.nccl.group]") && Catch::Contains("group_end()"));
  // NCCL's group is per thread: another thread's call on `a` would run outside it.
  std::string other_thread;
  std::thread([&] {
    try {
      a->all_reduce(in.data(), 8, DType::F32, dist::ReduceOp::Sum);
    } catch (const CommError& e) {
      other_thread = e.what();
    }
  }).join();
  CHECK_THAT(other_thread, Catch::Contains("[ptrain.nccl.group]") && Catch::Contains("from a thread other than"));
  na.group_end();
  w->wait();
  CHECK(out.to_vector() == iota(8, 1.0f));
  // Both work once the group is closed.
  b->all_reduce(out.data(), 8, DType::F32, dist::ReduceOp::Sum);
  CHECK(out.to_vector() == iota(8, 1.0f));
}

TEST_CASE("nccl: a rank that never joins ends init with an error, not a hang", "[gpu][nccl]") {
  // Rank 0 of 2 alone: NCCL's bootstrap waits for rank 1, which never comes
  // (Note [NCCL nonblocking] in dist/nccl.hpp).
  dist::TCPStore store("127.0.0.1", 0, true, std::chrono::seconds(10), std::string());
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(dist::NcclCommunicator(store, 0, 2, 0, std::chrono::seconds(3)),
                    Catch::Contains("[ptrain.nccl.init]") && Catch::Contains("not every rank joined"));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s >= 2.5);
  CHECK(s < 30.0);
  // The device and NCCL still work for a communicator that does complete.
  auto comm = nccl_world();
  double v = 2.0;
  comm->all_reduce(&v, 1, DType::F64, dist::ReduceOp::Sum);
  CHECK(v == 2.0);
}

#else

TEST_CASE("nccl: not built", "[gpu][nccl]") {
  WARN("ptrain was configured without NCCL (nccl.h and libnccl not found): the NCCL tests were not built");
}

#endif
