"""What the gpt_char end-to-end tests share (test_gpt_char_*.py import it: CTest runs each as
`python3 SCRIPT ARGS`, which puts this folder on sys.path)."""
import json
import os
import re
import struct
import subprocess
import sys

TIMEOUT_S = 240


class Failure(Exception):
    pass


def run(argv, what, expect=0):
    """argv's stdout and stderr together; a hang or an exit code other than `expect` fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    try:
        p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise Failure(f"{what}: no exit within {TIMEOUT_S} s (hang)")
    if p.returncode != expect:
        raise Failure(f"{what}: exit code {p.returncode}, expected {expect}\n{p.stdout}\n{p.stderr}")
    return p.stdout + p.stderr


def final(out, what):
    """The final validation loss and its ratio to the unigram entropy, from gpt_char's last line."""
    m = re.search(r"final val_loss ([0-9.]+) nats/char = ([0-9.]+) x unigram entropy", out)
    if not m:
        raise Failure(f"{what}: no final line\n{out}")
    return float(m.group(1)), float(m.group(2))


def safetensors_names(path):
    """name -> shape of the tensors in a .safetensors file, read from its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def run_main(main):
    """Runs a test's main: a Failure prints FAILED and the reason, and exits 1."""
    try:
        main()
    except Failure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
