// all_to_all and all_to_all_v (Note [All-to-all layout]) against a reference each
// rank computes from the known pattern: the element k of the block rank s sends to
// rank d is input(s, d * kStride + k), and the block sizes are a function of (s, d)
// with empty blocks and, from 2 ranks on, a last rank that sends nothing. Every
// dtype, synchronous and async forms overlapping, exchange_counts, the Tensor
// forms, refused arguments, and the mismatch checks. Run under mpirun (MPI), ptrun
// (Gloo, also with DETAIL and through the flight recorder) and as a world of one.

#include <algorithm>
#include <chrono>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "comm_util.hpp"

namespace test_all_to_all {

using namespace comm_test;
using Catch::Contains;

namespace {

constexpr std::size_t kStride = 100'000;  // > any block: blocks to different ranks hold different values

// Elements rank `src` sends to rank `dst` in pattern `salt`: 0, 37, 74 or 111, and
// nothing at all from the last rank of a group of 2 or more.
std::size_t split(int src, int dst, int size, int salt) {
  if (size > 1 && src == size - 1) return 0;
  return static_cast<std::size_t>((src * 3 + dst * 2 + salt) % 4) * 37;
}

// The value of element k of the block src sends to dst.
double value(int src, int dst, std::size_t k, int salt) { return input(src, dst * kStride + k, salt); }

struct Plan {
  std::vector<std::size_t> send_counts, recv_counts;
  std::size_t send_total = 0, recv_total = 0;
};

Plan plan(int rank, int size, int salt) {
  Plan p;
  for (int q = 0; q < size; ++q) {
    p.send_counts.push_back(split(rank, q, size, salt));
    p.recv_counts.push_back(split(q, rank, size, salt));
  }
  p.send_total = std::accumulate(p.send_counts.begin(), p.send_counts.end(), std::size_t{0});
  p.recv_total = std::accumulate(p.recv_counts.begin(), p.recv_counts.end(), std::size_t{0});
  return p;
}

// This rank's input of pattern `salt`, blocks back to back in rank order.
Buf send_buffer(DType dt, const Plan& p, int rank, int salt) {
  Buf b(dt, p.send_total);
  std::size_t at = 0;
  for (std::size_t q = 0; q < p.send_counts.size(); ++q)
    for (std::size_t k = 0; k < p.send_counts[q]; ++k) b.set(at++, value(rank, static_cast<int>(q), k, salt));
  return b;
}

// Elements of recv that differ from what the other ranks' send buffers hold for this rank.
std::size_t wrong_received(const Buf& recv, const Plan& p, int rank, int salt) {
  std::size_t at = 0, wrong = 0;
  for (std::size_t q = 0; q < p.recv_counts.size(); ++q)
    for (std::size_t k = 0; k < p.recv_counts[q]; ++k)
      if (recv.get(at++) != value(static_cast<int>(q), rank, k, salt)) ++wrong;
  return wrong;
}

Plan equal_plan(std::size_t n, int size) {
  Plan p;
  p.send_counts.assign(static_cast<std::size_t>(size), n);
  p.recv_counts = p.send_counts;
  p.send_total = p.recv_total = n * static_cast<std::size_t>(size);
  return p;
}

// A new group over the whole world without the DETAIL wrapper (test_mismatch.cpp's).
std::unique_ptr<Communicator> plain_group() {
  Communicator& w = world();
  auto* checked = dynamic_cast<CheckedCommunicator*>(&w);
  Communicator& base = checked ? checked->inner() : w;
  return base.split(0, base.rank());
}

}  // namespace

TEST_CASE("comm: all_to_all, equal blocks, all dtypes", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  for (DType dt : all_dtypes())
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1031}}) {
      const Plan p = equal_plan(n, P);
      const Buf send = send_buffer(dt, p, r, 1);
      Buf in = send, recv(dt, p.recv_total);
      for (std::size_t i = 0; i < p.recv_total; ++i) recv.set(i, -99);
      c.all_to_all(in.data(), recv.data(), n, dt);
      INFO(dtype_name(dt) << " n=" << n);
      CHECK(wrong_received(recv, p, r, 1) == 0);
      CHECK(in.bytes == send.bytes);  // input untouched
    }
}

