// TensorBoard event files: CRC-32C against its published check value, and a
// written file decoded by tests/unit/obs/read_tfevents.py, a reader written
// from the format description (and by the tensorboard package when installed).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "ptrain/obs/tensorboard.hpp"
#include "ptrain/train/metrics.hpp"

namespace test_tensorboard {

using namespace ptrain;

TEST_CASE("crc32c matches the standard check value", "[obs][tensorboard]") {
  CHECK(obs::detail::crc32c("123456789", 9) == 0xe3069283u);  // RFC 3720 / iSCSI check value
  CHECK(obs::detail::crc32c("", 0) == 0u);
}

TEST_CASE("metrics records become TensorBoard scalars that an independent reader decodes", "[obs][tensorboard]") {
  const std::string dir = "/tmp/ptrain_tb_unit_" + std::to_string(::getpid());
  REQUIRE(std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str()) == 0);
  std::string path;
  {
    MetricsWriter m("", false, dir);  // TensorBoard only
    m.write({{"step", 10}, {"epoch", 1}, {"loss", 2.5}, {"lr", 1e-3}, {"name", "x"}});
    m.write({{"step", 20}, {"epoch", 1}, {"loss", 1.25}, {"samples_per_s", 1234.5}});
    m.write({{"loss", 9.0}});  // no step: not a scalar
  }
  std::string out;
  {
    std::unique_ptr<FILE, int (*)(FILE*)> p(
        ::popen(("python3 " PTRAIN_TESTS_DIR "/unit/obs/read_tfevents.py " + dir + " 2>&1").c_str(), "r"), ::pclose);
    REQUIRE(p != nullptr);
    std::array<char, 4096> buf{};
    while (std::fgets(buf.data(), static_cast<int>(buf.size()), p.get()) != nullptr) out += buf.data();
  }
  INFO(out);
  const auto doc = nlohmann::json::parse(out);
  CHECK(doc["file_version"] == "brain.Event:2");
  const nlohmann::json want = {{"loss", {{10, 2.5}, {20, 1.25}}}, {"lr", {{10, 1e-3f}}}, {"samples_per_s", {{20, 1234.5}}}};
  CHECK(doc["scalars"].size() == want.size());
  for (const auto& [tag, points] : want.items()) {
    INFO(tag);
    REQUIRE(doc["scalars"].contains(tag));
    REQUIRE(doc["scalars"][tag].size() == points.size());
    for (std::size_t i = 0; i < points.size(); ++i) {
      CHECK(doc["scalars"][tag][i][0] == points[i][0]);
      CHECK(doc["scalars"][tag][i][1].get<double>() == Approx(points[i][1].get<double>()).epsilon(1e-6));
    }
  }
  if (doc.contains("tensorboard_reader")) CHECK(doc["tensorboard_reader"] == doc["scalars"]);
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace test_tensorboard
