// Helper program the runtime tests start as real processes (under ptrun,
// mpirun, or with a hand-made environment). Each mode leaves files in OUTDIR
// that the test then checks against what the launch should have produced.
//
//   env OUTDIR               write the launcher variables to OUTDIR/env_<RANK>
//   rendezvous OUTDIR        detect the launch, meet through the store, write OUTDIR/rank_<rank>
//   fail R CODE OUTDIR       write a pid file; rank R exits with CODE ("sig9": SIGKILL itself; "throw":
//                            throws, records the exception with ptrain::dist::record_error and exits 1;
//                            "corrupt": writes a broken TORCHELASTIC_ERROR_FILE and exits 5) once
//                            every rank has started, the others sleep
//   flaky R FAILS OUTDIR     meet through the store, write OUTDIR/round_<restart>_<rank> (MASTER_PORT and
//                            the TORCHELASTIC_* variables); while TORCHELASTIC_RESTART_COUNT < FAILS
//                            rank R then exits with 3 and the others sleep, afterwards all exit 0
//   linger R SECONDS         rank R sleeps SECONDS, then every rank exits 0 (the others at once)
//   elastic OUTDIR SECONDS   write OUTDIR/world_<WORLD_SIZE>_<RANK> (GROUP_RANK, GROUP_WORLD_SIZE), sleep
//                            SECONDS and exit 0; on SIGTERM exit 75 at once
//   sleep OUTDIR [ignore]    write a pid file and sleep; on SIGTERM write OUTDIR/term_<rank> and exit 75
//                            (as a program that saved a checkpoint on preemption; "ignore": SIGTERM
//                            is ignored, so only SIGKILL ends it)
//   usr OUTDIR CODE          install SIGUSR1 and SIGUSR2 handlers, write a pid file and sleep; on SIGUSR1
//                            or SIGUSR2 write OUTDIR/usr1_<rank> or usr2_<rank> and exit CODE (as a program
//                            that checkpoints before a time limit; "stay": sleep on, as after a
//                            flight-recorder dump); SIGTERM as in "sleep"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "ptrain/dist/error_file.hpp"
#include "ptrain/dist/launch_env.hpp"
#include "ptrain/dist/store.hpp"

namespace {

std::string out_dir;
int my_rank = 0;

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

void write_file(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp);
    f << text;
  }
  std::rename(tmp.c_str(), path.c_str());  // readers never see half a file
}

bool exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

void write_pid() { write_file(out_dir + "/pid_" + std::to_string(my_rank), std::to_string(::getpid())); }

// The SIGTERM handler may only make async-signal-safe calls, so the path of
// the file it creates is built before the handler is installed.
std::string term_path;

void on_term(int) {
  int fd = ::open(term_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) ::close(fd);
  ::_exit(75);
}

// Mode "usr": the same for SIGUSR1 and SIGUSR2, with the exit code the test chose.
std::string usr1_path, usr2_path;
int usr_code = 0;  // -1: stay

