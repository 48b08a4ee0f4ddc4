#!/bin/sh
# Builds the programs of the container image (examples/k8s/Dockerfile) and
# copies them to PREFIX/bin, with the list of the distribution packages that
# hold the shared libraries they load in PREFIX/share/ptrain/runtime-packages.
#
#   examples/k8s/build-programs.sh cpu|cuda SOURCE_DIR BUILD_DIR PREFIX [-DMORE=...]
#
# The Dockerfile's build stages run it, and tests/cluster/test_image_programs.py
# runs it (cpu) on this machine and checks what it leaves in PREFIX. Both
# variants: Release, no -march=native (the image runs on other CPUs than the
# build host's), OpenBLAS, MPI and Gloo required (a missing one is an error,
# not a smaller image), no tests or benchmarks. cuda adds gpt_char_cuda with
# CUDA, cuBLAS and NCCL for sm_80 and sm_90 (A100, H100/H200; CUDA_ARCHS
# overrides). The runtime stage installs exactly the packages listed; dpkg
# names them, so the list is right for Debian and Ubuntu alike.
set -eu

if [ $# -lt 4 ]; then
  echo "usage: $0 cpu|cuda SOURCE_DIR BUILD_DIR PREFIX [cmake options]" >&2
  exit 2
fi
variant=$1 src=$2 build=$3 prefix=$4
shift 4

programs="fashion_mnist gpt_char tokenize_text finetune ptrun"
case "$variant" in
  cpu) cuda="-DPTRAIN_WITH_CUDA=OFF -DPTRAIN_WITH_NCCL=OFF" ;;
  cuda)
    cuda="-DPTRAIN_WITH_CUDA=ON -DPTRAIN_WITH_NCCL=ON"
    programs="$programs gpt_char_cuda" ;;
  *) echo "$0: variant must be cpu or cuda, not '$variant'" >&2; exit 2 ;;
esac

# $cuda is split on purpose: two options. SentencePiece is off so that the image's
# runtime packages do not depend on what the build host happens to have installed.
# shellcheck disable=SC2086
cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DPTRAIN_NATIVE=OFF \
  -DPTRAIN_BUILD_TESTS=OFF -DPTRAIN_BUILD_EXAMPLES=ON -DPTRAIN_BUILD_LAUNCHER=ON \
  -DPTRAIN_WITH_BLAS=ON -DPTRAIN_WITH_MPI=ON -DPTRAIN_WITH_GLOO=ON -DPTRAIN_WITH_SENTENCEPIECE=OFF $cuda \
  "-DPTRAIN_CUDA_ARCHS=${CUDA_ARCHS:-80;90}" "$@"
# shellcheck disable=SC2086
cmake --build "$build" --parallel "${JOBS:-$(nproc)}" --target $programs

mkdir -p "$prefix/bin" "$prefix/share/ptrain"
for p in $programs; do
  path=$(find "$build" -type f -name "$p" -perm -u+x | head -n 1)
  [ -n "$path" ] || { echo "$0: $p was not built under $build" >&2; exit 1; }
  install -m 0755 "$path" "$prefix/bin/$p"
done

# The packages of the libraries each program names (DT_NEEDED), found through
# the paths the dynamic loader resolves them to; apt installs their own
# dependencies (libopenmpi3 -> libhwloc, ...). A library that no package holds
# is an error: the runtime stage could not install it.
packages=""
for p in $programs; do
  needed=$(readelf -d "$prefix/bin/$p" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for lib in $needed; do
    path=$(ldd "$prefix/bin/$p" | awk -v lib="$lib" '$1 == lib && $3 ~ /^\// { print $3 }')
    [ -n "$path" ] || { echo "$0: $p needs $lib, which the loader does not find" >&2; exit 1; }
    real=$(readlink -f "$path")
    # Merged /usr: dpkg may know the file under /lib or /usr/lib. Its answer is
    # "package[:arch][, other]: path"; the first package is the one.
    owner=$(dpkg -S "$real" 2>/dev/null || dpkg -S "${real#/usr}" 2>/dev/null || dpkg -S "/usr$real" 2>/dev/null) || {
      echo "$0: no package holds $real ($lib, needed by $p)" >&2; exit 1; }
    packages="$packages ${owner%%[:,]*}"
  done
done
printf '%s\n' $packages | sort -u > "$prefix/share/ptrain/runtime-packages"
echo "build-programs: $programs -> $prefix/bin; runtime packages: $(tr '\n' ' ' < "$prefix/share/ptrain/runtime-packages")"
