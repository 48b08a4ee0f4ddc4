#pragma once
// The store server (detail::StoreServer): one thread that serves the store's
// map to every TCP client (Note [Store protocol] in dist/store_protocol.hpp),
// answers waits when their keys arrive, and lingers briefly at shutdown
// (Note [Server shutdown]). TCPStore starts it on rank 0.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/dist/launch_env.hpp"  // parse_int
#include "ptrain/dist/store_interface.hpp"
#include "ptrain/dist/store_protocol.hpp"

namespace ptrain::dist {

namespace detail {

/// The store's map and protocol without sockets: the server's connections as
/// byte buffers in and out (Note [Store protocol]). StoreServer runs it on real
/// sockets; the protocol fuzzer (tests/fuzz/fuzz_store_protocol.cpp) feeds it directly.
class StoreProtocol {
 public:
  /// job: this job's id (TORCHELASTIC_RUN_ID), which a refused client's hello is compared with.
  explicit StoreProtocol(std::string token, std::string job = {}) : token_(std::move(token)), job_(std::move(job)) {}

  /// A new client connection; `peer` ("address:port") is named in messages. Returns its id.
  std::uint64_t open(std::string peer, Fd fd = Fd()) {
    Conn c;
    c.fd = std::move(fd);
    c.peer = std::move(peer);
    conns_.emplace(next_id_, std::move(c));
    return next_id_++;
  }
  /// Bytes from client `id`: handles every complete message in order. False when
  /// the client broke the protocol; then close(id).
  bool receive(std::uint64_t id, std::string_view bytes) {
    Conn& c = conns_.at(id);
    c.in.append(bytes);
    return process(id, c);
  }
  /// Takes the replies queued for client `id`.
  std::string take_output(std::uint64_t id) { return std::exchange(conns_.at(id).out, std::string()); }
  /// Whether client `id` must be closed once its replies are sent (a refused hello).
  bool closing(std::uint64_t id) const { return conns_.at(id).closing; }
  void close(std::uint64_t id) { close_conn(id); }
  std::size_t connections() const { return conns_.size(); }

 protected:
  using Clock = std::chrono::steady_clock;
  struct Conn {
    Fd fd;
    std::string in, out;
    bool hello = false;       // the hello (magic, version, token) was accepted
    bool closing = false;     // close once `out` is flushed (a rejected hello)
    std::string peer;         // "address:port", for messages
    std::vector<std::string> waiting;  // keys of an unanswered WAIT; empty when none
    std::optional<Clock::time_point> refused_deadline;  // Note [Refused clients]
  };

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
        std::string_view job = r.str(kMaxKeyBytes);
        const std::int64_t rank = r.i64();
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
        if (status == 1) refuse(c.peer, token.empty(), job, rank);
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
  static void reply_error(Conn& c, std::string_view message) {
    c.out.push_back(static_cast<char>(StoreStatus::Error));
    put_str(c.out, message);
  }

  // Note [Refused clients]
  // A client that speaks the protocol but presents a wrong or missing token may
  // be a rank of this job started with another PTRAIN_STORE_TOKEN (or without
  // one): it never joins, so every rank waiting for its keys would sit out the
  // whole timeout (300 s by default) and then blame a missing rank. Or it is a
  // stranger: another job's rank that reached this port, a tool, a scan. The
  // hello says who the client is: its job (TORCHELASTIC_RUN_ID, empty when the
  // launcher sets none) and its rank (-1 for a client that is no rank). A
  // refused client that claims a rank of this job (a rank >= 0 and this
  // server's job) gives every WAIT open at that moment, or begun within
  // kRefusedGrace after it, kRefusedGrace to complete; one that does not fails
  // with an error naming that rank. A job whose ranks are all there completes
  // its waits in time and trains on; waits begun later are not affected. Any
  // other refused client is a stranger: it is named on stderr and changes
  // nothing, so a stranger never ends a job, whether it has all its ranks or
  // still waits for a late one. Garbage on the port (a wrong magic) only loses
  // its connection.
  static constexpr std::chrono::seconds kRefusedGrace{10};

