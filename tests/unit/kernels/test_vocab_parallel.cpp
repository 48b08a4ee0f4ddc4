// The vocabulary-parallel CPU kernels (kernels/cpu/vocab_parallel.hpp, through
// ops/vocab_parallel.hpp) against naive loops in double over the whole
// vocabulary: each of tp ranks runs its part, the test does what the
// collectives would (sum the embedding rows, max and sum the statistics), and the
// result must be the full embedding, the full cross-entropy and its gradient.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <vector>

#include <ptrain/core/random.hpp>
#include <ptrain/ops/vocab_parallel.hpp>

namespace test_vocab_parallel {

using namespace ptrain;

namespace {

constexpr std::int64_t kB = 3, kS = 5, kC = 4, kV = 11;

std::vector<double> random_vec(std::size_t n, std::uint64_t seed, double scale) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * (2.0 * random_uniform(seed, i) - 1.0);
  return v;
}
template <class T>
Tensor<T> tensor_of(const std::vector<double>& v, const Shape& shape) {
  std::vector<T> t(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) t[i] = static_cast<T>(static_cast<acc_t<T>>(v[i]));
  return Tensor<T>::from(t, shape);
}
template <class T>
std::vector<double> doubles(const Tensor<T>& t) {
  std::vector<double> out;
  for (const T& x : t.to_vector()) out.push_back(static_cast<double>(static_cast<acc_t<T>>(x)));
  return out;
}
// Rank r's rows [lo, lo + local) of the full table [kV, kC] (padding rows zero).
std::vector<double> shard_rows(const std::vector<double>& full, std::int64_t lo, std::int64_t local) {
  std::vector<double> out(static_cast<std::size_t>(local * kC), 0.0);
  for (std::int64_t r = 0; r < local && lo + r < kV; ++r)
    for (std::int64_t c = 0; c < kC; ++c) out[r * kC + c] = full[(lo + r) * kC + c];
  return out;
}
Tensor<std::int32_t> ids_of(const std::vector<std::int32_t>& v) { return Tensor<std::int32_t>::from(v, {kB, kS}); }

std::vector<std::int32_t> random_ids(std::uint64_t seed) {
  std::vector<std::int32_t> v(kB * kS);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(random_uniform(seed, i) * kV);
  v[2] = v[7] = v[11];  // repeated ids accumulate in backward
  return v;
}

}  // namespace

TEMPLATE_TEST_CASE("vocabulary-parallel embedding: the ranks' rows sum to the full lookup, their gradients to the "
                   "full scatter-add", "[kernels][tp]", float, double) {
  using T = TestType;
  const double tol = std::is_same_v<T, float> ? 1e-6 : 1e-14;
  const auto table = random_vec(kV * kC, 1, 1.0), pos = random_vec(kS * kC, 2, 1.0), dout = random_vec(kB * kS * kC, 3, 1.0);
  const auto ids_v = random_ids(4);
  const auto ids = ids_of(ids_v);
  // Naive: out = table[id] + pos[s]; dtable[id] += dout; dpos[s] += dout.
  std::vector<double> out_ref(kB * kS * kC), dtable_ref(kV * kC, 0.0), dpos_ref(kS * kC, 0.0);
  for (std::int64_t t = 0; t < kB * kS; ++t)
    for (std::int64_t c = 0; c < kC; ++c) {
      out_ref[t * kC + c] = table[ids_v[t] * kC + c] + pos[(t % kS) * kC + c];
      dtable_ref[ids_v[t] * kC + c] += dout[t * kC + c];
      dpos_ref[(t % kS) * kC + c] += dout[t * kC + c];
    }
  for (std::int64_t tp : {1, 2, 3, 4}) {
    INFO("tp " << tp);
    const std::int64_t local = (kV + tp - 1) / tp;
    std::vector<double> out(kB * kS * kC, 0.0), dtable(kV * kC, 0.0), dpos;
    for (std::int64_t r = 0; r < tp; ++r) {
      const std::int64_t lo = r * local;
      const auto shard = tensor_of<T>(shard_rows(table, lo, local), {local, kC});
      // tp rank 0 adds the positions.
      const auto part = ops::vocab_parallel_embedding(ids, lo, shard, r == 0 ? tensor_of<T>(pos, {kS, kC}) : Tensor<T>());
      REQUIRE(part.shape() == Shape{kB, kS, kC});
      const auto p = doubles(part);
      for (std::size_t i = 0; i < p.size(); ++i) out[i] += p[i];
      auto dshard = Tensor<T>::zeros({local, kC});
      auto dp = Tensor<T>::zeros({kS, kC});
      ops::vocab_parallel_embedding_backward(ids, lo, tensor_of<T>(dout, {kB, kS, kC}), dshard, &dp);
      const auto d = doubles(dshard);
      for (std::int64_t row = 0; row < local; ++row)
        for (std::int64_t c = 0; c < kC; ++c) {
          if (lo + row < kV) dtable[(lo + row) * kC + c] = d[row * kC + c];
          else CHECK(d[row * kC + c] == 0.0);  // padding rows get no gradient
        }
      if (r == 0) dpos = doubles(dp);
      else CHECK(doubles(dp) == dpos);  // every rank adds the whole position gradient
    }
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(out[i] == Approx(out_ref[i]).margin(tol));
    for (std::size_t i = 0; i < dtable.size(); ++i) CHECK(dtable[i] == Approx(dtable_ref[i]).margin(tol));
    for (std::size_t i = 0; i < dpos.size(); ++i) CHECK(dpos[i] == Approx(dpos_ref[i]).margin(tol));
  }
}

