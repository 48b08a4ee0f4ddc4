#pragma once
// Context parallelism as an Engine: GPT and Llama with every sequence split over
// cp ranks (Note [Context-parallel layout] in parallel/context_parallel.hpp), and
// world / cp data-parallel replicas.
//
//   auto engine = parallel::make_engine<double>(llama, *world, parallel::ContextParallelPlan{.cp = 2});
//   optim::AdamW<double> opt(engine->parameters(), {.lr = 1e-3});
//   engine->zero_grad();
//   engine->forward_backward(ids, targets);   // this replica's whole [B, S] batch on each of its cp ranks
//   engine->step(opt);
//
// Note [Context-parallel engine]
// - Mesh: dp x cp (parallel/mesh.hpp), the cp ranks of a replica consecutive. Every
//   cp rank of a replica is given the replica's whole batch (ids [B, S], targets
//   [B * S] or [B, S]) and keeps its 2 chunks of each row; S must divide into 2 cp
//   chunks ([ptrain.cp.length]).
// - The model: the same modules as the full model (parameters shared with it, the
//   same names), except the attention of every block, which runs the ring
//   (ContextParallelSelfAttention, ContextParallelGQA), and GPT's embedding, which
//   adds wpe at the tokens' global positions. Norms, MLPs and the head act on the
//   local tokens as they are. Llama's rotary positions are global, restarting at
//   each packed document (document_token); document starts are global positions.
// - The loss is the token-weighted mean cross-entropy over the whole sequence (sum
//   and count of the non-ignored targets, ignore_index -100, all-reduced over the
//   cp group); set_loss() does not apply. Each rank's gradient is cp times its
//   tokens' share, and the gradients are averaged over all dp x cp ranks in one
//   all-reduce: the sum over a replica's cp ranks, averaged over the replicas (CP
//   ranks are data-parallel for the weights).
// - Every rank holds the whole model: clipping needs no reduction, and checkpoints
//   are DDP's (mode() is Mode::DDP; ckpt/engine_checkpoint.hpp saves and loads the
//   whole model by name, so a checkpoint resumes at any cp and dp, or in one process).
// - With ContextParallelPlan::fsdp, since every rank of the dp x cp mesh holds the
//   same weights, they are sharded over all of them instead (torchtitan's FSDP over dp x cp):
//   the engine hands its units (the rebuilt blocks, whose attention runs the ring) to
//   an FSDP (FullShard over the world, unit_names the full model's), which gathers a
//   unit's parameters before it runs and reduce-scatters its gradients (averaged over
//   the world, as the all-reduce above) into this rank's 1/world shard. parameters()
//   and local_module() are the FSDP's, mode() is Mode::FSDP: clipping sums over the
//   world, checkpoints are FSDP's sharded ones under the full tensor names
//   (engine_checkpoint.hpp finds the FSDP as local_module()), loadable at any layout.
//   Inside no_sync() each backward still reduce-scatters (FSDP's Note [Accumulation]).
// - With tensor parallelism, "With tensor parallelism" below: TensorParallelPlan::cp, in
//   the TensorParallel engine (parallel/tensor_parallel.hpp), not in this one.
// - Devices: the engine runs where the model is (ContextParallelBatch::device, the
//   parameters' device). The ids and targets may be on the host or that device; the
//   positions and document starts are built on the host from a host copy of the ids,
//   and this rank's slices of ids, targets, positions and starts go to the device. GPT's
//   qkv split and join dispatch to the table's copy_strided_rows; the loss's sum and
//   count are host doubles (NCCL stages them). The communicator must serve the device
//   (checked when built: [ptrain.comm.device]). On CUDA the ring's kernels are gated, so
//   the engine is too ([ptrain.cuda.unverified] unless PTRAIN_UNVERIFIED_CUDA=1).
// - Limits: no dropout (GPT's dropout must be 0: a slice of a sequence would draw other
//   masks than one process); no pipeline parallelism (docs/context_parallel.md).
//
// With tensor parallelism (Megatron-Core's cp inside tp):
//   auto engine = parallel::make_engine<double>(llama, *world, parallel::TensorParallelPlan{.tp = 2, .cp = 2});
// - A field of the tensor-parallel plan, since the weights are tp shards and the TP engine
//   already owns what shards need (vocabulary-parallel embedding, head and loss, clipping,
//   full-tensor checkpoints, FSDP x TP); cp adds the attention, the positions, the batch
//   slicing, the whole-sequence loss and a replica axis.
// - Mesh dp x cp x tp, tp innermost. Each tp rank holds its heads; its blocks are rebuilt
//   (detail::context_parallel_tp_unit) with ContextParallelSelfAttention or
//   ContextParallelGQA on those heads, the ring over context_group() (the cp ranks with
//   the same t); GPT's VocabParallelEmbedding adds wpe at global positions. The projections
//   keep their f and g over tp (for Llama the block's ColumnParallelRegion applies f).
// - The loss: detail::context_parallel_run with the vocabulary-parallel cross-entropy
//   (its sum and count all-reduced over cp). Gradients: each tp shard's averaged over
//   Mesh::data_context_group() (dp x cp ranks with the same t), or reduce-scattered over
//   it by FSDP x TP's FSDP. Clipping and checkpoints are the TP engine's (sharded squares
//   summed over tp; full tensors written by cp rank 0 and tp rank 0 of replica 0).
// - Refused: pp > 1 ([ptrain.cp.pipeline]), sequence parallelism
//   ([ptrain.cp.sequence_parallel]), GPT dropout ([ptrain.cp.dropout]).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ptrain/nn/loss.hpp"
#include "ptrain/nn/models/gpt.hpp"
#include "ptrain/nn/models/llama.hpp"
#include "ptrain/nn/recompute.hpp"
#include "ptrain/parallel/context_parallel.hpp"
#include "ptrain/parallel/engine.hpp"
#include "ptrain/parallel/fsdp.hpp"
#include "ptrain/parallel/mesh.hpp"
#include "ptrain/parallel/model_check.hpp"
#include "ptrain/parallel/pipeline.hpp"
#include "ptrain/parallel/tp_gpt.hpp"
#include "ptrain/parallel/tp_llama.hpp"

