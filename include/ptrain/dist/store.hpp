#pragma once
// Key-value rendezvous store: the abstract Store and TCPStore, a store served
// over TCP by one process (rank 0) and reached by every rank.
//
// Note [Store protocol]
// One request, one reply, over a TCP connection per client. All integers are
// little-endian; a string is a u32 length followed by its bytes.
//   hello:   "PTRS" u8 version, string token  -> u8 status (0 ok, 1 bad token, 2 bad version)
//   request: u8 command, then its fields       -> u8 status (0 ok, 1 error + string, 2 wait canceled), result
// Keys are at most kMaxKeyBytes, values at most kMaxValueBytes, a WAIT or CHECK
// names at most kMaxKeysPerRequest keys. The server checks every length before
// it buffers the bytes behind it, and closes a connection that sends anything
// else (wrong magic, unknown command, an oversized length), so one broken or
// hostile client costs only its own connection.
//
// Note [Waits]
// WAIT is answered by the server when all keys exist; a client that gives up
// sends CANCEL_WAIT and reads replies until the cancel acknowledgement, so the
// connection stays in step and later calls still work (barrier uses this to
// ask which ranks are missing after its wait timed out). GET is WAIT + GET.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/dist/launch_env.hpp"

namespace ptrain::dist {

/// Largest key the store accepts, in bytes.
inline constexpr std::size_t kMaxKeyBytes = 4096;
/// Largest value the store accepts, in bytes.
inline constexpr std::size_t kMaxValueBytes = std::size_t{64} << 20;
/// Most keys one wait() or check() may name.
inline constexpr std::size_t kMaxKeysPerRequest = 4096;
/// Most client connections the server keeps open at once.
inline constexpr std::size_t kMaxStoreConnections = 4096;

/// Key-value store for rendezvous. All blocking calls honour timeout(); failures throw CommError.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets key to value (binary-safe), waking every waiter on key.
  virtual void set(const std::string& key, const std::string& value) = 0;
  /// Value of key; blocks until key exists or timeout() passes.
  virtual std::string get(const std::string& key) = 0;
  /// Blocks until every key exists; CommError naming the missing keys after `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  /// Adds delta to the decimal integer stored at key (0 when absent); returns the new value.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  /// Sets key to desired if it holds expected (or is absent and expected is empty); returns the value now stored
  /// (expected when the key is absent and expected is not empty).
  virtual std::string compare_set(const std::string& key, const std::string& expected,
                                  const std::string& desired) = 0;
  /// True when every key exists; does not block.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Removes key; true when it existed.
  virtual bool delete_key(const std::string& key) = 0;

  /// Blocks until world_size callers passed barrier `name`; reusable. The timeout error names missing ranks
  /// when set_rank() was called.
  void barrier(const std::string& name, int world_size);

  /// Timeout of get(), barrier() and every request.
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  /// This process's rank, so that barrier() can say which ranks are missing; -1 when unknown.
  int rank() const { return rank_; }
  void set_rank(int r) { rank_ = r; }

 protected:
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
  int rank_ = -1;
};

namespace detail {

using ptrain::detail::cat;

/// Owns a file descriptor; closes it once.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

enum class StoreCmd : std::uint8_t { Set = 1, Get, Wait, CancelWait, Add, CompareSet, Check, Delete };
enum class StoreStatus : std::uint8_t { Ok = 0, Error = 1, Canceled = 2 };
inline constexpr char kStoreMagic[4] = {'P', 'T', 'R', 'S'};
inline constexpr std::uint8_t kStoreVersion = 1;

inline void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
inline void put_i64(std::string& out, std::int64_t v) {
  auto u = static_cast<std::uint64_t>(v);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
}
inline void put_str(std::string& out, std::string_view s) {
  put_u32(out, static_cast<std::uint32_t>(s.size()));
  out.append(s);
}

// Reads fields from a buffer that may hold only part of a message. need_more()
// means "wait for more bytes"; bad() means "close the connection".
class Reader {
 public:
  explicit Reader(std::string_view buf) : buf_(buf) {}
  bool ok() const { return !more_ && !bad_; }
  bool need_more() const { return more_ && !bad_; }
  bool bad() const { return bad_; }
  std::size_t consumed() const { return pos_; }

