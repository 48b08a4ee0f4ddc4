#pragma once
// Tracing: spans of a rank's steps as a Chrome trace / Perfetto JSON file, and
// the same spans as NVTX ranges for Nsight Systems.
//
//   obs::Tracer::get().configure({.dir = "traces", .first_step = 10, .last_step = 12}, rank);
//   ... each step: obs::Tracer::get().step(step);      // the Trainer does this
//   { obs::Span s("optimizer", "train"); opt.step(); }  // a span, ~free when tracing is off
//   obs::Tracer::get().flush();                         // writes <dir>/trace_rank<R>.json
//
// Note [Tracing cost]
// Every span site tests one global atomic flag (a relaxed load: a plain load
// and a branch) and does nothing else while it is false; the flag is true only
// inside the chosen step window. Span names and categories are string literals
// (const char*), never built at the site, so an off span allocates nothing. In
// the window, events go into a vector under a mutex (one per event, a few
// hundred per step) and are written once, when the window ends or at flush().
// benchmarks/ddp_step.cpp measures the off cost against the same step without
// span sites (docs/observability.md has the numbers).
//
// Note [NVTX without a link]
// NVTX ranges come from the NVTX library found at run time (dlopen of
// libnvToolsExt.so.1, or libnvtx3interop.so.1 of CUDA 12.9 and later, whose
// nvtxRangePushA / nvtxRangePop are the same C functions): the header is the
// same under g++ and nvcc, a CPU program links nothing new, and a program run
// without the library simply gets no ranges. Ranges are pushed on the thread
// that opens a Span and popped when it closes, so they nest as spans do;
// complete() events (spans recorded after the fact, such as a collective from
// its issue to its observed end) have no NVTX range.

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ptrain/core/error.hpp"
#include "ptrain/core/writable_dir.hpp"

namespace ptrain::obs {

namespace detail {
inline std::atomic<bool> trace_on{false};
}

/// True inside the trace window (Note [Tracing cost]).
inline bool tracing() { return detail::trace_on.load(std::memory_order_relaxed); }

/// Microseconds on the trace clock (steady; the same clock on every rank of a host).
inline double trace_now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Where and when to trace.
struct TraceOptions {
  std::string dir;                ///< where trace_rank<R>.json goes; "" disables tracing
  std::int64_t first_step = 1;    ///< first traced step (1-based, as the Trainer counts)
  std::int64_t last_step = 3;     ///< last traced step
  bool nvtx = true;               ///< also NVTX ranges, when the NVTX library loads (Note [NVTX without a link])
};

/// PTRAIN_TRACE_DIR and PTRAIN_TRACE_STEPS ("10:12", or "5" for one step; default 1:3).
inline TraceOptions trace_options_from_env() {
  TraceOptions o;
  if (const char* d = std::getenv("PTRAIN_TRACE_DIR")) o.dir = d;
  if (const char* s = std::getenv("PTRAIN_TRACE_STEPS"); s && *s) {
    long long a = 0, b = 0;
    int n = 0;
    const std::string str(s);
    const bool range = std::sscanf(s, "%lld:%lld%n", &a, &b, &n) == 2 && n == static_cast<int>(str.size());
    const bool one = !range && std::sscanf(s, "%lld%n", &a, &n) == 1 && n == static_cast<int>(str.size());
    if (one) b = a;
    PTRAIN_CHECK((range || one) && a >= 1 && b >= a, Error, "[ptrain.trace.steps] PTRAIN_TRACE_STEPS='", s,
                 "' is not FIRST:LAST (1 <= FIRST <= LAST) or one step; e.g. 10:12");
    o.first_step = a;
    o.last_step = b;
  }
  return o;
}

/// One trace event: a complete span ("X") or an instant ("i").
struct TraceEvent {
  const char* name;
  const char* cat;
  double ts_us, dur_us;
  std::uint32_t tid;
  std::int64_t arg;  ///< shown as args.n when >= 0 (a unit, a bucket, a micro-batch)
  std::string label; ///< extra name part (a collective's label), usually empty
};

/// The process's tracer (one per rank).
class Tracer {
 public:
  static Tracer& get() {
    static Tracer* t = new Tracer();  // never destroyed: spans may close during static destruction
    return *t;
  }

