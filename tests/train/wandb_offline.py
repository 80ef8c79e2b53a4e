"""Read the metrics back from a wandb offline run directory (``WANDB_MODE=offline``).

A ``run-<id>.wandb`` file is a LevelDB-style log of protobuf ``Record`` messages: a 7-byte
header (``:W&B``, magic, version), then 32 KiB blocks of chunks, each with a 7-byte header
(crc32, length, type: 1 full, 2 first, 3 middle, 4 last).
"""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32768


def _records(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        data = f.read()
    ident, _, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", path
    pos, out, buf = 7, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(buf)
            buf = b""
    return out


def offline_history(log_dir: str) -> list[dict]:
    """The logged rows ({metric: value, '_step': step}) of the one offline run under ``log_dir/wandb``."""
    from wandb.proto import wandb_internal_pb2

    runs = glob.glob(os.path.join(log_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    rows = []
    for raw in _records(runs[0]):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            rows.append({it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in rec.history.item})
    return rows
