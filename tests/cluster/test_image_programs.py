#!/usr/bin/python3
"""The CPU image's runtime stage, built here the way the Dockerfile builds it.

No image can be built on this machine (no container daemon, no registry), but
the CPU variant's build stage is Debian bookworm, as this machine is. So this
test runs examples/k8s/build-programs.sh cpu as the Dockerfile's build-cpu
stage does (same script, same CMake options but for -O3, which it leaves out to
build faster; ccache when present), into a temporary prefix, and checks what
the runtime stage would get:

  1. every program of the image is there, was compiled without
     -march=native, and starts (--help);
  2. the runtime package list that the script wrote is exactly the packages
     of the libraries the programs name, as this test finds them itself
     (objdump's NEEDED entries and `ldconfig -p`, then dpkg), and holds no
     -dev package or compiler;
  3. every library the programs load, transitively (ldd), belongs to a
     package that installing that list with --no-install-recommends brings
     (apt's dependency closure of the list alone, without the packages that
     runtime-setup.sh adds for mpirun and sshd): the runtime stage has every
     library, and
  4. no CUDA library is among them.

  /usr/bin/python3 tests/cluster/test_image_programs.py BUILD_DIR [REPO_ROOT]
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

BUILD = Path(sys.argv[1] if len(sys.argv) > 1 else "build/image-cpu").resolve()
ROOT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "k8s" / "build-programs.sh"
PREFIX = None
PACKAGES = None


def run(*cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, check=True, **kw).stdout


def owner(path):
    """The Debian package that holds a file (merged /usr: under /lib or /usr/lib)."""
    real = os.path.realpath(path)
    for candidate in (real, real.removeprefix("/usr"), "/usr" + real):
        r = subprocess.run(["dpkg-query", "-S", candidate], capture_output=True, text=True)
        if r.returncode == 0:
            return r.stdout.split(":")[0].strip()
    raise AssertionError(f"no Debian package holds {path}")


def ldd(program):
    """{soname: resolved path} of every library the loader maps for a program."""
    libs = {}
    for line in run("ldd", str(program)).splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m:
            libs[m.group(1)] = m.group(2)
    return libs


def closure(packages):
    """The packages apt installs for `packages` without recommends: the packages and their dependencies."""
    out = run("apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
              "--no-breaks", "--no-replaces", "--no-enhances", "--no-pre-depends", *packages)
    names = set(packages)
    for line in out.splitlines():
        m = re.match(r"\s*(?:\|)?(?:Depends|PreDepends): <?([^>\s]+)>?", line)
        if m:
            names.add(m.group(1).split(":")[0])
        elif line and not line.startswith(" "):
            names.add(line.strip().strip("<>").split(":")[0])
    return names


class TestImagePrograms(unittest.TestCase):
    def test_1_programs_start(self):
        # Built for a generic x86-64: no -march=native in any compile command.
        native = [str(f) for f in BUILD.rglob("flags.make") if "-march=native" in f.read_text()]
        self.assertFalse(native, f"-march=native in {native}")
        self.assertTrue(list(BUILD.rglob("flags.make")), "no flags.make: not a Makefile build tree?")
        script = SCRIPT.read_text()
        programs = re.search(r'(?m)^programs="([^"$]*)"', script).group(1).split()
        self.assertEqual(sorted(p.name for p in (PREFIX / "bin").iterdir()), sorted(programs))
        for p in programs:
            r = subprocess.run([str(PREFIX / "bin" / p), "--help"], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, f"{p} --help: {r.stderr[-500:]}")

    def test_2_package_list_is_what_the_programs_name(self):
        cache = {}
        for line in run("ldconfig", "-p").splitlines():
            m = re.match(r"\s*(\S+) \(libc6,x86-64[^)]*\) => (\S+)", line)
            if m:
                cache.setdefault(m.group(1), m.group(2))
        expected = set()
        for program in (PREFIX / "bin").iterdir():
            needed = re.findall(r"^\s*NEEDED\s+(\S+)$", run("objdump", "-p", str(program)), re.M)
            self.assertTrue(needed, f"{program.name} names no library?")
            for soname in needed:
                self.assertIn(soname, cache, f"{program.name} needs {soname}, which ldconfig does not know")
                expected.add(owner(cache[soname]))
        self.assertEqual(set(PACKAGES), expected)
        # On Debian bookworm: BLAS, MPI, Gloo, zlib and the C/C++ runtime.
        for name in ("libopenblas0-pthread", "libopenmpi3", "libgloo0", "zlib1g"):
            self.assertIn(name, PACKAGES)
        for name in PACKAGES:
            self.assertFalse(name.endswith("-dev") or re.match(r"^(g\+\+|gcc|cpp|clang|cmake|make)\b", name),
                             f"{name} does not belong in a runtime image")

    def test_3_runtime_stage_has_every_library(self):
        installed = closure(PACKAGES)
        self.assertIn("libhwloc15", installed, "apt's closure of libopenmpi3 should include hwloc")
        for program in (PREFIX / "bin").iterdir():
            for soname, path in ldd(program).items():
                self.assertIn(owner(path), installed,
                              f"{program.name} loads {soname} ({path}), which the runtime stage would not install")

    def test_4_no_cuda(self):
        for program in (PREFIX / "bin").iterdir():
            for soname in ldd(program):
                self.assertIsNone(re.match(r"lib(cuda|cudart|cublas|nccl)", soname),
                                  f"the CPU variant's {program.name} loads {soname}")


def main():
    global PREFIX, PACKAGES
    for tool in ("cmake", "readelf", "objdump", "ldd", "dpkg-query", "apt-cache"):
        if shutil.which(tool) is None:
            print(f"FAIL: {tool} is not installed: run tools/install-deps.sh --test", flush=True)
            sys.exit(1)
    work = Path(tempfile.mkdtemp(prefix="ptrain-image-"))
    try:
        PREFIX = work / "opt-ptrain"
        # Release without its -O3: what is checked here (the programs, their flags, the
        # libraries they load) does not depend on optimisation, and the main build
        # already compiles the same sources optimised. It takes a third of the time.
        extra = ["-DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG"]
        if shutil.which("ccache"):
            extra.append("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache")
        env = dict(os.environ, JOBS=os.environ.get("JOBS", "2"))
        r = subprocess.run(["sh", str(SCRIPT), "cpu", str(ROOT), str(BUILD), str(PREFIX), *extra], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stdout[-4000:], r.stderr[-4000:])
            print(f"FAILED: build-programs.sh cpu exited {r.returncode}")
            sys.exit(1)
        print(r.stdout.splitlines()[-1])
        PACKAGES = (PREFIX / "share" / "ptrain" / "runtime-packages").read_text().split()
        result = unittest.main(argv=[sys.argv[0], "-v"], exit=False).result
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if result.wasSuccessful() else 1)


if __name__ == "__main__":
    main()