TEMPLATE_TEST_CASE("vocabulary-parallel cross-entropy: the ranks' statistics give the full loss and gradient",
                   "[kernels][tp]", float, double) {
  using T = TestType;
  using A = acc_t<T>;
  const double tol = std::is_same_v<T, float> ? 1e-5 : 1e-12;
  const std::int64_t N = kB * kS;
  const auto logits = random_vec(N * kV, 5, 4.0);
  auto targets_v = random_ids(6);
  targets_v[4] = -100;  // ignored
  const auto targets = ids_of(targets_v);
  const double dloss = 0.7;
  // Naive, over the full vocabulary: mean of logsumexp - x_t, d = dloss (softmax - onehot) / valid.
  double loss_ref = 0;
  std::int64_t valid_ref = 0;
  std::vector<double> d_ref(N * kV, 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets_v[i] == -100) continue;
    ++valid_ref;
    double z = 0;
    for (std::int64_t j = 0; j < kV; ++j) z += std::exp(logits[i * kV + j]);
    loss_ref += std::log(z) - logits[i * kV + targets_v[i]];
  }
  loss_ref /= static_cast<double>(valid_ref);
  for (std::int64_t i = 0; i < N; ++i) {
    if (targets_v[i] == -100) continue;
    double z = 0;
    for (std::int64_t j = 0; j < kV; ++j) z += std::exp(logits[i * kV + j]);
    for (std::int64_t j = 0; j < kV; ++j)
      d_ref[i * kV + j] = dloss * (std::exp(logits[i * kV + j]) / z - (j == targets_v[i])) / valid_ref;
  }
  for (std::int64_t tp : {1, 2, 3, 4}) {
    INFO("tp " << tp);
    const std::int64_t local = (kV + tp - 1) / tp;
    std::vector<Tensor<T>> parts;
    std::vector<Tensor<A>> stats;
    for (std::int64_t r = 0; r < tp; ++r) {
      std::vector<double> part(N * local, -1e3);  // padding columns hold garbage: they must not count
      for (std::int64_t i = 0; i < N; ++i)
        for (std::int64_t j = 0; j < local && r * local + j < kV; ++j) part[i * local + j] = logits[i * kV + r * local + j];
      parts.push_back(tensor_of<T>(part, {kB, kS, local}));
      stats.push_back(ops::vocab_parallel_row_max(parts.back(), std::clamp<std::int64_t>(kV - r * local, 0, local)));
    }
    auto all_reduce = [&](std::int64_t from, std::int64_t count, bool max) {
      for (std::int64_t k = from; k < from + count; ++k) {
        A v = stats[0].data()[k];
        for (std::int64_t r = 1; r < tp; ++r) v = max ? std::max(v, stats[r].data()[k]) : v + stats[r].data()[k];
        for (std::int64_t r = 0; r < tp; ++r) stats[r].data()[k] = v;
      }
    };
    all_reduce(0, N, true);
    for (std::int64_t r = 0; r < tp; ++r)
      ops::vocab_parallel_row_sums(parts[r], targets, r * local, std::clamp<std::int64_t>(kV - r * local, 0, local),
                                   -100, stats[r]);
    all_reduce(N, 2 * N, false);
    for (std::int64_t r = 0; r < tp; ++r) {
      std::int64_t valid = 0;
      const double loss = ops::vocab_parallel_loss<T>(stats[r], targets, kV, -100, valid);
      CHECK(valid == valid_ref);
      CHECK(loss == Approx(loss_ref).epsilon(tol));
      const std::int64_t real = std::clamp<std::int64_t>(kV - r * local, 0, local);
      const auto d = doubles(ops::vocab_parallel_loss_backward(parts[r], stats[r], targets, r * local, real, valid,
                                                               static_cast<A>(dloss), -100));
      for (std::int64_t i = 0; i < N; ++i)
        for (std::int64_t j = 0; j < local; ++j) {
          const double want = j < real ? d_ref[i * kV + r * local + j] : 0.0;
          CHECK(d[i * local + j] == Approx(want).margin(tol));
        }
    }
  }
  SECTION("a target outside the vocabulary is named") {
    auto bad = targets_v;
    bad[9] = kV;
    auto part = tensor_of<T>(logits, {kB, kS, kV});
    auto st = ops::vocab_parallel_row_max(part, kV);
    ops::vocab_parallel_row_sums(part, ids_of(bad), 0, kV, -100, st);
    std::int64_t valid = 0;
    CHECK_THROWS_WITH(ops::vocab_parallel_loss<T>(st, ids_of(bad), kV, -100, valid),
                      Catch::Contains("[ptrain.tp.target]") && Catch::Contains("at row 9"));
  }
}

