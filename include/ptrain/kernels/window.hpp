#pragma once
// The geometry of a 2-D sliding window (convolution, pooling) over one plane
// of an NCHW tensor, shared by the CPU and CUDA kernels and the kernel table.

#include <cstdint>

namespace ptrain::kernels {

/// An h x w input plane, a kh x kw window moved by (sh, sw) over the plane
/// padded by (ph, pw) on each side, with dilation (dh, dw); ho x wo outputs:
///   ho = (h + 2 ph - dh (kh - 1) - 1) / sh + 1, likewise wo (PyTorch's floor rule).
struct Window2d {
  std::int64_t h = 0, w = 0;
  std::int64_t kh = 1, kw = 1;
  std::int64_t sh = 1, sw = 1;
  std::int64_t ph = 0, pw = 0;
  std::int64_t dh = 1, dw = 1;
  std::int64_t ho = 0, wo = 0;
};

/// Fills ho and wo from the other fields (may be <= 0 when the window does not fit).
inline Window2d with_output_size(Window2d g) {
  g.ho = (g.h + 2 * g.ph - g.dh * (g.kh - 1) - 1) / g.sh + 1;
  g.wo = (g.w + 2 * g.pw - g.dw * (g.kw - 1) - 1) / g.sw + 1;
  return g;
}

}  // namespace ptrain::kernels
