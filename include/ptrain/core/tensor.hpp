#pragma once
// Tensor<T>: shared storage + element offset + shape + device.
//
// Tensors are contiguous and row-major. A Tensor is a handle: copying it shares
// the storage (like torch.Tensor); clone() copies the data. Views along the
// first dimension (narrow, operator[]), reshape and raw views into a flat
// buffer (view) share storage, which is how flat parameter buffers, DDP buckets
// and FSDP shards alias parameters without copies.
//
//   auto x = Tensor<float>::zeros({128, 784});   // cpu
//   auto rows = x.narrow(0, 32);                  // [32, 784], same storage
//   auto g = x.to(Device::cuda(0));               // copy to GPU (nvcc builds)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "ptrain/core/allocator.hpp"
#include "ptrain/core/dtype.hpp"
#include "ptrain/core/shape.hpp"

namespace ptrain {

/// A block of device memory returned to its allocator when the last tensor using it goes.
class Storage {
 public:
  Storage(std::size_t bytes, Device device)
      : bytes_(bytes), device_(device), allocator_(&allocator_for(device)), ptr_(allocator_->allocate(bytes)) {}
  /// Non-owning storage over memory kept alive by `owner` (for example an mmap'ed file).
  Storage(void* ptr, std::size_t bytes, Device device, std::shared_ptr<void> owner)
      : bytes_(bytes), device_(device), ptr_(ptr), owner_(std::move(owner)) {}
  ~Storage() {
    if (allocator_) allocator_->deallocate(ptr_, bytes_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  /// See Tensor::record_stream.
  void record_stream(std::uintptr_t stream) const {
    if (allocator_) allocator_->record_stream(ptr_, stream);
  }

 private:
  std::size_t bytes_;
  Device device_;
  Allocator* allocator_ = nullptr;
  void* ptr_;
  std::shared_ptr<void> owner_;
};

namespace detail {
inline void copy_bytes(void* dst, Device dd, const void* src, Device sd, std::size_t bytes) {
  if (bytes == 0) return;
  if (dd.is_cpu() && sd.is_cpu()) std::memcpy(dst, src, bytes);
  else cuda_backend().copy(dst, dd, src, sd, bytes);
}
}  // namespace detail

template <class T>
class Tensor {
 public:
  using value_type = T;

  /// An undefined tensor (no storage); defined() is false.
  Tensor() = default;

  /// Uninitialised tensor of the given shape.
  static Tensor empty(const Shape& shape, Device device = Device::cpu()) {
    check_shape(shape);
    Tensor t;
    t.storage_ = std::make_shared<Storage>(static_cast<std::size_t>(shape.numel()) * sizeof(T), device);
    t.shape_ = shape;
    return t;
  }
  static Tensor zeros(const Shape& shape, Device device = Device::cpu()) {
    Tensor t = empty(shape, device);
    t.zero_();
    return t;
  }
  /// CPU tensor filled with `value`.
  static Tensor full(const Shape& shape, T value) {
    Tensor t = empty(shape);
    std::fill(t.data(), t.data() + t.numel(), value);
    return t;
  }
  /// CPU tensor holding a copy of `values`; their count must match the shape.
  static Tensor from(const std::vector<T>& values, const Shape& shape) {
    PTRAIN_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(), ShapeError, "[ptrain.tensor.from] ",
                 values.size(), " values for shape ", shape, " (", shape.numel(), " elements)");
    Tensor t = empty(shape);
    std::copy(values.begin(), values.end(), t.data());
    return t;
  }
  /// Tensor over memory that `owner` keeps alive (no copy, not counted by allocators).
  static Tensor wrap(T* data, const Shape& shape, Device device, std::shared_ptr<void> owner) {
    Tensor t;
    t.storage_ = std::make_shared<Storage>(data, static_cast<std::size_t>(shape.numel()) * sizeof(T), device,
                                           std::move(owner));
    t.shape_ = shape;
    return t;
  }

  bool defined() const { return storage_ != nullptr; }
  T* data() const { return storage_ ? static_cast<T*>(storage_->data()) + offset_ : nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.size(); }
  std::int64_t size(int i) const {
    PTRAIN_CHECK(i >= -dim() && i < dim(), ShapeError, "[ptrain.tensor.dim] dimension ", i, " out of range for shape ",
                 shape_);
    return shape_[i < 0 ? i + dim() : i];
  }
  /// Number of elements; 0 for an undefined tensor.
  std::int64_t numel() const { return storage_ ? shape_.numel() : 0; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  Device device() const { return storage_ ? storage_->device() : Device::cpu(); }
  static constexpr DType dtype() { return dtype_of<T>(); }
  /// Offset in elements from the start of the storage.
  std::int64_t storage_offset() const { return offset_; }
  bool shares_storage(const Tensor& other) const { return storage_ && storage_ == other.storage_; }
  /// Announces that work on another stream (a CUDA stream handle, see
  /// kernels::cuda::record_stream) uses this tensor's memory: once freed, the
  /// memory is reused only after the work queued on that stream so far has
  /// finished (Note [Streams and cached blocks] in core/allocator.hpp).
  void record_stream(std::uintptr_t stream) const {
    if (storage_) storage_->record_stream(stream);
  }

  /// View of `shape.numel()` elements starting `offset` elements after this tensor's start.
  Tensor view(std::int64_t offset, const Shape& shape) const {
    check_shape(shape);
    PTRAIN_CHECK(offset >= 0 && shape.numel() <= numel() && offset <= numel() - shape.numel(), ShapeError,
                 "[ptrain.tensor.view] view of ",
                 shape.numel(), " elements at offset ", offset, " exceeds tensor of ", numel(), " elements");
    Tensor t = *this;
    t.offset_ = offset_ + offset;
    t.shape_ = shape;
    return t;
  }
  /// Same data with another shape; one dimension may be -1 (inferred).
  Tensor reshape(Shape shape) const {
    int infer = -1;
    std::int64_t known = 1;
    for (int i = 0; i < shape.size(); ++i) {
      if (shape[i] == -1) {
        PTRAIN_CHECK(infer < 0, ShapeError, "[ptrain.tensor.reshape] only one dimension may be -1 in ", shape);
        infer = i;
      } else {
        known *= shape[i];
      }
    }
    if (infer >= 0 && known > 0) shape[infer] = numel() / known;
    PTRAIN_CHECK(shape.numel() == numel(), ShapeError, "[ptrain.tensor.reshape] cannot reshape ", shape_, " (",
                 numel(), " elements) to ", shape);
    return view(0, shape);
  }
  /// Rows [start, start + length) along the first dimension.
  Tensor narrow(std::int64_t start, std::int64_t length) const {
    PTRAIN_CHECK(dim() >= 1 && start >= 0 && length >= 0 && start + length <= shape_[0], ShapeError,
                 "[ptrain.tensor.narrow] rows [", start, ", ", start + length, ") out of range for shape ", shape_);
    Shape s = shape_;
    s[0] = length;
    return view(start * row_numel(), s);
  }
  /// Row i along the first dimension, with that dimension dropped.
  Tensor operator[](std::int64_t i) const {
    PTRAIN_CHECK(dim() >= 1 && i >= 0 && i < shape_[0], ShapeError, "[ptrain.tensor.index] index ", i,
                 " out of range for shape ", shape_);
    std::vector<std::int64_t> rest(shape_.begin() + 1, shape_.end());
    return view(i * row_numel(), Shape(rest));
  }

  /// Deep copy on the same device.
  Tensor clone() const { return to(device()); }
  /// Copy on another device (always a new tensor).
  Tensor to(Device device) const {
    check_defined("to() or clone()");
    Tensor t = empty(shape_, device);
    detail::copy_bytes(t.data(), device, data(), this->device(), nbytes());
    return t;
  }
  /// Copies src's elements into this tensor (any devices; element counts must match).
  void copy_(const Tensor& src) {
    check_defined("copy_()");
    src.check_defined("copy_() from it");
    PTRAIN_CHECK(src.numel() == numel(), ShapeError, "[ptrain.tensor.copy] cannot copy ", src.shape(), " into ",
                 shape_);
    if (src.data() != data()) detail::copy_bytes(data(), device(), src.data(), src.device(), nbytes());
  }
  void zero_() {
    check_defined("zero_()");
    if (device().is_cpu()) std::memset(static_cast<void*>(data()), 0, nbytes());
    else detail::cuda_backend().memset_zero(data(), device(), nbytes());
  }
  /// Elements copied to a host vector.
  std::vector<T> to_vector() const {
    check_defined("to_vector()");
    std::vector<T> v(static_cast<std::size_t>(numel()));
    detail::copy_bytes(v.data(), Device::cpu(), data(), device(), nbytes());
    return v;
  }
  /// Element access on CPU tensors: t.at({i, j}).
  T& at(std::initializer_list<std::int64_t> index) const {
    check_defined("at()");
    PTRAIN_CHECK(device().is_cpu(), Error, "[ptrain.tensor.at] at() needs a cpu tensor; call to(Device::cpu()) first");
    PTRAIN_CHECK(static_cast<int>(index.size()) == dim(), ShapeError, "[ptrain.tensor.at] ", index.size(),
                 " indices for shape ", shape_);
    std::int64_t flat = 0;
    int d = 0;
    for (std::int64_t i : index) {
      PTRAIN_CHECK(i >= 0 && i < shape_[d], ShapeError, "[ptrain.tensor.at] index ", i, " out of range in dimension ",
                   d, " of ", shape_);
      flat = flat * shape_[d++] + i;
    }
    return data()[flat];
  }

 private:
  static void check_shape(const Shape& s) {
    std::int64_t n = 1;
    for (std::int64_t d : s) {
      PTRAIN_CHECK(d >= 0, ShapeError, "[ptrain.tensor.shape] invalid shape ", s, ": dimensions must be >= 0");
      PTRAIN_CHECK(!__builtin_mul_overflow(n, d, &n) && n <= INT64_MAX / 16, ShapeError, "[ptrain.tensor.shape] shape ",
                   s, " has more elements than memory can address");
    }
  }
  void check_defined(const char* what) const {
    PTRAIN_CHECK(defined(), Error, "[ptrain.tensor.undefined] ", what, " on an undefined tensor (default-constructed, "
                 "or the input gradient of a module whose input has none, such as Embedding's or GPT's backward)");
  }
  std::int64_t row_numel() const { return shape_[0] == 0 ? 0 : numel() / shape_[0]; }

  std::shared_ptr<Storage> storage_;
  std::int64_t offset_ = 0;
  Shape shape_;
};

/// Throws ShapeError naming `what` unless t has exactly `shape`.
template <class T>
void check_shape(const Tensor<T>& t, const Shape& shape, const char* what) {
  PTRAIN_CHECK(t.shape() == shape, ShapeError, "[ptrain.shape] ", what, " has shape ", t.shape(), ", expected ", shape);
}

/// Rows of t read as a [rows, last dimension] matrix; ShapeError naming `what`
/// unless t has a dimension and the last one is positive.
template <class T>
std::int64_t rows_of(const Tensor<T>& t, const char* what) {
  PTRAIN_CHECK(t.dim() >= 1 && t.size(-1) > 0, ShapeError, "[ptrain.shape] ", what, " has shape ", t.shape(),
               "; its last dimension must be positive");
  return t.numel() / t.size(-1);
}

}  // namespace ptrain