void on_usr(int sig) {
  int fd = ::open((sig == SIGUSR1 ? usr1_path : usr2_path).c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) ::close(fd);
  if (usr_code >= 0) ::_exit(usr_code);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return 2;
  std::string mode = argv[1];
  my_rank = std::atoi(env_or("RANK", "0").c_str());

  if (mode == "env") {
    out_dir = argv[2];
    std::string text;
    for (const char* v : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                          "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID",
                          "OMP_NUM_THREADS", "PTRAIN_STORE_TOKEN", "ROLE_NAME", "TORCHELASTIC_ERROR_FILE"})
      text += std::string(v) + "=" + env_or(v, "<unset>") + "\n";
    text += "ARGS=";
    for (int i = 3; i < argc; ++i) text += std::string(i > 3 ? " " : "") + argv[i];
    text += "\n";
    write_file(out_dir + "/env_" + env_or("RANK", "x"), text);
    return 0;
  }

  if (mode == "rendezvous") {
    out_dir = argv[2];
    try {
      auto env = ptrain::dist::detect_launch_env();
      auto store = ptrain::dist::make_store(env, std::chrono::seconds(30));
      store->set("who/" + std::to_string(env.rank), std::to_string(::getpid()));
      store->barrier("start", env.world_size);
      store->add("sum", env.rank + 1);
      store->barrier("summed", env.world_size);
      std::string sum = store->get("sum");
      // Every rank reads every other rank's key: the store really is shared.
      int seen = 0;
      for (int r = 0; r < env.world_size; ++r) seen += store->check({"who/" + std::to_string(r)}) ? 1 : 0;
      store->barrier("end", env.world_size);
      write_file(out_dir + "/rank_" + std::to_string(env.rank),
                 ptrain::detail::cat("launcher=", env.launcher_name(), "\nrank=", env.rank, "\nworld_size=",
                                     env.world_size, "\nlocal_rank=", env.local_rank, "\nlocal_world_size=",
                                     env.local_world_size, "\nsum=", sum, "\nseen=", seen, "\n"));
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "runtime_worker: %s\n", e.what());
      write_file(out_dir + "/error_" + std::to_string(::getpid()), e.what());
      return 3;
    }
  }

  if (mode == "fail" && argc >= 5) {
    int victim = std::atoi(argv[2]);
    std::string code = argv[3];
    out_dir = argv[4];
    term_path = out_dir + "/term_" + std::to_string(my_rank);  // the others: SIGTERM leaves term_<rank>
    if (my_rank != victim) ::signal(SIGTERM, on_term);
    write_pid();
    int world = std::atoi(env_or("WORLD_SIZE", "1").c_str());
    if (my_rank == victim) {
      for (int r = 0; r < world; ++r)
        while (!exists(out_dir + "/pid_" + std::to_string(r))) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      if (code == "sig9") ::raise(SIGKILL);
      if (code == "corrupt") {
        write_file(ptrain::dist::error_file_path(), "{\"message\": {\"message\": \"cut sho");
        return 5;
      }
      if (code == "throw") {
        try {
          throw std::runtime_error("rank " + std::to_string(my_rank) + " failed on purpose");
        } catch (const std::exception& e) {
          ptrain::dist::record_error(e);
          return 1;
        }
      }
      return std::atoi(code.c_str());
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  if (mode == "flaky" && argc >= 5) {
    int victim = std::atoi(argv[2]), fails = std::atoi(argv[3]);
    out_dir = argv[4];
    int restart = std::atoi(env_or("TORCHELASTIC_RESTART_COUNT", "-1").c_str());
    std::string text;
    for (const char* v : {"MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                          "TORCHELASTIC_RUN_ID"})
      text += std::string(v) + "=" + env_or(v, "<unset>") + "\n";
    try {
      auto env = ptrain::dist::detect_launch_env();
      auto store = ptrain::dist::make_store(env, std::chrono::seconds(30));
      store->barrier("met", env.world_size);
      write_file(out_dir + "/round_" + std::to_string(restart) + "_" + std::to_string(my_rank), text);
      store->barrier("written", env.world_size);  // every rank's file is there before one fails
      if (restart < fails) {
        if (my_rank == victim) return 3;
        std::this_thread::sleep_for(std::chrono::seconds(60));
      }
      store->barrier("end", env.world_size);  // rank 0 serves the store until all are done
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "runtime_worker: %s\n", e.what());
      return 4;
    }
  }

  if (mode == "linger" && argc >= 4) {
    if (my_rank == std::atoi(argv[2])) std::this_thread::sleep_for(std::chrono::seconds(std::atoi(argv[3])));
    return 0;
  }

  if (mode == "elastic" && argc >= 4) {
    out_dir = argv[2];
    write_file(out_dir + "/world_" + env_or("WORLD_SIZE", "x") + "_" + env_or("RANK", "x"),
               env_or("GROUP_RANK", "x") + " " + env_or("GROUP_WORLD_SIZE", "x") + "\n");
    term_path = out_dir + "/term_" + std::to_string(my_rank);
    ::signal(SIGTERM, on_term);
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(std::atof(argv[3]) * 1000)));
    return 0;
  }

  if (mode == "usr" && argc >= 4) {
    out_dir = argv[2];
    usr_code = std::string(argv[3]) == "stay" ? -1 : std::atoi(argv[3]);
    usr1_path = out_dir + "/usr1_" + std::to_string(my_rank);
    usr2_path = out_dir + "/usr2_" + std::to_string(my_rank);
    term_path = out_dir + "/term_" + std::to_string(my_rank);
    // Every signal waits while a handler runs, so a SIGTERM that ptrun sends when another
    // rank has exited cannot cut this one's file short.
    struct sigaction sa {};
    sigfillset(&sa.sa_mask);
    sa.sa_handler = on_usr;
    ::sigaction(SIGUSR1, &sa, nullptr);
    ::sigaction(SIGUSR2, &sa, nullptr);
    sa.sa_handler = on_term;
    ::sigaction(SIGTERM, &sa, nullptr);
    write_pid();  // the handlers are in place
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }

  if (mode == "sleep") {
    out_dir = argv[2];
    bool ignore = argc >= 4 && std::string(argv[3]) == "ignore";
    term_path = out_dir + "/term_" + std::to_string(my_rank);
    ::signal(SIGTERM, ignore ? SIG_IGN : on_term);
    write_pid();
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  return 2;
}
