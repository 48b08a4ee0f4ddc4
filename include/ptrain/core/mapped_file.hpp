#pragma once
// A read-only memory mapping of a whole file (checkpoint tensors, token files).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "ptrain/core/error.hpp"

namespace ptrain::detail {

/// Maps `path` read-only; move-only, unmapped at destruction. A failure throws E
/// as "<tag> cannot open|stat|mmap <path>: <reason>; <hint>".
template <class E>
class MappedFile {
 public:
  MappedFile(const std::string& path, const char* tag, const char* hint) : path_(path) {
    auto fail = [&](const char* what, int err) {
      throw_at<E>(__FILE__, __LINE__, cat(tag, " cannot ", what, " ", path, ": ", std::strerror(err), "; ", hint));
    };
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open", errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      fail("stat", err);
    }
    size_ = static_cast<std::size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      const int err = errno;
      ::close(fd);
      if (p == MAP_FAILED) fail("mmap", err);
      data_ = static_cast<const std::uint8_t*>(p);
    } else {
      ::close(fd);
    }
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  }
  MappedFile(MappedFile&& o) noexcept
      : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile& operator=(MappedFile&&) = delete;

  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace ptrain::detail
