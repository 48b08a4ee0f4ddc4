#pragma once
// Context parallelism: the sequence of every batch split over cp ranks, attention
// by a ring that passes key/value blocks (Megatron-Core's context parallelism,
// torchtitan's ring attention). The engine that trains GPT and Llama this way is
// parallel/cp_engine.hpp; this header holds the layout and the ring.
//
//   parallel::ContextParallelGroup g(mesh.context_group());   // a Mesh with MeshShape::cp
//   auto local_ids = g.shard(ids);                       // [B, S] -> [B, S / cp]
//   parallel::RingSaved<double> saved;
//   auto y = parallel::ring_attention(g, q, k, v, starts, 0, saved);   // local q, k, v
//   parallel::ring_attention_backward(g, q, k, v, saved, dy, dq, dk, dv);
//
// Note [Context-parallel layout]
// A sequence of S tokens is cut into 2 cp chunks of c = S / (2 cp) tokens; rank r
// holds chunks r and 2 cp - 1 - r (in that order: its local tokens 0..c-1 are global
// positions r c .. r c + c - 1, its tokens c..2c-1 are (2 cp - 1 - r) c ..). Under a
// causal mask each rank then holds an early and a late chunk and does the same work
// (Megatron's load balancing). S must divide into 2 cp chunks; other lengths are
// refused ([ptrain.cp.length]).
//
// Note [Ring attention]
// Forward, cp steps: at step s rank r holds the keys and values of rank
// (r - s) mod cp; it first starts sending them to rank r + 1 and receiving the next
// block from rank r - 1 (async p2p), then merges the attention of its two query
// chunks against the block's two key chunks into its output and log-sum-exp (Note
// [Ring attention blocks] in kernels/cpu/ring_attention.hpp): a key chunk that
// starts after a query chunk is skipped, one before it is a full block, the same
// chunk is the diagonal block; document starts (global positions) and a sliding
// window mask inside blocks. The order of the merges is fixed (step, then query
// chunk, then key chunk), so the result is deterministic. On cuda:N tensors every
// buffer of the ring lives on that device and the blocks are the kernel table's.
// Backward, cp steps: the key/value blocks go round again (the same transfers as the
// forward); each step adds the block's dq to the local dq and computes the block's
// dk and dv into a fresh buffer, while the partial sum of that block's dk and dv from
// the ranks before arrives from rank r - 1; it adds the two (arrived + own) and
// sends the sum on to rank r + 1. After cp steps each block's dk and dv, summed over
// every rank in ring order, arrive home. Traffic per layer and rank: forward (cp - 1)
// blocks of K and V, 2 (cp - 1) B (S / cp) Hkv D elements; backward those again plus
// cp blocks of dK and dV, 2 (2 cp - 1) B (S / cp) Hkv D (docs/context_parallel.md).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "ptrain/core/tensor.hpp"
#include "ptrain/dist/communicator.hpp"
#include "ptrain/kernels/cpu/ring_attention.hpp"
#include "ptrain/ops/dispatch.hpp"
#include "ptrain/ops/vector.hpp"

namespace ptrain::parallel {

/// How attention reaches the other ranks' keys and values: passed around a ring, block by
/// block during the computation (Note [Ring attention]), or gathered at once (Llama 3's).
enum class KVExchange { Ring, AllGather };

/// The ranks that share one sequence and where each holds its tokens (Note [Context-parallel layout]).
class ContextParallelGroup {
 public:
  /// comm: the cp ranks, rank = place in the layout (null: a group of one); it must outlive the group.
  explicit ContextParallelGroup(dist::Communicator* comm, KVExchange exchange = KVExchange::Ring)
      : comm_(comm), exchange_(exchange) {}
  KVExchange exchange() const { return exchange_; }
  int size() const { return comm_ ? comm_->size() : 1; }
  int rank() const { return comm_ ? comm_->rank() : 0; }
  dist::Communicator& communicator() {
    PTRAIN_CHECK(comm_ != nullptr, Error, "[ptrain.cp.group] a context-parallel group of one has no communicator");
    return *comm_;
  }

