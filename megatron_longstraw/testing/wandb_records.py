"""Read back what a wandb run logged, from its ``run-*.wandb`` file (tests and tooling).

wandb >= 0.2x dropped its Python reader of the transaction log. The file is a LevelDB-style log
(header ``:W&B`` + magic 0xBEE1 + version 0, then 32 KiB blocks of records: CRC32C (4 bytes),
length (2), type (1: full, 2: first, 3: middle, 4: last), payload) whose payloads are wandb's
own ``Record`` protobufs; this module parses the framing and lets wandb's protobuf do the rest.
"""

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_HEADER = 7
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a wandb transaction log (bad header)")
    pos, pending = _HEADER, b""
    while pos + 7 <= len(data):
        block_left = _BLOCK - (pos % _BLOCK)
        if block_left < 7:  # trailer padding at the end of a block
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""
        elif kind == 0 and length == 0:
            pos += block_left - 7  # zero padding
        else:
            raise ValueError(f"corrupt wandb log record type {kind}")


def read_history(run_file: str | Path) -> list[dict]:
    """Every ``run.log`` row of the run, in order, as ``{key: value}`` (``_step`` included)."""
    rows = []
    for payload in _payloads(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def find_run_file(wandb_dir: str | Path) -> Path:
    """The newest ``run-*.wandb`` under ``wandb_dir``."""
    files = sorted(Path(wandb_dir).rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise ValueError(f"{wandb_dir}: no wandb run file")
    return files[-1]
