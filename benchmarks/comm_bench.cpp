// comm_bench: nccl-tests-style sweep of all_reduce, reduce_scatter, all_gather,
// all_to_all and all_to_all_v through ptrain's MPI and Gloo communicators, with
// the raw MPI call in the same run as the reference.
//
//   mpirun -np 2 comm_bench [--min-bytes 1024 --max-bytes 67108864 --iters 20]
//
// Sizes follow nccl-tests: all_reduce moves `bytes` per rank, all_gather
// `bytes` of output, reduce_scatter `bytes` of input, all_to_all(_v) `bytes` of
// input per rank (n blocks of bytes/n; all_to_all_v passes the same blocks as
// split sizes, against MPI_Alltoallv). algbw = bytes / time; busbw = algbw *
// 2(n-1)/n (all_reduce) or * (n-1)/n (the others). Time is
// the median over iterations of the slowest rank, each iteration starting
// after a barrier. Inputs are small integers, so every result is exact and
// #wrong counts elements that differ from the reference.

#include <CLI/CLI.hpp>

#include <cstdio>

#ifdef PTRAIN_MPI
#include <mpi.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#ifdef PTRAIN_GLOO
#include "ptrain/dist/gloo.hpp"
#endif
#include "ptrain/dist/mpi.hpp"
#include "ptrain/dist/store.hpp"

using namespace ptrain;
using namespace ptrain::dist;

