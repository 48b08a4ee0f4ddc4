#pragma once
// How ptrun's nodes agree: the rounds of a fixed set of nodes (--nnodes N with
// --max-restarts) and elastic membership (--nnodes MIN:MAX).

#include <ifaddrs.h>
#include <netdb.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "ptrain/dist/store.hpp"

namespace ptrun {

// What every round of ranks shares.
struct Launch {
  std::vector<std::string> command;
  int nproc = 1, nnodes = 1, node_rank = 0, master_port = 0, max_restarts = 0;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT of the round being started
  std::string master_addr, run_id, role = "default";
  double grace = 5.0;
  bool agent_store = false;  // Note [Restarts across nodes], Note [Elastic membership]
  // What happens to the ranks' output (output.hpp): files under log_dir/attempt_<k>/,
  // lines on the console prefixed with line_prefix (a template; empty: as written).
  std::map<int, unsigned> redirects, tee;
  std::string log_dir, line_prefix;
  bool temporary_log_dir = false;  // Note [Error files]: ptrun's own, removed at exit unless it holds error files
  std::set<int> shown;  // --local-ranks-filter: the local ranks whose output reaches the console (empty: all)
  std::chrono::milliseconds monitor{100};  // --monitor-interval
};

// Note [Signals ptrun handles]
// ptrun reads its signals through a signalfd and sorts them in three kinds:
//   stop     SIGINT, SIGTERM and SIGHUP always, SIGQUIT when --signals-to-handle lists it
//            (the default does): forwarded to every rank, and the job stops (SIGKILL after
//            --grace-period, no restart);
//   forward  every other signal of --signals-to-handle (SIGUSR1 and SIGUSR2 by default):
//            forwarded to every running rank and nothing else; the ranks decide what it
//            means (a checkpoint before a time limit, a flight-recorder dump), and how they
//            exit is handled as any exit of theirs;
//   ignored  SIGUSR1 or SIGUSR2 left out of the list: ptrun says so on stderr and goes on,
//            so that a stray `pkill -USR2` never kills the job (their default action would
//            end ptrun, and PR_SET_PDEATHSIG would SIGKILL every rank).
// Any other signal that is not listed keeps its default action, as under torchrun.
struct SignalPolicy {
  std::set<int> stop{SIGINT, SIGTERM, SIGHUP, SIGQUIT};
  std::set<int> forward{SIGUSR1, SIGUSR2};
  /// The signals ptrun blocks and reads through its signalfd (SIGCHLD included).
  sigset_t caught() const {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGCHLD}) sigaddset(&set, s);
    for (int s : stop) sigaddset(&set, s);
    for (int s : forward) sigaddset(&set, s);
    return set;
  }
};

/// ptrun's policy, set once by main from --signals-to-handle.
inline SignalPolicy& signal_policy() {
  static SignalPolicy policy;
  return policy;
}

// The first signal that stops the job (Note [Signals ptrun handles]) waiting in `sfd`, or 0.
// A signal only to be forwarded goes to `forward` (which sends it to the running ranks);
// without one (no rank runs) it is reported and dropped, as is a signal ptrun ignores.
inline int pending_signal(int sfd, const std::function<void(int)>& forward = {}) {
  const SignalPolicy& policy = signal_policy();
  int sig = 0;
  signalfd_siginfo si;
  while (::read(sfd, &si, sizeof si) == static_cast<ssize_t>(sizeof si)) {
    const int s = static_cast<int>(si.ssi_signo);
    if (s == SIGCHLD) continue;
    if (policy.stop.count(s)) {
      if (!sig) sig = s;
    } else if (policy.forward.count(s) && forward) {
      forward(s);
    } else if (policy.forward.count(s)) {
      std::fprintf(stderr, "ptrun: got signal %d (%s) while no rank runs; not forwarded\n", s, strsignal(s));
    } else {
      std::fprintf(stderr, "ptrun: got signal %d (%s); ignored: it is not in --signals-to-handle\n", s, strsignal(s));
    }
  }
  return sig;
}

