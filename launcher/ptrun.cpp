// ptrun: a torchrun-compatible local launcher.
//
//   ptrun --nproc-per-node 4 [--nnodes N --node-rank K --master-addr H --master-port P] prog args...
//
// Starts nproc-per-node copies of prog with the variables torchrun sets
// (RANK, WORLD_SIZE, LOCAL_RANK, ...), forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to
// them and stops the job, forwards SIGUSR1/SIGUSR2 (and whatever else
// --signals-to-handle lists) without stopping it (Note [Signals ptrun handles]
// in rendezvous.hpp), and when one rank fails stops the others (SIGTERM, SIGKILL
// after a grace period). With --max-restarts N it then starts every rank again, up to N
// times, on every node (Note [Restarts across nodes]); otherwise, or when no
// restart is left, it exits with that rank's status (128 + signal for a signal).
// Each rank gets a TORCHELASTIC_ERROR_FILE of its own; a failed job's root cause goes to
// ptrun's own TORCHELASTIC_ERROR_FILE (Note [Error files] in error_files.hpp).
// Rank 0 of the program serves ptrain's TCP store; only several nodes with
// --max-restarts add an agent store, served by node 0's ptrun.

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "error_files.hpp"
#include "output.hpp"
#include "rendezvous.hpp"
#include "ptrain/config.hpp"
#include "ptrain/dist/store.hpp"

extern char** environ;

