#pragma once
// Error types and check macros.
//
// Every error ptrain throws derives from ptrain::Error. Messages start with a
// stable id in brackets ("[ptrain.shape]") so that logs can be searched, then
// say what went wrong and what to do about it.

#include <sstream>
#include <stdexcept>
#include <string>

namespace ptrain {

/// Base of every exception ptrain throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A tensor had the wrong shape, dtype or device for an operation.
class ShapeError : public Error {
  using Error::Error;
};
/// The launch environment (rank variables, master address) is missing or inconsistent.
class LaunchError : public Error {
  using Error::Error;
};
/// A collective, point-to-point transfer or store operation failed or timed out.
class CommError : public Error {
  using Error::Error;
};
/// A checkpoint file is missing, corrupt or does not match the model.
class CheckpointError : public Error {
  using Error::Error;
};
/// A data file (IDX, token file) is missing or malformed.
class DataError : public Error {
  using Error::Error;
};
/// A CUDA, cuBLAS or NCCL call failed, or CUDA was requested in a build without it.
class CudaError : public Error {
  using Error::Error;
};

namespace detail {

// Concatenates anything with operator<< into one string.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class E>
[[noreturn]] void throw_at(const char* file, int line, const std::string& msg) {
  throw E(cat(msg, " (", file, ":", line, ")"));
}

}  // namespace detail
}  // namespace ptrain

/// Throws ErrorType with the streamed message and file:line when cond is false.
/// Usage: PTRAIN_CHECK(a.numel() == b.numel(), ShapeError, "[ptrain.shape] ", a.shape(), " vs ", b.shape());
#define PTRAIN_CHECK(cond, ErrorType, ...)                                                   \
  do {                                                                                       \
    if (!(cond))                                                                             \
      ::ptrain::detail::throw_at<::ptrain::ErrorType>(__FILE__, __LINE__,                    \
                                                      ::ptrain::detail::cat(__VA_ARGS__));   \
  } while (0)

/// Throws ErrorType unconditionally.
#define PTRAIN_THROW(ErrorType, ...) \
  ::ptrain::detail::throw_at<::ptrain::ErrorType>(__FILE__, __LINE__, ::ptrain::detail::cat(__VA_ARGS__))
