#!/usr/bin/env bash
# Installs what ptrain's build, tests and examples need on Debian 12 (bookworm).
#   tools/install-deps.sh          build, tests, examples (and Fashion-MNIST)
#   tools/install-deps.sh --test   also what only the tests run: PyTorch's torchrun (tools/test.sh asks for it)
#   tools/install-deps.sh --bench  also PyTorch (side-by-side benchmarks) and matplotlib (timeline pictures)
# CUDA is not installed here: the CUDA toolkit at /usr/local/cuda is used when present.
set -euo pipefail

packages=(
  cmake make g++ git pkg-config
  libeigen3-dev          # CPU kernels (vectorised math, fallback GEMM)
  libopenblas-dev        # CPU GEMM (float, double)
  catch2                 # tests
  nlohmann-json3-dev     # metrics, safetensors headers, checkpoint index
  libcli11-dev           # command lines of examples, benchmarks, ptrun
  zlib1g-dev             # gzip'ed IDX files
  libopenmpi-dev openmpi-bin  # MPI communicator, mpirun
  libgloo-dev            # Gloo communicator (torchrun / Kubernetes launches)
  dataset-fashion-mnist  # the main example's data
  fortunes               # plain English text for the character-level GPT example
  python3 python3-numpy python3-regex  # independent readers and references in tests
  clang libclang-rt-14-dev  # libFuzzer target for the safetensors parser
  python3-yaml iproute2  # manifest checks and the multi-pod test (network namespaces)
)
for arg in "$@"; do
  case "$arg" in
    --test) packages+=(python3-torch) ;;
    --bench) packages+=(python3-torch libopenblas0-pthread python3-matplotlib) ;;
    *) echo "install-deps: unknown option $arg (use --test or --bench)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: everything is installed"
  exit 0
fi

SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