  std::uint8_t u8() {
    if (!avail(1)) return 0;
    return static_cast<std::uint8_t>(buf_[pos_++]);
  }
  std::uint32_t u32() {
    if (!avail(4)) return 0;
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t(static_cast<std::uint8_t>(buf_[pos_ + i])) << (8 * i);
    pos_ += 4;
    return v;
  }
  std::int64_t i64() {
    if (!avail(8)) return 0;
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t(static_cast<std::uint8_t>(buf_[pos_ + i])) << (8 * i);
    pos_ += 8;
    return static_cast<std::int64_t>(v);
  }
  // The length is checked against `limit` before the bytes are awaited, so an
  // oversized length closes the connection instead of filling memory.
  std::string_view str(std::size_t limit) {
    std::uint32_t n = u32();
    if (!ok()) return {};
    if (n > limit) {
      bad_ = true;
      return {};
    }
    if (!avail(n)) return {};
    std::string_view s = buf_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  void fail() { bad_ = true; }

 private:
  bool avail(std::size_t n) {
    if (!ok()) return false;
    if (buf_.size() - pos_ < n) {
      more_ = true;
      return false;
    }
    return true;
  }
  std::string_view buf_;
  std::size_t pos_ = 0;
  bool more_ = false, bad_ = false;
};

inline void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL, 0) | O_NONBLOCK); }
inline void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Compares without an early exit, so the time taken does not reveal how much of a guessed token was right.
inline bool same_token(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

inline std::string quote_keys(const std::vector<std::string>& keys, std::size_t max = 8) {
  std::string s;
  for (std::size_t i = 0; i < keys.size() && i < max; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > max) s += cat(" and ", keys.size() - max, " more");
  return s;
}

/// The store server: one thread polling the listening socket, every client and a wake-up pipe.
/// Single-threaded on purpose: the map needs no lock and requests from all clients are totally ordered.
class StoreServer {
 public:
  StoreServer(int port, std::string token) : token_(std::move(token)) {
    listen_ = open_listener(port);
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    ::getsockname(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                             : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    int p[2];
    PTRAIN_CHECK(::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0, CommError, "[ptrain.store.server] pipe2 failed: ",
                 std::strerror(errno));
    wake_read_ = Fd(p[0]);
    wake_write_ = Fd(p[1]);
    thread_ = std::thread([this] { loop(); });
  }
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;
  // Wakes the loop through the pipe and joins it; clients still connected see
  // their connection close and fail instead of waiting forever.
  ~StoreServer() {
    stop_.store(true);
    char c = 1;
    [[maybe_unused]] auto n = ::write(wake_write_.get(), &c, 1);
    if (thread_.joinable()) thread_.join();
  }
  int port() const { return port_; }
  void set_shutdown_grace(std::chrono::milliseconds g) { grace_ms_.store(g.count()); }

 private:
  struct Conn {
    Fd fd;
    std::string in, out;
    bool hello = false;       // the hello (magic, version, token) was accepted
    bool closing = false;     // close once `out` is flushed (a rejected hello)
    std::vector<std::string> waiting;  // keys of an unanswered WAIT; empty when none
  };

  static Fd open_listener(int port) {
    // Dual-stack "::" takes IPv4 and IPv6 clients; hosts without IPv6 get 0.0.0.0.
    for (int family : {AF_INET6, AF_INET}) {
      Fd fd(::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0));
      if (!fd) continue;
      int one = 1, zero = 0;
      ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      int rc;
      if (family == AF_INET6) {
        ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        sockaddr_in6 a{};
        a.sin6_family = AF_INET6;
        a.sin6_addr = in6addr_any;
        a.sin6_port = htons(static_cast<std::uint16_t>(port));
        rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
      } else {
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_ANY);
        a.sin_port = htons(static_cast<std::uint16_t>(port));
        rc = ::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a);
      }
      if (rc != 0) {
        if (errno == EADDRINUSE)
          PTRAIN_THROW(CommError, "[ptrain.store.bind] cannot serve the store on port ", port,
                       ": address already in use; another job (or a previous run still exiting) holds MASTER_PORT=",
                       port, ", choose another free port");
        continue;
      }
      PTRAIN_CHECK(::listen(fd.get(), 1024) == 0, CommError, "[ptrain.store.bind] listen on port ", port,
                   " failed: ", std::strerror(errno));
      set_nonblocking(fd.get());
      return fd;
    }
    PTRAIN_THROW(CommError, "[ptrain.store.bind] cannot open a listening socket on port ", port, ": ",
                 std::strerror(errno));
  }

  // Note [Server shutdown]
  // Rank 0 often leaves right after the last barrier, while another rank's
  // final request is still on the wire. So after stop the loop keeps serving
  // until every client has disconnected or the grace period (default 2 s)
  // ends, then flushes what is queued and closes. Never longer: a hung client
  // costs rank 0 at most the grace period.
  void loop() {
    std::vector<pollfd> pfds;
    std::vector<std::uint64_t> ids;
    std::optional<std::chrono::steady_clock::time_point> linger_until;
    for (;;) {
      if (stop_.load() && !linger_until)
        linger_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(grace_ms_.load());
      int wait_ms = -1;
      if (linger_until) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*linger_until -
                                                                          std::chrono::steady_clock::now());
        if (conns_.empty() || left.count() <= 0) break;
        wait_ms = static_cast<int>(std::min<long long>(left.count(), 50));
      }
      pfds.clear();
      ids.clear();
      pfds.push_back({wake_read_.get(), POLLIN, 0});
      pfds.push_back({listen_.get(), POLLIN, 0});
      for (auto& [id, c] : conns_) {
        short ev = POLLIN;
        if (!c.out.empty()) ev |= POLLOUT;
        pfds.push_back({c.fd.get(), ev, 0});
        ids.push_back(id);
      }
      int n = ::poll(pfds.data(), pfds.size(), wait_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        break;  // nothing sensible left to do; clients see their connections close
      }
      if (pfds[0].revents) {
        char drain[16];
        while (::read(wake_read_.get(), drain, sizeof drain) > 0) {
        }
        continue;  // stop_ is set; the next turn starts the grace period
      }
      if (pfds[1].revents & POLLIN) accept_all();
      for (std::size_t i = 2; i < pfds.size(); ++i) {
        auto it = conns_.find(ids[i - 2]);
        if (it == conns_.end() || !pfds[i].revents) continue;
        if (!service(it->first, it->second, pfds[i].revents)) close_conn(it->first);
      }
    }
    flush_all();
    conns_.clear();  // closes every client socket before the thread ends
    waiters_.clear();
  }

  // Replies already decided (say, the last barrier release) still reach their
  // clients when rank 0 shuts down right after its own reply; bounded to 1 s.
  void flush_all() {
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (auto& [id, c] : conns_) {
      while (!c.out.empty() && std::chrono::steady_clock::now() < until) {
        pollfd p{c.fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, 50) <= 0) continue;
        ssize_t sent = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
        if (sent <= 0 && errno != EAGAIN && errno != EINTR) break;
        if (sent > 0) c.out.erase(0, static_cast<std::size_t>(sent));
      }
    }
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (conns_.size() >= kMaxStoreConnections) {
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      Conn c;
      c.fd = Fd(fd);
      conns_.emplace(next_id_++, std::move(c));
    }
  }

  // Returns false when the connection must close.
  bool service(std::uint64_t id, Conn& c, short revents) {
    if (revents & (POLLERR | POLLNVAL)) return false;
    if (revents & (POLLIN | POLLHUP)) {
      char buf[1 << 16];
      ssize_t got = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (got == 0) return false;
      if (got < 0) return errno == EAGAIN || errno == EINTR;
      c.in.append(buf, static_cast<std::size_t>(got));
      if (!process(id, c)) return false;
    }
    if (!c.out.empty()) {
      ssize_t sent = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (sent < 0 && errno != EAGAIN && errno != EINTR) return false;
      if (sent > 0) c.out.erase(0, static_cast<std::size_t>(sent));
      // A client that never reads its replies may not make the server hoard them.
      if (c.out.size() > 2 * kMaxValueBytes) return false;
    }
    return !(c.closing && c.out.empty());
  }

  // Handles every complete message in c.in; false on a protocol violation.
  bool process(std::uint64_t id, Conn& c) {
    std::size_t done = 0;
    while (!c.closing) {
      Reader r(std::string_view(c.in).substr(done));
      if (!c.hello) {
        char magic[4];
        for (char& m : magic) m = static_cast<char>(r.u8());
        std::uint8_t version = r.u8();
        std::string_view token = r.str(kMaxKeyBytes);
        if (r.need_more()) {
          // Reject a wrong magic as soon as its bytes are in, not after a length arrives.
          std::size_t have = std::min<std::size_t>(c.in.size() - done, 4);
          if (std::memcmp(c.in.data() + done, kStoreMagic, have) != 0) return false;
          break;
        }
        if (r.bad() || std::memcmp(magic, kStoreMagic, 4) != 0) return false;
        std::uint8_t status = version != kStoreVersion ? 2 : same_token(token, token_) ? 0 : 1;
        c.out.push_back(static_cast<char>(status));
        c.hello = status == 0;
        c.closing = status != 0;
        done += r.consumed();
        continue;
      }
      auto cmd = static_cast<StoreCmd>(r.u8());
      if (r.need_more()) break;
      // While a WAIT is open, the client may only cancel it.
      if (!c.waiting.empty() && cmd != StoreCmd::CancelWait) return false;
      if (!handle(id, c, cmd, r)) return false;
      if (r.need_more()) break;
      if (r.bad()) return false;
      done += r.consumed();
    }
    c.in.erase(0, done);
    return true;
  }

  static void reply_ok(Conn& c) { c.out.push_back(static_cast<char>(StoreStatus::Ok)); }

  // Parses and, once complete, executes one command. Side effects only happen
  // when r.ok() after parsing, so a partial message is re-parsed later from the start.
  bool handle(std::uint64_t id, Conn& c, StoreCmd cmd, Reader& r) {
    switch (cmd) {
      case StoreCmd::Set: {
        auto key = r.str(kMaxKeyBytes);
        auto value = r.str(kMaxValueBytes);
        if (!r.ok()) return true;
        data_[std::string(key)] = std::string(value);
        reply_ok(c);
        notify(std::string(key));
        return true;
      }
      case StoreCmd::Get: {
        auto key = r.str(kMaxKeyBytes);
        if (!r.ok()) return true;
        auto it = data_.find(std::string(key));
        reply_ok(c);
        c.out.push_back(it != data_.end() ? 1 : 0);
        if (it != data_.end()) put_str(c.out, it->second);
        return true;
      }
      case StoreCmd::Wait: {
        std::uint32_t n = r.u32();
        if (!r.ok()) return true;
        if (n == 0 || n > kMaxKeysPerRequest) return false;
        std::vector<std::string> keys;
        for (std::uint32_t i = 0; i < n && r.ok(); ++i) keys.emplace_back(r.str(kMaxKeyBytes));
        if (!r.ok()) return true;
        std::vector<std::string> missing;
        for (auto& k : keys)
          if (!data_.count(k)) missing.push_back(std::move(k));
        if (missing.empty()) {
          reply_ok(c);
        } else {
          for (auto& k : missing) waiters_[k].insert(id);
          c.waiting = std::move(missing);
        }
        return true;
      }
      case StoreCmd::CancelWait: {
        // If the WAIT was answered before the cancel arrived, the client reads
        // that Ok first and then this Canceled (Note [Waits]).
        drop_waits(id, c);
        c.out.push_back(static_cast<char>(StoreStatus::Canceled));
        return true;
      }
      case StoreCmd::Add: {
        auto key = r.str(kMaxKeyBytes);
        std::int64_t delta = r.i64();
        if (!r.ok()) return true;
        std::string k(key);
        std::int64_t v = 0;
        if (auto it = data_.find(k); it != data_.end()) {
          auto parsed = parse_int(it->second);
          if (!parsed) {
            c.out.push_back(static_cast<char>(StoreStatus::Error));
            put_str(c.out, cat("add() on key '", k, "' whose value is not a decimal integer"));
            return true;
          }
          v = *parsed;
        }
        v += delta;
        data_[k] = std::to_string(v);
        reply_ok(c);
        put_i64(c.out, v);
        notify(k);
        return true;
      }
      case StoreCmd::CompareSet: {
        auto key = r.str(kMaxKeyBytes);
        auto expected = r.str(kMaxValueBytes);
        auto desired = r.str(kMaxValueBytes);
        if (!r.ok()) return true;
        std::string k(key);
        auto it = data_.find(k);
        reply_ok(c);
        if (it == data_.end()) {
          if (expected.empty()) {
            data_[k] = std::string(desired);
            put_str(c.out, desired);
            notify(k);
          } else {
            put_str(c.out, expected);
          }
        } else {
          if (it->second == expected) it->second = std::string(desired);
          put_str(c.out, it->second);
        }
        return true;
      }
      case StoreCmd::Check: {
        std::uint32_t n = r.u32();
        if (!r.ok()) return true;
        if (n > kMaxKeysPerRequest) return false;
        bool all = true;
        for (std::uint32_t i = 0; i < n && r.ok(); ++i) all = data_.count(std::string(r.str(kMaxKeyBytes))) && all;
        if (!r.ok()) return true;
        reply_ok(c);
        c.out.push_back(all ? 1 : 0);
        return true;
      }
      case StoreCmd::Delete: {
        auto key = r.str(kMaxKeyBytes);
        if (!r.ok()) return true;
        bool erased = data_.erase(std::string(key)) > 0;
        reply_ok(c);
        c.out.push_back(erased ? 1 : 0);
        return true;
      }
    }
    return false;  // unknown command byte
  }

  // Answers every WAIT whose last missing key is `key`.
  void notify(const std::string& key) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    std::unordered_set<std::uint64_t> ids = std::move(it->second);
    waiters_.erase(it);
    for (std::uint64_t id : ids) {
      auto cit = conns_.find(id);
      if (cit == conns_.end()) continue;
      Conn& c = cit->second;
      std::erase_if(c.waiting, [&](const std::string& k) { return data_.count(k) > 0; });
      if (c.waiting.empty()) reply_ok(c);
      // Keys deleted again before this point stay registered in waiters_.
    }
  }

  void drop_waits(std::uint64_t id, Conn& c) {
    for (auto& k : c.waiting) {
      auto it = waiters_.find(k);
      if (it == waiters_.end()) continue;
      it->second.erase(id);
      if (it->second.empty()) waiters_.erase(it);
    }
    c.waiting.clear();
  }

  void close_conn(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    drop_waits(id, it->second);
    conns_.erase(it);
  }

  std::string token_;
  Fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<long long> grace_ms_{2000};
  std::unordered_map<std::uint64_t, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::unordered_set<std::uint64_t>> waiters_;
  std::uint64_t next_id_ = 0;
  std::thread thread_;  // last member: starts after, and is joined before, everything it uses is destroyed
};

}  // namespace detail

