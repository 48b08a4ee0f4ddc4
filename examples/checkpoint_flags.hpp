#pragma once
// The checkpoint flags of the examples (docs/checkpointing.md): the same names,
// defaults and meaning in each program.

#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli_checks.hpp"
#include "observe_flags.hpp"

/// Adds --checkpoint-dir, --checkpoint-every, --keep-checkpoints, --resume,
/// --start-over and --preempt-exit-code, bound to opt.checkpoint_dir,
/// checkpoint_every, keep_checkpoints, resume, start_over and preempt_exit_code.
template <class Options>
void add_checkpoint_flags(CLI::App& app, Options& opt) {
  app.add_option("--checkpoint-dir", opt.checkpoint_dir,
                 "save checkpoints here (every --checkpoint-every steps, at the end, and on SIGTERM/SIGINT/SIGUSR1)");
  app.add_option("--checkpoint-every", opt.checkpoint_every, "steps between checkpoints (0: only at the end and on "
                 "a signal)")->check(non_negative);
  app.add_option("--keep-checkpoints", opt.keep_checkpoints, "committed checkpoints kept (0: all)")
      ->check(non_negative);
  auto* resume =
      app.add_flag("--resume", opt.resume, "continue from the newest complete checkpoint in --checkpoint-dir, if any");
  app.add_flag("--start-over", opt.start_over, "with --resume, when every checkpoint in --checkpoint-dir is corrupt: "
               "rename them to corrupt-step-N and start from step 0 (without it such a run is refused)")
      ->needs(resume);
  app.add_option("--preempt-exit-code", opt.preempt_exit_code,
                 "exit status after a signal-triggered checkpoint (0; Kubernetes manifests use 75 so that "
                 "the Job restarts the pods instead of counting them as finished)")
      ->check(CLI::Range(0, 125));
}

/// Adds the checkpoint and observability flags (after the program's own, so --help lists them
/// last), parses the command line, applies --run-dir (opt.metrics, opt.checkpoint_dir) and
/// refuses --resume without a checkpoint folder. Returns -1 to go on, else the exit code (0
/// after --help, 2 for a usage error).
template <class Options>
int parse_training_flags(const char* program, CLI::App& app, int argc, char** argv, Options& opt,
                         ObserveFlags& observe) {
  add_checkpoint_flags(app, opt);
  add_observe_flags(app, observe);
  if (const int rc = parse_command_line(app, argc, argv); rc >= 0) return rc;
  if (!apply_run_dir(program, app, observe, opt.metrics, opt.checkpoint_dir)) return 2;
  if (opt.resume && opt.checkpoint_dir.empty()) {
    std::fprintf(stderr, "%s: --resume needs --checkpoint-dir (or --run-dir)\n", program);
    return 2;
  }
  return -1;
}