  /// Tokens per chunk of a global sequence of S tokens (S / (2 cp)); refuses S that does not divide.
  std::int64_t chunk(std::int64_t S) const {
    PTRAIN_CHECK(S > 0 && S % (2 * size()) == 0, ShapeError, "[ptrain.cp.length] a sequence of ", S,
                 " tokens does not divide into 2 * cp = ", 2 * size(), " chunks (Note [Context-parallel layout]); "
                 "use a sequence length that is a multiple of ", 2 * size(), " or another cp degree");
    return S / (2 * size());
  }
  /// Global position of the first token of rank r's chunk `half` (0: early, 1: late) of c tokens.
  std::int64_t chunk_start(int r, int half, std::int64_t c) const {
    return (half == 0 ? r : 2 * size() - 1 - r) * c;
  }
  /// The global positions of this rank's 2c tokens of a sequence of S, int32 [2c].
  Tensor<std::int32_t> positions(std::int64_t S) const {
    const std::int64_t c = chunk(S);
    auto p = Tensor<std::int32_t>::empty({2 * c});
    for (int half = 0; half < 2; ++half)
      for (std::int64_t i = 0; i < c; ++i)
        p.data()[half * c + i] = static_cast<std::int32_t>(chunk_start(rank(), half, c) + i);
    return p;
  }
  /// This rank's tokens of full [B, S, ...] (on the CPU or the device): [B, 2c, ...].
  template <class X>
  Tensor<X> shard(const Tensor<X>& full) const {
    PTRAIN_CHECK(full.dim() >= 2, ShapeError, "[ptrain.cp.shard] expected [B, S, ...], got ", full.shape());
    const std::int64_t B = full.size(0), S = full.size(1), c = chunk(S), row = full.numel() / (B * S);
    std::vector<std::int64_t> shape(full.shape().begin(), full.shape().end());
    shape[1] = 2 * c;
    auto out = Tensor<X>::empty(Shape(shape), full.device());
    for (std::int64_t b = 0; b < B; ++b)
      for (int half = 0; half < 2; ++half)
        out.view((b * 2 * c + half * c) * row, {c * row})
            .copy_(full.view((b * S + chunk_start(rank(), half, c)) * row, {c * row}));
    return out;
  }
  /// Every rank's `local` one after the other, in rank order (collective over the group).
  template <class X>
  Tensor<X> gather_blocks(const Tensor<X>& local) {
    if (size() == 1) return local;
    auto all = Tensor<X>::empty({size() * local.numel()}, local.device());
    communicator().all_gather(local.data(), all.data(), static_cast<std::size_t>(local.numel()), dtype_of<X>());
    return all;
  }
  /// The whole [B, S, ...] from every rank's [B, 2c, ...] (collective over the group).
  template <class X>
  Tensor<X> gather(const Tensor<X>& local) {
    PTRAIN_CHECK(local.dim() >= 2 && local.size(1) % 2 == 0, ShapeError, "[ptrain.cp.gather] expected [B, 2c, ...], "
                 "got ", local.shape());
    const std::int64_t B = local.size(0), c = local.size(1) / 2, S = 2 * c * size(), row = local.numel() / (B * 2 * c);
    const Tensor<X> all = gather_blocks(local);
    std::vector<std::int64_t> shape(local.shape().begin(), local.shape().end());
    shape[1] = S;
    auto out = Tensor<X>::empty(Shape(shape), local.device());
    for (int r = 0; r < size(); ++r)
      for (std::int64_t b = 0; b < B; ++b)
        for (int half = 0; half < 2; ++half)
          out.view((b * S + chunk_start(r, half, c)) * row, {c * row})
              .copy_(all.view(r * local.numel() + (b * 2 * c + half * c) * row, {c * row}));
    return out;
  }

