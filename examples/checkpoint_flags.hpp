#pragma once
// The checkpoint flags of the examples (docs/checkpointing.md): the same names,
// defaults and meaning in each program.

#include <CLI/CLI.hpp>

#include "cli_checks.hpp"

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
