#pragma once
// Training metrics as JSON lines: one JSON object per line, one line per record.
//
// The format is what pandas (read_json(lines=True)), jq and plotting scripts
// read directly. Each line is flushed as it is written, so a run that is
// killed or preempted keeps every record up to its last step.
//
//   MetricsWriter metrics(rank == 0 ? cli.metrics_path : "");  // "" disables
//   metrics.write({{"step", step}, {"epoch", epoch}, {"loss", loss}, {"lr", lr}});
//   // -> {"epoch":1,"loss":0.4312,"lr":0.001,"step":100,"time":12.84}
//
// Given a TensorBoard directory as well, every numeric field of a record that
// has a "step" (except step, epoch and time) also becomes a scalar of that name
// at that step in an event file there (obs/tensorboard.hpp).

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include <nlohmann/json.hpp>

#include "ptrain/core/error.hpp"
#include "ptrain/obs/tensorboard.hpp"

namespace ptrain {

/// Appends JSON objects, one per line, to a file; adds "time" (seconds since the writer was created).
/// A writer made with an empty path is disabled and writes nothing.
class MetricsWriter {
 public:
  /// Disabled writer.
  MetricsWriter() = default;
  /// Opens `path` (truncating it, or appending when `append`, e.g. for a resumed run), making its
  /// folder if needed; "" disables.
  /// A non-empty `tensorboard` directory also gets the records' scalars.
  explicit MetricsWriter(const std::string& path, bool append = false, const std::string& tensorboard = {})
      : path_(path), tb_(tensorboard), start_(std::chrono::steady_clock::now()) {
    if (path_.empty()) return;
    std::error_code ec;  // a folder that cannot be made shows as the open's error below
    if (const auto folder = std::filesystem::path(path_).parent_path(); !folder.empty())
      std::filesystem::create_directories(folder, ec);
    out_.open(path_, append ? std::ios::out | std::ios::app : std::ios::out | std::ios::trunc);
    PTRAIN_CHECK(out_.is_open(), Error, "[ptrain.metrics.open] cannot open metrics file '", path_,
                 "' for writing; check that its folder can be made and written, or pass another --metrics path");
  }
  MetricsWriter(MetricsWriter&&) = default;
  MetricsWriter& operator=(MetricsWriter&&) = default;
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  bool enabled() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  /// Seconds since the writer was created (the "time" field).
  double elapsed() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

  /// Writes `record` (a JSON object) plus "time" as one line and flushes it. No-op when disabled.
  /// A "time" the caller set is kept. Non-finite numbers are written as null (JSON has no NaN).
  void write(nlohmann::json record) {
    if (!enabled() && !tb_.enabled()) return;
    PTRAIN_CHECK(record.is_object(), Error, "[ptrain.metrics.record] a metrics record must be a JSON object, got ",
                 record.type_name(), "; pass {{\"key\", value}, ...}");
    if (tb_.enabled() && record.contains("step") && record["step"].is_number_integer()) {
      const auto step = record["step"].get<std::int64_t>();
      for (const auto& [key, value] : record.items())
        if (value.is_number() && key != "step" && key != "epoch" && key != "time")
          tb_.scalar(key, step, value.get<double>());
    }
    if (!enabled()) return;
    if (!record.contains("time")) record["time"] = elapsed();
    out_ << record.dump() << '\n';
    out_.flush();
    PTRAIN_CHECK(out_.good(), Error, "[ptrain.metrics.write] writing to metrics file '", path_,
                 "' failed; the disk may be full or the file removed");
  }

 private:
  std::string path_;
  std::ofstream out_;
  obs::TensorBoardWriter tb_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace ptrain