namespace ptrain::parallel {

/// Context parallelism over cp consecutive ranks; data parallelism over world / cp replicas.
struct ContextParallelPlan {
  int cp = 1;
  /// How attention reaches the other ranks' keys and values (docs/context_parallel.md, "Ring or all-gather").
  KVExchange kv_exchange = KVExchange::Ring;
  /// Shard the parameters, gradients and optimizer state over all dp x cp ranks (FSDP
  /// FullShard over the world) instead of replicating them (Note [Context-parallel engine]).
  bool fsdp = false;
};

/// What the layers of a context-parallel model read about the batch they run on (set by the engine).
struct ContextParallelBatch {
  ContextParallelBatch(dist::Communicator* cp, KVExchange exchange) : group(cp, exchange) {}
  ContextParallelGroup group;
  Tensor<std::int32_t> positions;  ///< [B, 2c] positions of the local tokens (global; restarting at documents)
  Tensor<std::int32_t> starts;     ///< [B, 2c] global document starts of the local tokens, or undefined
  Device device = Device::cpu();   ///< the model's: where the local ids, targets, positions and starts go
};

namespace detail {
// A child of `owner` as a shared_ptr that keeps the owner alive.
template <class M, class T>
std::shared_ptr<M> part_of(const std::shared_ptr<nn::Module<T>>& owner, M& m) {
  return std::shared_ptr<M>(owner, &m);
}
// q, k and v [B, n, H, D] out of a packed qkv [B, n, 3 H D] (on its device).
template <class T>
Tensor<T> qkv_column(const Tensor<T>& qkv, std::int64_t which, std::int64_t H, std::int64_t D) {
  const std::int64_t B = qkv.size(0), n = qkv.size(1), C = H * D;
  auto out = Tensor<T>::empty({B, n, H, D}, qkv.device());
  PTRAIN_DISPATCH(qkv.device(), T, copy_strided_rows, B * n, C, qkv.data() + which * C, 3 * C, out.data(), C);
  return out;
}
// dqkv [B, n, 3 H D] from the gradients of q, k and v [B, n, H, D].
template <class T>
Tensor<T> qkv_join(const Tensor<T>& dq, const Tensor<T>& dk, const Tensor<T>& dv) {
  const std::int64_t B = dq.size(0), n = dq.size(1), C = dq.size(2) * dq.size(3);
  auto dqkv = Tensor<T>::empty({B, n, 3 * C}, dq.device());
  int which = 0;
  for (const Tensor<T>* d : {&dq, &dk, &dv})
    PTRAIN_DISPATCH(dq.device(), T, copy_strided_rows, B * n, C, d->data(), C, dqkv.data() + (which++) * C, 3 * C);
  return dqkv;
}
// The device of m's parameters (the CPU without any); with more than one rank in the batch's
// group, its communicator must move that device's memory.
template <class T>
Device context_parallel_device(nn::Module<T>& m, ContextParallelBatch& batch) {
  const auto params = m.named_parameters();
  const Device d = params.empty() ? Device::cpu() : params.front().param->value.device();
  if (batch.group.size() > 1) batch.group.communicator().check_serves(d, "context parallelism");
  return d;
}
}  // namespace detail

/// GPT's embedding (wte + wpe) at the tokens' global positions: "wte", "wpe" and
/// "drop" of an nn::TokenPositionEmbedding (dropout must be 0).
template <class T>
class ContextParallelEmbedding : public nn::Module<T> {
 public:
  ContextParallelEmbedding(const std::shared_ptr<nn::Module<T>>& owner, nn::TokenPositionEmbedding<T>& e,
                           std::shared_ptr<ContextParallelBatch> batch)
      : batch_(std::move(batch)) {
    wte_ = this->register_module("wte", detail::part_of(owner, e.wte()));
    wpe_ = this->register_module("wpe", detail::part_of(owner, e.wpe()));
    this->register_module("drop", detail::part_of(owner, e.dropout()));
  }
  Tensor<T> forward(const Tensor<T>&, nn::Cache<T>&) override {
    PTRAIN_THROW(ShapeError, "[ptrain.module.tokens] ", describe(), " takes int32 token ids: call forward_tokens()");
  }
  Tensor<T> forward_tokens(const Tensor<std::int32_t>& x, nn::Cache<T>& cache) override {
    const std::int64_t S = x.dim() == 2 ? x.size(1) * batch_->group.size() : 0;
    PTRAIN_CHECK(S <= wpe_->num_embeddings(), ShapeError, "[ptrain.embedding.positions] sequence of ", S,
                 " tokens exceeds block_size ", wpe_->num_embeddings(), "; crop the context to block_size tokens");
    auto ids = ops::token_ids(x, wte_->num_embeddings());
    auto pos = ops::token_ids(batch_->positions, wpe_->num_embeddings());
    auto y = ops::embedding(ids, wte_->weight().value, Tensor<T>());
    ops::axpy_(acc_t<T>(1), ops::embedding(pos, wpe_->weight().value, Tensor<T>()), y);
    cache.indices = {ids, pos};
    return y;
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(cache.indices.size() == 2, Error, "[ptrain.backward] ContextParallelEmbedding::backward without a "
                 "forward");
    ops::embedding_backward(cache.indices[0], dy, wte_->weight().grad, static_cast<Tensor<T>*>(nullptr));
    ops::embedding_backward(cache.indices[1], dy, wpe_->weight().grad, static_cast<Tensor<T>*>(nullptr));
    wpe_->weight().mark_grad_ready();
    wte_->weight().mark_grad_ready();
    cache.clear();
    return {};
  }
  std::string describe() const override { return "ContextParallelEmbedding(" + wte_->describe() + ")"; }

