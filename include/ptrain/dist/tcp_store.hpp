#pragma once
// TCPStore, the Store every rank reaches over TCP (rank 0 also serves it), and
// make_store(), which builds it from the launch environment.
//
// Note [Waits]
// WAIT is answered by the server when all keys exist; a client that gives up
// sends CANCEL_WAIT and reads replies until the cancel acknowledgement, so the
// connection stays in step and later calls still work (barrier uses this to
// ask which ranks are missing after its wait timed out). GET is WAIT + GET.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/dist/launch_env.hpp"
#include "ptrain/dist/store_interface.hpp"
#include "ptrain/dist/store_protocol.hpp"
#include "ptrain/dist/store_server.hpp"

namespace ptrain::dist {

namespace detail {
inline bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}
}  // namespace detail

/// Who a store client says it is in its hello (Note [Refused clients] in store_server.hpp).
struct StoreClaim {
  std::string job;    ///< the job's id: TORCHELASTIC_RUN_ID, which ptrun and torchrun set ("" when unset)
  int rank = -1;      ///< the client's rank (a launcher's agent: its node rank); -1: none

  /// This process's job from TORCHELASTIC_RUN_ID, with `rank`.
  static StoreClaim from_env(int rank = -1) {
    const char* job = std::getenv("TORCHELASTIC_RUN_ID");
    return {job ? std::string(job) : std::string(), rank};
  }
};

/// A Store served over TCP. The process constructed with is_server = true serves it
/// (and is itself a client); the others connect, retrying with backoff until the timeout.
/// A server whose host is an IPv4 loopback address listens on loopback only.
class TCPStore : public Store {
 public:
  /// host/port: where the server listens (port 0 with is_server picks a free port; see port()).
  /// token: shared secret every client must present; default: the PTRAIN_STORE_TOKEN variable.
  /// claim: who this client is, sent in its hello; the server's job is its claim's job.
  TCPStore(std::string host, int port, bool is_server,
           std::chrono::milliseconds timeout = std::chrono::seconds(300),
           std::optional<std::string> token = std::nullopt, StoreClaim claim = StoreClaim::from_env())
      : host_(std::move(host)), port_(port), claim_(std::move(claim)) {
    timeout_ = timeout;
    if (!token) {
      const char* t = std::getenv("PTRAIN_STORE_TOKEN");
      token = t ? std::string(t) : std::string();
    }
    PTRAIN_CHECK(token->size() <= kMaxKeyBytes, CommError, "[ptrain.store.token] PTRAIN_STORE_TOKEN is ",
                 token->size(), " bytes; use at most ", kMaxKeyBytes);
    PTRAIN_CHECK(port >= 0 && port <= 65535 && (port > 0 || is_server), CommError,
                 "[ptrain.store.port] port ", port, " is not a TCP port; set MASTER_PORT to 1..65535");
    if (is_server) {
      server_ = std::make_unique<detail::StoreServer>(port, *token, detail::is_loopback(host_) && host_ != "::1",
                                                      claim_.job);
      port_ = server_->port();
      // The server's own client uses loopback: the advertised host may be a
      // name other hosts use for this machine, behind a firewall from itself.
      connect("127.0.0.1", *token);
    } else {
      connect(host_, *token);
    }
  }

  TCPStore(const TCPStore&) = delete;
  TCPStore& operator=(const TCPStore&) = delete;
  // This process's own connection closes first, so the server (Note [Server
  // shutdown]) waits only for the other ranks.
  ~TCPStore() override {
    sock_.reset();
    server_.reset();
  }

  /// Port the store is served on (the chosen one when constructed with port 0).
  int port() const { return port_; }
  /// Server only: how long destruction keeps serving clients that are still connected (default 2 s).
  void set_shutdown_grace(std::chrono::milliseconds g) {
    if (server_) server_->set_shutdown_grace(g);
  }
  /// Host clients connect to.
  const std::string& host() const { return host_; }

  void set(const std::string& key, const std::string& value) override {
    check_key(key, "set");
    PTRAIN_CHECK(value.size() <= kMaxValueBytes, CommError, "[ptrain.store.too_large] set('", key, "'): value of ",
                 value.size(), " bytes exceeds the store's limit of ", kMaxValueBytes, " bytes");
    std::string msg = request(detail::StoreCmd::Set);
    detail::put_str(msg, key);
    detail::put_str(msg, value);
    std::lock_guard lock(mu_);
    roundtrip(msg, "set", key, deadline(timeout_));
  }