  void refuse(const std::string& peer, bool missing_token, std::string_view job, std::int64_t rank) {
    const char* presented = missing_token ? "no token" : "a wrong token";
    if (rank < 0 || job != job_) {
      const std::string claims = rank < 0 ? std::string("no rank")
                                          : cat("rank ", rank, " of job '", job, "' (this job is '", job_, "')");
      std::fprintf(stderr, "ptrain store: refused a client from %s that presented %s and claims %s; it is not a "
                   "rank of this job, so it is ignored\n", peer.c_str(), presented, claims.c_str());
      return;
    }
    refused_ = cat("the store refused rank ", rank, " of this job, from ", peer, ", which presented ", presented,
                   " (a wrong or missing PTRAIN_STORE_TOKEN), and this wait did not complete within ",
                   kRefusedGrace.count(), " s after it, so that rank cannot join; set PTRAIN_STORE_TOKEN to the "
                   "same value on every rank (or on none)");
    refused_until_ = Clock::now() + kRefusedGrace;
    for (auto& [id, w] : conns_)
      if (!w.waiting.empty()) w.refused_deadline = *refused_until_;
  }

 public:
  /// Fails the WAITs whose refusal deadline has passed (Note [Refused clients]); the
  /// time until the next deadline, if any.
  std::optional<std::chrono::milliseconds> expire_refused_waits() {
    std::optional<std::chrono::milliseconds> next;
    const auto now = Clock::now();
    for (auto& [id, w] : conns_) {
      if (w.waiting.empty()) w.refused_deadline.reset();  // answered meanwhile
      if (w.waiting.empty() || !w.refused_deadline) continue;
      if (now >= *w.refused_deadline) {
        drop_waits(id, w);
        reply_error(w, refused_);
        continue;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*w.refused_deadline - now);
      next = next ? std::min(*next, left) : left;
    }
    return next;
  }

 protected:

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
          c.refused_deadline.reset();  // Note [Refused clients]
          if (refused_until_ && Clock::now() < *refused_until_) c.refused_deadline = Clock::now() + kRefusedGrace;
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
            reply_error(c, cat("add() on key '", k, "' whose value is not a decimal integer"));
            return true;
          }
          v = *parsed;
        }
        if (__builtin_add_overflow(v, delta, &v)) {
          reply_error(c, cat("add(", delta, ") on key '", k, "' would overflow a 64-bit integer"));
          return true;
        }
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
  std::string job_;  // this job's id (TORCHELASTIC_RUN_ID), for refused clients' claims
  std::string refused_;  // why waits fail, once a client was refused (Note [Refused clients])
  std::optional<Clock::time_point> refused_until_;  // waits begun before this get a deadline
  std::unordered_map<std::uint64_t, Conn> conns_;
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::unordered_set<std::uint64_t>> waiters_;
  std::uint64_t next_id_ = 0;
};

/// The store server: one thread polling the listening socket, every client and a wake-up pipe.
/// Single-threaded on purpose: the map needs no lock and requests from all clients are totally ordered.
class StoreServer : private StoreProtocol {
 public:
  /// loopback_only: listen on 127.0.0.1 only (the store's host is a loopback address,
  /// so no other machine should reach it).
  StoreServer(int port, std::string token, bool loopback_only = false, std::string job = {})
      : StoreProtocol(std::move(token), std::move(job)) {
    listen_ = open_listener(port, loopback_only);
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
  static Fd open_listener(int port, bool loopback_only) {
    // Dual-stack "::" takes IPv4 and IPv6 clients; hosts without IPv6 get 0.0.0.0.
    for (int family : {AF_INET6, AF_INET}) {
      if (loopback_only && family == AF_INET6) continue;
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
        a.sin_addr.s_addr = htonl(loopback_only ? INADDR_LOOPBACK : INADDR_ANY);
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
      if (const auto next = expire_refused_waits()) wait_ms = static_cast<int>(next->count()) + 1;
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
      sockaddr_storage addr{};
      socklen_t len = sizeof addr;
      int fd = ::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (conns_.size() >= kMaxStoreConnections) {
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      open(peer_name(addr), Fd(fd));
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

  static std::string peer_name(const sockaddr_storage& a) {
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (a.ss_family == AF_INET6) {
      const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
      ::inet_ntop(AF_INET6, &v6.sin6_addr, host, sizeof host);
      port = ntohs(v6.sin6_port);
    } else if (a.ss_family == AF_INET) {
      const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
      ::inet_ntop(AF_INET, &v4.sin_addr, host, sizeof host);
      port = ntohs(v4.sin_port);
    }
    std::string h = host;
    if (h.rfind("::ffff:", 0) == 0) h.erase(0, 7);  // an IPv4 client of the dual-stack socket
    return cat(h, ":", port);
  }

  Fd listen_, wake_read_, wake_write_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<long long> grace_ms_{2000};
  std::thread thread_;  // last member: starts after, and is joined before, everything it uses is destroyed
};

}  // namespace detail

}  // namespace ptrain::dist