  /// Sets where and when to trace for rank `rank`; an empty dir turns tracing off.
  void configure(TraceOptions o, int rank) {
    std::lock_guard lock(m_);
    PTRAIN_CHECK(o.first_step >= 1 && o.last_step >= o.first_step, Error, "[ptrain.trace.steps] trace steps ",
                 o.first_step, ":", o.last_step, " are not 1 <= first <= last");
    if (!o.dir.empty()) {
      const std::string err = make_writable_dir(o.dir, rank);
      PTRAIN_CHECK(err.empty(), Error, "[ptrain.trace.dir] rank ", rank, " cannot write to the trace folder ", o.dir,
                   " (", err, "); create it or pass another --trace-dir (PTRAIN_TRACE_DIR)");
    }
    opts_ = std::move(o);
    rank_ = rank;
    configured_ = true;
    written_ = false;
    if (opts_.nvtx && !opts_.dir.empty()) load_nvtx();
  }
  /// configure(trace_options_from_env(), rank) unless configure() was called already.
  void configure_from_env(int rank) {
    {
      std::lock_guard lock(m_);
      if (configured_) return;
    }
    configure(trace_options_from_env(), rank);
  }
  bool enabled() const {
    std::lock_guard lock(m_);
    return !opts_.dir.empty();
  }

  /// Called at the start of every step: opens the window at first_step, writes the file after last_step.
  void step(std::int64_t s) {
    std::int64_t first = 0, last = 0;
    {
      std::lock_guard lock(m_);
      if (!configured_ || opts_.dir.empty() || written_) return;
      first = opts_.first_step;
      last = opts_.last_step;
    }
    if (s >= first && s <= last) {
      if (!tracing()) instant("trace.window_start", "trace", s);
      detail::trace_on.store(true, std::memory_order_relaxed);
    } else if (s > last) {
      flush();
    }
    if (tracing()) instant("step", "train", s);
  }

  /// Writes what was traced (if anything) to <dir>/trace_rank<R>.json and ends tracing. Returns the path or "".
  std::string flush() {
    detail::trace_on.store(false, std::memory_order_relaxed);
    std::lock_guard lock(m_);
    if (opts_.dir.empty() || events_.empty() || written_) return {};
    const std::string path = opts_.dir + "/trace_rank" + std::to_string(rank_) + ".json";
    std::ofstream f(path);
    PTRAIN_CHECK(f.is_open(), Error, "[ptrain.trace.open] cannot write the trace file '", path,
                 "'; create the directory or pass another --trace-dir");
    // Chrome trace format: pid = rank, one tid per thread; ts and dur in microseconds.
    // wall_minus_steady_us turns this rank's steady timestamps into wall-clock ones, so that
    // tools/merge_traces.py can line up ranks of different hosts (whose steady clocks differ).
    const double wall_us =
        std::chrono::duration<double, std::micro>(std::chrono::system_clock::now().time_since_epoch()).count();
    char num[64];
    std::snprintf(num, sizeof num, "%.3f", wall_us - trace_now_us());
    f << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"rank\":" << rank_ << ",\"wall_minus_steady_us\":"
      << num << "},\"traceEvents\":[\n";
    f << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << rank_ << ",\"args\":{\"name\":\"rank " << rank_
      << "\"}},\n{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" << rank_ << ",\"args\":{\"sort_index\":"
      << rank_ << "}}";
    for (const TraceEvent& e : events_) {
      f << ",\n{\"name\":\"" << e.name << (e.label.empty() ? "" : " ") << e.label << "\",\"cat\":\"" << e.cat
        << "\",\"ph\":\"" << (e.dur_us < 0 ? "i" : "X") << "\",\"pid\":" << rank_ << ",\"tid\":" << e.tid;
      std::snprintf(num, sizeof num, ",\"ts\":%.3f", e.ts_us);
      f << num;
      if (e.dur_us >= 0) {
        std::snprintf(num, sizeof num, ",\"dur\":%.3f", e.dur_us);
        f << num;
      } else {
        f << ",\"s\":\"p\"";
      }
      if (e.arg >= 0) f << ",\"args\":{\"n\":" << e.arg << "}";
      f << "}";
    }
    f << "\n]}\n";
    f.close();
    PTRAIN_CHECK(f.good(), Error, "[ptrain.trace.write] writing the trace file '", path, "' failed; the disk may be full");
    events_.clear();
    written_ = true;
    return path;
  }