 private:
  std::shared_ptr<ContextParallelBatch> batch_;
  std::shared_ptr<nn::Embedding<T>> wte_, wpe_;
};

/// GPT's attention with the ring: "c_attn", "c_proj" and "resid_drop" of an
/// nn::CausalSelfAttention (no dropout).
template <class T>
class ContextParallelSelfAttention : public nn::Module<T> {
 public:
  ContextParallelSelfAttention(const std::shared_ptr<nn::Module<T>>& owner, nn::CausalSelfAttention<T>& a,
                               std::shared_ptr<ContextParallelBatch> batch)
      : n_head_(a.n_head()), batch_(std::move(batch)) {
    c_attn_ = this->register_module("c_attn", detail::part_of(owner, a.c_attn()));
    c_proj_ = this->register_module("c_proj", detail::part_of(owner, a.c_proj()));
    this->register_module("resid_drop", detail::part_of(owner, a.resid_dropout()));
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    auto qkv = c_attn_->forward(x, cache.child(0));
    const std::int64_t B = qkv.size(0), n = qkv.size(1), C = qkv.size(2) / 3, D = C / n_head_;
    auto q = detail::qkv_column(qkv, 0, n_head_, D), k = detail::qkv_column(qkv, 1, n_head_, D),
         v = detail::qkv_column(qkv, 2, n_head_, D);
    RingSaved<T> saved;
    auto y = context_attention(batch_->group, q, k, v, Tensor<std::int32_t>(), 0, saved);
    cache.tensors = {q, k, v, saved.out};
    cache.stats = {saved.lse};
    return c_proj_->forward(y.reshape({B, n, C}), cache.child(1));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 4 && cache.stats.size() == 1, Error,
                 "[ptrain.backward] ContextParallelSelfAttention::backward without a forward");
    const Tensor<T>&q = cache.tensors[0], &k = cache.tensors[1], &v = cache.tensors[2];
    auto g = c_proj_->backward(dy, cache.child(1)).reshape(q.shape());
    Tensor<T> dq, dk, dv;
    context_attention_backward(batch_->group, q, k, v, RingSaved<T>{cache.tensors[3], cache.stats[0], {}, 0}, g, dq, dk,
                            dv);
    auto dx = c_attn_->backward(detail::qkv_join(dq, dk, dv), cache.child(0));
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "ContextParallelSelfAttention(heads=" + std::to_string(n_head_) + ")";
  }

