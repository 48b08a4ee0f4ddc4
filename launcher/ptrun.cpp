// ptrun: a torchrun-compatible local launcher.
//
//   ptrun --nproc-per-node 4 [--nnodes N --node-rank K --master-addr H --master-port P] prog args...
//
// Starts nproc-per-node copies of prog with the variables torchrun sets
// (RANK, WORLD_SIZE, LOCAL_RANK, ...), forwards SIGINT/SIGTERM/SIGHUP to them,
// and when one rank fails stops the others (SIGTERM, SIGKILL after a grace
// period). With --max-restarts N it then starts every rank again, up to N
// times, on every node (Note [Restarts across nodes]); otherwise, or when no
// restart is left, it exits with that rank's status (128 + signal for a signal).
// Rank 0 of the program serves ptrain's TCP store; only several nodes with
// --max-restarts add an agent store, served by node 0's ptrun.

#include <arpa/inet.h>
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
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ptrain/config.hpp"
#include "ptrain/dist/store.hpp"

extern char** environ;

namespace {

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

// What every round of ranks shares.
struct Launch {
  std::vector<std::string> command;
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 0, max_restarts = 0;
  std::string master_addr, run_id;
  double grace = 5.0;
  bool agent_store = false;  // Note [Restarts across nodes]
};

// The first signal (not SIGCHLD) waiting in `sfd`, or 0.
int pending_signal(int sfd) {
  int sig = 0;
  signalfd_siginfo si;
  while (::read(sfd, &si, sizeof si) == static_cast<ssize_t>(sizeof si))
    if (si.ssi_signo != SIGCHLD && !sig) sig = static_cast<int>(si.ssi_signo);
  return sig;
}

// Note [Restarts across nodes]
// With --nnodes > 1 and --max-restarts, node 0's ptrun serves an agent store at
// --master-port (the programs' rank 0 then serves theirs at MASTER_PORT + 1, as
// under torchrun: TORCHELASTIC_USE_AGENT_STORE=True), and the agents agree on
// every round k there:
//   join   every agent counts itself in round/k/joined; the ranks start once all
//          nnodes have (a node that never comes fails the others at the timeout);
//   run    an agent whose rank fails sets round/k/failed, one that gets a signal
//          round/k/stopped; every agent polls both keys and stops its own ranks
//          when one is set, so a failure anywhere ends the round everywhere;
//   end    an agent whose ranks have all exited counts itself in round/k/ended and
//          waits for all; every agent then reads the same keys and takes the same
//          decision: stopped -> exit, failed -> round k + 1 while restarts are
//          left, else exit 0. Node 0 serves the store, so it leaves last
//          (round/k/left).
// Waits poll every 100 ms, so that signals to ptrun still stop the job, and end
// after --rdzv-timeout: at join with an error; at end (as torchrun's exit barrier)
// with this node's own status and no restart, since the others may be gone.
class Rendezvous {
 public:
  enum class Outcome { Done, Failed, Stopped, Incomplete };

  Rendezvous(const Launch& l, std::chrono::milliseconds timeout)
      : store_(l.master_addr, l.master_port, l.node_rank == 0, timeout), nnodes_(l.nnodes), node_(l.node_rank),
        timeout_(timeout) {
    // Two ptruns with one --node-rank would each start the same ranks.
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string me = std::string(host) + " (pid " + std::to_string(::getpid()) + ")";
    const std::string owner = store_.compare_set("ptrun/node/" + std::to_string(node_), "", me);
    PTRAIN_CHECK(owner == me, CommError, "[ptrun.rendezvous] --node-rank ", node_, " is taken by the ptrun on ",
                 owner, "; give every node its own --node-rank (0 to ", nnodes_ - 1, ")");
  }

