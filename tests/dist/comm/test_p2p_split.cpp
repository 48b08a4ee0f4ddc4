// Point-to-point rings, per-op timeouts and split sub-groups.

#include "comm_util.hpp"

namespace test_p2p_split {

using namespace comm_test;

TEST_CASE("comm: send/recv ring, posted together, several tags and sizes", "[dist][comm]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  if (P == 1) return;
  const int right = (r + 1) % P, left = (r - 1 + P) % P;
  for (DType dt : all_dtypes())
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{300007}}) {
      // Two messages with different tags to the same peer, received in the
      // opposite order: tags, not posting order, pair them.
      Buf out_a(dt, n), out_b(dt, n), in_a(dt, n), in_b(dt, n);
      for (std::size_t i = 0; i < n; ++i) {
        out_a.set(i, input(r, i, 4));
        out_b.set(i, input(r, i, 5));
      }
      auto sa = c.send_async(out_a.data(), n, dt, right, 1);
      auto sb = c.send_async(out_b.data(), n, dt, right, 2);
      auto rb = c.recv_async(in_b.data(), n, dt, left, 2);
      auto ra = c.recv_async(in_a.data(), n, dt, left, 1);
      rb->wait();
      ra->wait();
      sa->wait();
      sb->wait();
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (in_a.get(i) != input(left, i, 4)) ++wrong;
        if (in_b.get(i) != input(left, i, 5)) ++wrong;
      }
      INFO(dtype_name(dt) << " n=" << n);
      CHECK(wrong == 0);
    }
}

TEST_CASE("comm: blocking send/recv pairs between rank 0 and every other rank", "[dist][comm]") {
  Communicator& c = world();
  std::vector<std::int32_t> v(17);
  if (c.rank() == 0) {
    for (int q = 1; q < c.size(); ++q) {
      c.recv(v.data(), v.size(), DType::I32, q);
      for (std::size_t i = 0; i < v.size(); ++i) CHECK(v[i] == q * 100 + static_cast<int>(i));
      c.send(v.data(), v.size(), DType::I32, q, 7);
    }
  } else {
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = c.rank() * 100 + static_cast<int>(i);
    c.send(v.data(), v.size(), DType::I32, 0);
    std::fill(v.begin(), v.end(), 0);
    c.recv(v.data(), v.size(), DType::I32, 0, 7);
    for (std::size_t i = 0; i < v.size(); ++i) CHECK(v[i] == c.rank() * 100 + static_cast<int>(i));
  }
}

TEST_CASE("comm: Work::wait(timeout) throws a CommError naming the operation; a later wait succeeds",
          "[dist][comm]") {
  Communicator& c = world();
  if (c.size() < 2) return;
  double x = 0;
  if (c.rank() == 0) {
    auto w = c.recv_async(&x, 1, DType::F64, 1, 99);
    CHECK_FALSE(w->is_completed());
    try {
      w->wait(std::chrono::milliseconds(100));
      FAIL("wait did not time out");
    } catch (const CommError& e) {
      std::string m = e.what();
      CHECK(m.find("[ptrain.comm.timeout]") != std::string::npos);
      CHECK(m.find("recv(F64 x 1, from 1, tag 99)") != std::string::npos);
      CHECK(m.find("peer 1") != std::string::npos);
      CHECK(m.find("100 ms") != std::string::npos);
    }
    c.barrier();  // now rank 1 sends
    w->wait();
    CHECK(x == 42.0);
  } else {
    c.barrier();
    if (c.rank() == 1) {
      x = 42.0;
      c.send(&x, 1, DType::F64, 0, 99);
    }
  }
}

TEST_CASE("comm: split by parity with reversed keys, nested split, color -1", "[dist][comm]") {
  Communicator& c = world();
  const int P = c.size(), r = c.rank();
  auto sub = c.split(r % 2, -r);  // key -r: higher world rank comes first
  REQUIRE(sub);
  std::vector<int> members;
  for (int q = 0; q < P; ++q)
    if (q % 2 == r % 2) members.push_back(q);
  std::reverse(members.begin(), members.end());
  CHECK(sub->size() == static_cast<int>(members.size()));
  CHECK(members[sub->rank()] == r);
  CHECK(sub->backend() == c.backend());

  // Sum of world ranks inside the group, and a broadcast from the group's rank 0.
  std::int64_t v = r, want = 0;
  for (int q : members) want += q;
  sub->all_reduce(&v, 1, DType::I64, ReduceOp::Sum);
  CHECK(v == want);
  std::int64_t root_rank = r;
  sub->broadcast(&root_rank, 1, DType::I64, 0);
  CHECK(root_rank == members[0]);

  // The parent still works while the child exists.
  float f = 1;
  c.all_reduce(&f, 1, DType::F32, ReduceOp::Sum);
  CHECK(f == static_cast<float>(P));

  // World rank 0 opts out; the others form one group ordered by world rank.
  auto rest = c.split(r == 0 ? -1 : 0, r);
  if (r == 0) {
    CHECK(rest == nullptr);
  } else {
    REQUIRE(rest);
    CHECK(rest->size() == P - 1);
    CHECK(rest->rank() == r - 1);
    std::int32_t one = 1;
    rest->all_reduce(&one, 1, DType::I32, ReduceOp::Sum);
    CHECK(one == P - 1);
    auto single = rest->split(rest->rank(), 0);  // groups of one
    REQUIRE(single);
    CHECK(single->size() == 1);
    double d = 3.5;
    single->all_reduce(&d, 1, DType::F64, ReduceOp::Avg);
    CHECK(d == 3.5);
  }
}

}  // namespace test_p2p_split
