"""What an offline W&B run wrote: its ``run-<id>.wandb`` file, read without W&B's service (wandb 0.31 has no Python
reader of its own). The file is a 7-byte header (``:W&B``, a magic number, a version) and then LevelDB's log format:
32 KiB blocks of chunks, each a 7-byte header (CRC32C, length, type: 1 full, 2 first, 3 middle, 4 last) and its
bytes, a block's tail shorter than a header left as padding. Each record is a ``wandb_internal_pb2.Record``."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: Path) -> Iterator[Any]:
    """The records of the ``.wandb`` file at ``path``, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = HEADER, b""
    while position + HEADER <= len(data):
        room = BLOCK - position % BLOCK
        if room < HEADER:
            position += room
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
        chunk = data[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind == 0 and length == 0:  # zeroes: the end of what was written
            break
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def run_id(path: Path) -> str:
    """The run's id, from its run record."""
    return next(record.run.run_id for record in records(path) if record.WhichOneof("record_type") == "run")


def history(path: Path) -> list[dict[str, Any]]:
    """Each ``log`` of the run, as the dict of its values (``trainer/global_step`` among them for Lightning's)."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