namespace {

using ptrun::ElasticRendezvous;
using ptrun::Launch;
using ptrun::Peers;
using ptrun::pending_signal;
using ptrun::Rendezvous;
using ptrun::signal_policy;

struct Child {
  pid_t pid = -1;
  int rank = 0;
  bool running = false;
};

std::string describe(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int exit_code(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// A free port for a single-node run asked to pick one (--master-port 0 or --standalone).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

// Every child leads its own process group, so that stopping a rank also stops
// whatever it started (a shell wrapper, a data-loader process).
void signal_children(std::vector<Child>& children, int sig) {
  for (auto& c : children)
    if (c.running) ::kill(-c.pid, sig);
}

// How a round ended. `failure` is the first failing rank's status (exit code, or
// 128 + signal); later failures are its consequences.
struct RoundEnd {
  std::optional<int> failure;
  std::string failed_rank;   // "rank R (pid P) exited with code C": this node's first failure
  std::string error_file;    // that rank's TORCHELASTIC_ERROR_FILE (Note [Error files])
  int error_code = 0;        // and its torchrun exit code: the exit status, or -signal
  std::string cause;         // why the round failed when no rank did (the program cannot start)
  int signal = 0;            // a signal ptrun received (and forwarded)
  bool cannot_start = false;  // exec or fork failed: starting again cannot help
  // After a forwarded signal: the lowest rank's non-zero exit code (a program that saved
  // a checkpoint and exited 75 says so), else whether a rank died of a signal.
  std::optional<int> code_after_signal, code_rank;
  bool killed_after_signal = false;

  /// ptrun's exit status.
  int status() const {
    if (failure) return *failure;
    if (!signal) return 0;
    if (code_after_signal) return *code_after_signal;
    return killed_after_signal ? 128 + signal : 0;
  }
};

// Starts this node's ranks for round `round`, waits until all have
// ended, and stops the others as soon as one fails or a signal arrives.
// Signals come through `sfd` (a signalfd) so that they are handled in order
// with child exits, never inside an async handler.
// With `rdzv` (Note [Restarts across nodes]) a failure or signal is reported to
// the other nodes, and one they report stops this node's ranks too.
RoundEnd run_round(Launch& l, int round, int sfd, const sigset_t& old_mask, Peers* rdzv) {
  RoundEnd end;
  // A signal that came between rounds stops the job before anything starts.
  if ((end.signal = pending_signal(sfd))) {
    if (rdzv) rdzv->report(round, "stopped", "signal " + std::to_string(end.signal));
    return end;
  }

  const int world = l.nnodes * l.nproc;
  std::vector<Child> children(l.nproc);
  std::vector<std::string> error_files(l.nproc);  // Note [Error files]
  ptrun::Output output;
  const std::string attempt_dir = l.log_dir + "/attempt_" + std::to_string(round);
  int running = 0;
  using Clock = std::chrono::steady_clock;
  constexpr auto no_deadline = Clock::time_point::max();
  auto kill_at = no_deadline;  // SIGKILL for ranks still running then
  auto stop_all = [&](int sig) {
    signal_children(children, sig);
    if (kill_at == no_deadline)
      kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(l.grace));
  };

  for (int local = 0; local < l.nproc; ++local) {
    const int rank = l.node_rank * l.nproc + local;
    // A close-on-exec pipe tells the parent whether exec worked: it reads EOF
    // on success and the child's errno on failure.
    int ep[2];
    std::pair<int, int> out{-1, -1};
    try {
      const unsigned file = ptrun::std_for(l.redirects, local) | ptrun::std_for(l.tee, local);
      const unsigned console = !l.shown.empty() && !l.shown.count(local)
                                   ? ptrun::kNone  // filtered out: its tee'd streams go to the files only
                                   : (ptrun::kAll & ~ptrun::std_for(l.redirects, local)) | ptrun::std_for(l.tee, local);
      out = output.add({rank, local, file, console}, ptrun::expand_prefix(l.line_prefix, l.role, rank, local),
                       attempt_dir);
      error_files[local] = ptrun::rank_error_file(attempt_dir, local);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ptrun: %s\n", e.what());
      stop_all(SIGKILL);
      end.failure = 1;
      end.cannot_start = true;
      end.cause = e.what();
      break;
    }
    if (::pipe2(ep, O_CLOEXEC) != 0) {
      end.cause = std::string("cannot create a pipe: ") + std::strerror(errno);
      std::perror("ptrun: pipe");
      stop_all(SIGKILL);
      end.failure = 1;
      end.cannot_start = true;
      break;
    }
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(ep[0]);
      ::setpgid(0, 0);
      // Die with ptrun, even if it is SIGKILLed and cannot stop us itself.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);
      sigprocmask(SIG_SETMASK, &old_mask, nullptr);
      if (out.first >= 0) ::dup2(out.first, STDOUT_FILENO);
      if (out.second >= 0) ::dup2(out.second, STDERR_FILENO);
      auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(rank));
      set("LOCAL_RANK", std::to_string(local));
      set("WORLD_SIZE", std::to_string(world));
      set("LOCAL_WORLD_SIZE", std::to_string(l.nproc));
      set("GROUP_RANK", std::to_string(l.node_rank));
      set("GROUP_WORLD_SIZE", std::to_string(l.nnodes));
      set("ROLE_RANK", std::to_string(rank));
      set("ROLE_WORLD_SIZE", std::to_string(world));
      set("ROLE_NAME", l.role);
      set("MASTER_ADDR", l.master_addr);
      set("MASTER_PORT", std::to_string(l.master_port));
      set("TORCHELASTIC_RESTART_COUNT", std::to_string(l.restart_count));
      set("TORCHELASTIC_MAX_RESTARTS", std::to_string(l.max_restarts));
      set("TORCHELASTIC_RUN_ID", l.run_id);
      set("TORCHELASTIC_USE_AGENT_STORE", l.agent_store ? "True" : "False");
      set("TORCHELASTIC_ERROR_FILE", error_files[local]);
      // torchrun's default: one thread per rank unless the user chose otherwise.
      if (l.nproc > 1 && !std::getenv("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
      std::vector<char*> args;
      for (auto& a : l.command) args.push_back(a.data());
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      int err = errno;
      [[maybe_unused]] auto n = ::write(ep[1], &err, sizeof err);
      ::_exit(127);
    }
    ::close(ep[1]);
    for (int fd : {out.first, out.second})
      if (fd >= 0) ::close(fd);
    if (pid < 0) {
      end.cause = std::string("cannot start a process: ") + std::strerror(errno);
      std::perror("ptrun: fork");
      ::close(ep[0]);
      stop_all(SIGKILL);
      end.failure = 1;
      end.cannot_start = true;
      break;
    }
    ::setpgid(pid, pid);  // also here, so the group exists before any kill(-pid)
    children[local] = {pid, rank, true};
    ++running;
    int err = 0;
    ssize_t got;
    do got = ::read(ep[0], &err, sizeof err);
    while (got < 0 && errno == EINTR);
    ::close(ep[0]);
    if (got == static_cast<ssize_t>(sizeof err)) {
      end.cause = "cannot execute '" + l.command[0] + "': " + std::strerror(err);
      std::fprintf(stderr, "ptrun: %s\n", end.cause.c_str());
      stop_all(SIGTERM);
      end.failure = 127;
      end.cannot_start = true;
      break;
    }
  }

  if (end.cannot_start && rdzv) rdzv->report(round, "stopped", "the program cannot start");
  // The ranks' pipes are drained up to 2 s after the last rank ended (a process it
  // left behind may hold them open).
  auto drain_until = no_deadline;
  while (running > 0 || (output.open() && Clock::now() < drain_until)) {
    if (running == 0 && drain_until == no_deadline) drain_until = Clock::now() + std::chrono::seconds(2);
    const int poll_ms = static_cast<int>(l.monitor.count());
    int timeout_ms = rdzv || running == 0 ? poll_ms : -1;  // the other nodes' reports are polled
    if (kill_at != no_deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - Clock::now());
      timeout_ms = static_cast<int>(std::clamp<long long>(left.count(), 0, rdzv ? poll_ms : INT32_MAX));
    }
    std::vector<pollfd> fds{{sfd, POLLIN, 0}};
    output.poll_fds(fds);
    int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n > 0) output.pump(fds);
    if (n == 0 && kill_at != no_deadline && Clock::now() >= kill_at) {
      std::fprintf(stderr, "ptrun: %d rank(s) still running %.1f s after SIGTERM; sending SIGKILL\n", running,
                   l.grace);
      signal_children(children, SIGKILL);
      kill_at = no_deadline;
      continue;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      std::perror("ptrun: poll");
      signal_children(children, SIGKILL);
    }
    // A signal that does not stop the job only reaches the ranks (Note [Signals ptrun handles]).
    auto forward = [&](int sig) {
      std::fprintf(stderr, "ptrun: got signal %d (%s); forwarding it to %d rank(s), which decide whether to stop\n",
                   sig, strsignal(sig), running);
      signal_children(children, sig);
    };
    if (const int sig = pending_signal(sfd, forward)) {
      end.signal = sig;
      std::fprintf(stderr, "ptrun: got signal %d (%s); forwarding it to %d rank(s)\n", sig, strsignal(sig), running);
      stop_all(sig);
      if (rdzv) rdzv->report(round, "stopped", "signal " + std::to_string(sig));
    }
    if (rdzv && !end.failure && !end.signal)
      if (auto other = rdzv->reported(round)) {
        std::fprintf(stderr, "ptrun: %s; stopping this node's %d rank(s)\n", other->c_str(), running);
        end.failure = 1;  // the exits that follow are consequences
        stop_all(SIGTERM);
      }
    // Reap every exited child; SIGCHLD signals coalesce, so one read may stand for several.
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (auto& c : children) {
        if (c.pid != pid || !c.running) continue;
        c.running = false;
        --running;
        // Also stop what the rank left behind in its process group.
        ::kill(-c.pid, SIGKILL);
        bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (failed && end.signal) {  // ended after the forwarded signal
          if (WIFSIGNALED(status)) end.killed_after_signal = true;
          else if (!end.code_after_signal || c.rank < *end.code_rank) {
            end.code_after_signal = WEXITSTATUS(status);
            end.code_rank = c.rank;
          }
        }
        if (failed && !end.failure && !end.signal) {
          end.failure = exit_code(status);
          end.failed_rank = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(pid) + ") " + describe(status);
          end.error_file = error_files[static_cast<std::size_t>(&c - children.data())];
          end.error_code = WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
          std::fprintf(stderr, "ptrun: %s; stopping the other %d rank(s)\n", end.failed_rank.c_str(), running);
          stop_all(SIGTERM);
          if (rdzv) rdzv->report(round, "failed", "rank " + std::to_string(c.rank) + " " + describe(status));
        }
      }
    }
  }
  output.finish();
  return end;
}

