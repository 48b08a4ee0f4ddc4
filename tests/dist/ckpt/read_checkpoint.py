"""Independent reader of a ptrain checkpoint: json + struct + zlib + numpy only
(plus torch when it is installed). Verifies the marker, index and per-file and
per-tensor CRC-32, parses every safetensors file, and writes every tensor's
values as JSON for the C++ test to compare.

usage: read_checkpoint.py CHECKPOINT_DIR OUT.json
"""
import json, os, struct, sys, zlib
import numpy as np

ckpt, out_path = sys.argv[1], sys.argv[2]
read = lambda name: open(os.path.join(ckpt, name), "rb").read()
marker = json.loads(read("COMMITTED"))
for f in ("index.json", "trainer.json"):
    assert zlib.crc32(read(f)) == marker[f], f"{f}: CRC-32 differs from COMMITTED"
index = json.loads(read("index.json"))
np_dtype = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I32": "<i4", "I64": "<i8", "U8": "u1", "BF16": "<u2"}
values, arrays = {}, {}
for fname, info in index["files"].items():
    b = read(fname)
    assert len(b) == info["bytes"] and zlib.crc32(b) == info["crc32"], f"{fname}: size or CRC-32 mismatch"
    (n,) = struct.unpack("<Q", b[:8])
    assert (8 + n) % 8 == 0, f"{fname}: data section not 8-byte aligned"
    header = json.loads(b[8:8 + n])
    assert header.get("__metadata__", {}).get("format") == "pt"
    for name, e in header.items():
        if name == "__metadata__":
            continue
        assert index["weight_map"][name] == fname
        lo, hi = e["data_offsets"]
        raw = b[8 + n + lo:8 + n + hi]
        assert zlib.crc32(raw) == index["tensor_crc32"][name], f"{fname}: tensor {name} CRC-32 mismatch"
        a = np.frombuffer(raw, dtype=np_dtype[e["dtype"]]).reshape(e["shape"])
        if e["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        arrays[name] = (e["dtype"], raw, a)
        values[name] = a.astype(np.float64).ravel().tolist()

torch_status = "/usr/bin/python3 cannot import torch (python3-torch)"
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    tdt = {"F32": torch.float32, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8,
           "F16": torch.float16, "BF16": torch.bfloat16}
    state = {}
    for name, (dt, raw, a) in arrays.items():
        t = torch.frombuffer(bytearray(raw), dtype=tdt[dt]).reshape(a.shape) if raw else torch.zeros(a.shape, dtype=tdt[dt])
        assert torch.equal(t.to(torch.float64), torch.from_numpy(a.astype(np.float64))), name
        if index["weight_map"][name] == "model.safetensors":
            state[name] = t
    if state:
        w0, w2 = state["0.weight"], state["2.weight"]
        m = torch.nn.Sequential(torch.nn.Linear(w0.shape[1], w0.shape[0]), torch.nn.ReLU(),
                                torch.nn.Linear(w2.shape[1], w2.shape[0]))
        m.load_state_dict(state, strict=True)
        x = torch.linspace(-1, 1, w0.shape[1]).reshape(1, -1)
        values["__torch_forward__"] = m(x).detach().to(torch.float64).ravel().tolist()
    torch_status = "ok"
json.dump({"tensors": values, "torch": torch_status}, open(out_path, "w"))
print("read", len(values), "tensors; torch:", torch_status)
