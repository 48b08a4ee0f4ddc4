#pragma once
// Activation checkpointing: a unit that recomputes its activations in backward.
//
//   auto block = std::make_shared<nn::Recompute<float>>(std::make_shared<nn::TransformerBlock<float>>(...));
//   GPTConfig{..., .recompute = true}            // every transformer block wrapped
//
// Note [Recompute]
// Recompute(inner) runs inner's forward into a scratch cache that it drops, and
// keeps only the input and the offsets its random streams (dropout) had before
// the call. backward() sets those streams back, runs inner's forward again into a
// fresh cache (same input, parameters and masks, hence the same activations to
// the bit), puts the streams back where they were, and runs inner's backward on
// that cache. A chain of wrapped units then holds one unit's activations at a
// time instead of all of them, for a second forward of each (about a third more
// compute for a transformer block). The wrapper adds no level to parameter names,
// so checkpoints, FSDP units and pipeline stages see the unwrapped model; FSDP
// gathers a unit before its backward, which is when the second forward runs.

#include <memory>
#include <string>
#include <vector>

#include "ptrain/nn/module.hpp"

namespace ptrain::nn {

template <class T>
class Recompute : public Module<T> {
 public:
  explicit Recompute(std::shared_ptr<Module<T>> inner) : inner_(std::move(inner)) {
    PTRAIN_CHECK(inner_ != nullptr, Error, "[ptrain.recompute] Recompute needs a module to wrap");
    this->register_module("", inner_);
  }

  Tensor<T> forward(const Tensor<T>& x, Cache<T>& cache) override {
    std::vector<std::uint64_t> before = offsets();
    const auto context = cache.shared_context();  // the batch's, kept for the replay (Note [Batch context])
    Cache<T> scratch;
    scratch.set_context(context);
    Tensor<T> y = inner_->forward(x, scratch);
    cache.clear();
    cache.set_context(context);
    cache.tensors = {x};
    cache.values = std::move(before);
    return y;
  }

  Tensor<T> backward(const Tensor<T>& dy, Cache<T>& cache) override {
    auto streams = inner_->random_streams();
    PTRAIN_CHECK(cache.tensors.size() == 1 && cache.values.size() == streams.size(), Error,
                 "[ptrain.backward] Recompute::backward without a forward of ", describe(), " in this cache");
    Cache<T> replay;
    replay.set_context(cache.shared_context());
    {
      const Replay at(std::move(streams), cache.values);
      inner_->forward(cache.tensors[0], replay);
    }
    cache.clear();
    return inner_->backward(dy, replay);
  }

  std::string describe() const override { return "Recompute(" + inner_->describe() + ")"; }
  Module<T>& inner() { return *inner_; }

 private:
  // Sets the streams to `at` for its lifetime, then back to where they were.
  class Replay {
   public:
    Replay(std::vector<Generator*> streams, const std::vector<std::uint64_t>& at) : streams_(std::move(streams)) {
      for (std::size_t i = 0; i < streams_.size(); ++i) {
        now_.push_back(streams_[i]->offset());
        streams_[i]->set_offset(at[i]);
      }
    }
    ~Replay() {
      for (std::size_t i = 0; i < streams_.size(); ++i) streams_[i]->set_offset(now_[i]);
    }
    Replay(const Replay&) = delete;
    Replay& operator=(const Replay&) = delete;

   private:
    std::vector<Generator*> streams_;
    std::vector<std::uint64_t> now_;
  };

  std::vector<std::uint64_t> offsets() {
    std::vector<std::uint64_t> out;
    for (Generator* g : inner_->random_streams()) out.push_back(g->offset());
    return out;
  }

  std::shared_ptr<Module<T>> inner_;
};

}  // namespace ptrain::nn