namespace {

struct Row {
  std::string op, impl;
  std::size_t bytes, count;
  double time_us, algbw, busbw;
  std::size_t wrong;
};

float input(int rank, std::size_t i) { return static_cast<float>((rank * 7 + i * 3) % 13); }

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Median over iterations of the slowest rank's time, in microseconds.
double time_op(const std::function<void()>& op, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) op();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    auto t0 = std::chrono::steady_clock::now();
    op();
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    double worst = 0;
    MPI_Allreduce(&us, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    t.push_back(worst);
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ptrain communicator benchmark"};
  std::size_t min_bytes = 1024, max_bytes = std::size_t{64} << 20;
  int iters = 20, warmup = 3;
  std::string backends = "mpi,gloo", ops = "all_reduce,reduce_scatter,all_gather,all_to_all,all_to_all_v";
  app.add_option("--min-bytes", min_bytes, "smallest message");
  app.add_option("--max-bytes", max_bytes, "largest message");
  app.add_option("--iters", iters, "timed iterations per size");
  app.add_option("--warmup", warmup, "untimed iterations per size");
  app.add_option("--backends", backends, "ptrain backends besides raw MPI: mpi,gloo");
  app.add_option("--ops", ops, "operations to sweep");
  bool unchecked = false;
  app.add_flag("--unchecked", unchecked, "also time communicators without the collective check (Note [Collective "
               "fingerprints]), as ptrain_*_unchecked right after the checked ones");
  CLI11_PARSE(app, argc, argv);

  // ptrain's runtime initialises MPI (MPI_THREAD_MULTIPLE) so raw and ptrain
  // calls run under the same thread level.
  auto mpi = std::make_unique<MpiCommunicator>();
  const int rank = mpi->rank(), n = mpi->size();

  std::unique_ptr<Communicator> gloo, mpi_off, gloo_off;
#ifdef PTRAIN_GLOO
  if (backends.find("gloo") != std::string::npos) {
    // Under mpirun there is no MASTER_ADDR: rank 0 picks a port and serves the store.
    int port = rank == 0 ? free_port() : 0;
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    std::shared_ptr<Store> store =
        std::make_shared<TCPStore>("127.0.0.1", port, rank == 0, std::chrono::milliseconds(60'000));
    gloo = std::make_unique<GlooCommunicator>(store, rank, n, default_comm_timeout(), "127.0.0.1");
    if (unchecked) {
      ::setenv("PTRAIN_DISTRIBUTED_DEBUG", "OFF", 1);  // read when a communicator is made
      gloo_off = std::make_unique<GlooCommunicator>(store, rank, n, default_comm_timeout(), "127.0.0.1",
                                                    "ptrain/gloo/unchecked");
    }
  }
#endif
  if (unchecked) {
    ::setenv("PTRAIN_DISTRIBUTED_DEBUG", "OFF", 1);
    mpi_off = std::make_unique<MpiCommunicator>();
    ::unsetenv("PTRAIN_DISTRIBUTED_DEBUG");
  }
  // The checked communicator and, with --unchecked, the same call without the check.
  auto both = [&](auto&& measure, const char* name, Communicator* checked, Communicator* off, auto&& call) {
    if (!checked) return;
    measure(name, [&] { call(*checked); });
    if (off) measure(std::string(name) + "_unchecked", [&] { call(*off); });
  };

  std::vector<Row> rows;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    std::size_t count = bytes / sizeof(float);
    for (const std::string op : {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v"}) {
      if (("," + ops + ",").find("," + op + ",") == std::string::npos) continue;
      // Per-rank element counts: all_reduce count in/out; reduce_scatter count in, count/n out;
      // all_gather count/n in, count out; all_to_all(_v) count in/out, blocks of count/n
      // (count rounded to a multiple of n).
      std::size_t c = count / n * n, part = c / n;
      std::vector<float> in(op == "all_gather" ? part : c), out(op == "reduce_scatter" ? part : c);
      for (std::size_t i = 0; i < in.size(); ++i) in[i] = input(rank, i);
      auto wrong = [&] {
        std::size_t w = 0;
        for (std::size_t i = 0; i < out.size(); ++i) {
          float want = 0;
          if (op == "all_reduce")
            for (int r = 0; r < n; ++r) want += input(r, i);
          else if (op == "reduce_scatter")
            for (int r = 0; r < n; ++r) want += input(r, rank * part + i);
          else if (op == "all_gather")
            want = input(static_cast<int>(i / part), i % part);
          else  // block i / part comes from that rank's block `rank`
            want = input(static_cast<int>(i / part), rank * part + i % part);
          if (out[i] != want) ++w;
        }
        return w;
      };
      double factor = op == "all_reduce" ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
      auto measure = [&](const std::string& impl, const std::function<void()>& f) {
        std::fill(out.begin(), out.end(), -1.0f);
        double us = time_op(f, warmup, iters);
        std::size_t w = wrong(), total = 0;
        MPI_Allreduce(&w, &total, 1, MPI_UNSIGNED_LONG, MPI_SUM, MPI_COMM_WORLD);
        double algbw = static_cast<double>(c * sizeof(float)) / (us * 1e-6) / 1e9;
        rows.push_back({op, impl, c * sizeof(float), c, us, algbw, algbw * factor, total});
        if (rank == 0) {
          nlohmann::json j = {{"bench", "comm"}, {"op", op}, {"impl", impl}, {"ranks", n},
                              {"bytes", c * sizeof(float)}, {"count", c}, {"dtype", "F32"},
                              {"time_us", us}, {"algbw_GBps", algbw}, {"busbw_GBps", algbw * factor},
                              {"wrong", total}};
          std::printf("%s\n", j.dump().c_str());
          std::fflush(stdout);
        }
      };
      int ic = static_cast<int>(c), ip = static_cast<int>(part);
      if (op == "all_reduce") {
        measure("raw_mpi", [&] { MPI_Allreduce(in.data(), out.data(), ic, MPI_FLOAT, MPI_SUM, mpi->native()); });
        auto call = [&](Communicator& k) { k.all_reduce(in.data(), out.data(), c, DType::F32, ReduceOp::Sum); };
        both(measure, "ptrain_mpi", mpi.get(), mpi_off.get(), call);
        both(measure, "ptrain_gloo", gloo.get(), gloo_off.get(), call);
      } else if (op == "reduce_scatter") {
        measure("raw_mpi", [&] {
          MPI_Reduce_scatter_block(in.data(), out.data(), ip, MPI_FLOAT, MPI_SUM, mpi->native());
        });
        auto call = [&](Communicator& k) { k.reduce_scatter(in.data(), out.data(), part, DType::F32, ReduceOp::Sum); };
        both(measure, "ptrain_mpi", mpi.get(), mpi_off.get(), call);
        both(measure, "ptrain_gloo", gloo.get(), gloo_off.get(), call);
      } else if (op == "all_gather") {
        measure("raw_mpi", [&] { MPI_Allgather(in.data(), ip, MPI_FLOAT, out.data(), ip, MPI_FLOAT, mpi->native()); });
        auto call = [&](Communicator& k) { k.all_gather(in.data(), out.data(), part, DType::F32); };
        both(measure, "ptrain_mpi", mpi.get(), mpi_off.get(), call);
        both(measure, "ptrain_gloo", gloo.get(), gloo_off.get(), call);
      } else if (op == "all_to_all") {
        measure("raw_mpi", [&] { MPI_Alltoall(in.data(), ip, MPI_FLOAT, out.data(), ip, MPI_FLOAT, mpi->native()); });
        auto call = [&](Communicator& k) { k.all_to_all(in.data(), out.data(), part, DType::F32); };
        both(measure, "ptrain_mpi", mpi.get(), mpi_off.get(), call);
        both(measure, "ptrain_gloo", gloo.get(), gloo_off.get(), call);
      } else {
        const std::vector<std::size_t> counts(static_cast<std::size_t>(n), part);
        std::vector<int> icounts(static_cast<std::size_t>(n), ip), displs;
        for (int r = 0; r < n; ++r) displs.push_back(r * ip);
        measure("raw_mpi", [&] {
          MPI_Alltoallv(in.data(), icounts.data(), displs.data(), MPI_FLOAT, out.data(), icounts.data(),
                        displs.data(), MPI_FLOAT, mpi->native());
        });
        auto call = [&](Communicator& k) {
          k.all_to_all_v(in.data(), counts.data(), out.data(), counts.data(), DType::F32);
        };
        both(measure, "ptrain_mpi", mpi.get(), mpi_off.get(), call);
        both(measure, "ptrain_gloo", gloo.get(), gloo_off.get(), call);
      }
    }
  }

  if (rank == 0) {
    std::printf("# %d ranks, F32, median of %d iterations (slowest rank)\n", n, iters);
    std::printf("# %-14s %-12s %12s %12s %10s %10s %10s %7s\n", "op", "impl", "size(B)", "count", "time(us)",
                "algbw", "busbw", "#wrong");
    for (const Row& r : rows)
      std::printf("# %-14s %-12s %12zu %12zu %10.1f %10.3f %10.3f %7zu\n", r.op.c_str(), r.impl.c_str(), r.bytes,
                  r.count, r.time_us, r.algbw, r.busbw, r.wrong);
  }
  gloo_off.reset();
  gloo.reset();
  mpi_off.reset();
  mpi.reset();
  return 0;
}

#else  // no MPI: the raw reference and the MPI backend are both missing

int main() {
  std::fprintf(stderr, "comm_bench needs ptrain built with MPI (-DPTRAIN_WITH_MPI=ON)\n");
  return 1;
}

#endif
