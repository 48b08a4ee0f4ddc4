#!/usr/bin/env bash
# Builds and runs ptrain's GPU tests and GPU benchmarks (ptrain and PyTorch side
# by side) on a machine with a GPU, nvcc, CMake and PyTorch but without Debian's
# -dev packages: the header-only dependencies come from .deps/, which
# tools/gpu/stage-deps.sh fills on a machine that has them.
#
#   bash tools/gpu/run.sh [build] [test] [bench] [batch] [sanitize] [profile]   (no argument: the first four)
#
# Run from the repository root with $OUT set (default build-gpu/out). Writes to $OUT:
#   env.txt          nvidia-smi, nvcc, cmake, torch versions
#   build.log        configure and build of ptrain_gpu and gpu_bench
#   gpu_tests.log    build-gpu/tests/gpu/ptrain_gpu (its XML report's failures, slowest cases
#                    and gate verdicts, from tools/gpu/gate_results.py; the [nccl] cases in a
#                    second run; the [multirank] cases, several ranks sharing the GPU over Gloo, only in their
#                    gate step), then examples/gpt_char_cuda trained on the GPU for 300 steps
#                    in fp32 and in bf16
#   gpu_bench.jsonl  one JSON line per measurement, "impl": "ptrain" and "pytorch"
#                    (ptrain's GPT steps twice: with cuBLASLt's fused epilogues and without;
#                    the Llama-shaped step, Llama 3.2 1B at 4 x 2048 tokens, on both sides)
#   gpu_bench.log    everything the benchmarks printed (tables on stderr)
#   gpu_compare.txt  ptrain / PyTorch ratios from gpu_bench.jsonl
#                    (batch only: the bf16 GPT steps again at PTRAIN_GPU_BATCHES, default 64,
#                    both sides, appended to gpu_bench.jsonl and compared with the rest)
#   summary.txt      each step's exit code
#   sanitize.log     (sanitize only) the GPU tests under compute-sanitizer: memcheck on
#                    all but the NCCL cases, racecheck and synccheck on the flash attention case
#   profile.log      (profile only) the bf16 GPT step with and without fused attention, and
#                    its GPU time per kernel from ncu (the raw CSV stays in the build
#                    directory: $OUT returns at most 8 files, and a full run fills them)
# Environment: PTRAIN_GPU_BUILD (build directory, default build-gpu),
# PTRAIN_GPU_BUDGET_S (default 540), PTRAIN_PYTHON (default python3),
# PTRAIN_GPU_BENCH_ARGS (flags passed to both benchmarks, so only those both take:
# --only, --batch, --llama-batch, --llama-layers, --layers, --heads, --embd, --block, --vocab, --steps, --warmup,
# --samples, --sample-ms, --no-float, --no-tf32, --no-bf16, --peak-tflops, --peak-tflops-bf16).
# A failed step does not stop the later ones. Each step has a time cap, and all
# together stay inside PTRAIN_GPU_BUDGET_S (default 540 s) so that a 10-minute
# command limit still returns every log.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
build=${PTRAIN_GPU_BUILD:-build-gpu}
OUT=${OUT:-$root/$build/out}
mkdir -p "$OUT"
budget=${PTRAIN_GPU_BUDGET_S:-540}
python=${PTRAIN_PYTHON:-python3}  # the Python with PyTorch (CUDA build)
jobs=$(nproc)
t0=$SECONDS
phases=("$@")
((${#phases[@]})) || phases=(build test bench batch)
want() { [[ " ${phases[*]} " == *" $1 "* ]]; }

summary=()
: >"$OUT/summary.txt"
note() { echo "== $*" | tee -a "$OUT/summary.txt"; }

# Seconds a step may run: its cap, less if the budget (minus `reserve` seconds
# kept for the steps after it) is running out; at least 10.
allowance() {
  local cap=$1 reserve=$2 left=$((budget - (SECONDS - t0) - $2))
  ((left < cap)) && cap=$left
  ((cap < 10)) && cap=10
  echo "$cap"
}

# step NAME CAP RESERVE LOG CMD...: runs CMD under `timeout`, appends its
# output (stdout and stderr) to LOG and the terminal, records the exit code.
step() {
  local name=$1 cap=$2 reserve=$3 log=$4 rcfile
  shift 4
  rcfile=$(mktemp)
  local limit
  limit=$(allowance "$cap" "$reserve")
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  local start=$SECONDS
  { timeout --kill-after=10 "$limit" "$@"; echo $? >"$rcfile"; } 2>&1 | tee -a "$log"
  local rc
  rc=$(cat "$rcfile")
  rm -f "$rcfile"
  local why=""
  [[ $rc == 124 || $rc == 137 ]] && why=" (timed out)"
  [[ $rc == 77 ]] && why=" (skipped: no GPU visible)"
  summary+=("$name: exit $rc after $((SECONDS - start)) s$why")
  return "$rc"
}

[[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
# Every phase runs the gated CUDA too (Note [The verification gate]): this run is what verifies it.
export PTRAIN_UNVERIFIED_CUDA=1

# --------------------------------------------------------------- environment ----
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  cores: $jobs"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 ||
    echo "nvidia-smi failed"
  nvidia-smi 2>&1 | head -n 4 | tail -n 2
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc not found"
  cmake --version 2>&1 | head -n 1
  command -v ninja >/dev/null && echo "ninja $(ninja --version)" || echo "ninja not found (make is used)"
  "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
              "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)' 2>&1
  [[ -d .deps ]] ||
    echo "WARNING: no .deps/ here; run tools/gpu/stage-deps.sh where Debian's packages are and carry .deps"
} 2>&1 | tee "$OUT/env.txt"

# ---------------------------------------------------------------------- Gloo ----
# Several ranks on the one GPU (the [multirank] tests) talk through Gloo staged by
# tools/gpu/stage-deps.sh: headers, CMake config and libgloo with the libraries it
# needs in .deps/lib. --disable-new-dtags writes the build's library path as
# DT_RPATH, which the loader also uses for libgloo's own dependencies (DT_RUNPATH
# serves only the executable's), so no LD_LIBRARY_PATH is needed.
if [[ -f .deps/share/cmake/Gloo/GlooConfig.cmake ]]; then
  gloo_args=(-DPTRAIN_WITH_GLOO=ON -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags)
  echo "Gloo: .deps/share/cmake/Gloo (multi-rank tests on one GPU)" | tee -a "$OUT/env.txt"
else
  gloo_args=(-DPTRAIN_WITH_GLOO=OFF)
  echo "Gloo: not staged in .deps; the multi-rank tests are not built" | tee -a "$OUT/env.txt"
fi

# ---------------------------------------------------------------------- NCCL ----
# ptrain's CMake finds NCCL with find_library(nccl) + find_path(nccl.h) next to
# the CUDA toolkit, which needs an unversioned libnccl.so. PyTorch's wheel
# (nvidia-nccl-cu*) ships include/nccl.h and lib/libnccl.so.2 only, so the paths
# are passed as the cache variables PTRAIN_NCCL_INCLUDE / PTRAIN_NCCL_LIBRARY
# directly: CMake links the full path and puts its directory in the binaries'
# build RUNPATH, where the loader finds libnccl.so.2. (No LD_LIBRARY_PATH: it
# would also steer PyTorch towards the toolkit's CUDA libraries.)
nccl_include="" nccl_library=""
find_nccl() {
  local dirs=(/usr/local/cuda /usr/local/cuda/targets/x86_64-linux /usr)
  local wheel
  wheel=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null) && dirs+=("$wheel")
  # Other wheel layouts: any nvidia/ package directory in site-packages that holds nccl.h.
  local site sites
  sites=$("$python" -c 'import site; print(*site.getsitepackages(), site.getusersitepackages())' 2>/dev/null)
  for site in $sites; do
    [[ -d $site/nvidia ]] || continue
    while IFS= read -r h; do
      dirs+=("$(dirname "$(dirname "$h")")")
    done < <(find "$site/nvidia" -name nccl.h -path '*/include/*' 2>/dev/null)
  done
  local d lib
  for d in "${dirs[@]}"; do
    [[ -f $d/include/nccl.h ]] || continue
    for lib in "$d"/lib64/libnccl.so "$d"/lib/libnccl.so "$d"/lib/x86_64-linux-gnu/libnccl.so \
               "$d"/lib64/libnccl.so.2 "$d"/lib/libnccl.so.2 "$d"/lib/x86_64-linux-gnu/libnccl.so.2; do
      if [[ -f $lib ]]; then
        nccl_include=$d/include nccl_library=$lib
        return 0
      fi
    done
  done
  return 1
}
if find_nccl; then
  nccl_args=(-DPTRAIN_WITH_NCCL=ON "-DPTRAIN_NCCL_INCLUDE=$nccl_include" "-DPTRAIN_NCCL_LIBRARY=$nccl_library")
  echo "NCCL: $nccl_include/nccl.h, $nccl_library" | tee -a "$OUT/env.txt"
else
  nccl_args=(-DPTRAIN_WITH_NCCL=OFF)
  echo "NCCL: not found; building without it" | tee -a "$OUT/env.txt"
fi

# --------------------------------------------------------------------- build ----
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# Only the two GPU binaries; keep going past a failed one so that the other is still built.
build_args=(--target ptrain_gpu gpu_bench gpt_char_cuda -j "$jobs" -- -k)
[[ ${generator[*]-} == "-G Ninja" ]] && build_args+=(0)

cmake_args=("${generator[@]}" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$root/.deps" -DPTRAIN_WITH_CUDA=ON
            -DPTRAIN_WITH_MPI=OFF "${gloo_args[@]}" -DPTRAIN_WITH_BLAS=OFF -DPTRAIN_CUDA_ARCHS=90)
# Which copies CMake found (.deps/..., not /usr) and which compiler and NCCL.
show_cache() {
  grep -E '^(Eigen3|Catch2|nlohmann_json|CLI11)_DIR|^ZLIB_(INCLUDE_DIR|LIBRARY_RELEASE):' "$1/CMakeCache.txt" 2>&1 |
    tee -a "$OUT/build.log"
  grep -E '^PTRAIN_NCCL_(INCLUDE|LIBRARY)|^CMAKE_CUDA_COMPILER:|^Gloo_DIR' "$1/CMakeCache.txt" 2>&1 | tee -a "$OUT/build.log"
}

tests_bin=$build/tests/gpu/ptrain_gpu
bench_bin=$build/benchmarks/gpu_bench
if want build; then
  : >"$OUT/build.log"
  # Configure (~15 s) and build (~1-2 min on 16 cores: each .cu is one nvcc process).
  step configure 120 360 "$OUT/build.log" cmake -S . -B "$build" "${cmake_args[@]}" "${nccl_args[@]}"
  show_cache "$build"
  step build 300 240 "$OUT/build.log" cmake --build "$build" "${build_args[@]}"
  # NCCL and the staged Gloo are the parts of the GPU build most likely to break on a new
  # machine (header and library versions); without them the kernels and the benchmarks still build.
  if [[ ! -x $tests_bin || ! -x $bench_bin ]] && [[ -n $nccl_library || ${gloo_args[0]} == -DPTRAIN_WITH_GLOO=ON ]]; then
    step configure_nonccl 60 300 "$OUT/build.log" cmake -S . -B "$build-nonccl" "${cmake_args[@]}" \
      -DPTRAIN_WITH_NCCL=OFF -DPTRAIN_WITH_GLOO=OFF
    step build_nonccl 240 240 "$OUT/build.log" cmake --build "$build-nonccl" "${build_args[@]}"
  fi
fi
# Binaries from the NCCL build where it produced them, else from the fallback.
[[ -x $tests_bin ]] || tests_bin=$build-nonccl/tests/gpu/ptrain_gpu
[[ -x $bench_bin ]] || bench_bin=$build-nonccl/benchmarks/gpu_bench
example_bin=$build/examples/gpt_char_cuda
[[ -x $example_bin ]] || example_bin=$build-nonccl/examples/gpt_char_cuda

# --------------------------------------------------------------------- tests ----
# The names on the verification gate's list, one per line.
gated_names() {
  sed -n '/kUnverifiedCuda = {/,/^};/p' include/ptrain/kernels/cuda_unverified.hpp | grep -o '"[a-z0-9_]*"' | tr -d '"'
}
if want test; then
  : >"$OUT/gpu_tests.log"
  if [[ -x $tests_bin ]]; then
    # One run of every case but the NCCL and multi-rank ones, reported as XML
    # (tools/gpu/gate_results.py prints its failures and slowest cases into the log
    # and tells which gated names passed there). The NCCL cases run on their own:
    # one that hangs (a collective, the init timeout) then costs only its own cap.
    xml=$build/gpu_tests.xml
    rm -f "$xml"
    step gpu_tests 150 300 "$OUT/gpu_tests.log" "$tests_bin" "~[nccl]~[.]~[multirank]" -r xml -o "$xml" --durations yes
    step gpu_tests_nccl 90 240 "$OUT/gpu_tests.log" "$tests_bin" "[nccl]" --durations yes
    # The verification gate (Note [The verification gate]): the summary says which
    # names passed and may leave include/ptrain/kernels/cuda_unverified.hpp. A name
    # whose cases did not all run and pass in the XML report ([nccl] or [multirank]
    # cases: ranks of ptrain_gpu started by the case itself, sharing the GPU; a run cut
    # short; a failure, perhaps left by an earlier case's sticky CUDA error) runs its
    # [cuda:<name>] cases again in a process of their own, multi-rank ones with a longer cap.
    mapfile -t verdicts < <(python3 tools/gpu/gate_results.py "$tests_bin" "$xml" $(gated_names) |
      tee -a "$OUT/gpu_tests.log" | sed -n 's/^gate //p')
    for line in "${verdicts[@]}"; do
      read -r name verdict <<<"$line"
      multirank=$("$tests_bin" --list-test-names-only "[cuda:$name][multirank]" 2>/dev/null | grep -v '^$')
      cap=60
      [[ -n $multirank ]] && cap=200
      if [[ $verdict == passed ]]; then
        summary+=("gate $name: passed")
      elif [[ $verdict == none ]]; then
        summary+=("gate $name: no test tagged [cuda:$name]")
      elif step "gate_$name" "$cap" 240 "$OUT/gpu_tests.log" "$tests_bin" "[cuda:$name]" >/dev/null; then
        summary+=("gate $name: passed")
      else
        summary+=("gate $name: FAILED")
      fi
      # The staged communicator's multi-rank cases exist only in a build with Gloo.
      if [[ $name == staged_communicator && -z $multirank ]]; then
        summary+=("gate $name: one process only; the multi-rank cases need Gloo (tools/gpu/stage-deps.sh, carry .deps)")
      fi
    done
  else
    summary+=("gpu_tests: not run, $tests_bin was not built")
  fi
  # End to end: examples/gpt_char trained on the GPU in fp32 and in bf16 on the
  # repository's docs as a corpus, then a one-stage bf16 pipeline over NCCL (the
  # path of --parallel pipeline: stage units on the GPU, eval_loss, the gather for
  # the sample) and bf16 FSDP over NCCL (shards placed from the CPU-built model,
  # full_parameters for the sample); its log goes to gpu_tests.log ($OUT holds at
  # most 8 files).
  if ! nvidia-smi -L >/dev/null 2>&1; then
    summary+=("example: not run, no GPU visible")
  elif [[ -x $example_bin ]]; then
    cat README.md docs/*.md >"$build/corpus.txt"
    step example 150 200 "$OUT/gpu_tests.log" bash -c 'for p in fp32 bf16; do
        "$0" --device cuda --precision "$p" --data "$1" --steps 300 --batch 32 --block 128 --eval-every 100 \
          --eval-batches 8 --sample-tokens 100 --log-every 100 || exit; done
        for par in pipeline fsdp; do
          "$0" --device cuda --precision bf16 --parallel "$par" --data "$1" --steps 100 --batch 32 --block 128 \
            --eval-every 50 --eval-batches 8 --sample-tokens 100 --log-every 50 || exit; done' \
      "$example_bin" "$build/corpus.txt"
  else
    summary+=("example: not run, $example_bin was not built")
  fi
fi

# ------------------------------------------------------------------ sanitize ----
# Not in the default run: for a session whose tests failed. Out-of-bounds and
# misaligned accesses (memcheck), shared-memory races (racecheck) and barriers
# not reached by every thread (synccheck) are named with the kernel and the
# source line (the build has -lineinfo).
if want sanitize; then
  : >"$OUT/sanitize.log"
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [[ ! -x $tests_bin ]]; then
    summary+=("sanitize: not run, $tests_bin was not built")
  elif [[ ! -x $sanitizer ]]; then
    summary+=("sanitize: not run, no compute-sanitizer in PATH or /usr/local/cuda/bin")
  else
    flash="cuda: flash attention matches the CPU in double"
    step memcheck 300 150 "$OUT/sanitize.log" "$sanitizer" --tool memcheck --error-exitcode 1 "$tests_bin" "~[nccl]~[.]~[multirank]"
    step racecheck 120 40 "$OUT/sanitize.log" "$sanitizer" --tool racecheck --error-exitcode 1 "$tests_bin" "$flash"
    step synccheck 60 0 "$OUT/sanitize.log" "$sanitizer" --tool synccheck --error-exitcode 1 "$tests_bin" "$flash"
    # The tensor-core flash attention's small shapes (cp.async double buffering, barriers skipped by no thread).
    flash_tc="tensor-core flash attention matches attention in double: widths 64, 128, causal or not, GQA"
    step racecheck_flash_tc 120 30 "$OUT/sanitize.log" "$sanitizer" --tool racecheck --error-exitcode 1 "$tests_bin" "$flash_tc"
    step synccheck_flash_tc 60 0 "$OUT/sanitize.log" "$sanitizer" --tool synccheck --error-exitcode 1 "$tests_bin" "$flash_tc"
  fi
fi

# ------------------------------------------------------------------- profile ----
# Not in the default run: where the bf16 GPT step's time goes. The step with and
# without the fused attention, then one step of the model cut to 2 layers (each
# layer's kernels are the same, and ncu's time grows with the launches) under
# Nsight Compute (GPU time of each kernel, clocks left alone), summed by kernel
# (tools/gpu/ncu_summary.py).
if want profile; then
  : >"$OUT/profile.log"
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
  if [[ ! -x $bench_bin ]]; then
    summary+=("profile: not run, $bench_bin was not built")
  else
    step bf16_flash 60 120 "$OUT/profile.log" "$bench_bin" --only gpt --no-float
    step bf16_materialized 60 100 "$OUT/profile.log" "$bench_bin" --only gpt --no-float --no-flash
    if [[ -n $ncu ]]; then
      step ncu 120 15 "$OUT/profile.log" bash -c '"$@" >"$0"' "$build/ncu.csv" "$ncu" --clock-control none \
        --cache-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
        "$bench_bin" --only gpt --no-float --layers 2 --warmup 0 --steps 1
      step ncu_summary 15 0 "$OUT/profile.log" python3 tools/gpu/ncu_summary.py "$build/ncu.csv" 60
    else
      summary+=("ncu: not run, no ncu in PATH, /usr/local/cuda/bin or /opt/nvidia/nsight-compute")
    fi
  fi
fi

# ---------------------------------------------------------------- benchmarks ----
# JSON lines go to gpu_bench.jsonl as well as the log; the readable tables
# (stderr) only to the log. `timeout` runs programs, not shell functions, hence bash -c.
to_jsonl=(bash -c '"$@" | tee -a "$0"; exit "${PIPESTATUS[0]}"' "$OUT/gpu_bench.jsonl")
# Default --no-float: the bf16 lines are what the targets are about, and the TF32 lines
# would not leave the budget room for the Llama step; PTRAIN_GPU_BENCH_ARGS= (empty) runs them.
read -r -a bench_args <<<"${PTRAIN_GPU_BENCH_ARGS---no-float}"
if want bench; then
  : >"$OUT/gpu_bench.jsonl"
  : >"$OUT/gpu_bench.log"
  if [[ -x $bench_bin ]]; then
    step bench_ptrain 150 270 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$bench_bin" "${bench_args[@]}"
  else
    summary+=("bench_ptrain: not run, $bench_bin was not built")
  fi
  # Without torch the PyTorch side would only print a traceback; say why in the summary instead.
  if "$python" -c 'import torch' >/dev/null 2>&1; then
    step bench_pytorch 210 90 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$python" benchmarks/gpu_bench.py \
      "${bench_args[@]}"
  else
    summary+=("bench_pytorch: not run, $python cannot import torch (set PTRAIN_PYTHON)")
  fi
  # The GPT steps captured in a CUDA graph and replayed (gpu_gpt_step_graph beside gpu_gpt_step:
  # with and without graphs); the loss on the device and AdamW in one launch are gated kernels.
  if [[ -x $bench_bin ]]; then
    step bench_graph 60 210 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$bench_bin" --only gpt --cuda-graph \
      "${bench_args[@]}"
  fi
  # The GPT steps again without cuBLASLt's fused epilogues: what they gain (last, as the least needed).
  if [[ -x $bench_bin ]]; then
    step bench_apart 60 150 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$bench_bin" --only gpt --no-epilogues \
      "${bench_args[@]}"
  fi
fi
# The bf16 step at larger batches: an H100 or H200 holds far more than 8 x 1024 tokens.
if want batch; then
  for b in ${PTRAIN_GPU_BATCHES:-64}; do
    [[ -x $bench_bin ]] && step "batch_${b}_ptrain" 60 60 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$bench_bin" \
      --only gpt --no-float --batch "$b"
    step "batch_${b}_pytorch" 120 15 "$OUT/gpu_bench.log" "${to_jsonl[@]}" "$python" benchmarks/gpu_bench.py \
      --only gpt --no-float --batch "$b"
  done
fi
if want bench || want batch; then
  : >"$OUT/gpu_compare.txt"
  step compare 15 0 "$OUT/gpu_compare.txt" python3 tools/gpu/compare.py "$OUT/gpu_bench.jsonl"
fi

echo
for s in "${summary[@]}"; do note "$s"; done
note "total $((SECONDS - t0)) s; logs in $OUT"
