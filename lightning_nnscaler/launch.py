"""Start N local processes joined in a torch.distributed group (gloo on CPU) and collect results.

A documented public helper: run a function on N local gloo processes (the integration tests and
benchmarks use it to run generated per-rank code on real ranks; so can a plan author).
A failing or hanging rank never hangs the caller: when one rank fails, or the timeout passes,
every other rank is terminated and ``LaunchError`` names what happened.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A rank failed, died, or the run passed its timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, *, backend: str = "gloo", timeout: float = 60.0) -> None:
    """Join the local group at 127.0.0.1:``port``; every collective default-times out after ``timeout`` s."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, result_dir: str, timeout: float) -> None:
    init_process_group(rank, world_size, port, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(("ok", result)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(("error", "".join(traceback.format_exception(error)))))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, collective_timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return results by rank.

    ``fn`` must be importable (a module-level function). Results must pickle.

    Raises:
        LaunchError: the first failing rank's traceback, a rank that died without a result, or a timeout.
    """
    context = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as result_dir:
        processes = [
            context.Process(target=_entry, args=(rank, world_size, port, fn, args, result_dir, collective_timeout), daemon=False)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        try:
            _wait(processes, deadline, result_dir)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                process.join(5)
        return [_result(result_dir, rank) for rank in range(world_size)]


def _wait(processes: list[Any], deadline: float, result_dir: str) -> None:
    while any(process.is_alive() for process in processes):
        for rank, process in enumerate(processes):
            if not process.is_alive() and process.exitcode != 0:
                raise LaunchError(_failure(rank, process.exitcode, result_dir))
        if time.monotonic() > deadline:
            raise LaunchError(f"ranks {[r for r, p in enumerate(processes) if p.is_alive()]} still running at the timeout")
        time.sleep(0.05)
    for rank, process in enumerate(processes):
        if process.exitcode != 0:
            raise LaunchError(_failure(rank, process.exitcode, result_dir))


def _result(result_dir: str, rank: int) -> Any:
    """A rank's result; ``None`` for a rank that exited cleanly without returning."""
    path = Path(result_dir, f"rank{rank}.pkl")
    return pickle.loads(path.read_bytes())[1] if path.exists() else None


def _failure(rank: int, exitcode: int | None, result_dir: str) -> str:
    path = Path(result_dir, f"rank{rank}.pkl")
    if path.exists():
        status, detail = pickle.loads(path.read_bytes())
        if status == "error":
            return f"rank {rank} failed:\n{detail}"
    return f"rank {rank} exited with code {exitcode} without a result"