  /// Waits until every node joined round k; returns a signal that came meanwhile (0: none).
  int join(int k, int sfd) {
    store_.add(key(k, "joined"), 1);
    int sig = 0;
    const std::int64_t n = wait_count(k, "joined", sfd, sig);
    PTRAIN_CHECK(n >= nnodes_, CommError, "[ptrun.rendezvous] round ", k, ": ", n, " of ", nnodes_,
                 " node(s) joined within ", timeout_.count() / 1000, " s; start ptrun on every node (--node-rank 0..",
                 nnodes_ - 1, " with the same --master-addr and --master-port), or raise --rdzv-timeout");
    return sig;
  }
  /// What a node reported for round k ("round k failed on node n: ..."), or nothing. An
  /// unreachable store counts as a failure (node 0's ptrun is gone).
  std::optional<std::string> reported(int k) noexcept {
    try {
      for (const char* what : {"stopped", "failed"})
        if (store_.check({key(k, what)})) return "round " + std::to_string(k) + " " + what + " on " + store_.get(key(k, what));
      return std::nullopt;
    } catch (const std::exception& e) {
      return "the agent store is unreachable (" + std::string(e.what()) + ")";
    }
  }
  /// Tells every node that round k failed or stopped here (the first report of each kind stays).
  void report(int k, const char* what, const std::string& detail) noexcept {
    try {
      store_.compare_set(key(k, what), "", "node " + std::to_string(node_) + ": " + detail);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ptrun: cannot report to the agent store: %s\n", e.what());
    }
  }
  /// After this node's ranks have exited: waits for every node, then the round's outcome.
  Outcome end(int k, int sfd, int& signal) {
    store_.add(key(k, "ended"), 1);
    if (const std::int64_t n = wait_count(k, "ended", sfd, signal); n < nnodes_) {
      std::fprintf(stderr, "ptrun: round %d: %lld of %d node(s) ended within %lld s; exiting with this node's "
                           "status, without a restart\n", k, static_cast<long long>(n), nnodes_,
                   static_cast<long long>(timeout_.count() / 1000));
      return Outcome::Incomplete;
    }
    if (store_.check({key(k, "stopped")})) return Outcome::Stopped;
    return store_.check({key(k, "failed")}) ? Outcome::Failed : Outcome::Done;
  }
  /// Node 0 serves the store: it returns once every node has read round k's outcome
  /// (or after the timeout: then the others have gone already).
  void leave(int k, int sfd) {
    store_.add(key(k, "left"), 1);
    int sig = 0;
    if (node_ == 0) wait_count(k, "left", sfd, sig);
  }

 private:
  static std::string key(int k, const char* what) { return "ptrun/round/" + std::to_string(k) + "/" + what; }

