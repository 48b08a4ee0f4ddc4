// The shared Hugging Face folder helpers (nn/models/hf_weights.hpp): F16 decoding
// against the IEEE binary16 values computed here from sign, exponent and mantissa.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <ptrain/nn/models/hf_weights.hpp>

namespace test_hf_weights {

using namespace ptrain;

TEST_CASE("F16 values decode to the IEEE half they encode", "[ckpt][llama]") {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const int sign = (h >> 15) ? -1 : 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    const float got = ckpt::detail::half_to_float(static_cast<std::uint16_t>(h));
    INFO("bits " << h);
    if (exp == 0x1f) {
      if (man == 0) REQUIRE(got == sign * std::numeric_limits<float>::infinity());
      else REQUIRE(std::isnan(got));
    } else {
      const double want = sign * (exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25));
      REQUIRE(static_cast<double>(got) == want);
      REQUIRE(std::signbit(got) == (sign < 0));  // -0 stays -0
    }
  }
  std::vector<float> out(2);
  const std::uint16_t bits[2] = {0x3c00, 0xc000};  // 1, -2
  ckpt::detail::convert_stored(reinterpret_cast<const std::uint8_t*>(bits), DType::F16, 2, out.data());
  CHECK(out == std::vector<float>{1.0f, -2.0f});
  CHECK_THROWS_WITH(ckpt::detail::convert_stored(reinterpret_cast<const std::uint8_t*>(bits), DType::I32, 0, out.data()),
                    Catch::Contains("[ptrain.ckpt.dtype]"));
}

}  // namespace test_hf_weights
