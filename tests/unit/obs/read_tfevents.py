#!/usr/bin/env python3
"""Decodes the TensorBoard event files in a directory from the format's
description (TFRecord framing with masked CRC-32C; Event and Summary protobuf
messages decoded field by field), independently of ptrain's writer, and prints
{"file_version": ..., "scalars": {tag: [[step, value], ...]}} as JSON. When the
tensorboard package is importable, its EventAccumulator reads the same
directory and its scalars go under "tensorboard_reader"."""
import glob
import json
import os
import struct
import sys


def crc32c(data):
    """CRC-32C, bit by bit: reflected Castagnoli polynomial 0x82F63B78."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(blob):
    pos = 0
    while pos < len(blob):
        header = blob[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (hcrc,) = struct.unpack("<I", blob[pos + 8:pos + 12])
        if hcrc != masked(header):
            raise SystemExit("bad length crc at offset %d" % pos)
        data = blob[pos + 12:pos + 12 + length]
        (dcrc,) = struct.unpack("<I", blob[pos + 12 + length:pos + 16 + length])
        if len(data) != length or dcrc != masked(data):
            raise SystemExit("bad data crc at offset %d" % pos)
        yield data
        pos += 16 + length


def fields(msg):
    """(field number, wire type, value) of a protobuf message."""
    pos = 0

    def varint():
        nonlocal pos
        shift = value = 0
        while True:
            b = msg[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while pos < len(msg):
        key = varint()
        num, wire = key >> 3, key & 7
        if wire == 0:
            yield num, wire, varint()
        elif wire == 1:
            yield num, wire, msg[pos:pos + 8]
            pos += 8
        elif wire == 2:
            n = varint()
            yield num, wire, msg[pos:pos + n]
            pos += n
        elif wire == 5:
            yield num, wire, msg[pos:pos + 4]
            pos += 4
        else:
            raise SystemExit("unexpected wire type %d" % wire)


def main():
    directory = sys.argv[1]
    out = {"file_version": None, "scalars": {}}
    for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            blob = f.read()
        for rec in records(blob):
            step, summary = 0, None
            for num, _, val in fields(rec):
                if num == 2:
                    step = val
                elif num == 3:
                    out["file_version"] = val.decode()
                elif num == 5:
                    summary = val
            if summary is None:
                continue
            for num, _, value in fields(summary):
                if num != 1:
                    continue
                tag, simple = None, None
                for vnum, _, v in fields(value):
                    if vnum == 1:
                        tag = v.decode()
                    elif vnum == 2:
                        (simple,) = struct.unpack("<f", v)
                out["scalars"].setdefault(tag, []).append([step, simple])
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError:
        event_accumulator = None
    if event_accumulator is not None:
        acc = event_accumulator.EventAccumulator(directory)
        acc.Reload()
        out["tensorboard_reader"] = {tag: [[e.step, e.value] for e in acc.Scalars(tag)]
                                     for tag in acc.Tags()["scalars"]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