// Note [A single node's store]
// On one node every rank reaches rank 0's store through loopback (MASTER_ADDR
// 127.0.0.1 by default), where the store then listens, and ptrun hands its ranks a
// random PTRAIN_STORE_TOKEN unless the job set one: another user's process on the
// same machine can neither join the job nor read its keys. Several nodes take the
// token from the job (a Kubernetes Secret; docs/kubernetes.md).
std::string random_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 8; ++i) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%08x", rd());
    t += buf;
  }
  return t;
}

// Visible CUDA devices, asked of the driver (libcuda, loaded only here: ptrun links no
// CUDA library); 0 without a driver.
int gpu_count() {
  void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 0;
  using Init = int (*)(unsigned);
  using Count = int (*)(int*);
  auto init = reinterpret_cast<Init>(::dlsym(lib, "cuInit"));
  auto count = reinterpret_cast<Count>(::dlsym(lib, "cuDeviceGetCount"));
  int n = 0;
  if (!init || !count || init(0) != 0 || count(&n) != 0) n = 0;
  ::dlclose(lib);
  return n;
}

int parse_count(const std::string& v, const char* flag, int max) {
  std::size_t used = 0;
  int n = 0;
  try {
    n = std::stoi(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || used == 0 || n < 1 || n > max)
    throw std::runtime_error(std::string(flag) + " '" + v + "': give a whole number from 1 to " + std::to_string(max));
  return n;
}

// torchrun's --nproc-per-node: a number, gpu, cpu or auto.
int procs_per_node(const std::string& v) {
  const int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (v == "cpu") return cpus;
  if (v == "gpu" || v == "auto") {
    if (const int gpus = gpu_count()) return gpus;
    if (v == "auto") return cpus;
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    throw std::runtime_error(std::string("--nproc-per-node gpu: this node has no visible GPU (the CUDA driver "
                             "libcuda.so.1 found none; CUDA_VISIBLE_DEVICES=") + (visible ? visible : "unset") +
                             "); give a number, or cpu");
  }
  return parse_count(v, "--nproc-per-node (a number, gpu, cpu or auto)", 4096);
}

double parse_seconds(const std::string& v, const char* key) {
  std::size_t used = 0;
  double s = -1;
  try {
    s = std::stod(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != v.size() || !(s >= 0 && s <= 86400))
    throw std::runtime_error(std::string("--rdzv-conf ") + key + "=" + v + ": give seconds from 0 to 86400");
  return s;
}

// "k=v,k=v" (torchrun's --rdzv-conf).
std::vector<std::pair<std::string, std::string>> parse_conf(const std::string& v) {
  std::vector<std::pair<std::string, std::string>> kv;
  std::size_t start = 0;
  while (start < v.size()) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string item = v.substr(start, end - start);
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw std::runtime_error("--rdzv-conf '" + v + "': give key=value pairs separated by commas");
    kv.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    start = end + 1;
  }
  return kv;
}

// "host", "host:port" or "[v6]:port".
std::pair<std::string, int> split_endpoint(const std::string& v, int default_port) {
  std::string host = v, port;
  if (!v.empty() && v.front() == '[') {
    const std::size_t close = v.find(']');
    if (close == std::string::npos) throw std::runtime_error("--rdzv-endpoint '" + v + "': missing ']'");
    host = v.substr(1, close - 1);
    if (close + 1 < v.size() && v[close + 1] == ':') port = v.substr(close + 2);
  } else if (const std::size_t colon = v.rfind(':'); colon != std::string::npos) {
    host = v.substr(0, colon);
    port = v.substr(colon + 1);
  }
  if (host.empty()) throw std::runtime_error("--rdzv-endpoint '" + v + "': no host");
  return {host, port.empty() ? default_port : parse_count(port, "--rdzv-endpoint's port", 65535)};
}

// torchrun's --signals-to-handle: comma-separated names (SIGUSR1; USR1 and lower case work
// too). Names a signal ptrun cannot or must not catch, or one that is no signal, are errors.
std::set<int> parse_signals(const std::string& v) {
  static const std::map<std::string, int> catchable{
      {"HUP", SIGHUP},   {"INT", SIGINT},     {"QUIT", SIGQUIT}, {"USR1", SIGUSR1},     {"USR2", SIGUSR2},
      {"ALRM", SIGALRM}, {"TERM", SIGTERM},   {"CONT", SIGCONT}, {"TSTP", SIGTSTP},     {"TTIN", SIGTTIN},
      {"TTOU", SIGTTOU}, {"URG", SIGURG},     {"XCPU", SIGXCPU}, {"XFSZ", SIGXFSZ},     {"VTALRM", SIGVTALRM},
      {"PROF", SIGPROF}, {"WINCH", SIGWINCH}, {"IO", SIGIO},     {"POLL", SIGPOLL},     {"PWR", SIGPWR}};
  static const std::map<std::string, std::string> refused{
      {"KILL", "cannot be caught"},
      {"STOP", "cannot be caught"},
      {"CHLD", "is ptrun's own (it says that a rank ended)"},
      {"CLD", "is ptrun's own (it says that a rank ended)"},
      {"PIPE", "is ptrun's own (a closed output pipe)"},
      {"SEGV", "reports a fault, not a request"},
      {"BUS", "reports a fault, not a request"},
      {"FPE", "reports a fault, not a request"},
      {"ILL", "reports a fault, not a request"},
      {"TRAP", "reports a fault, not a request"},
      {"SYS", "reports a fault, not a request"},
      {"ABRT", "reports a fault, not a request"},
      {"IOT", "reports a fault, not a request"},
      {"STKFLT", "reports a fault, not a request"}};
  auto trim = [](std::string t) {
    const auto b = t.find_first_not_of(" \t"), e = t.find_last_not_of(" \t");
    return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
  };
  std::set<int> out;
  if (trim(v).empty()) return out;  // an empty list: only what ptrun always handles
  std::size_t start = 0;
  for (;;) {
    const std::size_t end = std::min(v.find(',', start), v.size());
    const std::string entry = trim(v.substr(start, end - start));
    std::string name = entry;
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    if (name.rfind("SIG", 0) == 0) name = name.substr(3);
    if (entry.empty())
      throw std::runtime_error("--signals-to-handle '" + v + "': an empty entry; give names separated by commas, "
                               "as SIGTERM,SIGUSR1");
    if (auto it = catchable.find(name); it != catchable.end()) {
      out.insert(it->second);
    } else if (auto r = refused.find(name); r != refused.end()) {
      throw std::runtime_error("--signals-to-handle: '" + entry + "' " + r->second + "; ptrun forwards SIGHUP, "
                               "SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGALRM, SIGCONT, SIGTSTP, SIGTTIN, "
                               "SIGTTOU, SIGURG, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF, SIGWINCH, SIGIO, SIGPWR");
    } else {
      throw std::runtime_error("--signals-to-handle: '" + entry + "' is not a signal name (give names such as "
                               "SIGTERM or SIGUSR1, separated by commas)");
    }
    if (end >= v.size()) break;
    start = end + 1;
  }
  return out;
}

// <dir>/<run id>_<random>/, as torchrun lays out its log folder.
std::string new_log_dir(std::string dir, const std::string& run_id) {
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    dir = tmp && *tmp ? tmp : "/tmp";
  }
  ptrun::make_dirs(dir);
  std::string path = dir + "/" + run_id + "_XXXXXX";
  if (!::mkdtemp(path.data())) throw std::runtime_error("cannot create a log folder in " + dir + ": " + std::strerror(errno));
  return path;
}

