// One data-parallel training step of the MLP of train_step: each rank runs its
// own batch, DDP all-reduces the gradients (overlapped with backward), AdamW
// updates. Launch with mpirun or ptrun; rank 0 prints one JSON line with the
// global throughput. benchmarks/ddp_step.py is the PyTorch DDP twin and
// benchmarks/run_ddp_step.sh runs both side by side.

#include <cstdio>

#include "mlp_bench.hpp"

using namespace ptrain;

int main(int argc, char** argv) {
  CLI::App app{"ptrain MLP data-parallel training-step benchmark"};
  bench::MlpOptions o;
  o.add_to(app);
  double bucket_mb = 25, first_bucket_mb = 1;
  app.add_option("--bucket-mb", bucket_mb, "DDP bucket cap in MiB");
  app.add_option("--first-bucket-mb", first_bucket_mb, "size of DDP's first (small) bucket in MiB");
  CLI11_PARSE(app, argc, argv);

  auto comm = dist::init_process_group();
  manual_seed(0);
  bench::MlpStep s(o, 1 + static_cast<std::uint64_t>(comm->rank()));
  parallel::DDP<float> ddp(s.model, s.params, *comm,
                          {.bucket_cap_bytes = static_cast<std::int64_t>(bucket_mb * (1 << 20)),
                           .first_bucket_bytes = static_cast<std::int64_t>(first_bucket_mb * (1 << 20))});
  comm->barrier();
  // With PTRAIN_TRACE_DIR set, the steps of PTRAIN_TRACE_STEPS are traced (benchmarks/trace_cost.sh).
  obs::Tracer::get().configure_from_env(comm->rank());
  std::int64_t step = 0;
  // Each step ends with the gradient sync (step() finishes it), so ranks stay in
  // lock step; the slowest rank's median is the step time.
  auto times = bench::time_runs(o.warmup, o.steps, [&] {
    obs::Tracer::get().step(++step);
    ddp.zero_grad();
    s.loss = ddp.forward_backward(s.x, s.y);
    ddp.step(s.opt);
  });
  obs::Tracer::get().flush();
  double ms = bench::median(times);
  comm->all_reduce(&ms, 1, DType::F64, dist::ReduceOp::Max);
  if (comm->rank() == 0) {
    auto j = bench::mlp_record("ddp_step", o, {ms}, comm->size(), s.loss);
    j["backend"] = comm->backend();
    j["buckets"] = ddp.num_buckets();
    std::printf("%s\n", j.dump().c_str());
  }
}
