"""Errors across ranks: the first rank that fails is named, with its error, by every rank it stopped.

When one rank raises (a bug in a callback, a bad batch, an op that fails on that rank's pieces), the
others fail too, later and less clearly: their next collective sees the connection close or time
out. Here:

- a rank whose error is its own (``report_failure``) publishes ``rank r failed: <type>: <message>
  (<where>)`` to the process group's store (the c10d rendezvous store), first publisher wins;
- a rank whose error is a communication failure (``is_communication_failure``) looks in the store,
  for at most ``PEER_REPORT_WAIT_S`` seconds, for another rank's report and gets ``PeerRankFailed``
  (to raise from the communication error) naming that rank and its error.

``lightning_nnscaler.launch`` and the strategy's script launcher (``strategy.failures``) use it.
Every wait is bounded; a store that is gone (its host rank exited) reads as "no report".
"""


from __future__ import annotations

import json
import linecache
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from lightning_nnscaler.runtime.comm import CommunicationError

FAILURE_KEY = "lightning_nnscaler/first_failure"
PEER_REPORT_WAIT_S = 2.0  # a failing rank reports before it exits, so its peers' collectives fail after the report
MAX_MESSAGE_CHARS = 2000
_POLL_S = 0.05
_COMMUNICATION_TEXT = re.compile(r"gloo|nccl|Connection closed by peer|Connection reset by peer|Broken pipe|timed out|Timeout", re.IGNORECASE)
_GENERATED_FILE = re.compile(r"^<(nnscaler_rank|lnn_plan_|rank\d).*>$")
_OP_COMMENT = re.compile(r"#\s*([\w.\-/]+):")
_LIBRARIES = ("lightning_nnscaler", "torch", "lightning")  # frames in these are not "where" a user's error was raised


@dataclass(frozen=True)
class RankFailure:
    """One rank's own error, as published: the rank, the exception type, its message and where it was raised."""

    rank: int
    kind: str
    message: str
    where: str = ""

    def describe(self) -> str:
        """``<type>: <message> (<where>)``."""
        return f"{self.kind}: {self.message}" + (f" ({self.where})" if self.where else "")

    def to_json(self) -> str:
        """The store's form."""
        return json.dumps(vars(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankFailure:
        """Read back ``to_json``'s form."""
        return cls(**json.loads(text))


class PeerRankFailed(RuntimeError):
    """This rank stopped because another rank failed first; names that rank and its error (``launch``
    chains the communication error this rank saw; the strategy's launcher leaves it out)."""

    def __init__(self, rank: int, failure: RankFailure) -> None:
        self.rank = rank
        self.failure = failure
        super().__init__(f"rank {rank} stopped: waiting for rank {failure.rank}, which failed: {failure.describe()}")


def is_communication_failure(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective or store failing: gloo/NCCL's
    connection closed or reset, a timeout, ``CommunicationError`` - the usual consequence of a peer failing."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (CommunicationError, dist.DistError, PeerRankFailed)):
            return True
        if type(current) is RuntimeError and _COMMUNICATION_TEXT.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def where_raised(error: BaseException) -> str:
    """Where ``error`` was raised: the generated code's op (its line's ``# op_name:`` comment), else the
    innermost frame outside lightning_nnscaler, torch and lightning (the user's module or callback)."""
    frames = [(frame.f_code, line) for frame, line in traceback.walk_tb(error.__traceback__)]
    for code, line in reversed(frames):
        if _GENERATED_FILE.match(code.co_filename):
            op = _OP_COMMENT.search(linecache.getline(code.co_filename, line))
            return f"generated op {op.group(1)}, {code.co_filename} line {line}" if op else f"{code.co_filename} line {line}"
    roots = _library_roots()
    for code, line in reversed(frames):
        if not code.co_filename.startswith("<") and not str(Path(code.co_filename).resolve()).startswith(roots):
            return f"in {getattr(code, 'co_qualname', code.co_name)}, {Path(code.co_filename).name} line {line}"
    return ""


def _library_roots() -> tuple[str, ...]:
    roots = (Path(module.__file__).resolve().parent for name in _LIBRARIES if getattr(module := sys.modules.get(name), "__file__", None))
    return tuple(str(root) + os.sep for root in roots)


def _store() -> Any:
    """The default process group's store, or ``None`` without one."""
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - no store: nothing to publish to or read from
        return None


def publish_failure(rank: int, error: BaseException, store: Any = None) -> Optional[RankFailure]:
    """Publish ``error`` as rank ``rank``'s failure unless another rank's came first; returns the first
    failure published (this one or an earlier one), ``None`` without a reachable store."""
    store = store if store is not None else _store()
    if store is None:
        return None
    message = str(error)
    message = message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + " ..."
    failure = RankFailure(rank, type(error).__name__, message, where_raised(error))
    try:
        first = store.compare_set(FAILURE_KEY, "", failure.to_json())  # sets it only where no rank has yet
        return RankFailure.from_json(first)
    except Exception:  # noqa: BLE001 - the store's host is gone: nobody is left to tell
        return None


def peer_failure(rank: int, wait_s: float = PEER_REPORT_WAIT_S, store: Any = None) -> Optional[RankFailure]:
    """Another rank's published failure, waiting at most ``wait_s`` seconds for one; else ``None``."""
    store = store if store is not None else _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        while not store.check([FAILURE_KEY]):
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        failure = RankFailure.from_json(store.get(FAILURE_KEY))
    except Exception:  # noqa: BLE001 - the store's host is gone: no report to read
        return None
    return failure if failure.rank != rank else None


def report_failure(rank: int, error: BaseException, store: Any = None) -> BaseException:
    """The error rank ``rank`` should raise for ``error``: a communication failure after another rank's
    published failure becomes ``PeerRankFailed`` (raise it ``from error``); any other error is published
    (so the ranks it stops can name it) and returned as it is."""
    if is_communication_failure(error):
        failure = peer_failure(rank, store=store)
        return PeerRankFailed(rank, failure) if failure is not None else error
    publish_failure(rank, error, store=store)
    return error
