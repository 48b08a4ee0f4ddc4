"""What the cluster tests that train share: ptrain checkpoints read independently of
ptrain, the work folder kept after a failure, and main's FAILED line.

A checkpoint is DIR/step-NNNNNNNN/ with model.safetensors, optimizer.safetensors,
index.json, trainer.json and a COMMITTED marker written last
(include/ptrain/ckpt/checkpoint.hpp, Note [Checkpoint layout]).
"""

import json
import shutil
import struct
import sys


def committed_steps(ckpt):
    """Steps of the committed checkpoints under `ckpt`, oldest first."""
    if not ckpt.exists():
        return []
    return sorted(int(d.name.split("-")[1]) for d in ckpt.glob("step-*")
                  if (d / "COMMITTED").exists() and d.name.split("-")[1].isdigit())


def read_safetensors(path):
    """{name: (dtype, shape, bytes)}, read independently of ptrain's reader."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        out[name] = (info["dtype"], tuple(info["shape"]), body[lo:hi])
    return out


def compare_final(ref_dir, run_dir):
    """Newest checkpoints of both runs: same step, model and optimizer tensors equal bit for bit."""
    ref_steps, run_steps = committed_steps(ref_dir), committed_steps(run_dir)
    if not ref_steps or not run_steps:
        raise AssertionError(f"no committed checkpoint (reference {ref_steps}, resumed {run_steps})")
    if ref_steps[-1] != run_steps[-1]:
        raise AssertionError(f"final step differs: reference {ref_steps[-1]}, resumed {run_steps[-1]}")
    step = ref_steps[-1]
    compared = 0
    for fname in ("model.safetensors", "optimizer.safetensors"):
        a = ref_dir / f"step-{step:08d}" / fname
        b = run_dir / f"step-{step:08d}" / fname
        if fname == "model.safetensors" and not a.exists():
            raise AssertionError(f"{a} missing")
        if not a.exists():
            continue
        ta, tb = read_safetensors(a), read_safetensors(b)
        if sorted(ta) != sorted(tb):
            raise AssertionError(f"{fname}: tensor names differ: {sorted(ta)} vs {sorted(tb)}")
        for name in ta:
            if ta[name] != tb[name]:
                da, sa, ba = ta[name]
                _, sb, bb = tb[name]
                diff = -1.0
                if da == "F32" and sa == sb:
                    fa = struct.unpack(f"<{len(ba) // 4}f", ba)
                    fb = struct.unpack(f"<{len(bb) // 4}f", bb)
                    diff = max(abs(x - y) for x, y in zip(fa, fb))
                raise AssertionError(f"{fname}: tensor {name} differs after resume (max |diff| {diff})")
            compared += 1
    return step, compared


def finish_work(work, passed, log):
    """Removes the test's work folder after a pass; after a failure keeps it and says where."""
    if passed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        log(f"logs and checkpoints kept in {work}")


def run_main(main):
    """Runs a test's main: an AssertionError prints FAILED and the reason, and exits 1."""
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", flush=True)
        sys.exit(1)
