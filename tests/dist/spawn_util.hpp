#pragma once
// Helpers of the tests that start their own ranks (kill scenarios).
#include <arpa/inet.h>
#include <catch2/catch.hpp>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <netinet/in.h>
#include <sstream>
#include <string>
#include <utility>
#include <sys/socket.h>
#include <unistd.h>

namespace ptrain::testing {

/// A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Path of the running executable, to start more ranks of it.
inline std::string self_exe() {
  char buf[PATH_MAX] = {};
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

/// In a forked child that becomes rank `rank`: the torchrun-style variables of a
/// Gloo job on 127.0.0.1, with the launcher variables of mpirun and Slurm (which
/// take precedence) removed, and $PTRAIN_KILL_OUT = out_dir for its report.
inline void set_gloo_rank_env(int rank, int world_size, const std::string& port, int timeout_s,
                              const std::string& out_dir) {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "SLURM_PROCID"}) ::unsetenv(v);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", port.c_str(), 1);
  ::setenv("PTRAIN_BACKEND", "gloo", 1);
  ::setenv("PTRAIN_COMM_TIMEOUT_S", std::to_string(timeout_s).c_str(), 1);
  ::setenv("PTRAIN_KILL_OUT", out_dir.c_str(), 1);
}

/// A spawned rank's report, in $PTRAIN_KILL_OUT/rank<r>.txt: the milliseconds
/// since t0 (when its failing operation started), then the error message.
inline void write_child_report(int rank, std::chrono::steady_clock::time_point t0, const std::string& msg) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  if (const char* out = std::getenv("PTRAIN_KILL_OUT")) {
    std::ofstream f(std::string(out) + "/rank" + std::to_string(rank) + ".txt");
    f << ms << "\n" << msg << "\n";
  }
}

/// The report rank r wrote into dir: (milliseconds, message).
inline std::pair<long, std::string> read_child_report(const std::string& dir, int r) {
  std::ifstream f(dir + "/rank" + std::to_string(r) + ".txt");
  REQUIRE(f.good());
  long ms = -1;
  f >> ms;
  std::stringstream rest;
  rest << f.rdbuf();
  return {ms, rest.str()};
}

}  // namespace ptrain::testing