// What a round of ranks learns from the other nodes: run_round reports its own
// failure or signal, and polls for theirs.
class Peers {
 public:
  virtual ~Peers() = default;
  /// Tells every node that round k failed or stopped here (the first report of each kind stays).
  virtual void report(int k, const char* what, const std::string& detail) noexcept = 0;
  /// What another node reported for round k, or nothing.
  virtual std::optional<std::string> reported(int k) noexcept = 0;
};

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
// Waits poll every --monitor-interval (0.1 s), so that signals to ptrun still stop the job, and end
// after --rdzv-timeout: at join with an error; at end (as torchrun's exit barrier)
// with this node's own status and no restart, since the others may be gone.
class Rendezvous : public Peers {
 public:
  enum class Outcome { Done, Failed, Stopped, Incomplete };

  Rendezvous(const Launch& l, std::chrono::milliseconds timeout)
      : store_(l.master_addr, l.master_port, l.node_rank == 0, timeout), nnodes_(l.nnodes), node_(l.node_rank),
        timeout_(timeout), monitor_(l.monitor) {
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
  std::optional<std::string> reported(int k) noexcept override {
    try {
      for (const char* what : {"stopped", "failed"})
        if (store_.check({key(k, what)})) return "round " + std::to_string(k) + " " + what + " on " + store_.get(key(k, what));
      return std::nullopt;
    } catch (const std::exception& e) {
      return "the agent store is unreachable (" + std::string(e.what()) + ")";
    }
  }
  /// Tells every node that round k failed or stopped here (the first report of each kind stays).
  void report(int k, const char* what, const std::string& detail) noexcept override {
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
      std::this_thread::sleep_for(monitor_);
    }
  }

  ptrain::dist::TCPStore store_;
  int nnodes_, node_;
  std::chrono::milliseconds timeout_, monitor_;
};


// Whether `host` names this machine: loopback, its hostname, or an address of one
// of its interfaces (torchrun's c10d backend asks the same to pick the store's host).
inline bool is_this_host(const std::string& host) {
  if (host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0) return true;
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  if (host == name) return true;
  std::vector<std::string> mine;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i; i = i->ifa_next) {
      if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
      char buf[NI_MAXHOST];
      const socklen_t len = i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
      if (::getnameinfo(i->ifa_addr, len, buf, sizeof buf, nullptr, 0, NI_NUMERICHOST) == 0) mine.push_back(buf);
    }
    ::freeifaddrs(list);
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  bool found = false;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0) {
    for (addrinfo* a = res; a && !found; a = a->ai_next) {
      char buf[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, buf, sizeof buf, nullptr, 0, NI_NUMERICHOST) == 0)
        found = std::find(mine.begin(), mine.end(), std::string(buf)) != mine.end();
    }
    ::freeaddrinfo(res);
  }
  return found;
}

// Note [Elastic membership]
// With --nnodes MIN:MAX a round runs on whichever nodes are there. The ptrun on the
// endpoint's host (--rdzv-endpoint, or --master-addr/--master-port) serves the agent
// store and is node 0 of every round; the others take indices 1, 2, ... in the order
// they join. Round k (keys under elastic/):
//   form  node 0 publishes round = k, waits until MIN nodes are in (k/joined counts the
//         others; --rdzv-timeout), then for more until MAX or last_call_timeout, and
//         writes k/plan = "run <nodes> <restarts>" (or "stop <why>"). A node whose index
//         is past the plan's count (it came late) joins round k + 1.
//   run   as Note [Restarts across nodes], with two more reasons to end a round early:
//         k/left (a node's ptrun got a signal: a spot node being reclaimed leaves, its
//         ranks and then everyone's checkpoint and exit) and k/regroup (a node waits in
//         k+1/joined while the round has fewer than MAX nodes: the others stop their
//         ranks with SIGTERM, so that they checkpoint, and the round re-forms with it).
//   next  a node whose ranks have exited joins round k + 1 at once: there is no end
//         barrier that a lost node would never reach. Node 0 counts round k against
//         --max-restarts when it failed with no node leaving or joining (a lost node's
//         peers fail in their collectives: that is a failure), and past the limit plans
//         "stop".
//   done  ranks that all exit 0 with nothing reported: every node counts itself in
//         k/done and waits for the round's other nodes; node 0 then marks the job
//         finished (a node that comes now is refused) and leaves last.
// Node 0 is the single point the job needs: when its ptrun is lost the store is gone,
// and every other node stops its ranks and exits 1 with an error naming node 0's
// store, within --rdzv-timeout (sooner when the connection is refused). A job that must
// outlive any one machine runs node 0 where it is not preempted, or lets its scheduler
// restart the whole job (it resumes from the last checkpoint).
class ElasticRendezvous : public Peers {
 public:
  struct Plan {
    int nodes = 0, index = 0, restarts = 0;
  };
  struct Options {
    int min_nodes = 1, max_nodes = 1;
    std::chrono::milliseconds join_timeout{600'000}, last_call{30'000}, monitor{100};
    std::chrono::milliseconds heartbeat{15'000};  // a node silent this long is lost
  };