  std::string get(const std::string& key) override {
    check_key(key, "get");
    auto until = deadline(timeout_);
    for (;;) {
      // The key can be deleted between the wait and the read; then wait again.
      wait_until({key}, until, timeout_, "get");
      std::string msg = request(detail::StoreCmd::Get);
      detail::put_str(msg, key);
      std::lock_guard lock(mu_);
      roundtrip(msg, "get", key, until);
      if (read_u8("get", key, until)) return read_str("get", key, until);
    }
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    wait_until(keys, deadline(timeout), timeout, "wait");
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check_key(key, "add");
    std::string msg = request(detail::StoreCmd::Add);
    detail::put_str(msg, key);
    detail::put_i64(msg, delta);
    std::lock_guard lock(mu_);
    auto until = deadline(timeout_);
    roundtrip(msg, "add", key, until);
    return read_i64("add", key, until);
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    check_key(key, "compare_set");
    PTRAIN_CHECK(expected.size() <= kMaxValueBytes && desired.size() <= kMaxValueBytes, CommError,
                 "[ptrain.store.too_large] compare_set('", key, "'): value exceeds ", kMaxValueBytes, " bytes");
    std::string msg = request(detail::StoreCmd::CompareSet);
    detail::put_str(msg, key);
    detail::put_str(msg, expected);
    detail::put_str(msg, desired);
    std::lock_guard lock(mu_);
    auto until = deadline(timeout_);
    roundtrip(msg, "compare_set", key, until);
    return read_str("compare_set", key, until);
  }

  bool check(const std::vector<std::string>& keys) override {
    std::string msg = keys_request(detail::StoreCmd::Check, keys, "check");
    std::lock_guard lock(mu_);
    auto until = deadline(timeout_);
    roundtrip(msg, "check", keys.empty() ? "" : keys[0], until);
    return read_u8("check", keys.empty() ? "" : keys[0], until) != 0;
  }

