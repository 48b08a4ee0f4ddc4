// ptrun: a torchrun-compatible local launcher.
//
//   ptrun --nproc-per-node 4 [--nnodes N --node-rank K --master-addr H --master-port P] prog args...
//
// Starts nproc-per-node copies of prog with the variables torchrun sets
// (RANK, WORLD_SIZE, LOCAL_RANK, ...), forwards SIGINT/SIGTERM/SIGHUP to them,
// and when one rank fails stops the others (SIGTERM, SIGKILL after a grace
// period) and exits with that rank's status (128 + signal for a signal).
// There is no agent store: rank 0 of the program serves ptrain's TCP store.

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrun: start a ptrain program on this node the way torchrun does"};
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 29500;
  double grace = 5.0;
  std::string master_addr = "127.0.0.1";
  bool no_python = false, standalone = false;
  std::vector<std::string> command;
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "processes on this node")
      ->envname("PET_NPROC_PER_NODE")->check(CLI::Range(1, 4096));
  app.add_option("--nnodes", nnodes, "number of nodes")->envname("PET_NNODES")->check(CLI::Range(1, 1 << 16));
  app.add_option("--node-rank,--node_rank", node_rank, "index of this node, 0 <= node-rank < nnodes")
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
  if (master_port == 0) {
    if (nnodes != 1) {
      std::fprintf(stderr, "ptrun: --master-port 0 (pick a free port) works on one node only; "
                           "with --nnodes %d give every node the same --master-port\n", nnodes);
      return 2;
    }
    master_port = free_port();
  }

  const int world = nnodes * nproc;
  const std::string run_id = std::to_string(::getpid());

  // Signals arrive through a signalfd so that the wait loop below handles them
  // in order with child exits, never inside an async handler.
  sigset_t mask, old_mask;
  sigemptyset(&mask);
  for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&mask, s);
  sigprocmask(SIG_BLOCK, &mask, &old_mask);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) {
    std::perror("ptrun: signalfd");
    return 1;
  }

  std::vector<Child> children(nproc);
  int running = 0;
  // First failure decides the exit status; later ones are its consequences.
  std::optional<int> first_failure;
  int received_signal = 0;
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  auto stop_all = [&](int sig) {
    signal_children(children, sig);
    if (!kill_at) kill_at = std::chrono::steady_clock::now() + std::chrono::duration_cast<
                                std::chrono::steady_clock::duration>(std::chrono::duration<double>(grace));
  };

  for (int local = 0; local < nproc; ++local) {
    const int rank = node_rank * nproc + local;
    // A close-on-exec pipe tells the parent whether exec worked: it reads EOF
    // on success and the child's errno on failure.
    int ep[2];
    if (::pipe2(ep, O_CLOEXEC) != 0) {
      std::perror("ptrun: pipe");
      stop_all(SIGKILL);
      first_failure = 1;
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
      set("LOCAL_WORLD_SIZE", std::to_string(nproc));
      set("GROUP_RANK", std::to_string(node_rank));
      set("GROUP_WORLD_SIZE", std::to_string(nnodes));
      set("ROLE_RANK", std::to_string(rank));
      set("ROLE_WORLD_SIZE", std::to_string(world));
      set("ROLE_NAME", "default");
      set("MASTER_ADDR", master_addr);
      set("MASTER_PORT", std::to_string(master_port));
      set("TORCHELASTIC_RESTART_COUNT", "0");
      set("TORCHELASTIC_MAX_RESTARTS", "0");
      set("TORCHELASTIC_RUN_ID", run_id);
      set("TORCHELASTIC_USE_AGENT_STORE", "False");
      // torchrun's default: one thread per rank unless the user chose otherwise.
      if (nproc > 1 && !std::getenv("OMP_NUM_THREADS")) set("OMP_NUM_THREADS", "1");
      std::vector<char*> args;
      for (auto& a : command) args.push_back(a.data());
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
      first_failure = 1;
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
      std::fprintf(stderr, "ptrun: cannot execute '%s': %s\n", command[0].c_str(), std::strerror(err));
      stop_all(SIGTERM);
      first_failure = 127;
      break;
    }
  }

  while (running > 0) {
    int timeout_ms = -1;
    if (kill_at) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*kill_at - std::chrono::steady_clock::now());
      timeout_ms = static_cast<int>(std::max<long long>(left.count(), 0));
    }
    pollfd p{sfd, POLLIN, 0};
    int n = ::poll(&p, 1, timeout_ms);
    if (n == 0 && kill_at) {
      std::fprintf(stderr, "ptrun: %d rank(s) still running %.1f s after SIGTERM; sending SIGKILL\n", running, grace);
      signal_children(children, SIGKILL);
      kill_at.reset();
      continue;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      std::perror("ptrun: poll");
      signal_children(children, SIGKILL);
    }
    signalfd_siginfo si;
    while (::read(sfd, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
      if (si.ssi_signo != SIGCHLD) {
        received_signal = static_cast<int>(si.ssi_signo);
        std::fprintf(stderr, "ptrun: got signal %d (%s); forwarding it to %d rank(s)\n", received_signal,
                     strsignal(received_signal), running);
        stop_all(received_signal);
      }
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
        if (failed && !first_failure && !received_signal) {
          first_failure = exit_code(status);
          std::fprintf(stderr, "ptrun: rank %d (pid %d) %s; stopping the other %d rank(s)\n", c.rank, pid,
                       describe(status).c_str(), running);
          stop_all(SIGTERM);
        }
      }
    }
  }
  ::close(sfd);
  if (first_failure) return *first_failure;
  if (received_signal) return 128 + received_signal;
  return 0;
}