TEST_CASE("comm: all_to_all_v, empty blocks and a rank that sends nothing, all dtypes", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  for (DType dt : all_dtypes())
    for (int salt : {0, 1, 2, 3}) {
      const Plan p = plan(r, P, salt);
      Buf send = send_buffer(dt, p, r, salt), recv(dt, p.recv_total);
      for (std::size_t i = 0; i < p.recv_total; ++i) recv.set(i, -99);
      c.all_to_all_v(send.data(), p.send_counts.data(), recv.data(), p.recv_counts.data(), dt);
      INFO(dtype_name(dt) << " salt=" << salt << " sends " << p.send_total << ", receives " << p.recv_total);
      CHECK(wrong_received(recv, p, r, salt) == 0);
    }
  // The flight recorder (comm_gloo_recorded_np2) keeps the split sizes of the last call.
  if (auto* rec = dynamic_cast<RecordingCommunicator*>(&c)) {
    const FlightEntry e = rec->recorder().entries().back();
    const Plan p = plan(r, P, 3);
    CHECK(e.op == "all_to_all_v");
    CHECK(e.dtype == DType::I64);
    CHECK(e.count == p.send_total);
    CHECK(e.send_counts == p.send_counts);
    CHECK(e.recv_counts == p.recv_counts);
    CHECK(e.state == "completed");
  }
}

TEST_CASE("comm: exchange_counts gives the receivers' counts; all_to_all_v with them", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  const Plan p = plan(r, P, 5);
  const std::vector<std::size_t> recv_counts = c.exchange_counts(p.send_counts);
  CHECK(recv_counts == p.recv_counts);
  Buf send = send_buffer(DType::F32, p, r, 5), recv(DType::F32, p.recv_total);
  c.all_to_all_v(send.data(), p.send_counts.data(), recv.data(), recv_counts.data(), DType::F32);
  CHECK(wrong_received(recv, p, r, 5) == 0);
  CHECK_THROWS_WITH(c.exchange_counts(std::vector<std::size_t>(static_cast<std::size_t>(P) + 1, 1)),
                    Contains("[ptrain.comm.all_to_all]") && Contains("one count per rank"));
}

TEST_CASE("comm: async all-to-alls overlap with other collectives and finish in order", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  std::vector<Plan> plans;
  std::vector<Buf> sends, recvs;
  for (int salt = 0; salt < 4; ++salt) {
    plans.push_back(salt % 2 ? plan(r, P, salt) : equal_plan(513, P));
    sends.push_back(send_buffer(DType::F64, plans.back(), r, salt));
    recvs.emplace_back(DType::F64, plans.back().recv_total);
  }
  std::vector<double> sum(1000, static_cast<double>(r + 1));
  std::vector<std::shared_ptr<Work>> works;
  for (int salt = 0; salt < 4; ++salt) {
    const Plan& p = plans[static_cast<std::size_t>(salt)];
    Buf& s = sends[static_cast<std::size_t>(salt)];
    Buf& d = recvs[static_cast<std::size_t>(salt)];
    if (salt % 2) works.push_back(c.all_to_all_v_async(s.data(), p.send_counts.data(), d.data(), p.recv_counts.data(),
                                                       DType::F64));
    else works.push_back(c.all_to_all_async(s.data(), d.data(), 513, DType::F64));
    if (salt == 1) works.push_back(c.all_reduce_async(sum.data(), sum.data(), sum.size(), DType::F64, ReduceOp::Sum));
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  for (int salt = 0; salt < 4; ++salt) {
    INFO("salt " << salt);
    CHECK(wrong_received(recvs[static_cast<std::size_t>(salt)], plans[static_cast<std::size_t>(salt)], r, salt) == 0);
  }
  CHECK(sum[999] == static_cast<double>(P * (P + 1) / 2));
}

// MPI runs a blocking all-to-all on the caller's thread when its worker is idle (Note
// [Inline blocking calls]); behind queued operations it must still wait its turn.
TEST_CASE("comm: a blocking all-to-all runs after the async operations queued before it", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  const Plan pv = plan(r, P, 1), pe = equal_plan(513, P);
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    std::vector<double> sum(200'000, static_cast<double>(r + 1));
    Buf sv = send_buffer(DType::F64, pv, r, 1), dv(DType::F64, pv.recv_total);
    Buf se = send_buffer(DType::F64, pe, r, 2), de(DType::F64, pe.recv_total);
    auto reduce = c.all_reduce_async(sum.data(), sum.data(), sum.size(), DType::F64, ReduceOp::Sum);
    auto v = c.all_to_all_v_async(sv.data(), pv.send_counts.data(), dv.data(), pv.recv_counts.data(), DType::F64);
    if (round == 1) c.all_to_all(se.data(), de.data(), 513, DType::F64);
    else c.all_to_all_v(se.data(), pe.send_counts.data(), de.data(), pe.recv_counts.data(), DType::F64);
    // Both ran before the blocking call returned (the worker runs in submission order).
    CHECK(reduce->is_completed());
    CHECK(v->is_completed());
    CHECK(wrong_received(de, pe, r, 2) == 0);
    reduce->wait();
    v->wait();
    CHECK(wrong_received(dv, pv, r, 1) == 0);
    CHECK(sum.back() == static_cast<double>(P * (P + 1) / 2));
  }
}

TEST_CASE("comm: a blocking MPI all-to-all that a peer never joins times out on the caller's thread",
          "[dist][comm][all_to_all]") {
  Communicator& w = world();
  const int P = w.size(), r = w.rank();
  if (w.backend() != "mpi" || P == 1) return;
  auto g = plain_group();
  g->set_timeout(std::chrono::milliseconds(300));
  std::vector<float> a(2 * static_cast<std::size_t>(P), 1.0f), b(a.size(), 0.0f);
  if (r == 0) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH(g->all_to_all(a.data(), b.data(), 2, DType::F32),
                      Contains("[ptrain.comm.timeout] all_to_all(F32 x 2 per rank) on rank 0") &&
                          Contains("300 ms"));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    // It timed out inside the operation, not in a wait on a worker still stuck in it: the
    // group is aborted and the next call fails at once.
    CHECK_THROWS_WITH(g->all_to_all(a.data(), b.data(), 2, DType::F32), Contains("[ptrain.comm.aborted]"));
  }
  w.barrier();
}

