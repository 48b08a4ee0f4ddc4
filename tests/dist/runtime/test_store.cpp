// TCPStore: semantics against hand-computed results, many concurrent clients
// against a sequential count, timeouts that name the key, raw-socket garbage
// that must not take the server down, token rejection, clean shutdown.

#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "../../skip.hpp"  // tests/skip.hpp
#include "process_util.hpp"
#include "ptrain/dist/store.hpp"

namespace test_store {

using namespace ptrain::dist;
using namespace std::chrono_literals;

namespace {

// A raw TCP connection to the store, for sending what a real client never would.
struct RawSocket {
  explicit RawSocket(int port) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }
  ~RawSocket() { ::close(fd); }
  void send(const std::string& bytes) const { ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL); }
  // True when the server closed the connection (recv sees EOF or a reset) within 5 s.
  bool closed_by_server() const {
    char buf[256];
    for (;;) {
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n == 0) return true;
      if (n < 0) return errno == ECONNRESET;
    }
  }
  int fd;
};

std::string hello(const std::string& token = "") {
  std::string m = "PTRS";
  m.push_back(static_cast<char>(detail::kStoreVersion));
  detail::put_str(m, token);
  detail::put_str(m, "");  // job
  detail::put_i64(m, -1);  // no rank
  return m;
}

}  // namespace

TEST_CASE("store: operations match hand-computed results", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 5s, std::string());
  TCPStore client("127.0.0.1", server.port(), false, 5s, std::string());
  REQUIRE(server.port() > 0);

  // Values are binary-safe: NULs and all 256 byte values round-trip.
  std::string bin;
  for (int i = 0; i < 256; ++i) bin.push_back(static_cast<char>(i));
  bin += std::string("\0\0end", 5);
  client.set("bin", bin);
  CHECK(server.get("bin") == bin);
  client.set("empty", "");
  CHECK(server.get("empty").empty());
  CHECK(server.check({"bin", "empty"}));
  CHECK_FALSE(server.check({"bin", "nope"}));

  CHECK(client.add("ctr", 5) == 5);
  CHECK(server.add("ctr", -7) == -2);
  CHECK(client.get("ctr") == "-2");
  client.set("text", "abc");
  CHECK_THROWS_WITH(client.add("text", 1), Catch::Contains("[ptrain.store.error]") && Catch::Contains("text"));
  CHECK(client.get("text") == "abc");  // the connection is still usable after that error

  // compare_set: absent + empty expected sets; absent + other expected returns expected;
  // present + matching swaps; present + mismatch returns the current value.
  CHECK(client.compare_set("cas", "", "v1") == "v1");
  CHECK(client.compare_set("cas2", "x", "v1") == "x");
  CHECK_FALSE(client.check({"cas2"}));
  CHECK(client.compare_set("cas", "v1", "v2") == "v2");
  CHECK(client.compare_set("cas", "v1", "v3") == "v2");
  CHECK(server.get("cas") == "v2");

  CHECK(client.delete_key("cas"));
  CHECK_FALSE(client.delete_key("cas"));
  CHECK_FALSE(server.check({"cas"}));

  // A 4 MiB value through both directions.
  std::string big(4 << 20, '\0');
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>((i * 2654435761u) >> 13);
  server.set("big", big);
  CHECK(client.get("big") == big);

  // Limits are refused on the client before anything is sent.
  CHECK_THROWS_WITH(client.set(std::string(kMaxKeyBytes + 1, 'k'), "v"), Catch::Contains("[ptrain.store.too_large]"));
}

TEST_CASE("store: get blocks until another client sets the key", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 5s, std::string());
  TCPStore client("127.0.0.1", server.port(), false, 5s, std::string());
  auto t0 = std::chrono::steady_clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(200ms);
    server.set("late", "here");
  });
  CHECK(client.get("late") == "here");
  setter.join();
  CHECK(std::chrono::steady_clock::now() - t0 >= 150ms);
  client.wait({"late"}, 100ms);  // already there: returns at once
}

