// Every collective against a reference computed on one rank from the inputs
// every rank is known to hold (comm_util.hpp), for all dtypes and ops, odd and
// zero lengths, in place and out of place. Run under mpirun (MPI) and ptrun (Gloo).

#include <cstdlib>
#include <string>

#include "comm_util.hpp"

namespace test_collectives {

using namespace comm_test;

TEST_CASE("comm: world agrees with the launch environment", "[dist][comm]") {
  Communicator& c = world();
  LaunchEnv env = detect_launch_env();
  CHECK(c.size() == env.world_size);
  CHECK(c.rank() == env.rank);
  if (const char* want = std::getenv("PTRAIN_TEST_EXPECT_BACKEND")) CHECK(c.backend() == want);
  CHECK(c.timeout() == std::chrono::milliseconds(60'000));  // PTRAIN_COMM_TIMEOUT_S=60 from CTest
}

TEST_CASE("comm: all_reduce, all dtypes and ops, in and out of place", "[dist][comm]") {
  Communicator& c = world();
  for (DType dt : all_dtypes())
    for (ReduceOp op : all_ops())
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1031}, std::size_t{70001}})
        for (bool in_place : {true, false}) {
          Buf send(dt, n), recv(dt, n);
          for (std::size_t i = 0; i < n; ++i) send.set(i, input(c.rank(), i));
          for (std::size_t i = 0; i < n; ++i) recv.set(i, -99);
          if (in_place) c.all_reduce(send.data(), send.data(), n, dt, op);
          else c.all_reduce(send.data(), recv.data(), n, dt, op);
          const Buf& out = in_place ? send : recv;
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < n; ++i)
            if (out.get(i) != reference(dt, op, column(c.size(), i))) ++wrong;
          if (!in_place)
            for (std::size_t i = 0; i < n; ++i)
              if (send.get(i) != input(c.rank(), i)) ++wrong;  // input untouched
          INFO(dtype_name(dt) << " " << reduce_op_name(op) << " n=" << n << " in_place=" << in_place);
          CHECK(wrong == 0);
        }
}

TEST_CASE("comm: reduce_scatter, all dtypes and ops, in and out of place", "[dist][comm]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  for (DType dt : all_dtypes())
    for (ReduceOp op : all_ops())
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{333}, std::size_t{20011}})
        for (bool in_place : {true, false}) {
          Buf send(dt, n * P), recv(dt, n);
          for (std::size_t i = 0; i < n * P; ++i) send.set(i, input(r, i, 1));
          if (in_place) c.reduce_scatter(send.data(), send.data(), n, dt, op);
          else c.reduce_scatter(send.data(), recv.data(), n, dt, op);
          const Buf& out = in_place ? send : recv;
          std::size_t wrong = 0;
          for (std::size_t i = 0; i < n; ++i)
            if (out.get(i) != reference(dt, op, column(P, r * n + i, 1))) ++wrong;
          INFO(dtype_name(dt) << " " << reduce_op_name(op) << " n=" << n << " in_place=" << in_place);
          CHECK(wrong == 0);
        }
}

TEST_CASE("comm: all_gather, all dtypes, in and out of place", "[dist][comm]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  for (DType dt : all_dtypes())
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1001}, std::size_t{40009}})
      for (bool in_place : {true, false}) {
        Buf send(dt, n), recv(dt, n * P);
        for (std::size_t i = 0; i < n * P; ++i) recv.set(i, -99);
        for (std::size_t i = 0; i < n; ++i) send.set(i, input(r, i, 2));
        void* src = send.data();
        if (in_place) {
          for (std::size_t i = 0; i < n; ++i) recv.set(r * n + i, input(r, i, 2));
          src = recv.bytes.data() + r * n * dtype_size(dt);
        }
        c.all_gather(src, recv.data(), n, dt);
        std::size_t wrong = 0;
        for (int q = 0; q < P; ++q)
          for (std::size_t i = 0; i < n; ++i)
            if (recv.get(q * n + i) != input(q, i, 2)) ++wrong;
        INFO(dtype_name(dt) << " n=" << n << " in_place=" << in_place);
        CHECK(wrong == 0);
      }
}

TEST_CASE("comm: broadcast from every root, all dtypes", "[dist][comm]") {
  Communicator& c = world();
  for (DType dt : all_dtypes())
    for (int root = 0; root < c.size(); ++root)
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{9}, std::size_t{65537}}) {
        Buf b(dt, n);
        for (std::size_t i = 0; i < n; ++i) b.set(i, input(c.rank(), i, 3));
        c.broadcast(b.data(), n, dt, root);
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < n; ++i)
          if (b.get(i) != input(root, i, 3)) ++wrong;
        INFO(dtype_name(dt) << " root=" << root << " n=" << n);
        CHECK(wrong == 0);
      }
}