  /// Serves the store when this is the endpoint's host and the port is free (or
  /// `serve` says so), else connects to it.
  ElasticRendezvous(const Launch& l, Options o, std::optional<bool> serve)
      : store_(open(l, o, serve, server_)), o_(o), nproc_(l.nproc) {
    if (server_) {
      store_.set(key("nproc"), std::to_string(nproc_));
    } else {
      const std::string theirs = store_.get(key("nproc"));
      PTRAIN_CHECK(theirs == std::to_string(nproc_), LaunchError, "[ptrun.rendezvous] node 0 runs ",
                   theirs, " process(es) per node and this node ", nproc_, "; give every node the same "
                   "--nproc-per-node");
    }
  }
  bool serves() const { return server_; }

  /// Takes part in round k (later rounds when this node comes too late for k); the
  /// round's plan, or nothing when the job stops (`why` says why) or a signal came.
  std::optional<Plan> join(int& k, int restarts, int sfd, int& sig, std::string& why) {
    if (server_) return form(k, restarts, sfd, sig, why);
    if (k < 0) {  // a node that comes to a running job
      PTRAIN_CHECK(!store_.check({key("finished")}), LaunchError, "[ptrun.rendezvous] the job has "
                   "finished; there is nothing to join");
      k = std::stoi(store_.get(key("round")));
      if (store_.check({key(k, "plan")})) {
        const Plan p = parse(store_.get(key(k, "plan")), why);
        PTRAIN_CHECK(why.empty(), LaunchError, "[ptrun.rendezvous] the job is ending: ", why);
        PTRAIN_CHECK(p.nodes < o_.max_nodes, LaunchError, "[ptrun.rendezvous] the job already runs on its "
                     "most nodes (", o_.max_nodes, "); this node is not needed");
        ++k;  // the running nodes regroup to take this one
      }
    }
    for (;; ++k) {
      const int index = static_cast<int>(store_.add(key(k, "joined"), 1));
      if (!wait_for(key(k, "plan"), o_.join_timeout + o_.last_call, sfd, sig)) {
        if (sig) return std::nullopt;
        PTRAIN_THROW(CommError, "[ptrun.rendezvous] node 0 formed no round ", k, " within ",
                     (o_.join_timeout + o_.last_call).count() / 1000, " s");
      }
      Plan p = parse(store_.get(key(k, "plan")), why);
      if (!why.empty()) {
        store_.add(key(k, "bye"), 1);
        return std::nullopt;
      }
      if (index < p.nodes) {
        p.index = index;
        return p;
      }
      PTRAIN_CHECK(p.nodes < o_.max_nodes, LaunchError, "[ptrun.rendezvous] round ", k, " filled all ",
                   o_.max_nodes, " places before this node came; this node is not needed");
    }
  }