/// A Store served over TCP. The process constructed with is_server = true serves it
/// (and is itself a client); the others connect, retrying with backoff until the timeout.
class TCPStore : public Store {
 public:
  /// host/port: where the server listens (port 0 with is_server picks a free port; see port()).
  /// token: shared secret every client must present; default: the PTRAIN_STORE_TOKEN variable.
  TCPStore(std::string host, int port, bool is_server,
           std::chrono::milliseconds timeout = std::chrono::seconds(300),
           std::optional<std::string> token = std::nullopt)
      : host_(std::move(host)), port_(port) {
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
      server_ = std::make_unique<detail::StoreServer>(port, *token);
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
        if (status != static_cast<std::uint8_t>(detail::StoreStatus::Ok))
          io_failure(op, keys[0], "unexpected reply to WAIT");
        return;
      }
      // Timed out: cancel, then drain until the cancel acknowledgement
      // (an Ok that raced with the cancel comes first; Note [Waits]).
      auto grace = deadline(std::chrono::seconds(10));
      send_all(request(detail::StoreCmd::CancelWait), op, keys[0], grace);
      for (;;) {
        auto s = static_cast<detail::StoreStatus>(read_u8(op, keys[0], grace));
        if (s == detail::StoreStatus::Canceled) break;
        if (s != detail::StoreStatus::Ok) io_failure(op, keys[0], "unexpected reply to CANCEL_WAIT");
      }
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