TEST_CASE("vocabulary-parallel kernels in bf16 compute in float and round once", "[kernels][tp]") {
  // bf16 inputs are exact in float, so the bf16 results are the float kernel's, rounded.
  const auto table = random_vec(kV * kC, 11, 1.0), pos = random_vec(kS * kC, 12, 1.0);
  const auto ids = ids_of(random_ids(13));
  const auto tb = tensor_of<bf16>(table, {kV, kC}), pb = tensor_of<bf16>(pos, {kS, kC});
  const auto tf = tensor_of<float>(doubles(tb), {kV, kC}), pf = tensor_of<float>(doubles(pb), {kS, kC});
  const auto ob = ops::vocab_parallel_embedding(ids, 3, tb.view(3 * kC, {6, kC}).clone(), pb).to_vector();
  const auto of = ops::vocab_parallel_embedding(ids, 3, tf.view(3 * kC, {6, kC}).clone(), pf).to_vector();
  REQUIRE(ob.size() == of.size());
  for (std::size_t i = 0; i < ob.size(); ++i) CHECK(static_cast<float>(ob[i]) == static_cast<float>(bf16(of[i])));
  const auto logits_b = tensor_of<bf16>(random_vec(kB * kS * kV, 14, 3.0), {kB, kS, kV});
  const auto logits_f = tensor_of<float>(doubles(logits_b), {kB, kS, kV});
  auto sb = ops::vocab_parallel_row_max(logits_b, kV);
  auto sf = ops::vocab_parallel_row_max(logits_f, kV);
  ops::vocab_parallel_row_sums(logits_b, ids, 0, kV, -100, sb);
  ops::vocab_parallel_row_sums(logits_f, ids, 0, kV, -100, sf);
  CHECK(sb.to_vector() == sf.to_vector());  // float statistics either way
  const auto db = ops::vocab_parallel_loss_backward(logits_b, sb, ids, 0, kV, kB * kS, 1.0f, -100).to_vector();
  const auto df = ops::vocab_parallel_loss_backward(logits_f, sf, ids, 0, kV, kB * kS, 1.0f, -100).to_vector();
  for (std::size_t i = 0; i < db.size(); ++i) CHECK(static_cast<float>(db[i]) == static_cast<float>(bf16(df[i])));
}

}  // namespace test_vocab_parallel
