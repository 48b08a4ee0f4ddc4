#include <catch2/catch.hpp>
#include <cmath>
#include <sstream>

#include "ptrain/train/progress.hpp"

namespace test_progress {

TEST_CASE("format_duration", "[train][progress]") {
  CHECK(ptrain::format_duration(0) == "0:00");
  CHECK(ptrain::format_duration(59.6) == "1:00");
  CHECK(ptrain::format_duration(754) == "12:34");
  CHECK(ptrain::format_duration(3725) == "1:02:05");
  CHECK(ptrain::format_duration(-1) == "?");
  CHECK(ptrain::format_duration(std::nan("")) == "?");
}

TEST_CASE("Progress reports window throughput and ETA from the average", "[train][progress]") {
  std::ostringstream os;
  ptrain::Progress p(10, 5, os);
  // Steps 1-5 take 10 s each, steps 6-10 take 20 s each; 1000 samples per step; loss = step.
  for (int s = 1; s <= 4; ++s) CHECK_FALSE(p.update_at(10.0 * s, s, 0, s, 1e-3, 1000));
  CHECK(os.str().empty());
  CHECK(p.update_at(50, 5, 0, 5, 1e-3, 1000));
  // 5000 samples in 50 s; ETA = 50 s / 5 steps * 5 steps left; loss = mean(1..5).
  CHECK(p.last_line() == "step 5/10 | epoch 0 | loss 3.0000 | lr 1.00e-03 | 100 samples/s | elapsed 0:50 | eta 0:50");
  CHECK(p.last_samples_per_s() == Approx(100));

  for (int s = 6; s <= 9; ++s) CHECK_FALSE(p.update_at(50.0 + 20 * (s - 5), s, 1, s, 5e-4, 1000));
  CHECK(p.update_at(150, 10, 1, 10, 5e-4, 1000));
  // The window (steps 6-10) ran at 5000 / 100 s, not the since-start 10000 / 150 s.
  CHECK(p.last_line() == "step 10/10 | epoch 1 | loss 8.0000 | lr 5.00e-04 | 50 samples/s | elapsed 2:30 | eta 0:00");
  CHECK(os.str() == "step 5/10 | epoch 0 | loss 3.0000 | lr 1.00e-03 | 100 samples/s | elapsed 0:50 | eta 0:50\n"
                    "step 10/10 | epoch 1 | loss 8.0000 | lr 5.00e-04 | 50 samples/s | elapsed 2:30 | eta 0:00\n");
}

TEST_CASE("Progress: last step, resumed runs, disabled", "[train][progress]") {
  std::ostringstream os;
  ptrain::Progress p(7, 5, os);
  for (int s = 1; s <= 6; ++s) p.update_at(s, s, 0, 1.0, 0.1, 10);
  CHECK(p.update_at(7, 7, 0, 1.0, 0.1, 10));  // 7 is not a multiple of 5 but is the last step
  CHECK_THAT(p.last_line(), Catch::StartsWith("step 7/7 |") && Catch::Contains("| 10 samples/s |"));

  // Resumed at step 50 of 100: the ETA counts only the 10 steps run here (2 s each).
  std::ostringstream os2;
  ptrain::Progress resumed(100, 10, os2, 50);
  for (int s = 51; s <= 59; ++s) resumed.update_at(2.0 * (s - 50), s, 3, 0.5, 0.1, 8);
  CHECK(resumed.update_at(20, 60, 3, 0.5, 0.1, 8));
  CHECK_THAT(resumed.last_line(), Catch::EndsWith("| elapsed 0:20 | eta 1:20"));

  std::ostringstream os3;
  ptrain::Progress off(10, 0, os3);
  for (int s = 1; s <= 10; ++s) CHECK_FALSE(off.update_at(s, s, 0, 1.0, 0.1, 1));
  CHECK(os3.str().empty());
  CHECK_THROWS_AS(ptrain::Progress(10, -1, os3), ptrain::Error);
}

}  // namespace test_progress
