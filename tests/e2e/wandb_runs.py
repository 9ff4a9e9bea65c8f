"""Reading an offline W&B run back from its files (what a run logged: config, summary, history)."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def wandb_records(run_file: Path) -> Iterator[Any]:
    """The records of an offline W&B run's ``.wandb`` file: W&B's LevelDB-style log (a 7-byte header
    ``:W&B`` + magic + version, then 32 KiB blocks of chunks ``crc u32, length u16, type u8`` where type
    1 is a whole record and 2/3/4 its first/middle/last piece), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    block, header, chunk_header = 32768, 7, 7
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    position, pending = header, b""
    while position + chunk_header <= len(data):
        if block - position % block < chunk_header:  # a block's tail too short for a chunk is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + chunk_header])
        pending += data[position + chunk_header : position + chunk_header + length]
        position += chunk_header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_wandb_run(save_dir: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, list[tuple[int, float]]], Path]:
    """The offline run's config, final summary, history ``(trainer/global_step, value)`` per metric and files folder."""
    (run_file,) = save_dir.glob("wandb/offline-run-*/run-*.wandb")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.summary.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if not key.startswith("_") and key not in ("epoch", "trainer/global_step"):
                    history.setdefault(key, []).append((row["trainer/global_step"], value))
    return config, summary, history, run_file.parent / "files"


def wait_for_finished_run(save_dir: Path, timeout: float = 60.0) -> None:
    """Wait until the offline run's file ends with its ``exit`` record: W&B's service can still be
    writing it when ``wandb.finish()`` returns in the same process (an early read found no records)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_file in save_dir.glob("wandb/offline-run-*/run-*.wandb"):
            try:
                if any(record.WhichOneof("record_type") == "exit" for record in wandb_records(run_file)):
                    return
            except Exception:  # a record still being written does not parse yet
                pass
        time.sleep(0.1)
    raise TimeoutError(f"no finished W&B run under {save_dir} after {timeout} s")
