#pragma once
// The observability flags of the examples (docs/observability.md): the same
// names and meaning in each program. Tracing and the flight recorder read their
// settings from the environment (so that a launcher can set them for programs
// without flags); the flags set those variables, before init_process_group().

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

#include "cli_checks.hpp"

struct ObserveFlags {
  std::string trace_dir, trace_steps, flight_recorder_dir, tensorboard_dir;
  int flight_recorder_size = 0;
};

/// Adds --trace-dir, --trace-steps, --flight-recorder-dir, --flight-recorder-size and --tensorboard-dir.
inline void add_observe_flags(CLI::App& app, ObserveFlags& f) {
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