 private:
  std::int64_t n_head_;
  std::shared_ptr<ContextParallelBatch> batch_;
  std::shared_ptr<nn::Linear<T>> c_attn_, c_proj_;
};

/// Llama's grouped-query attention with the ring: "q_proj", "k_proj", "v_proj" and
/// "o_proj" of an nn::GroupedQueryAttention, rotary at the batch's global positions,
/// its document masking (global starts) and sliding window.
template <class T>
class ContextParallelGQA : public nn::Module<T> {
 public:
  ContextParallelGQA(const std::shared_ptr<nn::Module<T>>& owner, nn::GroupedQueryAttention<T>& a,
                     std::shared_ptr<ContextParallelBatch> batch)
      : H_(a.n_head()), Hkv_(a.n_kv_head()), D_(a.head_dim()), window_(a.sliding_window()), rope_(a.rotary()),
        batch_(std::move(batch)) {
    q_ = this->register_module("q_proj", detail::part_of(owner, a.q_proj()));
    k_ = this->register_module("k_proj", detail::part_of(owner, a.k_proj()));
    v_ = this->register_module("v_proj", detail::part_of(owner, a.v_proj()));
    o_ = this->register_module("o_proj", detail::part_of(owner, a.o_proj()));
  }
  Tensor<T> forward(const Tensor<T>& x, nn::Cache<T>& cache) override {
    const std::int64_t B = x.size(0), n = x.size(1);
    auto q = q_->forward(x, cache.child(0)).reshape({B, n, H_, D_});
    auto k = k_->forward(x, cache.child(1)).reshape({B, n, Hkv_, D_});
    auto v = v_->forward(x, cache.child(2)).reshape({B, n, Hkv_, D_});
    const Tensor<std::int32_t> pos = batch_->positions, starts = batch_->starts;
    ops::rotary_(q, rope_, pos);
    ops::rotary_(k, rope_, pos);
    RingSaved<T> saved;
    auto y = context_attention(batch_->group, q, k, v, starts, window_, saved);
    cache.tensors = {q, k, v, saved.out};
    cache.stats = {saved.lse};
    cache.indices = {pos, starts};
    return o_->forward(y.reshape({B, n, H_ * D_}), cache.child(3));
  }
  Tensor<T> backward(const Tensor<T>& dy, nn::Cache<T>& cache) override {
    PTRAIN_CHECK(cache.tensors.size() == 4 && cache.stats.size() == 1 && cache.indices.size() == 2, Error,
                 "[ptrain.backward] ContextParallelGQA::backward without a forward");
    const Tensor<T>&q = cache.tensors[0], &k = cache.tensors[1], &v = cache.tensors[2];
    const std::int64_t B = q.size(0), n = q.size(1);
    auto g = o_->backward(dy, cache.child(3)).reshape(q.shape());
    Tensor<T> dq, dk, dv;
    context_attention_backward(batch_->group, q, k, v,
                            RingSaved<T>{cache.tensors[3], cache.stats[0], cache.indices[1], window_}, g, dq, dk, dv);
    ops::rotary_backward_(dq, rope_, cache.indices[0]);
    ops::rotary_backward_(dk, rope_, cache.indices[0]);
    auto dx = q_->backward(dq.reshape({B, n, H_ * D_}), cache.child(0));
    ops::axpy_(acc_t<T>(1), k_->backward(dk.reshape({B, n, Hkv_ * D_}), cache.child(1)), dx);
    ops::axpy_(acc_t<T>(1), v_->backward(dv.reshape({B, n, Hkv_ * D_}), cache.child(2)), dx);
    cache.clear();
    return dx;
  }
  std::string describe() const override {
    return "ContextParallelGQA(heads=" + std::to_string(H_) + ", kv_heads=" + std::to_string(Hkv_) + ")";
  }

