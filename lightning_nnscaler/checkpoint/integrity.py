"""Content hashes of checkpoint files, and reading a file back only if it is the one that was written.

A file is hashed while ``torch.save`` writes it (``HashingWriter``), so saving reads nothing back;
``xxh3_128`` (xxhash, if installed: several GB/s) or else ``blake2b`` with a 16-byte digest. The
algorithm is part of the recorded hash (``"xxh3_128:<hex>"``), so a checkpoint names what checks it.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch
from lightning_nnscaler.ir.errors import NnScalerError

try:
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None


class CheckpointError(NnScalerError, RuntimeError):
    """A checkpoint that is incomplete, damaged, of another save or format: the message names the file, what is wrong and what to do."""


class _Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


DEFAULT_ALGORITHM = "xxh3_128" if xxhash is not None else "blake2b-128"


def new_hasher(algorithm: str = DEFAULT_ALGORITHM) -> _Hasher:
    """A fresh hasher for ``algorithm`` (``xxh3_128`` or ``blake2b-128``).

    Raises:
        CheckpointError: the algorithm is unknown, or is ``xxh3_128`` and xxhash is not installed.
    """
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise CheckpointError("this checkpoint's files are hashed with xxh3_128: install xxhash (pip install xxhash) to check them")
        return xxhash.xxh3_128()
    if algorithm == "blake2b-128":
        return hashlib.blake2b(digest_size=16)
    raise CheckpointError(f"unknown content hash algorithm {algorithm!r}: the checkpoint was written by a newer lightning-nnscaler; upgrade it")


def hash_bytes(data: bytes | memoryview, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """``"<algorithm>:<hex digest>"`` of ``data``."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return f"{algorithm}:{hasher.hexdigest()}"


class HashingWriter:
    """A binary stream for ``torch.save`` that hashes and counts every byte on its way to ``stream``."""

    def __init__(self, stream: BinaryIO, algorithm: str = DEFAULT_ALGORITHM) -> None:
        self.stream, self.algorithm, self.size = stream, algorithm, 0
        self._hasher = new_hasher(algorithm)

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._hasher.update(view)
        self.size += view.nbytes
        return self.stream.write(view)

    def flush(self) -> None:
        self.stream.flush()

    @property
    def digest(self) -> str:
        """``"<algorithm>:<hex digest>"`` of what was written."""
        return f"{self.algorithm}:{self._hasher.hexdigest()}"


def write_hashed(payload: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` to a temporary name, flushed to disk, renamed to ``path``; returns ``{"size", "hash"}`` of the file."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as stream:
        writer = HashingWriter(stream)
        torch.save(payload, writer)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, path)
    return {"size": writer.size, "hash": writer.digest}


def read_bytes(path: Path, what: str) -> bytes:
    """The bytes of ``path``.

    Raises:
        CheckpointError: missing or unreadable, naming ``path`` and ``what`` it is.
    """
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint lacks its {what}. Restore the file, or load another checkpoint") from None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error}): fix its permissions or load another checkpoint") from None


def check_hash(path: Path, data: bytes, record: dict[str, Any], source: str = "the metadata") -> None:
    """Compare ``data`` (the bytes of ``path``) with its recorded ``{"size", "hash"}`` (recorded in ``source``).

    Raises:
        CheckpointError: another size or content hash: the file changed after the save.
    """
    _compare(path, len(data), hash_bytes(data, str(record["hash"]).split(":", 1)[0]), record, source)


def _compare(path: Path, size: int, digest: str, record: dict[str, Any], source: str) -> None:
    if size != record["size"]:
        raise CheckpointError(
            f"{path} is {size} bytes; {source} says {record['size']} bytes: the file was truncated or replaced after the "
            "save. Restore it from a copy of this checkpoint, or load another checkpoint"
        )
    if digest != record["hash"]:
        raise CheckpointError(
            f"{path} has content hash {digest}; {source} says {record['hash']}: the file is corrupted (e.g. a flipped bit) or "
            "was replaced after the save. Restore it from a copy of this checkpoint, or load another checkpoint"
        )


def torch_load(data: bytes | None, path: Path) -> Any:
    """``torch.load(weights_only=True)`` of ``data`` (the bytes of ``path``; read from ``path`` when None).

    Raises:
        CheckpointError: not a torch file, or a damaged one (truncated zip, corrupted pickle record).
    """
    try:
        source: Any = io.BytesIO(data) if data is not None else path
        return torch.load(source, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: restore the file or load another checkpoint") from None
    except Exception as error:  # noqa: BLE001 - a damaged pickle raises anything (UnpicklingError, IndexError, EOFError, ...)
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{path} is not a readable torch checkpoint file ({type(error).__name__}: {reason[:200]}): it is damaged or of another "
            "kind. Restore it from a copy, or load another checkpoint"
        ) from None


def hash_file(path: Path, algorithm: str, what: str) -> tuple[int, str]:
    """``(size, "<algorithm>:<hex digest>")`` of the file at ``path``, hashed through a read-only memory map (no copy).

    Raises:
        CheckpointError: missing or unreadable, naming ``path`` and ``what`` it is.
    """
    hasher = new_hasher(algorithm)
    try:
        with open(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            if size:
                with mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                    hasher.update(memoryview(mapped))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint lacks its {what}. Restore the file, or load another checkpoint") from None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read ({error}): fix its permissions or load another checkpoint") from None
    return size, f"{algorithm}:{hasher.hexdigest()}"


def check_file(path: Path, record: dict[str, Any], what: str) -> None:
    """Compare the file at ``path`` with its recorded ``{"size", "hash"}`` in the metadata (see ``check_hash``).

    Raises:
        CheckpointError: missing, unreadable, another size or content hash.
    """
    size, digest = hash_file(path, str(record["hash"]).split(":", 1)[0], what)
    _compare(path, size, digest, record, "the metadata")


def torch_load_mapped(path: Path) -> Any:
    """``torch.load(weights_only=True, mmap=True)``: tensors read from the (already hashed, so cached) file on use.

    Raises:
        CheckpointError: see ``torch_load``.
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - the same file through the plain reader gives the named error
        return torch_load(None, path)
