#pragma once
// Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d (to 1x1), Flatten and Unflatten on NCHW
// tensors, with PyTorch's parameter layout, initialisation and output sizes.

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "ptrain/nn/module.hpp"
#include "ptrain/ops/conv.hpp"
#include "ptrain/ops/init.hpp"

namespace ptrain::nn {

namespace detail {
inline std::string pair_str(const std::array<std::int64_t, 2>& p) {
  std::ostringstream s;  // not "(" + to_string(...): g++ 12 warns there (a false -Wrestrict)
  s << "(" << p[0] << ", " << p[1] << ")";
  return s.str();
}
// A shape kept in Cache::values, for layers whose backward needs only the input's shape.
inline std::vector<std::uint64_t> shape_values(const Shape& s) {
  std::vector<std::uint64_t> v;
  for (std::int64_t d : s) v.push_back(static_cast<std::uint64_t>(d));
  return v;
}
inline Shape shape_of(const std::vector<std::uint64_t>& v) {
  std::vector<std::int64_t> d;
  for (std::uint64_t x : v) d.push_back(static_cast<std::int64_t>(x));
  return Shape(d);
}
}  // namespace detail

/// Options of Conv2d beyond the channel counts and kernel size (torch.nn.Conv2d's keywords).
/// Layers take options by const reference: g++ 12 with -march=native (AVX2) builds
/// a by-value `{}` argument of this aggregate with wrong members (padding 1).
struct Conv2dOptions {
  std::array<std::int64_t, 2> stride{1, 1};
  std::array<std::int64_t, 2> padding{0, 0};
  std::array<std::int64_t, 2> dilation{1, 1};
  std::int64_t groups = 1;
  bool bias = true;
};

/// x [N, Cin, H, W] -> y [N, Cout, Ho, Wo]; weight [Cout, Cin/groups, kh, kw], bias [Cout].
template <class T>
class Conv2d : public Module<T> {
 public:
  /// Weights and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = Cin/groups kh kw, as torch.nn.Conv2d.
  Conv2d(std::int64_t in, std::int64_t out, std::array<std::int64_t, 2> kernel, const Conv2dOptions& o = {},
         Generator& gen = default_generator())
      : in_(in), out_(out), groups_(o.groups) {
    PTRAIN_CHECK(in > 0 && out > 0 && o.groups > 0 && in % o.groups == 0 && out % o.groups == 0, ShapeError,
                 "[ptrain.conv2d.channels] channels ", in, " -> ", out, " must be positive and divisible by groups ",
                 o.groups);
    args_.kernel = kernel;
    args_.stride = o.stride;
    args_.padding = o.padding;
    args_.dilation = o.dilation;
    for (int i = 0; i < 2; ++i)
      PTRAIN_CHECK(kernel[i] > 0 && o.stride[i] > 0 && o.padding[i] >= 0 && o.dilation[i] > 0, ShapeError,
                   "[ptrain.conv2d.args] kernel ", detail::pair_str(kernel), ", stride ", detail::pair_str(o.stride),
                   " and dilation ", detail::pair_str(o.dilation), " must be positive, padding ",
                   detail::pair_str(o.padding), " non-negative");
    const double bound = 1.0 / std::sqrt(static_cast<double>(in / o.groups * kernel[0] * kernel[1]));
    auto w = Tensor<T>::empty({out, in / o.groups, kernel[0], kernel[1]});
    ops::uniform_(w, -bound, bound, gen);
    weight_ = &this->register_parameter("weight", w);
    if (o.bias) {
      auto b = Tensor<T>::empty({out});
      ops::uniform_(b, -bound, bound, gen);
      bias_ = &this->register_parameter("bias", b);
    }
  }
  /// A square kernel.
  Conv2d(std::int64_t in, std::int64_t out, std::int64_t kernel, const Conv2dOptions& o = {},
         Generator& gen = default_generator())
      : Conv2d(in, out, {kernel, kernel}, o, gen) {}

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    cache.tensors = {x};
    return ops::conv2d(x, weight_->value, bias_ ? bias_->value : Tensor<T>(), args_, groups_);
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.tensors.empty(), Error, "[ptrain.backward] Conv2d::backward without a forward in this cache");
    auto dx = ops::conv2d_backward(cache.tensors[0], weight_->value, dy, weight_->grad,
                                   bias_ ? &bias_->grad : nullptr, args_, groups_, need_input_grad_);
    weight_->mark_grad_ready();
    if (bias_) bias_->mark_grad_ready();
    cache.clear();
    return dx;
  }
  /// The first layer of a model needs no dx; skipping it saves a GEMM and col2im per sample.
  void set_need_input_grad(bool need) { need_input_grad_ = need; }

  std::string describe() const override {
    std::string s = "Conv2d(" + std::to_string(in_) + ", " + std::to_string(out_) +
                    ", kernel_size=" + detail::pair_str(args_.kernel) + ", stride=" + detail::pair_str(args_.stride);
    if (args_.padding != std::array<std::int64_t, 2>{0, 0}) s += ", padding=" + detail::pair_str(args_.padding);
    if (args_.dilation != std::array<std::int64_t, 2>{1, 1}) s += ", dilation=" + detail::pair_str(args_.dilation);
    if (groups_ != 1) s += ", groups=" + std::to_string(groups_);
    return s + (bias_ ? ")" : ", bias=False)");
  }
  Parameter<T>& weight() { return *weight_; }
  Parameter<T>* bias() { return bias_; }

 private:
  std::int64_t in_, out_, groups_;
  ops::Conv2dArgs args_;
  Parameter<T>* weight_ = nullptr;
  Parameter<T>* bias_ = nullptr;
  bool need_input_grad_ = true;
};