TEST_CASE("store: 16 concurrent clients agree with a sequential count", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 10s, std::string());
  const int n = 16, rounds = 50;
  std::vector<std::set<std::int64_t>> seen(n);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      try {
        TCPStore c("127.0.0.1", server.port(), false, 10s, std::string());
        c.set_rank(t);
        c.set("client/" + std::to_string(t), std::to_string(t * t));
        for (int i = 0; i < rounds; ++i) seen[t].insert(c.add("counter", 1));
        c.barrier("mid", n);
        // After the barrier every client's key exists and the count is final.
        for (int o = 0; o < n; ++o)
          if (c.get("client/" + std::to_string(o)) != std::to_string(o * o)) ++failures;
        if (c.add("counter", 0) != n * rounds) ++failures;
        c.barrier("mid", n);  // the same name again: a second generation
      } catch (const std::exception& e) {
        UNSCOPED_INFO(e.what());
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures == 0);
  // Every add returned a distinct value and together they are exactly 1..n*rounds.
  std::set<std::int64_t> all;
  for (auto& s : seen) all.insert(s.begin(), s.end());
  CHECK(all.size() == static_cast<std::size_t>(n * rounds));
  CHECK(*all.begin() == 1);
  CHECK(*all.rbegin() == n * rounds);
}

TEST_CASE("store: timeouts name the key and barrier names the missing ranks", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 300ms, std::string());
  server.set("present", "1");
  auto t0 = std::chrono::steady_clock::now();
  // The wait's own 200 ms, not the store's 300 ms: named in the error, and at least that long.
  CHECK_THROWS_WITH(server.wait({"present", "never/set"}, 200ms),
                    Catch::Contains("[ptrain.store.timeout]") && Catch::Contains("after 200 ms") &&
                        Catch::Contains("'never/set'") && Catch::Contains("still missing: 'never/set'") &&
                        !Catch::Contains("still missing: 'present'"));
  CHECK(std::chrono::steady_clock::now() - t0 >= 190ms);
  CHECK_THROWS_WITH(server.get("absent-key"), Catch::Contains("absent-key") && Catch::Contains("300 ms"));
  // The connection stays in step after a cancelled wait.
  CHECK(server.get("present") == "1");

  // World of 4: ranks 0 and 2 arrive, 1 and 3 never do.
  TCPStore other("127.0.0.1", server.port(), false, 300ms, std::string());
  server.set_rank(0);
  other.set_rank(2);
  std::string err0, err2;
  std::thread t([&] {
    try {
      other.barrier("step", 4);
    } catch (const ptrain::CommError& e) {
      err2 = e.what();
    }
  });
  try {
    server.barrier("step", 4);
  } catch (const ptrain::CommError& e) {
    err0 = e.what();
  }
  t.join();
  for (auto* e : {&err0, &err2}) {
    CHECK_THAT(*e, Catch::Contains("[ptrain.store.barrier_timeout]") && Catch::Contains("'step'") &&
                       Catch::Contains("2 of 4 ranks arrived") && Catch::Contains("missing ranks: 1, 3"));
  }
}

TEST_CASE("store: garbage and oversized input close only that connection", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 5s, std::string());
  server.set("k", "v");
  int port = server.port();
  {
    RawSocket s(port);  // not the protocol at all
    s.send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(s.closed_by_server());
  }
  {
    RawSocket s(port);  // a valid hello, then an unknown command byte
    s.send(hello() + std::string(1, '\x7f'));
    CHECK(s.closed_by_server());
  }
  {
    RawSocket s(port);  // a key length over the limit, without the bytes behind it
    std::string m = hello();
    m.push_back(static_cast<char>(detail::StoreCmd::Set));
    detail::put_u32(m, static_cast<std::uint32_t>(kMaxKeyBytes + 1));
    s.send(m);
    CHECK(s.closed_by_server());
  }
  {
    RawSocket s(port);  // a 4 GiB value length
    std::string m = hello();
    m.push_back(static_cast<char>(detail::StoreCmd::Set));
    detail::put_str(m, "x");
    detail::put_u32(m, 0xffffffffu);
    s.send(m);
    CHECK(s.closed_by_server());
  }
  {
    RawSocket s(port);  // a WAIT on 2^32-1 keys
    std::string m = hello();
    m.push_back(static_cast<char>(detail::StoreCmd::Wait));
    detail::put_u32(m, 0xffffffffu);
    s.send(m);
    CHECK(s.closed_by_server());
  }
  {
    // Random bytes from many connections at once, left open while a client works.
    std::vector<std::unique_ptr<RawSocket>> junk;
    std::minstd_rand rng(42);
    for (int i = 0; i < 8; ++i) {
      junk.push_back(std::make_unique<RawSocket>(port));
      std::string bytes(1000, '\0');
      for (auto& b : bytes) b = static_cast<char>(rng());
      junk.back()->send(bytes);
    }
    TCPStore client("127.0.0.1", port, false, 5s, std::string());
    CHECK(client.get("k") == "v");
    for (auto& j : junk) CHECK(j->closed_by_server());
  }
  // A half-sent message from a client that then goes silent blocks nobody else.
  RawSocket stalled(port);
  stalled.send(hello().substr(0, 3));
  TCPStore client("127.0.0.1", port, false, 5s, std::string());
  client.set("after", "garbage");
  CHECK(server.get("after") == "garbage");
}