 private:
  dist::Communicator* comm_;
  KVExchange exchange_;
};

/// What ring_attention_backward needs besides q, k and v.
template <class T>
struct RingSaved {
  Tensor<T> out;                ///< [B, 2c, H, D]
  Tensor<acc_t<T>> lse;         ///< [B, H, 2c]
  Tensor<std::int32_t> starts;  ///< [B, 2c] global document starts of the queries, or undefined
  std::int64_t window = 0;
};

namespace detail {
// Tags of the ring's transfers: a step's key/value block and its dk/dv partial sums.
constexpr int kRingKVTag = 0x5200, kRingGradTag = 0x5300;

// Ring attention runs on q's device: the CPU kernels, or on cuda:N the kernel table's
// (kernels/cuda/ring_attention.cuh, gated); the group's communicator must move tensors
// of that device (NCCL, or MPI and Gloo through dist::StagedCommunicator).
template <class T>
void check_ring_inputs(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                       const Tensor<std::int32_t>& starts) {
  ops::detail::check_devices("ring attention", q.device(), k, v);
  if (starts.defined()) ops::detail::check_devices("ring attention (document starts)", q.device(), starts);
  if (g.size() > 1) g.communicator().check_serves(q.device(), "context parallelism");
  PTRAIN_CHECK(q.dim() == 4 && q.size(1) % 2 == 0 && k.dim() == 4 && k.size(0) == q.size(0) &&
                   k.size(1) == q.size(1) && k.size(3) == q.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
               ShapeError, "[ptrain.cp.ring] q must be [B, 2c, H, D] and k [B, 2c, Hkv, D] with Hkv dividing H, got ",
               q.shape(), " and ", k.shape());
  check_shape(v, k.shape(), "ring attention v (the shape of k)");
  if (starts.defined()) check_shape(starts, {q.size(0), q.size(1)}, "ring attention document starts");
}

template <class T>
Tensor<T> pack_kv(const Tensor<T>& k, const Tensor<T>& v) {
  auto kv = Tensor<T>::empty({2 * k.numel()}, k.device());
  kv.view(0, {k.numel()}).copy_(k.reshape({k.numel()}));
  kv.view(k.numel(), {v.numel()}).copy_(v.reshape({v.numel()}));
  return kv;
}

// Starts sending `kv` to the next rank and receiving the next block into `next` (step s).
using WorkPair = std::pair<std::shared_ptr<dist::Work>, std::shared_ptr<dist::Work>>;
template <class T>
WorkPair pass_on(ContextParallelGroup& g, const Tensor<T>& kv, Tensor<T>& next, int tag) {
  dist::Communicator& comm = g.communicator();
  const int n = g.size(), r = g.rank();
  const auto count = static_cast<std::size_t>(kv.numel());
  comm.group_start();
  auto s = comm.send_async(kv.data(), count, dtype_of<T>(), (r + 1) % n, tag);
  auto rv = comm.recv_async(next.data(), count, dtype_of<T>(), (r + n - 1) % n, tag);
  comm.group_end();
  return {s, rv};
}

// Merges the attention of this rank's queries against the key/value block of rank src
// (kv: its K then its V, [B, 2c, Hkv, D] each) into y and lse (Note [Ring attention]).
template <class T>
void attend_block(const ContextParallelGroup& g, const Tensor<T>& q, const T* kv, std::int64_t Hkv, int src,
                  const Tensor<std::int32_t>& starts, std::int64_t window, Tensor<T>& y, Tensor<acc_t<T>>& lse) {
  const std::int64_t B = q.size(0), n2 = q.size(1), c = n2 / 2, H = q.size(2), D = q.size(3), half = B * n2 * Hkv * D;
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(static_cast<double>(D)));
  for (std::int64_t b = 0; b < B; ++b)
    for (int qh = 0; qh < 2; ++qh)
      for (int kh = 0; kh < 2; ++kh) {
        const std::int64_t q0 = g.chunk_start(g.rank(), qh, c), k0 = g.chunk_start(src, kh, c);
        if (k0 > q0) continue;  // a later chunk: every key is in the queries' future
        const std::int64_t qrow = b * n2 + qh * c, krow = b * n2 + kh * c;
        PTRAIN_DISPATCH(
            q.device(), T, ring_attention_block_forward, c, H, Hkv, D, q.data() + qrow * H * D, H * D, q0,
            starts.defined() ? starts.data() + qrow : nullptr, kv + krow * Hkv * D, kv + half + krow * Hkv * D,
            Hkv * D, k0, window, scale, y.data() + qrow * H * D, H * D, lse.data() + b * H * n2 + qh * c, n2);
      }
}
// Adds the block of rank src's part of dq to dq and its dk, dv to dkv (K's then V's).
template <class T>
void attend_block_backward(const ContextParallelGroup& g, const Tensor<T>& q, const T* kv, std::int64_t Hkv, int src,
                           const RingSaved<T>& saved, const Tensor<T>& dy, Tensor<T>& dq, T* dkv) {
  const std::int64_t B = q.size(0), n2 = q.size(1), c = n2 / 2, H = q.size(2), D = q.size(3), half = B * n2 * Hkv * D;
  const auto scale = static_cast<acc_t<T>>(1.0 / std::sqrt(static_cast<double>(D)));
  const Tensor<std::int32_t>& starts = saved.starts;
  for (std::int64_t b = 0; b < B; ++b)
    for (int qh = 0; qh < 2; ++qh)
      for (int kh = 0; kh < 2; ++kh) {
        const std::int64_t q0 = g.chunk_start(g.rank(), qh, c), k0 = g.chunk_start(src, kh, c);
        if (k0 > q0) continue;
        const std::int64_t qrow = b * n2 + qh * c, krow = b * n2 + kh * c;
        PTRAIN_DISPATCH(
            q.device(), T, ring_attention_block_backward, c, H, Hkv, D, q.data() + qrow * H * D, H * D, q0,
            starts.defined() ? starts.data() + qrow : nullptr, kv + krow * Hkv * D, kv + half + krow * Hkv * D,
            Hkv * D, k0, saved.window, scale, saved.out.data() + qrow * H * D, H * D,
            saved.lse.data() + b * H * n2 + qh * c, n2, dy.data() + qrow * H * D, dq.data() + qrow * H * D,
            dkv + krow * Hkv * D, dkv + half + krow * Hkv * D);
      }
}
template <class T>
void check_backward_inputs(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                           const RingSaved<T>& saved, const Tensor<T>& dy) {
  check_ring_inputs(g, q, k, v, saved.starts);
  ops::detail::check_devices("ring attention backward", q.device(), dy, saved.out, saved.lse);
  check_shape(dy, q.shape(), "context-parallel attention output gradient");
  check_shape(saved.out, q.shape(), "saved context-parallel attention output");
  check_shape(saved.lse, {q.size(0), q.size(2), q.size(1)}, "saved context-parallel attention log-sum-exp");
}

// The running log-sum-exp before any block: -inf, [B, H, 2c] on `dev`.
template <class A>
Tensor<A> empty_lse(const Shape& shape, Device dev) {
  auto lse = Tensor<A>::full(shape, -std::numeric_limits<A>::infinity());
  return dev.is_cpu() ? lse : lse.to(dev);
}
}  // namespace detail