/// Options of MaxPool2d and AvgPool2d; stride defaults to the kernel size (PyTorch's rule).
struct Pool2dOptions {
  std::array<std::int64_t, 2> stride{0, 0};  ///< {0, 0}: the kernel size
  std::array<std::int64_t, 2> padding{0, 0};
};

namespace detail {
inline ops::Conv2dArgs pool_args(std::array<std::int64_t, 2> kernel, const Pool2dOptions& o) {
  ops::Conv2dArgs a;
  a.kernel = kernel;
  a.stride = o.stride == std::array<std::int64_t, 2>{0, 0} ? kernel : o.stride;
  a.padding = o.padding;
  return a;
}
inline std::string pool_str(const char* name, const ops::Conv2dArgs& a) {
  return std::string(name) + "(kernel_size=" + pair_str(a.kernel) + ", stride=" + pair_str(a.stride) +
         ", padding=" + pair_str(a.padding) + ")";
}
}  // namespace detail

/// Max over each window of [N, C, H, W] (padding is -inf, floor output size).
template <class T>
class MaxPool2d : public Module<T> {
 public:
  MaxPool2d(std::array<std::int64_t, 2> kernel, const Pool2dOptions& o = {}) : args_(detail::pool_args(kernel, o)) {}
  explicit MaxPool2d(std::int64_t kernel, const Pool2dOptions& o = {}) : MaxPool2d({kernel, kernel}, o) {}
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    Tensor<std::int32_t> idx;
    auto y = ops::max_pool2d(x, args_, idx);
    cache.tensors = {x};
    cache.indices = {idx};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.indices.size() == 1, Error,
                 "[ptrain.backward] MaxPool2d::backward without a forward in this cache");
    auto dx = ops::max_pool2d_backward(cache.tensors[0], cache.indices[0], dy, args_);
    cache.clear();
    return dx;
  }
  std::string describe() const override { return detail::pool_str("MaxPool2d", args_); }

 private:
  ops::Conv2dArgs args_;
};

/// Mean over each window of [N, C, H, W], padding counted (count_include_pad=True).
template <class T>
class AvgPool2d : public Module<T> {
 public:
  AvgPool2d(std::array<std::int64_t, 2> kernel, const Pool2dOptions& o = {}) : args_(detail::pool_args(kernel, o)) {}
  explicit AvgPool2d(std::int64_t kernel, const Pool2dOptions& o = {}) : AvgPool2d({kernel, kernel}, o) {}
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    auto y = ops::avg_pool2d(x, args_);
    cache.values = detail::shape_values(x.shape());
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.values.size() == 4, Error, "[ptrain.backward] AvgPool2d::backward without a forward");
    auto dx = ops::avg_pool2d_backward(detail::shape_of(cache.values), dy, args_);
    cache.clear();
    return dx;
  }
  std::string describe() const override { return detail::pool_str("AvgPool2d", args_); }

 private:
  ops::Conv2dArgs args_;
};