TEST_CASE("store: a token keeps unauthenticated clients out", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 2s, std::string("s3cret"));
  int port = server.port();
  server.set("k", "v");
  CHECK_THROWS_WITH(TCPStore("127.0.0.1", port, false, 2s, std::string()),
                    Catch::Contains("[ptrain.store.auth]") && Catch::Contains("PTRAIN_STORE_TOKEN"));
  CHECK_THROWS_WITH(TCPStore("127.0.0.1", port, false, 2s, std::string("s3creT")),
                    Catch::Contains("[ptrain.store.auth]"));
  {
    // Skipping the hello and sending a SET straight away is refused too.
    RawSocket s(port);
    std::string m(1, static_cast<char>(detail::StoreCmd::Set));
    detail::put_str(m, "k");
    detail::put_str(m, "hacked");
    s.send(m);
    CHECK(s.closed_by_server());
  }
  {
    RawSocket s(port);  // wrong token, then a SET on the same connection
    std::string m = hello("guess");
    m.push_back(static_cast<char>(detail::StoreCmd::Set));
    detail::put_str(m, "k");
    detail::put_str(m, "hacked");
    s.send(m);
    CHECK(s.closed_by_server());
  }
  TCPStore good("127.0.0.1", port, false, 2s, std::string("s3cret"));
  CHECK(good.get("k") == "v");
}