 private:
  std::int64_t H_, Hkv_, D_, window_;
  ops::RotaryConfig rope_;
  std::shared_ptr<ContextParallelBatch> batch_;
  std::shared_ptr<nn::Linear<T>> q_, k_, v_, o_;
};

namespace detail {
// One batch of a context-parallel model (Note [Context-parallel engine]): this rank's 2
// chunks of each row of the replica's ids [B, S] and targets through `model`, the loss
// (nn::CrossEntropyLoss, or VocabParallelCrossEntropy under tensor parallelism) summed and
// counted over the whole sequences, and backward with cp times this rank's share.
// The ids and targets may be on the CPU or the model's device: the positions and document
// starts are built from them on the host, and this rank's slices of all four go to
// batch.device. Returns the mean loss over the sequences' counted tokens; collective over
// the cp group.
template <class T, class Loss>
double context_parallel_run(ContextParallelBatch& batch, std::int32_t document_token, nn::Module<T>& model,
                            Loss& loss, const BatchInput<T>& in, const Targets<T>& targets, double grad_scale,
                            bool training) {
  PTRAIN_CHECK(in.ids != nullptr && in.ids->dim() == 2, ShapeError, "[ptrain.cp.input] context parallelism takes "
               "int32 token ids [B, S] (forward_backward(ids, targets))");
  auto on_host = [](const Tensor<std::int32_t>& t) { return t.device().is_cpu() ? t : t.to(Device::cpu()); };
  const Device dev = batch.device;
  auto on_device = [dev](const Tensor<std::int32_t>& t) { return dev.is_cpu() ? t : t.to(dev); };
  const Tensor<std::int32_t> ids = on_host(*in.ids);
  const std::int64_t B = ids.size(0), S = ids.size(1);
  const Tensor<std::int32_t> all_targets = on_host(targets.ids("ContextParallel"));
  PTRAIN_CHECK(all_targets.numel() == B * S, ShapeError, "[ptrain.cp.targets] ", all_targets.shape(),
               " targets for ", B, " x ", S, " tokens; give every rank of a replica the whole [B, S] batch");
  ContextParallelGroup& g = batch.group;
  g.chunk(S);  // refuses a length that does not divide
  auto positions = Tensor<std::int32_t>::empty({B, S});
  if (document_token >= 0) {
    auto starts = nn::document_starts(ids, document_token);
    batch.starts = on_device(g.shard(starts));
    positions = nn::document_positions(starts);
  } else {
    for (std::int64_t i = 0; i < B * S; ++i) positions.data()[i] = static_cast<std::int32_t>(i % S);
    batch.starts = Tensor<std::int32_t>();
  }
  batch.positions = on_device(g.shard(positions));
  const auto local_ids = on_device(g.shard(ids));
  const auto local_targets = on_device(g.shard(all_targets.reshape({B, S})));

  nn::Cache<T> cache, lc;
  Tensor<T> out = model.forward_tokens(local_ids, cache);
  const double mean = loss.forward(out, Targets<T>(local_targets.reshape({local_targets.numel()})), lc);
  const auto valid = static_cast<double>(lc.values.at(0));
  double sums[2] = {valid > 0 ? mean * valid : 0.0, valid};  // the sequences' loss sum and token count
  if (g.size() > 1) g.communicator().all_reduce(sums, 2, DType::F64, dist::ReduceOp::Sum);
  if (training) {
    // d(sum / count) for this rank's tokens, times cp: the gradient reduction averages over dp x cp ranks.
    const double scale = sums[1] > 0 ? grad_scale * valid * g.size() / sums[1] : 0.0;
    Tensor<T> dout = valid > 0 ? loss.backward(lc, static_cast<acc_t<T>>(scale))
                             : Tensor<T>::zeros(out.shape(), out.device());
    model.backward(dout, cache);
  }
  return sums[1] > 0 ? sums[0] / sums[1] : 0.0;
}

// Unit `unit` of a tensor-parallel GPT or Llama (parallel/tp_gpt.hpp, tp_llama.hpp) with
// the sequence split over the batch's cp group (Note [Context-parallel engine], "With
// tensor parallelism"): GPT's embedding adds wpe at the global positions; each block is
// rebuilt around its parts with its attention (this rank's heads) running the ring, and
// wrapped again in Recompute where it was; the head as it is. The parts stay the unit's
// (the result keeps it alive), under the same names.
template <class T>
std::shared_ptr<nn::Module<T>> context_parallel_tp_unit(const std::shared_ptr<nn::Module<T>>& unit,
                                                        TensorParallelGroup& group,
                                                        const std::shared_ptr<ContextParallelBatch>& batch) {
  using Part = typename nn::PreNormBlock<T>::Part;
  batch->device = context_parallel_device(*unit, *batch);
  if (auto* e = dynamic_cast<VocabParallelEmbedding<T>*>(unit.get())) {
    if (const std::int64_t block = e->block_size(); block > 0)  // GPT's; the engine holds the batch
      e->set_positions([b = batch.get(), block] {
        const std::int64_t S = b->positions.size(1) * b->group.size();
        PTRAIN_CHECK(S <= block, ShapeError, "[ptrain.embedding.positions] sequence of ", S,
                     " tokens exceeds block_size ", block, "; crop the context to block_size tokens");
        return b->positions;
      });
    return unit;
  }
  auto* rc = dynamic_cast<nn::Recompute<T>*>(unit.get());
  nn::Module<T>& inner = rc ? rc->inner() : *unit;
  std::shared_ptr<nn::Module<T>> block;
  if (auto* b = dynamic_cast<TensorParallelBlock<T>*>(&inner)) {
    block = std::make_shared<nn::PreNormBlock<T>>(
        Part{"ln_1", part_of(unit, b->ln_1())},
        Part{"attn", std::make_shared<ContextParallelSelfAttention<T>>(unit, b->attn(), batch)},
        Part{"ln_2", part_of(unit, b->ln_2())}, Part{"mlp", part_of(unit, b->mlp())});
  } else if (auto* b = dynamic_cast<TensorParallelLlamaBlock<T>*>(&inner)) {
    // The q, k and v projections read their input with f outside: the region applies it.
    auto attn = std::make_shared<ContextParallelGQA<T>>(unit, b->self_attn(), batch);
    block = std::make_shared<nn::PreNormBlock<T>>(
        Part{"input_layernorm", part_of(unit, b->input_layernorm())},
        Part{"self_attn", std::make_shared<ColumnParallelRegion<T>>(group, attn)},
        Part{"post_attention_layernorm", part_of(unit, b->post_attention_layernorm())},
        Part{b->ffn().name, part_of(unit, *b->ffn().module)});
  } else {
    return unit;  // the head
  }
  return rc ? std::make_shared<nn::Recompute<T>>(block) : block;
}
}  // namespace detail

