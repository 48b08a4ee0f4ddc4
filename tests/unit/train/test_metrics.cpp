#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ptrain/train/metrics.hpp"

namespace test_metrics {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("ptrain_metrics_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

std::vector<json> read_lines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<json> out;
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line));
  return out;
}

}  // namespace

TEST_CASE("MetricsWriter writes one JSON object per line, flushed", "[train][metrics]") {
  TempDir dir("lines");
  const fs::path path = dir.path / "metrics.jsonl";
  ptrain::MetricsWriter w(path.string());
  CHECK(w.enabled());
  w.write({{"step", 100}, {"epoch", 1}, {"loss", 0.4312}, {"lr", 1e-3}, {"samples_per_s", 20531.5}});
  // Read while the writer is still open: a killed run keeps every finished line.
  auto lines = read_lines(path);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["step"] == 100);
  CHECK(lines[0]["epoch"] == 1);
  CHECK(lines[0]["loss"].get<double>() == 0.4312);
  CHECK(lines[0]["lr"].get<double>() == 1e-3);
  CHECK(lines[0]["samples_per_s"].get<double>() == 20531.5);
  CHECK(lines[0].size() == 6);  // the five fields plus "time"

  w.write({{"step", 469}, {"epoch", 1}, {"test_accuracy", 0.8571}});
  w.write({{"step", 470}, {"loss", std::nan("")}, {"time", 5.0}});
  lines = read_lines(path);
  REQUIRE(lines.size() == 3);
  CHECK(lines[1]["test_accuracy"].get<double>() == 0.8571);
  CHECK(lines[1]["step"] == 469);
  CHECK(lines[2]["loss"].is_null());  // JSON has no NaN
  CHECK(lines[2]["time"].get<double>() == 5.0);  // caller's time is kept

  const double t0 = lines[0]["time"].get<double>(), t1 = lines[1]["time"].get<double>();
  CHECK(t0 >= 0.0);
  CHECK(t1 >= t0);
  CHECK(t1 <= w.elapsed());
}

TEST_CASE("MetricsWriter truncates or appends", "[train][metrics]") {
  TempDir dir("append");
  const fs::path path = dir.path / "m.jsonl";
  {
    ptrain::MetricsWriter w(path.string());
    w.write({{"step", 1}});
    w.write({{"step", 2}});
  }
  {
    ptrain::MetricsWriter resumed(path.string(), /*append=*/true);
    resumed.write({{"step", 3}});
  }
  auto lines = read_lines(path);
  REQUIRE(lines.size() == 3);
  CHECK(lines[2]["step"] == 3);
  {
    ptrain::MetricsWriter fresh(path.string());
    fresh.write({{"step", 10}});
  }
  lines = read_lines(path);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0]["step"] == 10);
}

TEST_CASE("MetricsWriter: disabled writer, bad path, bad record", "[train][metrics]") {
  TempDir dir("errors");
  ptrain::MetricsWriter off("");
  CHECK_FALSE(off.enabled());
  off.write({{"step", 1}});  // does nothing
  ptrain::MetricsWriter def;
  def.write({{"step", 1}});
  CHECK(fs::is_empty(dir.path));

  // A missing folder is made (issue 44); one below a regular file cannot be, even by root.
  {
    ptrain::MetricsWriter made((dir.path / "new" / "run" / "m.jsonl").string());
    made.write({{"step", 1}});
  }
  CHECK(fs::file_size(dir.path / "new" / "run" / "m.jsonl") > 0);
  std::ofstream(dir.path / "a_file") << "not a directory";
  const std::string bad = (dir.path / "a_file" / "m.jsonl").string();
  try {
    ptrain::MetricsWriter w(bad);
    FAIL("opening a path below a regular file did not throw");
  } catch (const ptrain::Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("[ptrain.metrics.open]") && Catch::Contains(bad));
  }

  ptrain::MetricsWriter w((dir.path / "m.jsonl").string());
  CHECK_THROWS_AS(w.write(json::array({1, 2})), ptrain::Error);
  CHECK_THROWS_AS(w.write(json(3.5)), ptrain::Error);
}

}  // namespace test_metrics