TEST_CASE("comm: all-to-all Tensor forms", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  auto in = Tensor<std::int32_t>::zeros({3 * P});
  for (int q = 0; q < P; ++q)
    for (int k = 0; k < 3; ++k) in.data()[3 * q + k] = 100 * r + 10 * q + k;
  auto out = Tensor<std::int32_t>::zeros({3 * P});
  c.all_to_all(in, out);
  std::size_t wrong = 0;
  for (int q = 0; q < P; ++q)
    for (int k = 0; k < 3; ++k) wrong += out.data()[3 * q + k] != 100 * q + 10 * r + k;
  CHECK(wrong == 0);
  const Plan p = plan(r, P, 2);
  Buf send = send_buffer(DType::F32, p, r, 2);
  auto tin = Tensor<float>::zeros({static_cast<std::int64_t>(p.send_total)});
  std::copy_n(reinterpret_cast<const float*>(send.bytes.data()), p.send_total, tin.data());
  auto tout = Tensor<float>::zeros({static_cast<std::int64_t>(p.recv_total)});
  c.all_to_all_v(tin, p.send_counts, tout, p.recv_counts);
  Buf got(DType::F32, p.recv_total);
  std::copy_n(tout.data(), p.recv_total, reinterpret_cast<float*>(got.bytes.data()));
  CHECK(wrong_received(got, p, r, 2) == 0);
  // Refused on every rank alike, before anything runs.
  auto odd = Tensor<std::int32_t>::zeros({3 * P + 1});
  if (P > 1) CHECK_THROWS_WITH(c.all_to_all(odd, odd), Contains("[ptrain.comm.numel]") && Contains("all_to_all_v"));
  auto longer = Tensor<float>::zeros({static_cast<std::int64_t>(p.recv_total) + 1});
  CHECK_THROWS_WITH(c.all_to_all_v(tin, p.send_counts, longer, p.recv_counts),
                    Contains("[ptrain.comm.numel]") && Contains("the sum of recv_counts"));
}