  // Polls the counter round/k/<what> until it reaches nnodes or the timeout passes; returns
  // the count. A signal in the meantime is reported as round k stopped and kept in `sig`;
  // the wait goes on, so that every node learns it.
  std::int64_t wait_count(int k, const char* what, int sfd, int& sig) {
    const auto until = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      const std::int64_t n = store_.add(key(k, what), 0);
      if (n >= nnodes_ || std::chrono::steady_clock::now() >= until) return n;
      if (const int s = pending_signal(sfd); s && !sig) {
        sig = s;
        report(k, "stopped", "signal " + std::to_string(s));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  ptrain::dist::TCPStore store_;
  int nnodes_, node_;
  std::chrono::milliseconds timeout_;
};

// How a round ended. `failure` is the first failing rank's status (exit code, or
// 128 + signal); later failures are its consequences.
struct RoundEnd {
  std::optional<int> failure;
  int signal = 0;            // a signal ptrun received (and forwarded)
  bool cannot_start = false;  // exec or fork failed: starting again cannot help
};

// Starts this node's ranks as restart number `restart`, waits until all have
// ended, and stops the others as soon as one fails or a signal arrives.
// Signals come through `sfd` (a signalfd) so that they are handled in order
// with child exits, never inside an async handler.
// With `rdzv` (Note [Restarts across nodes]) a failure or signal is reported to
// the other nodes, and one they report stops this node's ranks too.
RoundEnd run_round(Launch& l, int restart, int sfd, const sigset_t& old_mask, Rendezvous* rdzv) {
  RoundEnd end;
  // A signal that came between rounds stops the job before anything starts.
  if ((end.signal = pending_signal(sfd))) {
    if (rdzv) rdzv->report(restart, "stopped", "signal " + std::to_string(end.signal));
    return end;
  }

  const int world = l.nnodes * l.nproc;
  std::vector<Child> children(l.nproc);
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
    if (::pipe2(ep, O_CLOEXEC) != 0) {
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
      auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(rank));
      set("LOCAL_RANK", std::to_string(local));
      set("WORLD_SIZE", std::to_string(world));
      set("LOCAL_WORLD_SIZE", std::to_string(l.nproc));
      set("GROUP_RANK", std::to_string(l.node_rank));
      set("GROUP_WORLD_SIZE", std::to_string(l.nnodes));
      set("ROLE_RANK", std::to_string(rank));
      set("ROLE_WORLD_SIZE", std::to_string(world));
      set("ROLE_NAME", "default");
      set("MASTER_ADDR", l.master_addr);
      set("MASTER_PORT", std::to_string(l.master_port));
      set("TORCHELASTIC_RESTART_COUNT", std::to_string(restart));
      set("TORCHELASTIC_MAX_RESTARTS", std::to_string(l.max_restarts));
      set("TORCHELASTIC_RUN_ID", l.run_id);
      set("TORCHELASTIC_USE_AGENT_STORE", l.agent_store ? "True" : "False");
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
    if (pid < 0) {
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
      std::fprintf(stderr, "ptrun: cannot execute '%s': %s\n", l.command[0].c_str(), std::strerror(err));
      stop_all(SIGTERM);
      end.failure = 127;
      end.cannot_start = true;
      break;
    }
  }

  if (end.cannot_start && rdzv) rdzv->report(restart, "stopped", "the program cannot start");
  while (running > 0) {
    int timeout_ms = rdzv ? 100 : -1;  // the other nodes' reports are polled
    if (kill_at != no_deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_at - Clock::now());
      timeout_ms = static_cast<int>(std::clamp<long long>(left.count(), 0, rdzv ? 100 : INT32_MAX));
    }
    pollfd p{sfd, POLLIN, 0};
    int n = ::poll(&p, 1, timeout_ms);
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
    if (const int sig = pending_signal(sfd)) {
      end.signal = sig;
      std::fprintf(stderr, "ptrun: got signal %d (%s); forwarding it to %d rank(s)\n", sig, strsignal(sig), running);
      stop_all(sig);
      if (rdzv) rdzv->report(restart, "stopped", "signal " + std::to_string(sig));
    }
    if (rdzv && !end.failure && !end.signal)
      if (auto other = rdzv->reported(restart)) {
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
        if (failed && !end.failure && !end.signal) {
          end.failure = exit_code(status);
          std::fprintf(stderr, "ptrun: rank %d (pid %d) %s; stopping the other %d rank(s)\n", c.rank, pid,
                       describe(status).c_str(), running);
          stop_all(SIGTERM);
          if (rdzv) rdzv->report(restart, "failed", "rank " + std::to_string(c.rank) + " " + describe(status));
        }
      }
    }
  }
  return end;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrun: start a ptrain program on this node the way torchrun does"};
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 29500, max_restarts = 0;
  double grace = 5.0, rdzv_timeout = 600.0;
  std::string master_addr = "127.0.0.1", run_id;
  bool no_python = false, standalone = false;
  std::vector<std::string> command;
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "processes on this node")
      ->envname("PET_NPROC_PER_NODE")->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", nnodes, "number of nodes")->envname("PET_NNODES")->check(CLI::Range(1, 1 << 16));
  auto* node_rank_opt = app.add_option("--node-rank,--node_rank", node_rank, "index of this node, 0 <= node-rank < "
                                       "nnodes (needed with --nnodes > 1)")
                            ->envname("PET_NODE_RANK")->check(CLI::Range(0, (1 << 16) - 1));
  app.add_option("--master-addr,--master_addr", master_addr, "host of rank 0 (node-rank 0)")
      ->envname("PET_MASTER_ADDR");
  auto* port_opt = app.add_option("--master-port,--master_port", master_port,
                                  "port of rank 0's store; 0 picks a free one (single node only)")
                       ->envname("PET_MASTER_PORT")->check(CLI::Range(0, 65535));
  app.add_flag("--standalone", standalone, "single node on localhost with a free port");
  app.add_flag("--no-python,--no_python", no_python, "accepted for torchrun compatibility; ptrun never runs python");
  app.add_option("--grace-period,--grace_period", grace, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::Range(0.0, 3600.0));
  app.add_option("--max-restarts,--max_restarts", max_restarts,
                 "start every rank (of every node) again after a failure, up to this many times")
      ->envname("PET_MAX_RESTARTS")->check(CLI::Range(0, 1000000));
  app.add_option("--rdzv-timeout,--rdzv_timeout", rdzv_timeout, "with --nnodes > 1 and --max-restarts: seconds "
                 "a node waits for the others at the start and end of a round")->check(CLI::Range(1.0, 86400.0));
  auto* run_id_opt = app.add_option("--rdzv-id,--rdzv_id", run_id, "the job's id, TORCHELASTIC_RUN_ID of every rank "
                                    "(default: ptrun's pid on one node, 'none' on several)")
                        ->envname("PET_RDZV_ID");
  // Everything from the first positional argument on is the program's command line.
  app.prefix_command();
  app.footer("Sets RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT for each rank.");
  app.set_version_flag("--version", PTRAIN_VERSION_STRING);
  CLI11_PARSE(app, argc, argv);
  command = app.remaining();
  if (!command.empty() && command.front() == "--") {  // "ptrun [options] -- prog args"
    command.erase(command.begin());
  } else if (!command.empty() && command.front().size() > 1 && command.front()[0] == '-') {
    std::fprintf(stderr, "ptrun: unknown option '%s' (the program comes after ptrun's options; see ptrun --help)\n",
                 command.front().c_str());
    return 2;
  }
  if (command.empty()) {
    std::fprintf(stderr, "ptrun: no program given; usage: ptrun --nproc-per-node N prog args...\n");
    return 2;
  }
  if (nnodes > 1 && node_rank_opt->count() == 0) {
    // A forgotten --node-rank would make every node node 0: two rank 0s, two stores.
    std::fprintf(stderr, "ptrun: --nnodes %d needs --node-rank (or PET_NODE_RANK): 0 on the node of --master-addr, "
                         "and each other node one of 1..%d\n", nnodes, nnodes - 1);
    return 2;
  }
  if (node_rank >= nnodes) {
    std::fprintf(stderr, "ptrun: --node-rank %d must be smaller than --nnodes %d\n", node_rank, nnodes);
    return 2;
  }
  if (standalone) {
    if (nnodes != 1) {
      std::fprintf(stderr, "ptrun: --standalone is a single-node launch; drop --nnodes %d\n", nnodes);
      return 2;
    }
    master_addr = "127.0.0.1";
    if (port_opt->count() == 0) master_port = 0;
  }
  const bool pick_port = master_port == 0;
  if (pick_port) {
    if (nnodes != 1) {
      std::fprintf(stderr, "ptrun: --master-port 0 (pick a free port) works on one node only; "
                           "with --nnodes %d give every node the same --master-port\n", nnodes);
      return 2;
    }
    master_port = free_port();
  }

  // The nodes of one job share their id: torchrun's default 'none' unless the job names itself.
  if (run_id_opt->count() == 0) run_id = nnodes > 1 ? "none" : std::to_string(::getpid());
  Launch l{std::move(command), nproc, nnodes, node_rank, master_port, max_restarts, master_addr,
           run_id, grace, nnodes > 1 && max_restarts > 0};

  sigset_t mask, old_mask;
  sigemptyset(&mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&mask, s);
  sigprocmask(SIG_BLOCK, &mask, &old_mask);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    std::perror("ptrun: signalfd");
    return 1;
  }

  try {
    std::unique_ptr<Rendezvous> rdzv;  // Note [Restarts across nodes]
    if (l.agent_store)
      rdzv = std::make_unique<Rendezvous>(
          l, std::chrono::milliseconds(static_cast<long long>(rdzv_timeout * 1000)));
    for (int restart = 0;; ++restart) {
      // A port picked for the run is picked again: the last round's may be taken by now.
      if (restart > 0 && pick_port) l.master_port = free_port();
      RoundEnd end;
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
        if (end.failure) return *end.failure;
        return end.signal ? 128 + end.signal : 0;
      }
      std::fprintf(stderr, "ptrun: starting all %d rank(s)%s again (restart %d of %d)\n", nproc,
                   rdzv ? " of this node" : "", restart + 1, max_restarts);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ptrun: %s\n", e.what());
    return 1;
  }
}