  void report(int k, const char* what, const std::string& detail) noexcept override {
    // A node other than node 0 that gets a signal leaves; the job goes on without it.
    if (std::string(what) == "stopped" && !server_) what = "left";
    try {
      store_.compare_set(key(k, what), "", "node " + std::to_string(index_) + ": " + detail);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ptrun: cannot report to the agent store: %s\n", e.what());
    }
  }
  std::optional<std::string> reported(int k) noexcept override {
    try {
      store_.add(key(k, "beat/" + std::to_string(index_)), 1);
      if (server_)
        if (auto lost = silent_node(k)) report(k, "failed", *lost);
      for (const char* what : {"stopped", "failed", "left", "regroup"})
        if (store_.check({key(k, what)})) return "round " + std::to_string(k) + " " + what + ": " + store_.get(key(k, what));
      if (nodes_ < o_.max_nodes && store_.add(key(k + 1, "joined"), 0) > 0) {
        store_.compare_set(key(k, "regroup"), "", "a node waits to join");
        return "round " + std::to_string(k) + ": a node waits to join; re-forming with it";
      }
      return std::nullopt;
    } catch (const std::exception& e) {
      return "node 0's agent store is unreachable (" + std::string(e.what()) + "); node 0 is lost";
    }
  }
  /// The round this node runs in now.
  void running(const Plan& p) {
    nodes_ = p.nodes;
    index_ = p.index;
  }

  /// Whether round k ended the job: node 0 stopped it (a signal), or every node's
  /// ranks finished. After ranks that all exited 0 this node waits for the others.
  bool ended(int k, bool finished_here, int sfd) {
    int sig = 0;
    if (store_.check({key(k, "stopped")})) {
      if (server_) wait_count(key(k, "bye"), nodes_ - 1, sfd, sig);
      else store_.add(key(k, "bye"), 1);
      return true;
    }
    if (!finished_here) return false;
    store_.add(key(k, "done"), 1);
    const auto until = std::chrono::steady_clock::now() + o_.join_timeout;
    while (std::chrono::steady_clock::now() < until) {
      if (store_.add(key(k, "done"), 0) >= nodes_) {
        if (server_) {
          store_.set(key("finished"), "1");
          wait_count(key(k, "bye"), nodes_ - 1, sfd, sig);  // the others read the outcome first
        } else {
          store_.add(key(k, "bye"), 1);
        }
        return true;
      }
      if (reported(k)) return false;
      std::this_thread::sleep_for(o_.monitor);
    }
    return true;  // the others are gone: this node's ranks are done
  }
  /// Node 0: whether round k counts against --max-restarts.
  bool failed(int k) {
    return store_.check({key(k, "failed")}) && !store_.check({key(k, "left")}) && !store_.check({key(k, "regroup")});
  }
  /// Node 0 ends the job: the plan of round k says why; waits briefly until the nodes
  /// that joined it have read it.
  void stop(int k, const std::string& why, int sfd) {
    store_.compare_set(key(k, "plan"), "", "stop " + why);
    int sig = 0;
    wait_count(key(k, "bye"), store_.add(key(k, "joined"), 0), sfd, sig);
  }

 private:
  static std::string key(const std::string& what) { return "ptrun/elastic/" + what; }
  static std::string key(int k, const std::string& what) { return key(std::to_string(k) + "/" + what); }