/// Causal attention of this rank's queries q [B, 2c, H, D] against the keys and values
/// k, v [B, 2c, Hkv, D] of every rank of the group, passed around the ring (Note [Ring
/// attention]); starts: int32 [B, 2c] global document starts of the queries (query at
/// position p sees keys starts .. p), or undefined; window > 0: each query sees its last
/// `window` keys. Returns y [B, 2c, H, D]; collective over the group.
template <class T>
Tensor<T> ring_attention(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                         const Tensor<std::int32_t>& starts, std::int64_t window, RingSaved<T>& saved) {
  detail::check_ring_inputs(g, q, k, v, starts);
  using A = acc_t<T>;
  const int cp = g.size(), r = g.rank();
  auto y = Tensor<T>::zeros(q.shape(), q.device());
  auto lse = detail::empty_lse<A>({q.size(0), q.size(2), q.size(1)}, q.device());
  Tensor<T> kv = detail::pack_kv(k, v), next = cp > 1 ? Tensor<T>::empty(kv.shape(), kv.device()) : Tensor<T>();
  for (int s = 0; s < cp; ++s) {
    detail::WorkPair w;
    if (s + 1 < cp) w = detail::pass_on(g, kv, next, detail::kRingKVTag + s);  // the next block, during this one
    detail::attend_block(g, q, kv.data(), k.size(2), (r - s + cp) % cp, starts, window, y, lse);
    if (w.first) {
      w.first->wait();
      w.second->wait();
      std::swap(kv, next);
    }
  }
  saved = {y, lse, starts, window};
  return y;
}

/// Gradients of ring_attention: dq like q, dk and dv like k (collective over the group).
template <class T>
void ring_attention_backward(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                             const RingSaved<T>& saved, const Tensor<T>& dy, Tensor<T>& dq, Tensor<T>& dk,
                             Tensor<T>& dv) {
  detail::check_backward_inputs(g, q, k, v, saved, dy);
  const int cp = g.size(), r = g.rank();
  dq = Tensor<T>::zeros(q.shape(), q.device());
  Tensor<T> kv = detail::pack_kv(k, v), next = cp > 1 ? Tensor<T>::empty(kv.shape(), kv.device()) : Tensor<T>();
  Tensor<T> arrived = cp > 1 ? Tensor<T>::empty(kv.shape(), kv.device()) : Tensor<T>(), part, sending;
  std::shared_ptr<dist::Work> sent;  // the previous step's dk/dv partial sum on its way to rank r + 1
  for (int s = 0; s < cp; ++s) {
    detail::WorkPair w;
    if (s + 1 < cp) w = detail::pass_on(g, kv, next, detail::kRingKVTag + s);
    std::shared_ptr<dist::Work> in;  // this block's dk/dv summed over the ranks before this one
    if (s > 0)
      in = g.communicator().recv_async(arrived.data(), static_cast<std::size_t>(arrived.numel()), dtype_of<T>(),
                                       (r + cp - 1) % cp, detail::kRingGradTag + s - 1);
    part = Tensor<T>::zeros(kv.shape(), kv.device());
    detail::attend_block_backward(g, q, kv.data(), k.size(2), (r - s + cp) % cp, saved, dy, dq, part.data());
    if (w.first) {
      w.first->wait();
      w.second->wait();
      std::swap(kv, next);
    }
    if (in) {
      in->wait();
      ops::axpy_(acc_t<T>(1), arrived, part);  // part = (sum over the ranks before) + this rank's
    }
    if (cp > 1) {
      if (sent) sent->wait();
      sending = part;
      sent = g.communicator().send_async(sending.data(), static_cast<std::size_t>(sending.numel()), dtype_of<T>(),
                                         (r + 1) % cp, detail::kRingGradTag + s);
    }
  }
  Tensor<T> total = part;  // cp == 1: this rank's block is the whole sequence
  if (cp > 1) {
    // The own block comes home from rank r - 1 after its last step.
    total = Tensor<T>::empty(kv.shape(), kv.device());
    g.communicator().recv(total.data(), static_cast<std::size_t>(total.numel()), dtype_of<T>(), (r + cp - 1) % cp,
                          detail::kRingGradTag + cp - 1);
    sent->wait();
  }
  dk = total.view(0, k.shape());
  dv = total.view(k.numel(), v.shape());
}

