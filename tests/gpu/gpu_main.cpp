// Catch2 main of the GPU tests. Without a usable CUDA device it runs only the
// hidden [nogpu] checks (the CUDA backend registers and reports a clear error)
// and then exits 77, which CTest reports as skipped (SKIP_RETURN_CODE).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cuda_runtime.h>

#include <cstdio>

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t status = cudaGetDeviceCount(&devices);
  const bool have_gpu = status == cudaSuccess && devices > 0;

  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (have_gpu) return session.run();

  const char* why = status == cudaSuccess ? "0 devices" : cudaGetErrorString(status);
  std::printf("ptrain_gpu: no CUDA device (%s); running the [nogpu] checks only, then skipping\n", why);
  session.configData().testsOrTags = {"[nogpu]"};
  if (session.run() != 0) return 1;
  std::printf("SKIPPED: no CUDA device (%s); the [nogpu] checks passed\n", why);
  return 77;
}