  // Node 0: a node of round k whose heartbeat (a counter each node raises as it polls)
  // has not moved for Options::heartbeat: its machine is gone or cut off, and its peers
  // would otherwise wait for it until their collectives time out.
  std::optional<std::string> silent_node(int k) {
    const auto now = std::chrono::steady_clock::now();
    if (beats_round_ != k) {
      beats_.assign(static_cast<std::size_t>(nodes_), {-1, now});
      beats_round_ = k;
    }
    for (int i = 1; i < nodes_; ++i) {
      auto& [count, since] = beats_[static_cast<std::size_t>(i)];
      const std::int64_t c = store_.add(key(k, "beat/" + std::to_string(i)), 0);
      if (c != count) {
        count = c;
        since = now;
      } else if (now - since > o_.heartbeat) {
        return "node " + std::to_string(i) + " sent no heartbeat for " +
               std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now - since).count()) +
               " s (its machine is lost or cut off)";
      }
    }
    return std::nullopt;
  }

  static ptrain::dist::TCPStore open(const Launch& l, const Options& o, std::optional<bool> serve, bool& server) {
    using ptrain::dist::TCPStore;
    server = serve ? *serve : is_this_host(l.master_addr);
    if (server && !serve) {
      try {
        return TCPStore(l.master_addr, l.master_port, true, o.join_timeout, std::nullopt, claim(l));
      } catch (const ptrain::CommError& e) {
        if (std::string(e.what()).find("[ptrain.store.bind]") == std::string::npos) throw;
        server = false;  // another ptrun of this host serves it
      }
    }
    return TCPStore(l.master_addr, l.master_port, server, o.join_timeout, std::nullopt, claim(l));
  }
  // An agent is a member of its job under its node rank (Note [Refused clients]).
  static ptrain::dist::StoreClaim claim(const Launch& l) { return {l.run_id, l.node_rank}; }

  static Plan parse(const std::string& plan, std::string& why) {
    Plan p;
    if (plan.rfind("stop ", 0) == 0) {
      why = plan.substr(5);
    } else if (std::sscanf(plan.c_str(), "run %d %d", &p.nodes, &p.restarts) != 2) {
      why = "node 0 wrote a plan this ptrun cannot read ('" + plan + "'): run the same ptrun on every node";
    }
    return p;
  }

  // Node 0 forms round k: waits for MIN nodes, then for more until MAX or the last call.
  std::optional<Plan> form(int& k, int restarts, int sfd, int& sig, std::string& why) {
    if (k < 0) k = 0;
    store_.set(key("round"), std::to_string(k));
    const auto joined = [&] { return 1 + static_cast<int>(store_.add(key(k, "joined"), 0)); };
    if (wait_count(key(k, "joined"), o_.min_nodes - 1, sfd, sig, o_.join_timeout) < o_.min_nodes - 1) {
      if (sig) return std::nullopt;
      why = std::to_string(joined()) + " of at least " + std::to_string(o_.min_nodes) + " node(s) came within " +
            std::to_string(o_.join_timeout.count() / 1000) + " s (--rdzv-timeout)";
      stop(k, why, sfd);
      PTRAIN_THROW(CommError, "[ptrun.rendezvous] round ", k, ": ", why,
                   "; start ptrun on more nodes with the same --rdzv-endpoint, or raise --rdzv-timeout");
    }
    if (wait_count(key(k, "joined"), o_.max_nodes - 1, sfd, sig, o_.last_call) < 0 || sig) return std::nullopt;
    Plan p{std::min(joined(), o_.max_nodes), 0, restarts};
    store_.set(key(k, "plan"), "run " + std::to_string(p.nodes) + " " + std::to_string(restarts));
    return p;
  }

  // Polls `counter` until it reaches n (true) or `timeout` passes or a signal comes (false).
  bool wait_for(const std::string& k, std::chrono::milliseconds timeout, int sfd, int& sig) {
    const auto until = std::chrono::steady_clock::now() + timeout;
    while (!store_.check({k})) {
      if ((sig = pending_signal(sfd)) || std::chrono::steady_clock::now() >= until) return false;
      std::this_thread::sleep_for(o_.monitor);
    }
    return true;
  }
  // Polls `counter` until it reaches n, the timeout passes or a signal comes; its value
  // (-1 after a signal).
  std::int64_t wait_count(const std::string& counter, std::int64_t n, int sfd, int& sig,
                          std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
    const auto until = std::chrono::steady_clock::now() + timeout.value_or(std::chrono::seconds(10));
    for (;;) {
      const std::int64_t got = store_.add(counter, 0);
      if (got >= n || std::chrono::steady_clock::now() >= until) return got;
      if ((sig = pending_signal(sfd))) return -1;
      std::this_thread::sleep_for(o_.monitor);
    }
  }

  bool server_ = false;
  ptrain::dist::TCPStore store_;
  Options o_;
  int nproc_, nodes_ = 0, index_ = 0;
  int beats_round_ = -1;
  std::vector<std::pair<std::int64_t, std::chrono::steady_clock::time_point>> beats_;
};

}  // namespace ptrun