/// Mean of each [H, W] plane: [N, C, H, W] -> [N, C, 1, 1] (torch.nn.AdaptiveAvgPool2d(1)).
template <class T>
class AdaptiveAvgPool2d : public Module<T> {
 public:
  /// Only the output size 1 (global average pooling).
  explicit AdaptiveAvgPool2d(std::int64_t output_size = 1) {
    PTRAIN_CHECK(output_size == 1, ShapeError, "[ptrain.adaptive_avg_pool2d.size] output size ", output_size,
                 " is not supported; only 1 (global average pooling)");
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() == 4, ShapeError, "[ptrain.adaptive_avg_pool2d.shape] input ", x.shape(),
                 " must be 4-D [N, C, H, W]");
    cache.values = detail::shape_values(x.shape());
    return ops::avg_pool2d(x, global(x.size(2), x.size(3)));
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(cache.values.size() == 4, Error, "[ptrain.backward] AdaptiveAvgPool2d::backward without a forward");
    const Shape s = detail::shape_of(cache.values);
    auto dx = ops::avg_pool2d_backward(s, dy, global(s[2], s[3]));
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "AdaptiveAvgPool2d(1)"; }

 private:
  static ops::Conv2dArgs global(std::int64_t h, std::int64_t w) {
    ops::Conv2dArgs a;
    a.kernel = {h, w};
    return a;
  }
};

/// [N, d1, d2, ...] -> [N, d1 d2 ...] (torch.nn.Flatten() with its defaults); a view.
template <class T>
class Flatten : public Module<T> {
 public:
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() >= 1, ShapeError, "[ptrain.flatten.shape] input must have a batch dimension");
    cache.values = detail::shape_values(x.shape());
    return x.reshape({x.size(0), x.size(0) ? x.numel() / x.size(0) : 0});
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.values.empty(), Error, "[ptrain.backward] Flatten::backward without a forward");
    auto dx = dy.reshape(detail::shape_of(cache.values));
    cache.clear();
    return dx;
  }
  std::string describe() const override { return "Flatten()"; }
};

/// [N, prod(shape)] -> [N, shape...] (torch.nn.Unflatten(1, shape)); a view. Puts
/// flat images ([N, 784]) into the [N, C, H, W] layout that Conv2d takes.
template <class T>
class Unflatten : public Module<T> {
 public:
  explicit Unflatten(std::vector<std::int64_t> shape) : shape_(std::move(shape)) {
    PTRAIN_CHECK(!shape_.empty(), ShapeError, "[ptrain.unflatten.shape] give the shape of one sample");
    for (std::int64_t d : shape_) {
      PTRAIN_CHECK(d > 0, ShapeError, "[ptrain.unflatten.shape] dimensions must be positive");
      numel_ *= d;
    }
  }
  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    PTRAIN_CHECK(x.dim() == 2 && x.size(1) == numel_, ShapeError, "[ptrain.unflatten.shape] input ", x.shape(),
                 " is not [N, ", numel_, "]");
    cache.values = detail::shape_values(x.shape());
    std::vector<std::int64_t> s{x.size(0)};
    s.insert(s.end(), shape_.begin(), shape_.end());
    return x.reshape(Shape(s));
  }
  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    PTRAIN_CHECK(!cache.values.empty(), Error, "[ptrain.backward] Unflatten::backward without a forward");
    // Undefined from a first layer that computes no input gradient (Conv2d::set_need_input_grad).
    auto dx = dy.defined() ? dy.reshape(detail::shape_of(cache.values)) : Tensor<T>();
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    std::string s = "Unflatten(1, (";
    for (std::size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + "))";
  }

 private:
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 1;
};

}  // namespace ptrain::nn
