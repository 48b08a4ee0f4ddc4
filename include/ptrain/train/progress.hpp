#pragma once
// A one-line progress report every N training steps.
//
//   Progress progress(total_steps, /*every=*/100);
//   for (...) { ...; progress.update(step, epoch, loss, lr, batch_size); }
//   // step 100/4690 | epoch 1 | loss 0.5123 | lr 1.00e-03 | 20531 samples/s | elapsed 0:03 | eta 2:14
//
// Throughput is measured over the last reporting window only, so it shows the
// current speed (after warm-up, after an evaluation pause) rather than a
// since-start average; the ETA uses the average step time since the start,
// which is steadier than the last window. The loss shown is the mean over the
// window's steps, which is less noisy than the last step's loss.

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <ostream>
#include <string>

#include "ptrain/core/error.hpp"

namespace ptrain {

/// Wall-clock seconds since construction or the last reset().
struct Stopwatch {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
  void reset() { start = std::chrono::steady_clock::now(); }
};

/// What happened since the last report: the steps run in this process (a
/// resumed run's first window starts at the resume, not at the previous report
/// step), their samples and summed loss, and when the window opened.
struct ReportWindow {
  double start = 0;  ///< seconds, on the caller's clock
  std::int64_t steps = 0;
  std::int64_t samples = 0;
  double loss = 0;

  void add(std::int64_t step_samples, double step_loss) {
    ++steps;
    samples += step_samples;
    loss += step_loss;
  }
  double mean_loss() const { return steps > 0 ? loss / static_cast<double>(steps) : 0.0; }
  /// Samples per second from `start` to `now`; 0 for an empty or zero-length window.
  double samples_per_s(double now) const {
    return now > start ? static_cast<double>(samples) / (now - start) : 0.0;
  }
  /// Opens the next window at `now`.
  void reset(double now) { *this = ReportWindow{now}; }
};

/// "m:ss" below an hour, "h:mm:ss" above; "?" for a negative or non-finite time.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<long long>(std::llround(seconds));
  char buf[48];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  return buf;
}

/// Prints a report line every `every` steps (and at the last step) to a stream.
class Progress {
 public:
  /// total_steps: the step count of the whole run; every: report interval (0 disables printing);
  /// start_step: steps already done before this run (a resumed run), so that the ETA counts only new ones.
  Progress(std::int64_t total_steps, std::int64_t every, std::ostream& out = std::cout, std::int64_t start_step = 0)
      : total_(total_steps), every_(every), out_(&out), start_step_(start_step) {
    PTRAIN_CHECK(total_steps >= 0 && every >= 0 && start_step >= 0, Error, "[ptrain.progress] invalid total_steps ",
                 total_steps, ", every ", every, " or start_step ", start_step, "; all must be >= 0");
  }

  /// Records finished step `step` (1-based, counted over the whole run) that processed `samples`
  /// samples; prints a line when step is a multiple of `every` or the last step. Returns whether it printed.
  bool update(std::int64_t step, std::int64_t epoch, double loss, double lr, std::int64_t samples) {
    return update_at(clock_.seconds(), step, epoch, loss, lr, samples);
  }

  /// update() with the time given explicitly (seconds since construction); for tests and own clocks.
  bool update_at(double now, std::int64_t step, std::int64_t epoch, double loss, double lr, std::int64_t samples) {
    window_.add(samples, loss);
    if (every_ == 0 || (step % every_ != 0 && step != total_)) return false;

    const double samples_per_s = window_.samples_per_s(now);
    const std::int64_t done = step - start_step_;
    const double eta = done > 0 ? now / static_cast<double>(done) * static_cast<double>(total_ - step) : -1.0;

    char buf[256];
    std::snprintf(buf, sizeof buf, "step %lld/%lld | epoch %lld | loss %.4f | lr %.2e | %.0f samples/s",
                  static_cast<long long>(step), static_cast<long long>(total_), static_cast<long long>(epoch),
                  window_.mean_loss(), lr, samples_per_s);
    last_line_ = std::string(buf) + " | elapsed " + format_duration(now) + " | eta " + format_duration(eta);
    last_samples_per_s_ = samples_per_s;
    *out_ << last_line_ << '\n' << std::flush;

    window_.reset(now);
    return true;
  }

  /// The most recent report line (without newline); empty before the first.
  const std::string& last_line() const { return last_line_; }
  /// Throughput of the most recent reporting window.
  double last_samples_per_s() const { return last_samples_per_s_; }
  /// Seconds since construction.
  double elapsed() const { return clock_.seconds(); }

 private:
  std::int64_t total_;
  std::int64_t every_;
  std::ostream* out_;
  std::int64_t start_step_;
  Stopwatch clock_;
  ReportWindow window_;
  std::string last_line_;
  double last_samples_per_s_ = 0;
};

}  // namespace ptrain