TEST_CASE("store: a refused client fails the waits that do not complete soon after it, not others", "[store]") {
  // Note [Refused clients]: a wait open at the refusal of a rank of this job gets 10 s to complete.
  const StoreClaim job{"job-a", 0};
  TCPStore server("127.0.0.1", 0, true, 30s, std::string("s3cret"), job);
  TCPStore early("127.0.0.1", server.port(), false, 30s, std::string("s3cret"), job);
  TCPStore other("127.0.0.1", server.port(), false, 30s, std::string("s3cret"), job);
  std::string err, other_err = "not answered";
  std::thread waiter([&] {
    try {
      early.wait({"never"}, 30s);
    } catch (const ptrain::CommError& e) {
      err = e.what();
    }
  });
  std::thread answered([&] {  // a rank of the job that is there: its wait completes
    try {
      other.wait({"soon"}, 30s);
      other_err.clear();
    } catch (const ptrain::CommError& e) {
      other_err = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(TCPStore("127.0.0.1", server.port(), false, 2s, std::string(), StoreClaim{"job-a", 2}),
                    Catch::Contains("[ptrain.store.auth]"));
  std::this_thread::sleep_for(1s);
  server.set("soon", "1");
  waiter.join();
  answered.join();
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(other_err.empty());
  // The refusal came after t0 and the wait had kRefusedGrace (10 s) from it: a lower bound
  // the server guarantees. That the wait ended through the refusal and not at its own 30 s
  // timeout is the error's id ([ptrain.store.refused], not [ptrain.store.timeout]).
  CHECK(took >= 9s);
  CHECK_THAT(err, !Catch::Contains("[ptrain.store.timeout]"));
  CHECK_THAT(err, Catch::Contains("[ptrain.store.refused]") && Catch::Contains("'never'") &&
                      Catch::Contains("rank 2 of this job") && Catch::Contains("no token") &&
                      Catch::Contains("wrong or missing PTRAIN_STORE_TOKEN"));
  // A wait begun after the grace is not affected; the connection stays usable.
  CHECK_THROWS_WITH(early.wait({"later"}, 300ms), Catch::Contains("[ptrain.store.timeout]"));
  CHECK(early.get("soon") == "1");
  // Garbage on the port (a wrong magic) is not a refused client.
  TCPStore other_server("127.0.0.1", 0, true, 30s, std::string("s3cret"));
  {
    RawSocket s(other_server.port());
    s.send("GET / HTTP/1.0\r\n\r\n");
    CHECK(s.closed_by_server());
  }
  TCPStore client("127.0.0.1", other_server.port(), false, 30s, std::string("s3cret"));
  CHECK_THROWS_WITH(client.wait({"never"}, 300ms), Catch::Contains("[ptrain.store.timeout]"));
}

TEST_CASE("store: a refused stranger ends no wait, even one for a late rank", "[store]") {
  // Issue 44: clients that claim no rank, or a rank of another job, are refused and
  // ignored. A wait for a late rank, open across their refusals, completes after
  // the 10 s in which a refused rank of this job would have failed it.
  const StoreClaim job{"job-a", 0};
  TCPStore server("127.0.0.1", 0, true, 30s, std::string("s3cret"), job);
  TCPStore waiting("127.0.0.1", server.port(), false, 30s, std::string("s3cret"), job);
  std::string err = "not answered";
  std::thread waiter([&] {
    try {
      waiting.wait({"late"}, 30s);
      err.clear();
    } catch (const ptrain::CommError& e) {
      err = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  for (const StoreClaim& stranger : {StoreClaim{"job-a", -1}, StoreClaim{"job-b", 1}, StoreClaim{"", 1}})
    CHECK_THROWS_WITH(TCPStore("127.0.0.1", server.port(), false, 2s, std::string("guess"), stranger),
                      Catch::Contains("[ptrain.store.auth]"));
  {
    RawSocket s(server.port());  // a raw hello without a token and without a rank
    s.send(hello());
    CHECK(s.closed_by_server());
  }
  std::this_thread::sleep_for(10500ms);
  server.set("late", "1");  // the late rank arrives
  waiter.join();
  CHECK(err.empty());
}

TEST_CASE("store: add() that would overflow int64 is an error, the value unchanged", "[store]") {
  TCPStore server("127.0.0.1", 0, true, 2s, std::string());
  CHECK(server.add("n", 9223372036854775807LL) == 9223372036854775807LL);
  CHECK_THROWS_WITH(server.add("n", 1), Catch::Contains("[ptrain.store.error]") && Catch::Contains("overflow"));
  CHECK(server.add("n", -7) == 9223372036854775800LL);
}

TEST_CASE("store: processes of one job, one with a wrong token: the others fail soon", "[store][process]") {
  // Three ranks meet through the store (a 30 s timeout); rank 2 has another token.
  ptrain_test::TempDir dir;
  const int port = ptrain_test::free_port();
  std::vector<ptrain_test::Process> procs;
  for (int r = 0; r < 3; ++r)
    procs.emplace_back(std::vector<std::string>{PTRAIN_TEST_WORKER, "rendezvous", dir.path()},
                       std::map<std::string, std::string>{{"RANK", std::to_string(r)}, {"WORLD_SIZE", "3"},
                                                          {"MASTER_ADDR", "127.0.0.1"},
                                                          {"MASTER_PORT", std::to_string(port)},
                                                          {"PTRAIN_STORE_TOKEN", r == 2 ? "other" : "job-token"}});
  // Ranks 0 and 1 fail through the refusal (10 s after it), not at their 30 s store
  // timeout: the error's id says which ([ptrain.store.refused], not [ptrain.store.timeout]).
  for (int r = 0; r < 3; ++r) {
    auto st = procs[r].wait(120s);
    REQUIRE(st.has_value());
    INFO("rank " << r);
    CHECK(ptrain_test::exit_code(*st) == 3);
    const std::string err = ptrain_test::read_text(dir.file("error_" + std::to_string(procs[r].pid())));
    if (r == 2) CHECK_THAT(err, Catch::Contains("[ptrain.store.auth]"));
    else CHECK_THAT(err, Catch::Contains("[ptrain.store.refused]") && Catch::Contains("a wrong token") &&
                             !Catch::Contains("[ptrain.store.timeout]"));
  }
}

TEST_CASE("store: clients retry until the server starts, and fail in time when it never does", "[store]") {
  int port = ptrain_test::free_port();
  std::unique_ptr<TCPStore> server;
  std::thread starter([&] {
    std::this_thread::sleep_for(300ms);
    server = std::make_unique<TCPStore>("127.0.0.1", port, true, 5s, std::string());
    server->set("ready", "yes");
  });
  TCPStore client("localhost", port, false, 5s, std::string());
  CHECK(client.get("ready") == "yes");
  starter.join();

  // A port nobody listens on: the client gives up after its own 300 ms, which the error names.
  int dead = ptrain_test::free_port();
  CHECK_THROWS_WITH(TCPStore("127.0.0.1", dead, false, 300ms, std::string()),
                    Catch::Contains("[ptrain.store.connect]") && Catch::Contains(std::to_string(dead)) &&
                        Catch::Contains("within 300 ms"));
  CHECK_THROWS_WITH(TCPStore("127.0.0.1", port, true, 300ms, std::string()), Catch::Contains("[ptrain.store.bind]"));
}

// An IPv4 address of this host other than loopback, or "" when it has none.
static std::string external_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    char buf[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
    if (std::string(buf).rfind("127.", 0) != 0) found = buf;
  }
  ::freeifaddrs(list);
  return found;
}

TEST_CASE("store: a server on a loopback host listens on loopback only", "[store]") {
  const std::string ip = external_ipv4();
  // CTest runs this test case in a process of its own (catch_discover_tests), so it may end the process.
  if (ip.empty()) ptrain::testing::skip_test("this host has no IPv4 address besides loopback; nothing to check");
  TCPStore local("127.0.0.1", 0, true, 5s, std::string());
  CHECK_THROWS_WITH(TCPStore(ip, local.port(), false, 300ms, std::string()),
                    Catch::Contains("[ptrain.store.connect]"));
  // The same server on the host's own address takes clients on it.
  TCPStore open(ip, 0, true, 5s, std::string());
  open.set("k", "v");
  CHECK(TCPStore(ip, open.port(), false, 2s, std::string()).get("k") == "v");
}

TEST_CASE("store: destroying the server wakes blocked clients instead of hanging", "[store]") {
  auto server = std::make_unique<TCPStore>("127.0.0.1", 0, true, 30s, std::string());
  TCPStore client("127.0.0.1", server->port(), false, 30s, std::string());
  std::string err;
  std::thread waiter([&] {
    try {
      client.wait({"never"}, 30s);
    } catch (const ptrain::CommError& e) {
      err = e.what();
    }
  });
  std::this_thread::sleep_for(100ms);
  server->set_shutdown_grace(300ms);
  auto t0 = std::chrono::steady_clock::now();
  server.reset();
  waiter.join();
  CHECK(std::chrono::steady_clock::now() - t0 >= 250ms);  // connected clients get the grace period (Note [Server shutdown])
  // The server's end woke the waiter (an I/O error), not the wait's own 5 s timeout ([ptrain.store.timeout]).
  CHECK_THAT(err, Catch::Contains("[ptrain.store.io]") && Catch::Contains("never"));
  // Later calls fail fast with a clear message.
  CHECK_THROWS_WITH(client.set("x", "y"), Catch::Contains("[ptrain.store.closed]"));
}

TEST_CASE("store: make_store follows the launch environment", "[store]") {
  LaunchEnv solo;  // one process, no master: a private store
  auto s = make_store(solo, 2s);
  s->set("a", "b");
  CHECK(s->get("a") == "b");
  s->barrier("one", 1);

  LaunchEnv r0, r1;
  int port = ptrain_test::free_port();
  for (auto* e : {&r0, &r1}) {
    e->world_size = 2;
    e->master_addr = "127.0.0.1";
    e->master_port = port;
    e->launcher = Launcher::Torchrun;
  }
  r1.rank = 1;
  auto server = make_store(r0, 5s);
  auto client = make_store(r1, 5s);
  CHECK(client->rank() == 1);
  client->set("from1", "x");
  CHECK(server->get("from1") == "x");

  LaunchEnv missing = r1;
  missing.master_addr.clear();
  CHECK_THROWS_AS(make_store(missing, 1s), ptrain::LaunchError);
}

}  // namespace test_store