TEST_CASE("comm: barrier waits for the last rank", "[dist][comm]") {
  Communicator& c = world();
  using clk = std::chrono::steady_clock;  // CLOCK_MONOTONIC: comparable across processes on one host
  std::this_thread::sleep_for(std::chrono::milliseconds(60 * c.rank()));
  std::int64_t entered = clk::now().time_since_epoch().count();
  c.barrier();
  std::int64_t left = clk::now().time_since_epoch().count();
  std::vector<std::int64_t> all(c.size());
  c.all_gather(&entered, all.data(), 1, DType::I64);
  CHECK(left >= *std::max_element(all.begin(), all.end()));
}

TEST_CASE("comm: async operations run in order; dropped Work is harmless", "[dist][comm]") {
  Communicator& c = world();
  const int P = c.size();
  constexpr std::size_t n = 4099;
  std::vector<std::vector<float>> bufs(6, std::vector<float>(n));
  for (std::size_t k = 0; k < bufs.size(); ++k)
    for (std::size_t i = 0; i < n; ++i) bufs[k][i] = static_cast<float>(input(c.rank(), i, static_cast<int>(k)));
  std::vector<std::shared_ptr<Work>> works;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    auto w = c.all_reduce_async(bufs[k].data(), bufs[k].data(), n, DType::F32, ReduceOp::Sum);
    if (k != 2) works.push_back(w);  // buffer 2's Work is dropped at once
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();  // reverse order is fine
  for (auto& w : works) CHECK(w->is_completed());
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < bufs.size(); ++k)
    for (std::size_t i = 0; i < n; ++i)
      if (bufs[k][i] != reference(DType::F32, ReduceOp::Sum, column(P, i, static_cast<int>(k)))) ++wrong;
  CHECK(wrong == 0);
}

TEST_CASE("comm: bad arguments throw at the call and leave the communicator usable", "[dist][comm]") {
  Communicator& c = world();
  float x = 1;
  CHECK_THROWS_AS(c.send(&x, 1, DType::F32, c.rank()), CommError);
  CHECK_THROWS_AS(c.send(&x, 1, DType::F32, c.size()), CommError);
  CHECK_THROWS_AS(c.broadcast(&x, 1, DType::F32, -1), CommError);
  CHECK_THROWS_WITH(c.all_reduce(&x, 1, DType::U8, ReduceOp::Sum), Catch::Contains("[ptrain.comm.dtype]"));
  c.all_reduce(&x, 1, DType::F32, ReduceOp::Sum);
  CHECK(x == static_cast<float>(c.size()));
}

TEST_CASE("comm: MPI and Gloo serve host memory only; CUDA tensors are refused by name", "[dist][comm]") {
  Communicator& c = world();
  CHECK(c.serves(Device::cpu()));
  CHECK_FALSE(c.serves(Device::cuda(0)));
  CHECK_NOTHROW(c.check_serves(Device::cpu(), "DDP"));
  CHECK_THROWS_WITH(c.check_serves(Device::cuda(0), "DDP"),
                    Catch::Contains("[ptrain.comm.device] DDP holds its tensors on cuda:0 but the " + c.backend()) &&
                        Catch::Contains("use the NCCL backend"));
  // The brackets for point-to-point groups do nothing here, so they may enclose anything.
  c.group_start();
  float x = 1;
  c.all_reduce(&x, 1, DType::F32, ReduceOp::Sum);
  c.group_end();
  CHECK(x == static_cast<float>(c.size()));
}

TEST_CASE("comm: Tensor overloads", "[dist][comm]") {
  Communicator& c = world();
  auto t = Tensor<double>::full({3, 5}, static_cast<double>(c.rank() + 1));
  c.all_reduce(t, ReduceOp::Max);
  for (std::int64_t i = 0; i < t.numel(); ++i) CHECK(t.data()[i] == static_cast<double>(c.size()));
  auto part = Tensor<std::int64_t>::full({4}, c.rank());
  auto whole = Tensor<std::int64_t>::zeros({4 * c.size()});
  c.all_gather(part, whole);
  for (int q = 0; q < c.size(); ++q) CHECK(whole.data()[4 * q + 3] == q);
  if (c.size() > 1) CHECK_THROWS_AS(c.all_gather(part, part), ShapeError);
}

}  // namespace test_collectives