// The last line of a failed job (the static rendezvous): what failed, on which node,
// whether restarts were left, and what to do.
std::string report_failure(const Launch& l, const RoundEnd& end, int restart, bool across_nodes) {
  std::string why = end.cannot_start ? "the program could not be started, which no restart can help"
                    : !end.failed_rank.empty()
                        ? end.failed_rank + " on node " + std::to_string(l.node_rank)
                        : "another node failed or was lost, so this node's ranks were stopped";
  std::string restarts =
      end.cannot_start       ? ""
      : l.max_restarts == 0  ? "; no restart was allowed (pass --max-restarts N to restart the job after a failure)"
                             : "; all " + std::to_string(l.max_restarts) + " restart(s) of --max-restarts are used up";
  std::string nodes;
  if (l.nnodes > 1 && !across_nodes)
    nodes = ". Without --max-restarts the nodes do not watch each other: when a node is lost, the ranks of the "
            "others fail in their next collective (their errors above name the peer they lost), and each node's "
            "ptrun reports its own ranks";
  return "the job failed after " + std::to_string(restart) + " restart(s): " + why + restarts + nodes;
}

// Note [Error files]: the job's end. A failed job leaves its root cause in ptrun's own
// TORCHELASTIC_ERROR_FILE (`why`: ptrun's words for a failure that is no rank's), and the
// temporary log folder goes unless a rank wrote an error file there. Returns `status`.
int finish_job(const Launch& l, int status, const RoundEnd& last, const std::string& why = "") {
  const std::string node = "node " + std::to_string(l.node_rank) + " (host " + ptrun::host_name() + ")";
  if (status != 0) {
    auto own = [&](const std::string& text) { return ptrain::dist::error_record("ptrun on " + node + ": " + text); };
    if (!last.failed_rank.empty() && last.failure && !last.signal)
      ptrun::write_launcher_error(ptrun::rank_root_cause(last.error_file, last.error_code,
                                                         last.failed_rank + " on " + node));
    else if (!why.empty())
      ptrun::write_launcher_error(own(why));
    else if (last.signal)
      ptrun::write_launcher_error(own("got signal " + std::to_string(last.signal) + " (" + strsignal(last.signal) +
                                      "), forwarded it to the ranks and stopped the job, which ended with status " +
                                      std::to_string(status)));
    else if (!last.cause.empty())
      ptrun::write_launcher_error(own(last.cause));
    else
      ptrun::write_launcher_error(own("the job ended with status " + std::to_string(status)));
  }
  if (l.temporary_log_dir && !l.log_dir.empty()) {
    std::error_code ec;
    if (!ptrun::holds_error_files(l.log_dir)) std::filesystem::remove_all(l.log_dir, ec);
    else std::fprintf(stderr, "ptrun: the ranks' error files (error.json) are kept in %s\n", l.log_dir.c_str());
  }
  return status;
}