  bool delete_key(const std::string& key) override {
    check_key(key, "delete_key");
    std::string msg = request(detail::StoreCmd::Delete);
    detail::put_str(msg, key);
    std::lock_guard lock(mu_);
    auto until = deadline(timeout_);
    roundtrip(msg, "delete_key", key, until);
    return read_u8("delete_key", key, until) != 0;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static Clock::time_point deadline(std::chrono::milliseconds t) { return Clock::now() + t; }
  static std::string request(detail::StoreCmd cmd) { return std::string(1, static_cast<char>(cmd)); }
  std::string where() const { return detail::cat(host_, ":", port_); }

  static void check_key(const std::string& key, const char* op) {
    PTRAIN_CHECK(key.size() <= kMaxKeyBytes, CommError, "[ptrain.store.too_large] ", op, "(): key of ", key.size(),
                 " bytes exceeds the store's limit of ", kMaxKeyBytes, " bytes");
  }

  static std::string keys_request(detail::StoreCmd cmd, const std::vector<std::string>& keys, const char* op) {
    PTRAIN_CHECK(keys.size() <= kMaxKeysPerRequest, CommError, "[ptrain.store.too_large] ", op, "() on ",
                 keys.size(), " keys; at most ", kMaxKeysPerRequest, " per call");
    std::string msg = request(cmd);
    detail::put_u32(msg, static_cast<std::uint32_t>(keys.size()));
    for (auto& k : keys) {
      check_key(k, op);
      detail::put_str(msg, k);
    }
    return msg;
  }

  // Connects with exponential backoff (10 ms .. 1 s, jittered) until the
  // timeout: rank 0 may start later than the others, and a Kubernetes
  // service name may not resolve until its pod is scheduled.
  void connect(const std::string& host, const std::string& token) {
    auto until = deadline(timeout_);
    std::chrono::milliseconds backoff(10);
    std::minstd_rand jitter(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(port_));
    std::string last_error = "no attempt made";
    for (;;) {
      if (try_connect(host, last_error)) {
        hello(token, until);
        return;
      }
      auto now = Clock::now();
      if (now >= until) break;
      auto pause = std::min<Clock::duration>(backoff + std::chrono::milliseconds(jitter() % 10), until - now);
      std::this_thread::sleep_for(pause);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
    PTRAIN_THROW(CommError, "[ptrain.store.connect] could not reach the rendezvous store at ", host, ":", port_,
                 " within ", timeout_.count(), " ms (last error: ", last_error,
                 "); check that rank 0 is running and that MASTER_ADDR/MASTER_PORT name its host and a port "
                 "it can listen on");
  }

  bool try_connect(const std::string& host, std::string& last_error) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    std::string port_str = std::to_string(port_);
    int rc = ::getaddrinfo(host.c_str(), port_str.c_str(), &hints, &res);
    if (rc != 0) {
      last_error = detail::cat("cannot resolve '", host, "': ", ::gai_strerror(rc));
      return false;
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, ::freeaddrinfo);
    for (addrinfo* a = res; a; a = a->ai_next) {
      detail::Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol));
      if (!fd) continue;
      if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) {
        detail::set_nodelay(fd.get());
        sock_ = std::move(fd);
        return true;
      }
      last_error = std::strerror(errno);
    }
    return false;
  }

  void hello(const std::string& token, Clock::time_point until) {
    std::string msg(detail::kStoreMagic, 4);
    msg.push_back(static_cast<char>(detail::kStoreVersion));
    detail::put_str(msg, token);
    detail::put_str(msg, claim_.job);
    detail::put_i64(msg, claim_.rank);
    send_all(msg, "connect", "", until);
    std::uint8_t status = 0;
    recv_all(&status, 1, "connect", "", until);
    if (status == 1) {
      sock_.reset();
      PTRAIN_THROW(CommError, "[ptrain.store.auth] the rendezvous store at ", where(),
                   " rejected this process's token; set PTRAIN_STORE_TOKEN to the same value on every rank (",
                   token.empty() ? "it is unset here" : "it is set here", ")");
    }
    if (status != 0) {
      sock_.reset();
      PTRAIN_THROW(CommError, "[ptrain.store.version] the rendezvous store at ", where(),
                   " speaks another protocol version; run the same ptrain build on every rank");
    }
  }

  [[noreturn]] void io_failure(const char* op, const std::string& key, const std::string& why) {
    sock_.reset();  // the stream is out of step now; later calls fail fast instead of reading stale replies
    PTRAIN_THROW(CommError, "[ptrain.store.io] ", op, "('", key, "') on the rendezvous store at ", where(),
                 " failed: ", why, "; rank 0 (which serves the store) may have exited or been killed");
  }

  void ensure_open(const char* op, const std::string& key) {
    if (!sock_)
      PTRAIN_THROW(CommError, "[ptrain.store.closed] ", op, "('", key, "'): the connection to the rendezvous store at ",
                   where(), " was lost by an earlier error; create a new store");
  }

  // poll() until the socket is ready or the deadline passes; false on timeout.
  bool wait_ready(short events, Clock::time_point until, const char* op, const std::string& key) {
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      if (left < 0) left = 0;
      pollfd p{sock_.get(), events, 0};
      int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1 << 30)));
      if (n > 0) return true;
      if (n == 0) return false;
      if (errno != EINTR) io_failure(op, key, std::strerror(errno));
    }
  }

  void send_all(const std::string& msg, const char* op, const std::string& key, Clock::time_point until) {
    ensure_open(op, key);
    std::size_t off = 0;
    while (off < msg.size()) {
      if (!wait_ready(POLLOUT, until, op, key)) io_failure(op, key, "timed out sending the request");
      ssize_t n = ::send(sock_.get(), msg.data() + off, msg.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        io_failure(op, key, std::strerror(errno));
      }
      off += static_cast<std::size_t>(n);
    }
  }

  // Returns false on timeout (only when allow_timeout); throws on EOF or error.
  bool recv_all(void* dst, std::size_t len, const char* op, const std::string& key, Clock::time_point until,
                bool allow_timeout = false) {
    ensure_open(op, key);
    auto* p = static_cast<char*>(dst);
    std::size_t off = 0;
    while (off < len) {
      if (!wait_ready(POLLIN, until, op, key)) {
        if (allow_timeout && off == 0) return false;
        io_failure(op, key, "timed out waiting for the reply");
      }
      ssize_t n = ::recv(sock_.get(), p + off, len - off, MSG_DONTWAIT);
      if (n == 0)
        io_failure(op, key, "the server closed the connection (if it requires a token, set PTRAIN_STORE_TOKEN)");
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        io_failure(op, key, std::strerror(errno));
      }
      off += static_cast<std::size_t>(n);
    }
    return true;
  }

  std::uint8_t read_u8(const char* op, const std::string& key, Clock::time_point until) {
    std::uint8_t v = 0;
    recv_all(&v, 1, op, key, until);
    return v;
  }
  std::int64_t read_i64(const char* op, const std::string& key, Clock::time_point until) {
    unsigned char b[8];
    recv_all(b, 8, op, key, until);
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t(b[i]) << (8 * i);
    return static_cast<std::int64_t>(v);
  }
  std::string read_str(const char* op, const std::string& key, Clock::time_point until) {
    unsigned char b[4];
    recv_all(b, 4, op, key, until);
    std::uint32_t n = b[0] | (b[1] << 8) | (b[2] << 16) | (std::uint32_t(b[3]) << 24);
    if (n > kMaxValueBytes) io_failure(op, key, "reply longer than the value limit");
    std::string s(n, '\0');
    recv_all(s.data(), n, op, key, until);
    return s;
  }

  // Sends a request and reads its status byte; an error status becomes CommError.
  void roundtrip(const std::string& msg, const char* op, const std::string& key, Clock::time_point until) {
    send_all(msg, op, key, until);
    auto status = static_cast<detail::StoreStatus>(read_u8(op, key, until));
    if (status == detail::StoreStatus::Error)
      PTRAIN_THROW(CommError, "[ptrain.store.error] ", op, "('", key, "'): ", read_str(op, key, until));
    if (status != detail::StoreStatus::Ok) io_failure(op, key, "unexpected reply from the server");
  }

  void wait_until(const std::vector<std::string>& keys, Clock::time_point until, std::chrono::milliseconds timeout,
                  const char* op) {
    if (keys.empty()) return;
    std::string msg = keys_request(detail::StoreCmd::Wait, keys, op);
    {
      std::lock_guard lock(mu_);
      send_all(msg, op, keys[0], until);
      std::uint8_t status = 0;
      if (recv_all(&status, 1, op, keys[0], until, /*allow_timeout=*/true)) {
        if (status == static_cast<std::uint8_t>(detail::StoreStatus::Error)) refused(keys, read_str(op, keys[0], until), op);
        if (status != static_cast<std::uint8_t>(detail::StoreStatus::Ok))
          io_failure(op, keys[0], "unexpected reply to WAIT");
        return;
      }
      // Timed out: cancel, then drain until the cancel acknowledgement
      // (an Ok or an error that raced with the cancel comes first; Note [Waits]).
      auto grace = deadline(std::chrono::seconds(10));
      send_all(request(detail::StoreCmd::CancelWait), op, keys[0], grace);
      std::string error;
      for (;;) {
        auto s = static_cast<detail::StoreStatus>(read_u8(op, keys[0], grace));
        if (s == detail::StoreStatus::Canceled) break;
        if (s == detail::StoreStatus::Error) error = read_str(op, keys[0], grace);
        else if (s != detail::StoreStatus::Ok) io_failure(op, keys[0], "unexpected reply to CANCEL_WAIT");
      }
      if (!error.empty()) refused(keys, error, op);
    }
    // Name the keys still missing, which is what the user has to chase.
    std::vector<std::string> missing;
    for (auto& k : keys)
      if (missing.size() < 16 && !check({k})) missing.push_back(k);
    if (missing.empty()) return;  // they all arrived while we were cancelling
    PTRAIN_THROW(CommError, "[ptrain.store.timeout] ", op, "() on the rendezvous store at ", where(),
                 " timed out after ", timeout.count(), " ms waiting for key(s) ", detail::quote_keys(keys),
                 "; still missing: ", detail::quote_keys(missing),
                 ". The rank that sets them has not reached that point: check its log, or raise the timeout");
  }

  // A WAIT the server failed (Note [Refused clients] in dist/store_server.hpp).
  [[noreturn]] void refused(const std::vector<std::string>& keys, const std::string& why, const char* op) const {
    PTRAIN_THROW(dist::StoreRefusedError, "[ptrain.store.refused] ", op, "() on the rendezvous store at ", where(), " for key(s) ",
                 detail::quote_keys(keys), " failed at once: ", why);
  }

  std::string host_;
  int port_ = 0;
  StoreClaim claim_;
  std::mutex mu_;  // one request/reply at a time on the socket
  detail::Fd sock_;
  // Declared last, destroyed first: the server thread stops before this client's socket closes.
  std::unique_ptr<detail::StoreServer> server_;
};

