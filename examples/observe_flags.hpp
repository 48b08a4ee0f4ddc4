#pragma once
// The observability flags of the examples (docs/observability.md): the same
// names and meaning in each program. Tracing and the flight recorder read their
// settings from the environment (so that a launcher can set them for programs
// without flags); the flags set those variables, before init_process_group().

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <unistd.h>

#include "cli_checks.hpp"

struct ObserveFlags {
  std::string run_dir, trace_dir, trace_steps, flight_recorder_dir, tensorboard_dir;
  int flight_recorder_size = 0;
};

/// Adds --run-dir, --trace-dir, --trace-steps, --flight-recorder-dir, --flight-recorder-size and --tensorboard-dir.
inline void add_observe_flags(CLI::App& app, ObserveFlags& f) {
  app.add_option("--run-dir", f.run_dir, "one folder for the run: config.toml (every flag), metrics.jsonl, "
                 "tensorboard/ and checkpoints/, unless --metrics, --tensorboard-dir or --checkpoint-dir say "
                 "otherwise");
  app.add_option("--trace-dir", f.trace_dir, "write each rank's Chrome/Perfetto trace here (trace_rank<R>.json; "
                 "PTRAIN_TRACE_DIR)");
  app.add_option("--trace-steps", f.trace_steps, "steps to trace, FIRST:LAST or one step (default 1:3; "
                 "PTRAIN_TRACE_STEPS)");
  app.add_option("--flight-recorder-dir", f.flight_recorder_dir, "keep each communicator's last operations and "
                 "dump them here on a communicator error or SIGUSR2 (PTRAIN_FLIGHT_RECORDER_DIR)");
  app.add_option("--flight-recorder-size", f.flight_recorder_size, "operations kept per communicator (default "
                 "2000; PTRAIN_FLIGHT_RECORDER_SIZE)")->check(positive);
  app.add_option("--tensorboard-dir", f.tensorboard_dir, "rank 0 also writes the metrics as TensorBoard scalars "
                 "here");
}

/// Puts the flags that were given into the environment the library reads; call before init_process_group().
inline void apply_observe_flags(const ObserveFlags& f) {
  if (!f.trace_dir.empty()) ::setenv("PTRAIN_TRACE_DIR", f.trace_dir.c_str(), 1);
  if (!f.trace_steps.empty()) ::setenv("PTRAIN_TRACE_STEPS", f.trace_steps.c_str(), 1);
  if (!f.flight_recorder_dir.empty()) ::setenv("PTRAIN_FLIGHT_RECORDER_DIR", f.flight_recorder_dir.c_str(), 1);
  if (f.flight_recorder_size > 0)
    ::setenv("PTRAIN_FLIGHT_RECORDER_SIZE", std::to_string(f.flight_recorder_size).c_str(), 1);
}

/// --run-dir D (Determined's experiment folder): fills the paths the flags left
/// empty with D/metrics.jsonl, D/tensorboard and D/checkpoints, and writes
/// D/config.toml, the value of every flag (CLI11's config format). Every rank
/// writes the same bytes through a rename, so ranks that share the folder never
/// see half a file. Call after parsing; false (after a message) when the folder
/// cannot be written.
inline bool apply_run_dir(const char* program, const CLI::App& app, ObserveFlags& f, std::string& metrics,
                          std::string& checkpoint_dir) {
  if (f.run_dir.empty()) return true;
  namespace fs = std::filesystem;
  const fs::path dir(f.run_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  const fs::path tmp = dir / ("config.toml.tmp." + std::to_string(::getpid()));
  {
    std::ofstream out(tmp);
    out << "# " << program << " --run-dir " << f.run_dir << "\n" << app.config_to_str(true, true);
    if (!ec && !out) ec = std::make_error_code(std::errc::io_error);
  }
  if (!ec) fs::rename(tmp, dir / "config.toml", ec);
  if (ec) {
    std::fprintf(stderr, "%s: --run-dir %s: cannot write its config.toml (%s); pass a writable folder\n",
                 program, f.run_dir.c_str(), ec.message().c_str());
    return false;
  }
  if (metrics.empty()) metrics = (dir / "metrics.jsonl").string();
  if (f.tensorboard_dir.empty()) f.tensorboard_dir = (dir / "tensorboard").string();
  if (checkpoint_dir.empty()) checkpoint_dir = (dir / "checkpoints").string();
  return true;
}