template <class T>
class ContextParallel : public Engine<T> {
 public:
  /// Over an nn::GPT that every rank built alike; the engine shares its modules (keep it alive).
  ContextParallel(nn::GPT<T>& full, dist::Communicator& world, ContextParallelPlan plan) : world_(world) {
    const nn::GPTConfig& cfg = full.config();
    PTRAIN_CHECK(cfg.dropout == 0, Error, "[ptrain.cp.dropout] context parallelism trains without dropout (a slice "
                 "of a sequence would draw other masks); build the GPT with dropout = 0");
    init(plan, full.describe(), -1);
    build(full, plan.fsdp, [&](const std::shared_ptr<nn::Module<T>>& owner, nn::Module<T>& inner) {
      auto& b = dynamic_cast<nn::TransformerBlock<T>&>(inner);
      return std::make_shared<nn::PreNormBlock<T>>(
          typename nn::PreNormBlock<T>::Part{"ln_1", detail::part_of(owner, b.ln_1())},
          typename nn::PreNormBlock<T>::Part{"attn", std::make_shared<ContextParallelSelfAttention<T>>(owner, b.attn(),
                                                                                                        batch_)},
          typename nn::PreNormBlock<T>::Part{"ln_2", detail::part_of(owner, b.ln_2())},
          typename nn::PreNormBlock<T>::Part{"mlp", detail::part_of(owner, b.mlp())});
    });
  }
  /// Over an nn::Llama that every rank built alike; the engine shares its modules (keep it alive).
  ContextParallel(nn::Llama<T>& full, dist::Communicator& world, ContextParallelPlan plan) : world_(world) {
    init(plan, full.describe(), full.config().document_token);
    build(full, plan.fsdp, [&](const std::shared_ptr<nn::Module<T>>& owner, nn::Module<T>& inner) {
      auto& b = dynamic_cast<nn::LlamaBlock<T>&>(inner);
      return std::make_shared<nn::PreNormBlock<T>>(
          typename nn::PreNormBlock<T>::Part{"input_layernorm", detail::part_of(owner, b.input_layernorm())},
          typename nn::PreNormBlock<T>::Part{"self_attn",
                                             std::make_shared<ContextParallelGQA<T>>(owner, b.self_attn(), batch_)},
          typename nn::PreNormBlock<T>::Part{"post_attention_layernorm",
                                             detail::part_of(owner, b.post_attention_layernorm())},
          typename nn::PreNormBlock<T>::Part{"mlp", detail::part_of(owner, b.mlp())});
    });
  }