  /// Records a span that already happened (start and end on the trace clock).
  void complete(const char* name, const char* cat, double start_us, double end_us, std::int64_t arg = -1,
                std::string label = {}) {
    add({name, cat, start_us, end_us - start_us, thread_id(), arg, std::move(label)});
  }
  /// Records an instant event.
  void instant(const char* name, const char* cat, std::int64_t arg = -1) {
    add({name, cat, trace_now_us(), -1, thread_id(), arg, {}});
  }

  /// NVTX push/pop (Note [NVTX without a link]); no-ops without the library.
  void nvtx_push(const char* name) const {
    if (auto f = nvtx_push_.load(std::memory_order_relaxed)) f(name);
  }
  void nvtx_pop() const {
    if (auto f = nvtx_pop_.load(std::memory_order_relaxed)) f();
  }
  bool nvtx_loaded() const { return nvtx_push_.load() != nullptr; }

  /// Events recorded and not yet written (for tests).
  std::vector<TraceEvent> events() const {
    std::lock_guard lock(m_);
    return events_;
  }

 private:
  Tracer() = default;
  using PushFn = int (*)(const char*);
  using PopFn = int (*)();

  void add(TraceEvent e) {
    std::lock_guard lock(m_);
    events_.push_back(std::move(e));
  }

  // Small per-process thread numbers, in order of first event.
  static std::uint32_t thread_id() {
    static std::atomic<std::uint32_t> next{0};
    thread_local std::uint32_t id = next++;
    return id;
  }

  void load_nvtx() {
    if (nvtx_push_.load() != nullptr) return;
    for (const char* lib : {"libnvToolsExt.so.1", "libnvtx3interop.so.1"}) {
      void* h = ::dlopen(lib, RTLD_LAZY | RTLD_LOCAL);
      if (h == nullptr) continue;
      auto push = reinterpret_cast<PushFn>(::dlsym(h, "nvtxRangePushA"));
      auto pop = reinterpret_cast<PopFn>(::dlsym(h, "nvtxRangePop"));
      if (push != nullptr && pop != nullptr) {
        nvtx_pop_ = pop;
        nvtx_push_ = push;
        return;
      }
    }
  }

  mutable std::mutex m_;
  TraceOptions opts_;
  int rank_ = 0;
  bool configured_ = false, written_ = false;
  std::vector<TraceEvent> events_;
  std::atomic<PushFn> nvtx_push_{nullptr};
  std::atomic<PopFn> nvtx_pop_{nullptr};
};

/// A span from construction to destruction on this thread (Note [Tracing cost]);
/// `name` and `cat` must be string literals; `n` (>= 0) is shown as args.n.
class Span {
 public:
  explicit Span(const char* name, const char* cat = "train", std::int64_t n = -1) {
    if (!tracing()) return;
    name_ = name;
    cat_ = cat;
    n_ = n;
    start_ = trace_now_us();
    Tracer::get().nvtx_push(name);
  }
  ~Span() {
    if (name_ == nullptr) return;
    Tracer::get().nvtx_pop();
    Tracer::get().complete(name_, cat_, start_, trace_now_us(), n_);
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  const char* name_ = nullptr;
  const char* cat_ = nullptr;
  std::int64_t n_ = -1;
  double start_ = 0;
};

}  // namespace ptrain::obs
