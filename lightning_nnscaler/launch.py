"""Start N local processes joined in a torch.distributed group (gloo on CPU) and collect results.

A documented public helper: run a function on N local gloo processes (the integration tests and
benchmarks use it to run generated per-rank code on real ranks; so can a plan author).
A failing or hanging rank never hangs the caller: when one rank fails, or the timeout passes,
every other rank is terminated and ``LaunchError`` names what happened. A rank's own error is published
to the others (``runtime.failures``): a rank whose collective then fails raises ``PeerRankFailed`` naming
it, and ``LaunchError`` ends with the first failing rank's traceback and a line naming it and its error.

Ranks are fresh interpreters ("spawn") unless ``preload`` names modules: then they are forked from one
server process ("forkserver") that imported those modules once, so a rank does not spend seconds
importing torch and Lightning again (the test suite starts dozens of ranks this way).

``bind_cores`` gives each rank a core of its own (``os.sched_setaffinity``, before the group starts, so
the backend's threads run there too), as DeepSpeed's ``--bind_cores_to_rank`` does: a rank's communication
threads then take time from its own compute, not from a peer's. Measured on 2 gloo ranks on 2 cores (the
simulator benchmark's GPT, median steps of 20-step rounds): tensor-parallel 35-37 ms bound against 38-52 ms
unbound, interleaved pipeline 32-34 ms against 39-48 ms. With more ranks than cores no rank is bound: the OS
shares the cores among them.
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
from typing import Any, Callable, Sequence

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_nnscaler.ir.errors import NnScalerError
from lightning_nnscaler.runtime.failures import PEER_REPORT_WAIT_S, PeerRankFailed, is_communication_failure, report_failure, where_raised

SETTLE_S = PEER_REPORT_WAIT_S + 1.0  # after a rank fails, how long the others may take to fail (and say why) before they are terminated


class LaunchError(NnScalerError, RuntimeError):
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


def rank_cores(world_size: int) -> list[set[int]] | None:
    """The core each rank of ``world_size`` gets under ``launch(..., bind_cores=True)``: the cores this process may
    run on, in order, one per rank; None when there are more ranks than those cores, or the system binds no
    process to cores (``os.sched_getaffinity`` is Linux's): no rank is bound."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    return [{core} for core in cores[:world_size]] if world_size <= len(cores) else None


def _entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, result_dir: str, timeout: float, environment: dict[str, str],
    cores: set[int] | None = None,
) -> None:
    os.environ.clear()
    os.environ.update(environment)  # a forked rank starts with the fork server's environment, not the caller's
    if cores is not None:
        os.sched_setaffinity(0, cores)
    init_process_group(rank, world_size, port, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(("ok", result)))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        reported = report_failure(rank, error) if isinstance(error, Exception) else error
        if reported is not error:
            reported.__cause__ = error
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(("error", _RankError.of(reported))))
        if reported is error:
            raise
        raise reported from error
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _RankError:
    """What the parent learns of a rank's error: its traceback, one line, and whether it is the rank's own."""

    def __init__(self, traceback_text: str, line: str, own: bool) -> None:
        self.traceback_text = traceback_text
        self.line = line
        self.own = own  # not a consequence of another rank failing
        self.time = time.time()

    @classmethod
    def of(cls, error: BaseException) -> _RankError:
        where = where_raised(error)
        if isinstance(error, PeerRankFailed):
            return cls("".join(traceback.format_exception(error)), str(error), own=False)
        line = f"{type(error).__name__}: {error}" + (f" ({where})" if where else "")
        return cls("".join(traceback.format_exception(error)), line, not is_communication_failure(error))


def launch(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, collective_timeout: float = 60.0, preload: Sequence[str] = (),
    bind_cores: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by rank.

    ``fn`` must be importable (a module-level function). Results must pickle. Each rank gets the
    caller's environment variables, working directory and ``sys.path`` as they are at this call.

    Args:
        preload: Modules (in import order) to import once into a fork server that then forks every rank
            (``multiprocessing``'s "forkserver" start method). The server is one per calling process: the
            first launch that starts it fixes its modules, later launches reuse it and their ranks import
            anything else themselves. Empty: every rank is a fresh interpreter ("spawn").
        bind_cores: Bind rank ``r`` to the ``r``-th core this process may run on, when there are at least
            ``world_size`` of them (``rank_cores``; see the module docstring).

    Raises:
        LaunchError: the first failing rank's traceback, a rank that died without a result, or a timeout.
    """
    context = _rank_context(preload)
    port = free_port()
    cores = (rank_cores(world_size) if bind_cores else None) or [None] * world_size
    with tempfile.TemporaryDirectory() as result_dir:
        processes = [
            context.Process(target=_entry, args=(rank, world_size, port, fn, args, result_dir, collective_timeout, dict(os.environ), cores[rank]),
                            daemon=False)
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


def _rank_context(preload: Sequence[str] = ()) -> Any:
    """The ``multiprocessing`` context that starts ranks: "spawn", or with ``preload`` a "forkserver" whose
    server imports those modules when it starts (see `launch`)."""
    if not preload:
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context


def _wait(processes: list[Any], deadline: float, result_dir: str) -> None:
    while any(process.is_alive() for process in processes):
        if any(not process.is_alive() and process.exitcode != 0 for process in processes):
            _settle(processes, min(deadline, time.monotonic() + SETTLE_S))
            raise LaunchError(_failure(processes, result_dir))
        if time.monotonic() > deadline:
            raise LaunchError(f"ranks {[r for r, p in enumerate(processes) if p.is_alive()]} still running at the timeout")
        time.sleep(0.05)
    if any(process.exitcode != 0 for process in processes):
        raise LaunchError(_failure(processes, result_dir))


def _settle(processes: list[Any], until: float) -> None:
    """Give the other ranks until ``until`` to fail on their own (saying which rank stopped them)."""
    while any(process.is_alive() for process in processes) and time.monotonic() < until:
        time.sleep(0.05)


def _result(result_dir: str, rank: int) -> Any:
    """A rank's result; ``None`` for a rank that exited cleanly without returning."""
    path = Path(result_dir, f"rank{rank}.pkl")
    return pickle.loads(path.read_bytes())[1] if path.exists() else None


def _failure(processes: list[Any], result_dir: str) -> str:
    """Every failed rank in a line, then the first failing rank's traceback and a line naming it and its error.

    The first failing rank: the earliest to fail with its own error (not a communication failure), else a
    rank that died without a result, else the earliest to fail."""
    errors: dict[int, _RankError] = {}
    silent: dict[int, int | None] = {}
    for rank, process in enumerate(processes):
        if process.is_alive() or process.exitcode == 0:
            continue
        path = Path(result_dir, f"rank{rank}.pkl")
        status, detail = pickle.loads(path.read_bytes()) if path.exists() else (None, None)
        if status == "error":
            errors[rank] = detail
        else:
            silent[rank] = process.exitcode
    own = sorted((error.time, rank) for rank, error in errors.items() if error.own)
    first = own[0][1] if own else (min(silent) if silent else min(errors, key=lambda rank: errors[rank].time))
    lines = [error.line if error.line.startswith(f"rank {rank} ") else f"rank {rank} failed: {error.line}" for rank, error in sorted(errors.items()) if rank != first]
    lines += [f"rank {rank} exited with code {code} without a result" for rank, code in sorted(silent.items()) if rank != first]
    if first in errors:
        lines += [f"rank {first} failed:", errors[first].traceback_text.rstrip(), f"rank {first} failed first: {errors[first].line}"]
    else:
        lines.append(f"rank {first} exited with code {silent[first]} without a result")
    return "\n".join(lines)