  // Every rank holds the whole model, or its shard (Note [Context-parallel engine]).
  Mode mode() const override { return fsdp_ ? Mode::FSDP : Mode::DDP; }
  nn::FlatParameters<T>& parameters() override { return fsdp_ ? fsdp_->parameters() : *params_; }
  nn::Module<T>& local_module() override { return fsdp_ ? static_cast<nn::Module<T>&>(*fsdp_) : *model_; }
  dist::Communicator& communicator() override { return world_; }
  dist::Communicator* data_parallel_group() override { return &mesh_->data_group(); }
  void zero_grad() override {
    finish_gradient_sync();
    if (fsdp_) fsdp_->zero_grad();
    else params_->zero_grad();
  }
  void finish_gradient_sync() override {
    if (fsdp_) fsdp_->finish_gradient_sync();
    if (!pending_) return;
    pending_ = false;
    if (world_.size() > 1 && params_->numel() > 0) {  // trainable gradients only
      dist::CollectiveLabel label("cp.gradients");
      world_.all_reduce(params_->grads(), dist::ReduceOp::Avg);
    }
  }
  void parameters_changed() override {
    if (fsdp_) fsdp_->parameters_changed();
  }
  Mesh& mesh() { return *mesh_; }
  ContextParallelGroup& group() { return batch_->group; }