/// The store every rank of a launch reaches: served by rank 0 at MASTER_ADDR:MASTER_PORT.
/// Under torchrun's agent store (whose protocol is PyTorch's, not ptrain's), rank 0 serves
/// ptrain's store on PTRAIN_STORE_PORT, or MASTER_PORT + 1 when that is unset.
/// A single process with no master address gets a private store on a free port.
inline std::unique_ptr<Store> make_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  std::unique_ptr<TCPStore> store;
  if (env.world_size == 1 && (env.master_addr.empty() || env.master_port == 0)) {
    store = std::make_unique<TCPStore>("127.0.0.1", 0, true, timeout, std::nullopt, StoreClaim::from_env(env.rank));
  } else {
    env.require_master();
    int port = env.master_port;
    if (env.agent_store) {
      port = env.master_port + 1;
      if (const char* p = std::getenv("PTRAIN_STORE_PORT")) {
        auto v = detail::parse_int(p);
        PTRAIN_CHECK(v && *v > 0 && *v <= 65535, LaunchError, "[ptrain.launch.out_of_range] PTRAIN_STORE_PORT='", p,
                     "' is not a TCP port; set it to a free port in 1..65535");
        port = static_cast<int>(*v);
      }
      PTRAIN_CHECK(port <= 65535, LaunchError, "[ptrain.launch.out_of_range] MASTER_PORT + 1 = ", port,
                   " is not a TCP port; set PTRAIN_STORE_PORT to a free port");
    }
    store = std::make_unique<TCPStore>(env.master_addr, port, env.rank == 0, timeout, std::nullopt,
                                       StoreClaim::from_env(env.rank));
  }
  store->set_rank(env.rank);
  return store;
}

}  // namespace ptrain::dist
