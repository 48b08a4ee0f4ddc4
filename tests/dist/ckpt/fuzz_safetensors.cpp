// libFuzzer target: the safetensors header parser must either reject an input
// with CheckpointError or return entries that stay inside the input.
#include <cstdint>
#include <cstdlib>
#include <ptrain/core/safetensors.hpp>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    auto h = ptrain::ckpt::detail::parse_safetensors(data, size, "fuzz-input");
    std::uint64_t covered = 0;
    volatile std::uint8_t sink = 0;
    for (const auto& e : h.tensors) {
      if (e.begin > e.end || h.data_start + e.end > size) std::abort();
      std::uint64_t numel = 1;
      for (auto d : e.shape) numel *= static_cast<std::uint64_t>(d);
      if (numel * ptrain::dtype_size(e.dtype) != e.nbytes()) std::abort();
      covered += e.nbytes();
      // Touch the first and last byte: ASan reports any out-of-bounds offset.
      if (e.nbytes() > 0) sink = data[h.data_start + e.begin] ^ data[h.data_start + e.end - 1];
    }
    if (h.data_start + covered != size) std::abort();  // the data section is tiled exactly
  } catch (const ptrain::CheckpointError&) {
  }
  return 0;
}
