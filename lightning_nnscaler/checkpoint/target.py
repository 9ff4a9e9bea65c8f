"""Who may save a sharded checkpoint at a path: never over what the format did not write, one saving job at a time.

A save refuses, before it writes or removes anything, a path that is a file or a directory holding
anything this format did not write (``layout.foreign_entries``): a user's directory keeps every file,
and so does a checkpoint someone put a file into. A directory of ours, or an empty one, is replaced
as Lightning replaces a checkpoint file of the same name. A file is refused, not replaced as
``strategy="auto"`` would: the save would delete what it did not write (any file a user names), and a
file cannot be swapped for a directory in one atomic step (a crash in between would leave neither).

One job at a time: the saving job's rank 0 holds ``fcntl.flock`` on ``path/.lock`` from before the
first write until after the commit (``claim``); a second job's save is refused at once, by name,
before it writes anything. The other ranks of the job write under rank 0's claim (they learn of it
from the save's first collective). The kernel releases the lock when its process dies, so a crashed
save blocks nothing; the file is removed when the save ends (a crashed save's file is reused).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lightning_nnscaler.checkpoint.integrity import CheckpointError
from lightning_nnscaler.checkpoint.layout import LOCK, POINTER, foreign_entries

_NO_LOCKS = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)  # e.g. Lustre mounted without -o flock: save unlocked, as before
_ATTEMPTS = 20  # a lock file removed by the save that held it, between our open and our flock: open the new one


def check_target(path: str | os.PathLike) -> None:
    """Refuse to save at ``path`` if the save would replace or delete anything this format did not write.

    Raises:
        CheckpointError: ``path`` is a file (or not a directory), or a directory holding foreign files (the first named).
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not path.is_dir():  # a link to a directory is that directory, as a link to a file is that file for strategy="auto"
        kind = "a symbolic link to no directory" if path.is_symlink() else "a file"
        raise CheckpointError(
            f"cannot save a sharded checkpoint at {path}: it is {kind} (e.g. a plain checkpoint another strategy saved), and a "
            "save never replaces what lightning-nnscaler did not write. Save under another path, or remove it first if you no longer need it"
        )
    foreign = foreign_entries(path)
    if not foreign:
        return
    more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
    if (path / POINTER).is_file():
        raise CheckpointError(
            f"cannot save at {path}: it is a lightning-nnscaler sharded checkpoint, but it holds {foreign[0]}{more}, which "
            f"lightning-nnscaler did not write; replacing the checkpoint would delete it. Move it out of {path}, or save under another path"
        )
    raise CheckpointError(
        f"cannot save a sharded checkpoint at {path}: it is an existing directory that is not a lightning-nnscaler checkpoint "
        f"(it holds {foreign[0]}{more}), and a save never deletes what it did not write. Save under another path (a new name, "
        f"e.g. {path / 'model.ckpt'}), or remove the directory first if you no longer need it"
    )


@contextmanager
def claim(path: str | os.PathLike) -> Iterator[None]:
    """Hold ``path`` for one save (its rank 0 only): check it (``check_target``), create it, take its lock, check it again.

    On exit the lock file is removed, and ``path`` too if this claim created it and it is empty (a failed first save).

    Raises:
        CheckpointError: see ``check_target``; or another process is saving to ``path``.
    """
    path = Path(path)
    check_target(path)  # before writing anything, even the lock file
    created = not os.path.lexists(path)
    descriptor = _lock(path)
    try:
        check_target(path)  # under the lock: no other save changes it now
        yield
    finally:
        _unlock(path, descriptor, created)


def _lock(path: Path) -> int:
    """A descriptor of ``path/.lock`` holding an exclusive ``flock`` (``path`` created if need be).

    Raises:
        CheckpointError: another process holds the lock.
    """
    lock_path = path / LOCK
    for _ in range(_ATTEMPTS):
        path.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # ``path`` removed in between (a failed first save's cleanup): create it again
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise CheckpointError(
                f"another process is saving to {path} ({holder}): two saves to one path would destroy each other. Save each run "
                "under its own path (e.g. its own ModelCheckpoint dirpath), or wait for that save to end and save again"
            ) from None
        except OSError as error:
            if error.errno not in _NO_LOCKS:
                os.close(descriptor)
                raise
            warnings.warn(
                f"the filesystem of {path} does not support file locks ({error.strerror}): saving without the lock that refuses a "
                "second job saving to the same path (e.g. mount Lustre with -o flock to have it)", stacklevel=2,
            )
            return descriptor
        if _is_current(descriptor, lock_path):
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"pid {os.getpid()} on {socket.gethostname()}".encode())
            return descriptor
        os.close(descriptor)  # its holder removed it when its save ended: lock the new one
    raise CheckpointError(f"could not take the lock {lock_path} in {_ATTEMPTS} attempts (other saves keep replacing it): save again")


def _is_current(descriptor: int, lock_path: Path) -> bool:
    """True if the locked file is still the one at ``lock_path`` (not removed or replaced after we opened it)."""
    try:
        found = os.stat(lock_path)
    except FileNotFoundError:
        return False
    mine = os.fstat(descriptor)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


def _holder(descriptor: int) -> str:
    """Who holds the lock, as its file says (best effort)."""
    try:
        return os.pread(descriptor, 200, 0).decode(errors="replace").strip() or "holder unknown"
    except OSError:
        return "holder unknown"


def _unlock(path: Path, descriptor: int, created: bool) -> None:
    """Remove the lock file while holding it (a waiter that opened it retries on a new one), release it, and
    remove ``path`` if this claim created it and nothing else is in it."""
    try:
        os.unlink(path / LOCK)
    except FileNotFoundError:  # ``path`` was removed meanwhile (e.g. ``rm -r``)
        pass
    os.close(descriptor)
    if created:
        try:
            os.rmdir(path)
        except OSError:  # not empty: the save committed, or left what the next save removes
            pass
