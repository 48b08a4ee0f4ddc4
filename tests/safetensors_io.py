"""safetensors files read and written with json and struct only, independently of
ptrain's reader and writer, for the tests' Python references.

  read(path)            {name: (dtype, shape, raw bytes)}, the layout checked
  write(path, tensors)  the same mapping, in its order, header padded to 8 bytes"""
import json
import struct

SIZES = {"F32": 4, "F64": 8, "I32": 4, "I64": 8, "BF16": 2, "F16": 2, "U8": 1}


def read(path):
    """{name: (dtype, shape, raw bytes)}; ValueError names what does not fit the layout."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise ValueError(f"{path}: header length {n} runs past the file ({len(blob)} bytes)")
    header = json.loads(blob[8:8 + n])
    data = blob[8 + n:]
    out, end = {}, 0
    for name, e in header.items():
        if name == "__metadata__":
            continue
        lo, hi = e["data_offsets"]
        count = 1
        for d in e["shape"]:
            count *= d
        if hi - lo != count * SIZES[e["dtype"]] or hi > len(data):
            raise ValueError(f"{path}: tensor {name} has offsets {lo}..{hi} for shape {e['shape']} {e['dtype']}")
        out[name] = (e["dtype"], tuple(e["shape"]), data[lo:hi])
        end = max(end, hi)
    if end != len(data):
        raise ValueError(f"{path}: tensors end at {end}, data is {len(data)} bytes")
    return out


def write(path, tensors):
    """tensors: {name: (dtype, shape, raw bytes)}, written in this order."""
    header, off = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(raw for _, _, raw in tensors.values()))
