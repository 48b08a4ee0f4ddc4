#pragma once
// The store's wire format, shared by the TCP client and server: commands and
// status codes, little-endian encoders, an incremental Reader that never reads
// past a length it has not checked, and socket helpers.
//
// Note [Store protocol]
// One request, one reply, over a TCP connection per client. All integers are
// little-endian; a string is a u32 length followed by its bytes.
//   hello:   "PTRS" u8 version, string token, string job, i64 rank
//                                              -> u8 status (0 ok, 1 bad token, 2 bad version)
//            (job and rank: who the client says it is, Note [Refused clients] in store_server.hpp)
//   request: u8 command, then its fields       -> u8 status (0 ok, 1 error + string, 2 wait canceled), result
// Keys are at most kMaxKeyBytes, values at most kMaxValueBytes, a WAIT or CHECK
// names at most kMaxKeysPerRequest keys. The server checks every length before
// it buffers the bytes behind it, and closes a connection that sends anything
// else (wrong magic, unknown command, an oversized length), so one broken or
// hostile client costs only its own connection.

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ptrain/core/error.hpp"

namespace ptrain::dist {

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
inline constexpr std::uint8_t kStoreVersion = 2;

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

}  // namespace detail

}  // namespace ptrain::dist