TEST_CASE("comm: all-to-all arguments refused at the call; the group stays usable", "[dist][comm][all_to_all]") {
  Communicator& c = world();
  const int P = c.size();
  const auto n = static_cast<std::size_t>(P);
  std::vector<float> buf(4 * n, 1.0f);
  CHECK_THROWS_WITH(c.all_to_all(buf.data(), buf.data() + 1, 2, DType::F32),
                    Contains("[ptrain.comm.all_to_all]") && Contains("overlap"));
  CHECK_THROWS_WITH(c.all_to_all(buf.data(), buf.data() + 2 * n, 2, DType::U8), Contains("[ptrain.comm.dtype]"));
  // A group of one checks its split sizes locally (larger ones across ranks: below).
  if (P == 1) {
    const std::size_t one = 1, two = 2;
    CHECK_THROWS_WITH(c.all_to_all_v(buf.data(), &one, buf.data() + 2, &two, DType::F32),
                      Contains("send_counts[0] = 1 but recv_counts[0] = 2") ||
                          Contains("rank 0 sends 1 elements to rank 0, which expects 2"));
  }
  c.all_to_all(buf.data(), buf.data() + 2 * n, 2, DType::F32);
  CHECK(std::count(buf.begin(), buf.end(), 1.0f) == static_cast<std::ptrdiff_t>(4 * n));
}

TEST_CASE("comm: all-to-all calls that differ across ranks are named", "[dist][comm][all_to_all][mismatch]") {
  Communicator& w = world();
  const int P = w.size(), r = w.rank();
  if (P == 1) return;
  const auto n = static_cast<std::size_t>(P);
  std::vector<float> a(8 * n, 1.0f), b(8 * n, 0.0f);

  SECTION("fingerprint: another count per rank, another collective") {
    auto g = plain_group();
    CHECK_THROWS_WITH(g->all_to_all(a.data(), b.data(), r == 0 ? 3 : 2, DType::F32),
                      Contains("[ptrain.comm.mismatch]") && Contains("rank 0: all_to_all(F32 x 3 per rank)") &&
                          Contains("all_to_all(F32 x 2 per rank)"));
    CHECK(std::count(b.begin(), b.end(), 0.0f) == static_cast<std::ptrdiff_t>(8 * n));  // nothing ran
    auto h = plain_group();
    const std::vector<std::size_t> ones(n, 1);
    if (r == 0) CHECK_THROWS_WITH(h->all_reduce(a.data(), 4, DType::F32, ReduceOp::Sum),
                                  Contains("rank 0: all_reduce(F32 x 4, sum)") && Contains("all_to_all_v(F32)"));
    else CHECK_THROWS_WITH(h->all_to_all_v(a.data(), ones.data(), b.data(), ones.data(), DType::F32),
                           Contains("rank 0: all_reduce(F32 x 4, sum)") && Contains("all_to_all_v(F32)"));
  }
  SECTION("fingerprint: rank 0 sends rank 1 one element more than rank 1 expects") {
    auto g = plain_group();
    std::vector<std::size_t> sc(n, 2), rc(n, 2);
    if (r == 0) sc[1] = 3;
    CHECK_THROWS_WITH(g->all_to_all_v(a.data(), sc.data(), b.data(), rc.data(), DType::F32),
                      Contains("[ptrain.comm.mismatch] collective #1 all_to_all_v(F32)") &&
                          Contains("rank 0 sends 3 elements to rank 1, which expects 2") &&
                          Contains("communicator is aborted"));
    CHECK(std::count(b.begin(), b.end(), 0.0f) == static_cast<std::ptrdiff_t>(8 * n));  // nothing ran
  }
  SECTION("DETAIL: the same, and the group stays usable") {
    CheckedCommunicator c(plain_group());
    std::vector<std::size_t> sc(n, 2), rc(n, 2);
    if (r == 0) sc[1] = 3;
    CHECK_THROWS_WITH(c.all_to_all_v(a.data(), sc.data(), b.data(), rc.data(), DType::F32),
                      Contains("[ptrain.comm.mismatch] collective #1 all_to_all_v(F32)") &&
                          Contains("rank 0 sends 3 elements to rank 1, which expects 2") &&
                          Contains("still usable"));
    CHECK(std::count(b.begin(), b.end(), 0.0f) == static_cast<std::ptrdiff_t>(8 * n));  // nothing ran
    // Matching sizes run, on the same group.
    const Plan p = plan(r, P, 1);
    Buf send = send_buffer(DType::BF16, p, r, 1), recv(DType::BF16, p.recv_total);
    c.all_to_all_v(send.data(), p.send_counts.data(), recv.data(), p.recv_counts.data(), DType::BF16);
    CHECK(wrong_received(recv, p, r, 1) == 0);
    CHECK(c.checked() == 2);
  }
  w.barrier();
}

}  // namespace test_all_to_all