// Note [Elastic membership]: rounds on whichever nodes are there, until the job ends.
int run_elastic(Launch& l, const ElasticRendezvous::Options& o, std::optional<bool> serve, int sfd,
                const sigset_t& old_mask) {
  ElasticRendezvous rdzv(l, o, serve);
  RoundEnd last;
  for (int k = -1, restarts = 0;; ++k) {
    int sig = 0;
    std::string why;
    const auto plan = rdzv.join(k, restarts, sfd, sig, why);
    if (sig) {
      if (rdzv.serves()) rdzv.stop(k, "node 0's ptrun got signal " + std::to_string(sig), sfd);
      RoundEnd stopped;
      stopped.signal = sig;
      return finish_job(l, 128 + sig, stopped);
    }
    if (!plan) {
      std::fprintf(stderr, "ptrun: the job stops: %s\n", why.c_str());
      return finish_job(l, last.failure.value_or(1), last, "the job stops: " + why);
    }
    rdzv.running(*plan);
    l.nnodes = plan->nodes;
    l.node_rank = plan->index;
    l.restart_count = plan->restarts;
    std::fprintf(stderr, "ptrun: round %d on %d node(s): this is node %d, ranks %d..%d of %d (restarts %d of %d)\n",
                 k, l.nnodes, l.node_rank, l.node_rank * l.nproc, (l.node_rank + 1) * l.nproc - 1, l.nnodes * l.nproc,
                 l.restart_count, l.max_restarts);
    last = run_round(l, k, sfd, old_mask, &rdzv);
    if (last.signal || last.cannot_start) {  // node 0 stops the job; another node leaves it
      if (rdzv.serves()) rdzv.ended(k, false, sfd);
      return finish_job(l, last.status(), last);
    }
    if (rdzv.ended(k, !last.failure, sfd)) return finish_job(l, last.status(), last);
    if (rdzv.serves() && rdzv.failed(k) && ++restarts > l.max_restarts) {
      rdzv.stop(k + 1, "round " + std::to_string(k) + " failed and the " + std::to_string(l.max_restarts) +
                           " restart(s) of --max-restarts are used up", sfd);
      return finish_job(l, last.status(), last);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrun: start a ptrain program on this node the way torchrun does"};
  int node_rank = 0, master_port = 29500, max_restarts = 0;
  double grace = 5.0, rdzv_timeout = 600.0, monitor_interval = 0.1;
  std::string nproc_arg = "1", nnodes_arg = "1", master_addr = "127.0.0.1", run_id, rdzv_backend = "static",
              rdzv_endpoint, rdzv_conf, log_dir, redirects = "0", tee = "0", role = "default",
              signals_arg = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2", ranks_filter, start_method = "spawn",
              local_addr, logs_specs;
  std::optional<std::string> line_prefix;
  bool no_python = false, standalone = false;
  std::vector<std::string> command;
  app.add_option("--nproc-per-node,--nproc_per_node", nproc_arg,
                 "processes on this node: a number, gpu (one per visible GPU), cpu (one per CPU) or auto "
                 "(gpu when there is one, else cpu)")->envname("PET_NPROC_PER_NODE");
  app.add_option("--nnodes", nnodes_arg, "number of nodes")->envname("PET_NNODES");
  auto* node_rank_opt = app.add_option("--node-rank,--node_rank", node_rank, "index of this node, 0 <= node-rank < "
                                       "nnodes (needed with --nnodes > 1)")
                            ->envname("PET_NODE_RANK")->check(CLI::Range(0, (1 << 16) - 1));
  auto* addr_opt = app.add_option("--master-addr,--master_addr", master_addr, "host of rank 0 (node-rank 0)")
                       ->envname("PET_MASTER_ADDR");
  auto* port_opt = app.add_option("--master-port,--master_port", master_port,
                                  "port of rank 0's store; 0 picks a free one (single node only)")
                       ->envname("PET_MASTER_PORT")->check(CLI::Range(0, 65535));
  app.add_flag("--standalone", standalone, "single node on localhost with a free port")->envname("PET_STANDALONE");
  app.add_flag("--no-python,--no_python", no_python, "accepted for torchrun compatibility; ptrun never runs python")
      ->envname("PET_NO_PYTHON");
  app.add_option("--grace-period,--grace_period,--shutdown-timeout,--shutdown_timeout", grace,
                 "seconds between SIGTERM and SIGKILL when stopping ranks (torchrun's --shutdown-timeout)")
      ->envname("PET_SHUTDOWN_TIMEOUT")->check(CLI::Range(0.0, 3600.0));
  app.add_option("--max-restarts,--max_restarts", max_restarts,
                 "start every rank (of every node) again after a failure, up to this many times")
      ->envname("PET_MAX_RESTARTS")->check(CLI::Range(0, 1000000));
  app.add_option("--rdzv-timeout,--rdzv_timeout", rdzv_timeout, "with --nnodes > 1 and --max-restarts: seconds "
                 "a node waits for the others at the start and end of a round")->check(CLI::Range(1.0, 86400.0));
  auto* run_id_opt = app.add_option("--rdzv-id,--rdzv_id", run_id, "the job's id, TORCHELASTIC_RUN_ID of every rank "
                                    "(default: ptrun's pid on one node, 'none' on several)")
                        ->envname("PET_RDZV_ID");
  app.add_option("--rdzv-backend,--rdzv_backend", rdzv_backend, "static, or c10d (then --rdzv-endpoint names the "
                 "store: node 0's host and port)")->envname("PET_RDZV_BACKEND");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint, "host[:port] of the store (with c10d; port "
                 "default 29400)")->envname("PET_RDZV_ENDPOINT");
  app.add_option("--rdzv-conf,--rdzv_conf", rdzv_conf, "key=value,...: join_timeout or timeout (seconds, as "
                 "--rdzv-timeout), last_call_timeout, keep_alive_interval, keep_alive_max_attempt, is_host; other "
                 "keys (read_timeout, use_libuv, ...) are ignored with a warning")
      ->envname("PET_RDZV_CONF");
  app.add_option("--local-addr,--local_addr", local_addr, "accepted for torchrun compatibility, no effect: the "
                 "ranks' MASTER_ADDR and the store are always the endpoint's host (node 0), so ptrun never "
                 "advertises an address of its own")->envname("PET_LOCAL_ADDR");
  app.add_option("--monitor-interval,--monitor_interval", monitor_interval,
                 "seconds between checks of the other nodes' state")
      ->envname("PET_MONITOR_INTERVAL")->check(CLI::Range(0.01, 60.0));
  app.add_option("--log-dir,--log_dir", log_dir, "folder for the ranks' log files (with --redirects or --tee) and "
                 "error files (TORCHELASTIC_ERROR_FILE); default: a new folder under TMPDIR, removed at exit unless it "
                 "holds logs or error files")->envname("PET_LOG_DIR");
  app.add_option("-r,--redirects", redirects, "streams that go to the log files only: 0 none, 1 stdout, 2 stderr, "
                 "3 both, or per local rank as 0:3,1:0")->envname("PET_REDIRECTS");
  app.add_option("-t,--tee", tee, "streams that go to the log files and to the console (values as --redirects)")
      ->envname("PET_TEE");
  app.add_option("--signals-to-handle,--signals_to_handle", signals_arg,
                 "comma-separated signals ptrun catches and forwards to every rank; torchrun's default plus "
                 "SIGUSR1 and SIGUSR2 (Slurm's --signal, the flight recorder). SIGINT, SIGTERM, SIGHUP (always "
                 "handled, listed or not) and SIGQUIT also stop the job; the others only reach the ranks. SIGUSR1 "
                 "or SIGUSR2 left out is ignored with a message; any other signal left out keeps its default action")
      ->capture_default_str()->envname("PET_SIGNALS_TO_HANDLE");
  app.add_option("--local-ranks-filter,--local_ranks_filter", ranks_filter,
                 "comma-separated local ranks whose stdout and stderr reach the console (e.g. 0 or 0,1); the "
                 "others' output goes to their log files if --redirects/--tee send it there, else nowhere")
      ->envname("PET_LOCAL_RANKS_FILTER");
  app.add_option("--start-method,--start_method", start_method, "spawn, fork or forkserver: accepted for torchrun "
                 "compatibility and ignored; ptrun always starts the program with fork and exec")
      ->envname("PET_START_METHOD");
  app.add_option("--logs-specs,--logs_specs", logs_specs, "torchrun's plugin for log destinations: not applicable "
                 "(a value is ignored with a warning); ptrun's logs are --log-dir, --redirects, --tee and "
                 "--log-line-prefix-template")->envname("PET_LOGS_SPECS");
  app.add_option("--role", role, "the ranks' ROLE_NAME (and the line prefix's ${role_name})")->envname("PET_ROLE");
  app.add_option("--log-line-prefix-template,--log_line_prefix_template", line_prefix,
                 "prefix of every line a rank writes; ${role_name}, ${rank}, ${local_rank} are replaced "
                 "(default: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE when set, as torchrun reads it, else with more "
                 "than one rank [${role_name}${rank}]: ; empty: no prefix)");
  // Everything from the first positional argument on is the program's command line.
  app.prefix_command();
  app.footer("Sets RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT for each rank.");
  app.set_version_flag("--version", PTRAIN_VERSION_STRING);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version end with 0; a bad option or value (on the command line or in a
    // PET_ variable) is a usage error, 2, as under torchrun's argparse.
    return app.exit(e) == 0 ? 0 : 2;
  }
  command = app.remaining();
  auto usage_error = [](const std::string& what) {
    std::fprintf(stderr, "ptrun: %s\n", what.c_str());
    return 2;
  };
  if (!command.empty() && command.front() == "--") {  // "ptrun [options] -- prog args"
    command.erase(command.begin());
  } else if (!command.empty() && command.front().size() > 1 && command.front()[0] == '-') {
    return usage_error("unknown option '" + command.front() + "' (the program comes after ptrun's options; "
                       "see ptrun --help)");
  }
  if (command.empty()) return usage_error("no program given; usage: ptrun --nproc-per-node N prog args...");

  int nproc = 0, nnodes = 0, min_nodes = 0;
  double last_call = 30.0, keep_alive = 5.0, keep_alive_attempts = 3;
  std::optional<bool> is_host;
  std::map<int, unsigned> redirect_map, tee_map;
  std::set<int> shown;
  try {
    // Note [Signals ptrun handles]
    ptrun::SignalPolicy& policy = signal_policy();
    policy.stop = {SIGINT, SIGTERM, SIGHUP};
    policy.forward.clear();
    for (int s : parse_signals(signals_arg)) (s == SIGQUIT ? policy.stop : policy.forward).insert(s);
    for (int s : {SIGINT, SIGTERM, SIGHUP}) policy.forward.erase(s);
    nproc = procs_per_node(nproc_arg);
    const std::size_t colon = nnodes_arg.find(':');
    nnodes = parse_count(nnodes_arg.substr(colon == std::string::npos ? 0 : colon + 1), "--nnodes", 1 << 16);
    min_nodes = colon == std::string::npos ? nnodes : parse_count(nnodes_arg.substr(0, colon), "--nnodes MIN", nnodes);
    redirect_map = ptrun::parse_std_map(redirects, "--redirects");
    tee_map = ptrun::parse_std_map(tee, "--tee");
    if (start_method != "spawn" && start_method != "fork" && start_method != "forkserver")
      throw std::runtime_error("--start-method '" + start_method + "': give spawn, fork or forkserver");
    for (std::size_t start = 0; !ranks_filter.empty() && start <= ranks_filter.size();) {
      const std::size_t end = std::min(ranks_filter.find(',', start), ranks_filter.size());
      const std::string item = ranks_filter.substr(start, end - start);
      if (item.empty() || item.size() > 5 || item.find_first_not_of("0123456789") != std::string::npos ||
          std::stoi(item) >= nproc)
        throw std::runtime_error("--local-ranks-filter: '" + item + "' is not a local rank; give numbers from 0 to " +
                                 std::to_string(nproc - 1) + " separated by commas");
      shown.insert(std::stoi(item));
      start = end + 1;
    }
    std::string ignored_keys;
    for (const auto& [key, value] : parse_conf(rdzv_conf)) {
      if (key == "join_timeout" || key == "timeout") rdzv_timeout = parse_seconds(value, key.c_str());
      else if (key == "last_call_timeout") last_call = parse_seconds(value, "last_call_timeout");
      else if (key == "keep_alive_interval") keep_alive = parse_seconds(value, "keep_alive_interval");
      else if (key == "keep_alive_max_attempt") keep_alive_attempts = parse_seconds(value, "keep_alive_max_attempt");
      else if (key == "is_host") is_host = value == "1" || value == "true" || value == "True";
      else ignored_keys += (ignored_keys.empty() ? "'" : ", '") + key + "'";
    }
    // As torchrun's backends, which read the keys they know and pass over the others.
    if (!ignored_keys.empty())
      std::fprintf(stderr, "ptrun: warning: --rdzv-conf %s not used by ptrun, ignored (it reads join_timeout, "
                   "timeout, last_call_timeout, keep_alive_interval, keep_alive_max_attempt and is_host)\n",
                   ignored_keys.c_str());
    if (!logs_specs.empty())
      std::fprintf(stderr, "ptrun: warning: --logs-specs %s does not apply to ptrun, ignored; its logs are "
                   "--log-dir, --redirects, --tee and --log-line-prefix-template\n", logs_specs.c_str());
    if (rdzv_backend == "c10d") {
      if (rdzv_endpoint.empty()) throw std::runtime_error("--rdzv-backend c10d needs --rdzv-endpoint host:port (node 0's)");
      if (addr_opt->count() || port_opt->count())
        throw std::runtime_error("--rdzv-endpoint names node 0's host and port; drop --master-addr/--master-port");
      std::tie(master_addr, master_port) = split_endpoint(rdzv_endpoint, 29400);
    } else if (rdzv_backend != "static") {
      throw std::runtime_error("--rdzv-backend " + rdzv_backend + " is not supported: use c10d (with --rdzv-endpoint) "
                               "or static (with --master-addr/--master-port)");
    } else if (!rdzv_endpoint.empty()) {
      std::tie(master_addr, master_port) = split_endpoint(rdzv_endpoint, master_port);
    }
  } catch (const std::exception& e) {
    return usage_error(e.what());
  }
  // Note [Elastic membership]: a range of nodes, or c10d's node ranks by arrival.
  const bool elastic = min_nodes < nnodes || (rdzv_backend == "c10d" && nnodes > 1 && node_rank_opt->count() == 0);
  if (elastic) {
    if (standalone || master_port == 0)
      return usage_error("--nnodes " + nnodes_arg + " needs the store's fixed host and port (--rdzv-endpoint)");
    node_rank = 0;  // node ranks come from the rendezvous, as under torchrun
  } else if (nnodes > 1 && node_rank_opt->count() == 0) {
    // A forgotten --node-rank would make every node node 0: two rank 0s, two stores.
    return usage_error("--nnodes " + std::to_string(nnodes) + " needs --node-rank (or PET_NODE_RANK): 0 on the node "
                       "of --master-addr, and each other node one of 1.." + std::to_string(nnodes - 1));
  }
  if (node_rank >= nnodes)
    return usage_error("--node-rank " + std::to_string(node_rank) + " must be smaller than --nnodes " +
                       std::to_string(nnodes));
  if (standalone) {
    if (nnodes != 1) return usage_error("--standalone is a single-node launch; drop --nnodes " + std::to_string(nnodes));
    master_addr = "127.0.0.1";
    if (port_opt->count() == 0) master_port = 0;
  }
  const bool pick_port = master_port == 0;
  if (pick_port) {
    if (nnodes != 1)
      return usage_error("--master-port 0 (pick a free port) works on one node only; with --nnodes " +
                         std::to_string(nnodes) + " give every node the same --master-port");
    master_port = free_port();
  }
  // Note [A single node's store]
  if (nnodes == 1 && !std::getenv("PTRAIN_STORE_TOKEN")) ::setenv("PTRAIN_STORE_TOKEN", random_token().c_str(), 1);

  // The nodes of one job share their id: torchrun's default 'none' unless the job names itself.
  if (run_id_opt->count() == 0) run_id = nnodes > 1 ? "none" : std::to_string(::getpid());
  Launch l;
  l.command = std::move(command);
  l.nproc = nproc;
  l.nnodes = nnodes;
  l.node_rank = node_rank;
  l.master_port = master_port;
  l.max_restarts = max_restarts;
  l.master_addr = master_addr;
  l.run_id = run_id;
  l.role = role;
  l.grace = grace;
  l.agent_store = elastic || (nnodes > 1 && max_restarts > 0);
  l.redirects = std::move(redirect_map);
  l.tee = std::move(tee_map);
  l.shown = std::move(shown);
  // torchrun >= 2.2 reads its template from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (unset or empty: its default).
  const char* prefix_env = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
  l.line_prefix = line_prefix                 ? *line_prefix
                  : prefix_env && *prefix_env ? prefix_env
                  : nnodes * nproc > 1        ? "[${role_name}${rank}]:"
                                              : "";
  l.monitor = std::chrono::milliseconds(static_cast<long long>(monitor_interval * 1000));
  // Note [Error files]: the log folder always exists, for the ranks' error files.
  const bool log_files = !l.redirects.empty() || !l.tee.empty();
  try {
    l.log_dir = new_log_dir(log_dir, run_id);
  } catch (const std::exception& e) {
    return usage_error(e.what());
  }
  l.temporary_log_dir = log_dir.empty() && !log_files;
  if (log_files) std::fprintf(stderr, "ptrun: the ranks' log files are in %s\n", l.log_dir.c_str());

  sigset_t mask = signal_policy().caught(), old_mask;
  sigprocmask(SIG_BLOCK, &mask, &old_mask);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    std::perror("ptrun: signalfd");
    return finish_job(l, 1, RoundEnd{}, std::string("signalfd: ") + std::strerror(errno));
  }

  try {
    if (elastic) {
      ElasticRendezvous::Options o;
      o.min_nodes = min_nodes;
      o.max_nodes = nnodes;
      o.join_timeout = std::chrono::milliseconds(static_cast<long long>(rdzv_timeout * 1000));
      o.last_call = std::chrono::milliseconds(static_cast<long long>(last_call * 1000));
      o.monitor = l.monitor;
      o.heartbeat = std::chrono::milliseconds(static_cast<long long>(keep_alive * keep_alive_attempts * 1000));
      const int status = run_elastic(l, o, is_host, sfd, old_mask);
      ::close(sfd);
      return status;
    }
    std::unique_ptr<Rendezvous> rdzv;  // Note [Restarts across nodes]
    if (l.agent_store)
      rdzv = std::make_unique<Rendezvous>(
          l, std::chrono::milliseconds(static_cast<long long>(rdzv_timeout * 1000)));
    for (int restart = 0;; ++restart) {
      // A port picked for the run is picked again: the last round's may be taken by now.
      if (restart > 0 && pick_port) l.master_port = free_port();
      RoundEnd end;
      l.restart_count = restart;
      if (rdzv) end.signal = rdzv->join(restart, sfd);
      if (!end.signal) end = run_round(l, restart, sfd, old_mask, rdzv.get());
      bool again = end.failure && !end.signal && !end.cannot_start && restart < max_restarts;
      if (rdzv) {  // every node takes the same decision
        using Outcome = Rendezvous::Outcome;
        const Outcome outcome = rdzv->end(restart, sfd, end.signal);
        again = outcome == Outcome::Failed && restart < max_restarts;
        if ((outcome == Outcome::Failed || outcome == Outcome::Stopped) && !end.failure && !end.signal)
          end.failure = 1;  // this node's ranks were stopped because of another node
        if (!again && outcome != Outcome::Incomplete) rdzv->leave(restart, sfd);
      }
      if (!again) {
        ::close(sfd);
        const std::string line = end.failure && !end.signal ? report_failure(l, end, restart, rdzv != nullptr) : "";
        finish_job(l, end.status(), end, line);
        if (!line.empty()) std::fprintf(stderr, "ptrun: %s\n", line.c_str());  // the cause comes last
        return end.status();
      }
      std::fprintf(stderr, "ptrun: starting all %d rank(s)%s again (restart %d of %d)\n", nproc,
                   rdzv ? " of this node" : "", restart + 1, max_restarts);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ptrun: %s\n", e.what());
    return finish_job(l, 1, RoundEnd{}, e.what());
  }
}