  std::string host_;
  int port_ = 0;
  std::mutex mu_;  // one request/reply at a time on the socket
  detail::Fd sock_;
  // Declared last, destroyed first: the server thread stops before this client's socket closes.
  std::unique_ptr<detail::StoreServer> server_;
};

inline void Store::barrier(const std::string& name, int world_size) {
  PTRAIN_CHECK(world_size >= 1, CommError, "[ptrain.store.barrier] barrier('", name, "') with world size ",
               world_size, "; it must be >= 1");
  // Arrivals are counted forever; the count's generation separates reuses of one name.
  const std::string base = "ptrain/barrier/" + name;
  std::int64_t n = add(base + "/count", 1);
  std::int64_t gen = (n - 1) / world_size;
  const std::string g = base + "/" + std::to_string(gen);
  if (rank_ >= 0) set(g + "/arrived/" + std::to_string(rank_), "");
  if (n % world_size == 0) {
    // The last arrival releases the others and has nothing to wait for.
    set(g + "/done", "");
    return;
  }
  try {
    wait({g + "/done"}, timeout_);
  } catch (const CommError&) {
    std::int64_t arrived = std::min<std::int64_t>(add(base + "/count", 0) - gen * world_size, world_size);
    std::string missing;
    if (rank_ >= 0) {
      int listed = 0;
      for (int r = 0; r < world_size && listed < 32; ++r)
        if (!check({g + "/arrived/" + std::to_string(r)})) missing += (listed++ ? ", " : "") + std::to_string(r);
      if (listed == 32) missing += ", ...";
    }
    PTRAIN_THROW(CommError, "[ptrain.store.barrier_timeout] barrier('", name, "') timed out after ", timeout_.count(),
                 " ms: ", arrived, " of ", world_size, " ranks arrived",
                 missing.empty() ? std::string() : "; missing ranks: " + missing,
                 ". Those ranks are stuck, crashed or were never started; check their logs");
  }
}

/// The store every rank of a launch reaches: served by rank 0 at MASTER_ADDR:MASTER_PORT.
/// Under torchrun's agent store (whose protocol is PyTorch's, not ptrain's), rank 0 serves
/// ptrain's store on PTRAIN_STORE_PORT, or MASTER_PORT + 1 when that is unset.
/// A single process with no master address gets a private store on a free port.
inline std::unique_ptr<Store> make_store(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  std::unique_ptr<TCPStore> store;
  if (env.world_size == 1 && (env.master_addr.empty() || env.master_port == 0)) {
    store = std::make_unique<TCPStore>("127.0.0.1", 0, true, timeout);
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
    store = std::make_unique<TCPStore>(env.master_addr, port, env.rank == 0, timeout);
  }
  store->set_rank(env.rank);
  return store;
}

}  // namespace ptrain::dist