 private:
  void init(const ContextParallelPlan& plan, const std::string& model, std::int32_t document_token) {
    try {
      check_same_model(world_, {::ptrain::detail::cat("ContextParallelPlan{.cp = ", plan.cp, ", .kv_exchange = ",
                                                     plan.kv_exchange == KVExchange::Ring ? "Ring" : "AllGather",
                                                     ", .fsdp = ", plan.fsdp, "} ", model)});
    } catch (const Error& e) {
      PTRAIN_THROW(Error, "[ptrain.cp.plan] the ranks were given different context-parallel plans or models; pass "
                          "every rank the same ContextParallelPlan and config. ", e.what());
    }
    PTRAIN_CHECK(plan.cp >= 1 && world_.size() % plan.cp == 0, Error, "[ptrain.cp.world] cp = ", plan.cp,
                 " does not divide the world of ", world_.size(), " ranks; launch a multiple of cp processes");
    mesh_ = std::make_unique<Mesh>(world_, MeshShape{.dp = world_.size() / plan.cp, .cp = plan.cp});
    batch_ = std::make_shared<ContextParallelBatch>(mesh_->context_group(), plan.kv_exchange);
    document_token_ = document_token;
  }

  // The local model: the full model's units, each block rebuilt by `block` around its
  // attention (and wrapped again in Recompute where the full model's was); with
  // `fsdp` sharded by an FSDP over the world, else replicated.
  template <class M, class Block>
  void build(M& full, bool fsdp, Block block) {
    batch_->device = detail::context_parallel_device(full, *batch_);
    if (world_.size() > 1) world_.check_serves(batch_->device, "the context-parallel engine's gradients");
    model_ = std::make_unique<detail::StageModule<T>>();
    const auto& units = full.units();
    const auto& names = full.unit_names();
    std::vector<std::shared_ptr<nn::Module<T>>> local_units;
    for (std::size_t u = 0; u < units.size(); ++u) {
      std::shared_ptr<nn::Module<T>> unit = units[u];
      if (u == 0) {
        if (auto* e = dynamic_cast<nn::TokenPositionEmbedding<T>*>(unit.get()))
          unit = std::make_shared<ContextParallelEmbedding<T>>(units[u], *e, batch_);
      } else if (u + 1 < units.size()) {
        auto* rc = dynamic_cast<nn::Recompute<T>*>(unit.get());
        unit = block(units[u], rc ? rc->inner() : *unit);
        if (rc) unit = std::make_shared<nn::Recompute<T>>(unit);
      }
      model_->add(names[u], unit);
      local_units.push_back(unit);
    }
    if (fsdp) {  // shards rank 0's values over the world and releases the full tensors
      fsdp_ = std::make_unique<FSDP<T>>(std::move(local_units), world_, FSDPOptions{.unit_names = names});
      return;
    }
    params_ = std::make_unique<nn::FlatParameters<T>>(*model_);
    if (world_.size() > 1) {  // rank 0's values, frozen ones too, as DDP
      if (params_->numel() > 0) world_.broadcast(params_->values(), 0);
      if (params_->frozen_values().numel() > 0) world_.broadcast(params_->frozen_values(), 0);
    }
  }

  // Under FSDP the shards of all the world's ranks together hold every gradient once.
  double sum_over_model(double sq) override {
    if (fsdp_ && world_.size() > 1) world_.all_reduce(&sq, 1, DType::F64, dist::ReduceOp::Sum);
    return sq;
  }

  double run(const BatchInput<T>& in, const Targets<T>& targets, double grad_scale, bool training) override {
    nn::CrossEntropyLoss<T> ce;
    const double l = detail::context_parallel_run(*batch_, document_token_, local_module(), ce, in, targets,
                                                  grad_scale, training);
    if (training && this->syncing() && !fsdp_) pending_ = true;
    return l;
  }

  dist::Communicator& world_;
  std::unique_ptr<Mesh> mesh_;
  std::shared_ptr<ContextParallelBatch> batch_;
  std::unique_ptr<detail::StageModule<T>> model_;
  std::unique_ptr<nn::FlatParameters<T>> params_;  // without FSDP
  std::unique_ptr<FSDP<T>> fsdp_;                  // with FSDP
  std::int32_t document_token_ = -1;
  bool pending_ = false;
};

}  // namespace ptrain::parallel