/// ring_attention's result with every rank's keys and values gathered at once (one
/// all-gather, Llama 3's choice) instead of passed around the ring; the blocks are
/// merged in the ring's order, so the output is the ring's. Holds the whole sequence's
/// K and V during the call (docs/context_parallel.md, "Ring or all-gather").
template <class T>
Tensor<T> allgather_attention(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                              const Tensor<std::int32_t>& starts, std::int64_t window, RingSaved<T>& saved) {
  detail::check_ring_inputs(g, q, k, v, starts);
  using A = acc_t<T>;
  const int cp = g.size(), r = g.rank();
  auto y = Tensor<T>::zeros(q.shape(), q.device());
  auto lse = detail::empty_lse<A>({q.size(0), q.size(2), q.size(1)}, q.device());
  const Tensor<T> all = g.gather_blocks(detail::pack_kv(k, v));
  const std::int64_t n = 2 * k.numel();
  for (int s = 0; s < cp; ++s) {
    const int src = (r - s + cp) % cp;
    detail::attend_block(g, q, all.data() + src * n, k.size(2), src, starts, window, y, lse);
  }
  saved = {y, lse, starts, window};
  return y;
}

/// Gradients of allgather_attention: K and V gathered again, every block's dk and dv
/// computed here and summed onto their ranks by one reduce-scatter.
template <class T>
void allgather_attention_backward(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                                  const RingSaved<T>& saved, const Tensor<T>& dy, Tensor<T>& dq, Tensor<T>& dk,
                                  Tensor<T>& dv) {
  detail::check_backward_inputs(g, q, k, v, saved, dy);
  const int cp = g.size(), r = g.rank();
  dq = Tensor<T>::zeros(q.shape(), q.device());
  const Tensor<T> all = g.gather_blocks(detail::pack_kv(k, v));
  const std::int64_t n = 2 * k.numel();
  auto dall = Tensor<T>::zeros(all.shape(), all.device());
  for (int s = 0; s < cp; ++s) {
    const int src = (r - s + cp) % cp;
    detail::attend_block_backward(g, q, all.data() + src * n, k.size(2), src, saved, dy, dq, dall.data() + src * n);
  }
  Tensor<T> total = dall;
  if (cp > 1) {
    total = Tensor<T>::empty({n}, all.device());
    g.communicator().reduce_scatter(dall.data(), total.data(), static_cast<std::size_t>(n), dtype_of<T>(),
                                    dist::ReduceOp::Sum);
  }
  dk = total.view(0, k.shape());
  dv = total.view(k.numel(), v.shape());
}

/// The group's choice of ring_attention or allgather_attention (ContextParallelGroup::exchange()).
template <class T>
Tensor<T> context_attention(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                            const Tensor<std::int32_t>& starts, std::int64_t window, RingSaved<T>& saved) {
  return g.exchange() == KVExchange::AllGather ? allgather_attention(g, q, k, v, starts, window, saved)
                                               : ring_attention(g, q, k, v, starts, window, saved);
}
template <class T>
void context_attention_backward(ContextParallelGroup& g, const Tensor<T>& q, const Tensor<T>& k, const Tensor<T>& v,
                                const RingSaved<T>& saved, const Tensor<T>& dy, Tensor<T>& dq, Tensor<T>& dk,
                                Tensor<T>& dv) {
  if (g.exchange() == KVExchange::AllGather) allgather_attention_backward(g, q, k, v, saved, dy, dq, dk, dv);
  else ring_attention_backward(g, q, k, v, saved, dy, dq, dk, dv);
}

}  // namespace ptrain::parallel
