#pragma once
// The ranks' output as ptrun passes it on: every line prefixed with the rank that
// wrote it, and copied to per-rank log files (torchrun's --log-dir, --redirects,
// --tee). Each stream of a rank is a pipe that ptrun's poll loop drains.

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace ptrun {

// torchrun's Std: which of a rank's streams a setting applies to.
enum Std : unsigned { kNone = 0, kOut = 1, kErr = 2, kAll = 3 };

/// "3" (every local rank) or "0:3,1:0" (by local rank; others none), as torchrun takes
/// for --redirects and --tee.
inline std::map<int, unsigned> parse_std_map(const std::string& v, const char* flag) {
  std::map<int, unsigned> m;
  auto bad = [&] {
    return std::runtime_error(std::string(flag) + " '" + v + "': give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
                              "for every local rank or as local_rank:value pairs such as 0:3,1:0");
  };
  auto value = [&](const std::string& s) {
    if (s.size() != 1 || s[0] < '0' || s[0] > '3') throw bad();
    return static_cast<unsigned>(s[0] - '0');
  };
  if (v.find(':') == std::string::npos) {
    if (const unsigned all = value(v)) m[-1] = all;
    return m;
  }
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string item = v.substr(start, end - start);
    const std::size_t colon = item.find(':');
    if (colon == std::string::npos || colon == 0 || item.find_first_not_of("0123456789") != colon) throw bad();
    m[std::stoi(item.substr(0, colon))] = value(item.substr(colon + 1));
    start = end + 1;
  }
  std::erase_if(m, [](const auto& kv) { return kv.second == kNone; });  // none is the default
  return m;
}

inline unsigned std_for(const std::map<int, unsigned>& m, int local_rank) {
  if (auto it = m.find(local_rank); it != m.end()) return it->second;
  if (auto it = m.find(-1); it != m.end()) return it->second;
  return kNone;
}

/// The prefix template with its variables filled in, as torchrun fills
/// TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (Python's string.Template.safe_substitute):
/// ${role_name}, ${rank} and ${local_rank}, also written $rank etc.; $$ is one $; any
/// other $ is left as written.
inline std::string expand_prefix(const std::string& t, const std::string& role, int rank, int local_rank) {
  auto value = [&](const std::string& name, std::string& out) {
    if (name == "role_name") out = role;
    else if (name == "rank") out = std::to_string(rank);
    else if (name == "local_rank") out = std::to_string(local_rank);
    else return false;
    return true;
  };
  auto ident_start = [](char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
  auto ident_char = [&](char c) { return ident_start(c) || (c >= '0' && c <= '9'); };
  std::string out;
  for (std::size_t i = 0; i < t.size();) {
    if (t[i] != '$' || i + 1 == t.size()) {
      out += t[i++];
      continue;
    }
    if (t[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    const bool braced = t[i + 1] == '{';
    std::size_t b = i + (braced ? 2 : 1), e = b;
    if (e < t.size() && ident_start(t[e]))
      while (e < t.size() && ident_char(t[e])) ++e;
    std::string v;
    if (e > b && (!braced || (e < t.size() && t[e] == '}')) && value(t.substr(b, e - b), v)) {
      out += v;
      i = braced ? e + 1 : e;
    } else {
      out += t[i++];  // not a known variable: kept as written
    }
  }
  return out;
}

inline void make_dirs(const std::string& path) {
  for (std::size_t p = path.find('/', 1);; p = path.find('/', p + 1)) {
    const std::string part = path.substr(0, p);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw std::runtime_error("cannot create the log folder " + part + ": " + std::strerror(errno));
    if (p == std::string::npos) return;
  }
}

inline void write_all(int fd, const std::string& s) {
  std::size_t done = 0;
  while (done < s.size()) {
    const ssize_t n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed console must not stop the job
    done += static_cast<std::size_t>(n);
  }
}

/// The pipes of one round's ranks.
class Output {
 public:
  struct Rank {
    int rank, local_rank;
    unsigned to_file;     // streams copied to <dir>/<local_rank>/std{out,err}.log
    unsigned to_console;  // streams passed on to ptrun's own stdout/stderr (neither: /dev/null)
  };

  /// Creates the pipes (and log files) of one rank; returns the write ends for the
  /// child's stdout and stderr (-1: the child keeps ptrun's stream).
  std::pair<int, int> add(const Rank& r, const std::string& prefix, const std::string& log_dir) {
    int ends[2] = {-1, -1};
    for (int s = 0; s < 2; ++s) {
      const unsigned bit = s == 0 ? kOut : kErr;
      const bool file = (r.to_file & bit) != 0, console = (r.to_console & bit) != 0;
      if (!file && !console) {  // shown nowhere (--local-ranks-filter): the stream goes to /dev/null
        ends[s] = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
        if (ends[s] < 0) throw std::runtime_error(std::string("cannot open /dev/null: ") + std::strerror(errno));
        continue;
      }
      if (!file && prefix.empty()) continue;  // nothing to do with the bytes: no pipe
      Stream st;
      st.console_fd = console ? (s == 0 ? STDOUT_FILENO : STDERR_FILENO) : -1;
      st.prefix = prefix;
      if (file) {
        const std::string dir = log_dir + "/" + std::to_string(r.local_rank);
        make_dirs(dir);
        const std::string path = dir + (s == 0 ? "/stdout.log" : "/stderr.log");
        st.file_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (st.file_fd < 0) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
      }
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
      st.read_fd = p[0];
      ends[s] = p[1];
      streams_.push_back(std::move(st));
    }
    return {ends[0], ends[1]};
  }

  ~Output() {
    for (auto& s : streams_) close(s);
  }

  bool open() const {
    for (const auto& s : streams_)
      if (s.read_fd >= 0) return true;
    return false;
  }
  /// Appends a pollfd per open stream.
  void poll_fds(std::vector<pollfd>& fds) const {
    for (const auto& s : streams_)
      if (s.read_fd >= 0) fds.push_back({s.read_fd, POLLIN, 0});
  }
  /// Reads what the ready streams hold; a stream at its end is closed.
  void pump(const std::vector<pollfd>& fds) {
    for (const auto& p : fds)
      if (p.revents & (POLLIN | POLLHUP | POLLERR))
        for (auto& s : streams_)
          if (s.read_fd == p.fd) read(s);
  }
  /// Closes every stream, passing on the last partial lines.
  void finish() {
    for (auto& s : streams_) close(s);
  }

 private:
  struct Stream {
    int read_fd = -1, file_fd = -1, console_fd = -1;
    std::string prefix, partial;
  };

  void read(Stream& s) {
    char buf[65536];
    const ssize_t n = ::read(s.read_fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) return;
    if (n <= 0) {
      close(s);
      return;
    }
    if (s.file_fd >= 0) write_all(s.file_fd, std::string(buf, static_cast<std::size_t>(n)));
    if (s.console_fd < 0) return;
    s.partial.append(buf, static_cast<std::size_t>(n));
    std::string lines;
    std::size_t start = 0;
    for (std::size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
      lines += s.prefix + s.partial.substr(start, nl + 1 - start);
    s.partial.erase(0, start);
    write_all(s.console_fd, lines);  // whole lines in one write: ranks' lines never interleave
  }
  void close(Stream& s) {
    if (s.console_fd >= 0 && !s.partial.empty()) write_all(s.console_fd, s.prefix + s.partial + "\n");
    s.partial.clear();
    for (int* fd : {&s.read_fd, &s.file_fd})
      if (*fd >= 0) {
        ::close(*fd);
        *fd = -1;
      }
  }

  std::vector<Stream> streams_;
};

}  // namespace ptrun
