#!/usr/bin/env bash
# Copies ptrain's header-only build dependencies from this machine's Debian
# packages into .deps/, a prefix for CMAKE_PREFIX_PATH, so that a machine
# without those packages (the GPU machine: CUDA, CMake and PyTorch but no
# Debian -dev packages) can configure and build the GPU tests and benchmarks.
# tools/gpu/run.sh uses it there; it travels with the working tree as an
# ignored path (the device tool's `carry`).
#
#   Eigen3         libeigen3-dev       include/eigen3, share/eigen3/cmake
#   Catch2 v2      catch2              include/catch2, lib/cmake/Catch2 (+ libCatch2WithMain.a,
#                                      which its config checks for)
#   nlohmann_json  nlohmann-json3-dev  include/nlohmann, share/cmake/nlohmann_json
#   CLI11          libcli11-dev        include/CLI, share/cmake/CLI11
#   ZLIB           zlib1g-dev          include/zlib.h, zconf.h, lib/libz.a (ptrain requires
#                                      zlib: gzip'ed IDX files, checkpoint CRCs; the static
#                                      archive needs no libz.so link on the other side)
#   Gloo           libgloo-dev,        include/gloo, share/cmake/Gloo, lib/libgloo.so.0(.5.0) and
#                  libgloo0            the shared libraries it needs that are not part of every
#                                      Linux (libhiredis, libibverbs, libnl): the GPU run's
#                                      several ranks on one GPU talk through Gloo, staged
#                                      (docs/cuda.md, "Several ranks on one GPU")
#
# The packages' CMake configs locate their headers relative to their own file
# (the prefix is three directories up), so they keep working after the copy as
# long as each keeps its depth below the prefix: files go to .deps/<path below /usr>.
# MPI and OpenBLAS are not staged: the GPU build turns them off. Gloo's shared
# library is built against this machine's glibc and libstdc++; a machine with the
# same or newer ones (the GPU machine's Ubuntu 24.04) loads it.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=.deps

rm -rf "$dest"
mkdir -p "$dest"

# Copies the files a package installed under /usr whose path matches $2
# (an extended regex), keeping their path below /usr.
stage() {
  local pkg=$1 pattern=$2 n=0
  while IFS= read -r f; do
    [[ -f $f && ! -L $f ]] || continue
    local rel=${f#/usr/}
    mkdir -p "$dest/$(dirname "$rel")"
    cp -p "$f" "$dest/$rel"
    n=$((n + 1))
  done < <(dpkg -L "$pkg" | grep -E "$pattern")
  if ((n == 0)); then
    echo "stage-deps: package $pkg installed no files matching $pattern (is it installed?)" >&2
    exit 1
  fi
  echo "stage-deps: $pkg: $n files"
}

stage libeigen3-dev '^/usr/(include/eigen3/|share/eigen3/cmake/)'
stage catch2 '^/usr/(include/catch2/|lib/cmake/Catch2/|lib/libCatch2WithMain\.a$)'
stage nlohmann-json3-dev '^/usr/(include/nlohmann/|share/cmake/nlohmann_json/)'
stage libcli11-dev '^/usr/(include/CLI/|share/cmake/CLI11/)'
stage zlib1g-dev '^/usr/include/z(lib|conf)\.h$'
# libz.a sits in the multiarch directory; put it where find_library looks on
# any distribution (<prefix>/lib), so the GPU machine's layout does not matter.
zlib_a=$(dpkg -L zlib1g-dev | grep -E '/libz\.a$')
cp -p "$zlib_a" "$dest/lib/libz.a"

# Gloo: headers and CMake config from libgloo-dev; the library, under its file
# name and its SONAME, and the libraries it needs beyond the C and C++ runtimes,
# each under the name the loader asks for. The imported target's location is
# made relative to the prefix.
stage libgloo-dev '^/usr/(include/gloo/|share/cmake/Gloo/)'
gloo_so=$(dpkg -L libgloo0 | grep -E '/libgloo\.so\.[0-9.]+$' | head -n 1)
[[ -n $gloo_so ]] || { echo "stage-deps: libgloo0 installed no libgloo.so.* (is it installed?)" >&2; exit 1; }
mkdir -p "$dest/lib"
cp -pL "$gloo_so" "$dest/lib/$(basename "$gloo_so")"
soname=$(objdump -p "$gloo_so" | awk '$1 == "SONAME" {print $2}')
[[ -n $soname && ! -e $dest/lib/$soname ]] && cp -pL "$gloo_so" "$dest/lib/$soname"
n=0
while read -r name _ path _; do
  case $name in
    linux-vdso* | ld-linux* | libc.so* | libm.so* | libstdc++.so* | libgcc_s.so* | libpthread.so* | libdl.so* | librt.so*) ;;
    *)
      [[ -f $path ]] || { echo "stage-deps: $gloo_so needs $name, which ldd cannot find" >&2; exit 1; }
      cp -pL "$path" "$dest/lib/$name"
      n=$((n + 1))
      ;;
  esac
done < <(ldd "$gloo_so" | awk '$2 == "=>" {print $1, $2, $3, $4}')
echo "stage-deps: libgloo0: $(basename "$gloo_so") and $n libraries it needs"
sed -i "s|/usr/lib/$(basename "$gloo_so")|\${_IMPORT_PREFIX}/lib/$(basename "$gloo_so")|g" \
  "$dest"/share/cmake/Gloo/GlooTargets-*.cmake

# A config that names an absolute /usr path would still point at this
# machine's copy. Catch2's files compare their own location with
# /usr/lib/cmake/Catch2 and use /usr only when they are loaded from there, so
# those lines are harmless elsewhere; any other line is an error to fix here
# (with sed) before the copy can move.
bad=$(grep -rnE '/usr([/"]|$)' "$dest/lib/cmake" "$dest/share" | grep -vE '^[^:]+:[0-9]+:[[:space:]]*#' |
  grep -vE '_realOrig "/usr/lib/cmake/Catch2"|set\((PACKAGE_PREFIX_DIR "/usr"|_IMPORT_PREFIX "/usr/lib/cmake/Catch2")\)' || true)
if [[ -n $bad ]]; then
  echo "stage-deps: absolute /usr paths in the staged CMake files:" >&2
  echo "$bad" >&2
  exit 1
fi

size_kib=$(du -sk "$dest" | cut -f1)
echo "stage-deps: $dest holds $((size_kib / 1024)) MiB ($(find "$dest" -type f | wc -l) files)"
if ((size_kib > 32 * 1024)); then
  echo "stage-deps: over 32 MiB; the device tool carries at most 64 MiB in all" >&2
  exit 1
fi
