"""Where a sharded checkpoint's files lie, and the commit that switches ``path`` to a new save in one atomic step.

Why a pointer file: a directory cannot be replaced by another in one POSIX step (``rename`` over a
non-empty directory fails), so renaming the old checkpoint away and the new one in leaves an
instant with nothing at ``path`` (a kill there loses both to hidden names). Instead ``path`` is a
stable directory; each save is a subdirectory, and the small file ``CURRENT`` names the one that
is the checkpoint. The switch is ``os.replace`` of ``CURRENT``: atomic, so at every instant
``path`` holds either the old save or the new one, both complete. ``path`` stays one name, so
``trainer.fit(ckpt_path=path)``, ``lightning-nnscaler ckpt merge path`` and ModelCheckpoint's
``remove_checkpoint`` (``rm -r path``) work unchanged::

    last.ckpt/
        CURRENT                 {"format", "version", "save": token, "metadata_hash"}: the switch
        save-<token>/           the checkpoint: metadata.json, common.pt, rank00000-of-00002.pt, ...
        .partial-<token>/       a save being written (or interrupted): never loaded
        .replaced-<token>/      an earlier save being removed
        README.txt              for people and other tools: what this directory is, how to load or merge it
        .lock                   held by the job saving into ``path`` (``target``): one saving job at a time

``CURRENT`` records the hash of ``metadata.json``, which records the size and content hash of every
other file, and every rank file and ``common.pt`` records the save's token: so an edited, truncated
or swapped file is refused. Leftovers of an interrupted save are removed by the next successful
save to ``path`` and listed by ``leftovers`` (``ckpt info``). Only names of this layout
(``own_name``, ``own_file_in_save``) are ever removed: a file someone else put inside ``path`` stays,
and ``target`` refuses to save over it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from lightning_nnscaler.checkpoint.integrity import CheckpointError, check_hash, hash_bytes, read_bytes

FORMAT = "lightning-nnscaler-sharded"
VERSION = 2
METADATA = "metadata.json"
COMMON = "common.pt"
POINTER = "CURRENT"
SAVE_RECORD = "lightning_nnscaler_save"  # the key of the save's record in common.pt
README = "README.txt"
LOCK = ".lock"

# Names this layout writes: directly in ``path`` (besides POINTER, README, LOCK) and inside a save's directory.
_SAVE_ENTRY = re.compile(r"(?:save|\.partial|\.replaced)-\w+|\.CURRENT\.tmp|\.README\.txt\.tmp")
_SAVE_FILE = r"(?:metadata\.json|common\.pt|rank\d+-of-\d+\.pt)"
_FILE_IN_SAVE = re.compile(rf"{_SAVE_FILE}|\.{_SAVE_FILE}\.tmp")  # a file, or its temporary (``write_hashed``)


def own_name(name: str) -> bool:
    """True for a name this layout writes directly inside a checkpoint directory."""
    return name in (POINTER, README, LOCK) or _SAVE_ENTRY.fullmatch(name) is not None


def own_file_in_save(name: str) -> bool:
    """True for a name this layout writes inside a save's directory (``save-``, ``.partial-``, ``.replaced-<token>``)."""
    return _FILE_IN_SAVE.fullmatch(name) is not None


def rank_file_name(rank: int, world_size: int) -> str:
    """``rank00003-of-00008.pt``."""
    return f"rank{rank:05d}-of-{world_size:05d}.pt"


def required_files(world_size: int) -> list[str]:
    """Every file a save of ``world_size`` ranks must hold, besides ``metadata.json``."""
    return [COMMON, *(rank_file_name(rank, world_size) for rank in range(world_size))]


def partial_directory(path: str | os.PathLike, token: str) -> Path:
    """The directory inside ``path`` that save ``token`` is written into before its commit."""
    return Path(path) / f".partial-{token}"


def save_directory(path: str | os.PathLike, token: str) -> Path:
    """The directory of committed save ``token`` inside ``path``."""
    return Path(path) / f"save-{token}"


def token_of(partial: Path) -> str:
    """The save token in a ``.partial-<token>`` directory's name."""
    return partial.name.rsplit("-", 1)[-1]


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True for a directory (finished or not) rather than a plain checkpoint file."""
    return Path(path).is_dir()


README_TEXT = """\
This directory is a lightning-nnscaler sharded checkpoint ({format} v{version}), not a checkpoint
file: torch.load, LightningModule.load_from_checkpoint and Trainer(strategy="auto") cannot read it
(they raise IsADirectoryError).

Resume or load it with the nnscaler strategy (under any recipe and number of devices):
    Trainer(strategy="nnscaler", ...).fit(model, ckpt_path={name!r})

Or merge it into one plain Lightning checkpoint file, which loads with any strategy
(run this in the directory that holds {name}):
    lightning-nnscaler ckpt merge {name_arg} {merged_arg}

In Python:
    lightning_nnscaler.checkpoint.load({name!r})  # the plain checkpoint dict
    MyModule.load_from_checkpoint(lightning_nnscaler.checkpoint.open_merged({name!r}))

CURRENT names the save (save-<token>/) that is the checkpoint. Every load checks each file's
content hash (`lightning-nnscaler ckpt info --verify {name_arg}` does too): do not edit them.
Keep other files out of this directory: a save refuses to replace a checkpoint that holds them.
"""


def merge_hint(path: str | os.PathLike) -> str:
    """How to read the sharded checkpoint at ``path`` where a plain checkpoint file is expected."""
    path = Path(path)
    merged = path.with_name(f"{path.stem}-merged.ckpt")
    return (
        f"{path} is a lightning-nnscaler sharded checkpoint (a directory; see its {README}): load it with strategy=\"nnscaler\", "
        f"or merge it into one plain Lightning checkpoint file that loads with any strategy: "
        f"lightning-nnscaler ckpt merge {shlex.quote(str(path))} {shlex.quote(str(merged))}"
    )


def write_readme(path: str | os.PathLike) -> None:
    """Write ``README.txt`` into ``path`` (unless it is there already): what the directory is and how to load or
    merge it, for whoever opens it with something else than lightning-nnscaler (``torch.load`` and
    ``strategy="auto"`` raise IsADirectoryError on a directory, and offer no hook to say more)."""
    path = Path(path)
    name, merged = path.name, f"{Path(path.name).stem}-merged.ckpt"
    text = README_TEXT.format(format=FORMAT, version=VERSION, name=name, name_arg=shlex.quote(name), merged_arg=shlex.quote(merged))
    readme = path / README
    try:
        if readme.read_text() == text:
            return
    except (OSError, UnicodeDecodeError):
        pass
    os.replace(_write_temporary(readme, text), readme)


def enclosing_checkpoint(path: str | os.PathLike) -> Path | None:
    """The sharded checkpoint directory that the file ``path`` lies in (directly, or in one of its saves), if any."""
    for directory in list(Path(path).absolute().parents)[:2]:
        if (directory / POINTER).is_file():
            return directory
    return None


def foreign_entries(path: str | os.PathLike) -> list[str]:
    """Names inside the directory ``path`` that this layout did not write, sorted: in ``path`` itself (``notes.txt``)
    and inside each save's directory (``save-<token>/notes.txt``). A symbolic link is foreign. Entries that vanish
    while they are listed (a concurrent save removing its own) are skipped."""
    foreign = []
    for entry in _entries(Path(path)):
        if not own_name(entry.name) or entry.is_symlink():
            foreign.append(entry.name)
        elif _SAVE_ENTRY.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            foreign += [f"{entry.name}/{inner.name}" for inner in _entries(Path(entry.path))
                        if not own_file_in_save(inner.name) or not inner.is_file(follow_symlinks=False)]
    return sorted(foreign)


def _entries(directory: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except FileNotFoundError:
        return []


def _after_step(step: str) -> None:
    """Called after each file-system step of ``commit`` (tests inject a failure here)."""


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_temporary(path: Path, text: str) -> Path:
    """``text`` in ``.<name>.tmp`` next to ``path``, flushed to disk; returns that temporary path."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    return temporary


def commit(partial: Path, path: str | os.PathLike, metadata: dict[str, Any], files: dict[str, dict[str, Any]] | None = None) -> None:
    """Write ``metadata.json`` into the finished ``partial`` directory and make it the checkpoint at ``path`` (rank 0 only).

    Args:
        files: Each file's ``{"size", "hash"}`` as its writer reported it; None hashes the files in ``partial``.

    Raises:
        CheckpointError: a file the world size requires is missing (nothing at ``path`` changes).
    """
    path = Path(path)
    token = token_of(partial)
    if files is None:
        files = {child.name: {"size": child.stat().st_size, "hash": hash_bytes(child.read_bytes())}
                 for child in partial.iterdir() if not child.name.startswith(".") and child.name != METADATA}
    missing = [name for name in required_files(metadata["world_size"]) if name not in files or not (partial / name).is_file()]
    if missing:
        raise CheckpointError(f"cannot commit {path}: {partial} lacks {', '.join(missing)} (a rank did not write its file); the earlier checkpoint is kept")
    _after_step("commit started")
    metadata = {"format": FORMAT, "version": VERSION, **metadata, "save": {**metadata.get("save", {}), "token": token}, "files": files}
    text = json.dumps(metadata, indent=1, sort_keys=True)
    os.replace(_write_temporary(partial / METADATA, text), partial / METADATA)
    _after_step("metadata written")
    _fsync_directory(partial)
    _after_step("partial synced")
    target = save_directory(path, token)
    os.replace(partial, target)
    _after_step("partial renamed")
    _fsync_directory(path)
    _after_step("directory synced")
    earlier = _current_token(path)
    pointer = {"format": FORMAT, "version": VERSION, "save": token, "metadata_size": len(text.encode()), "metadata_hash": hash_bytes(text.encode())}
    temporary = _write_temporary(path / POINTER, json.dumps(pointer, sort_keys=True))
    _after_step("pointer written")
    os.replace(temporary, path / POINTER)  # the switch: one atomic step
    _after_step("pointer switched")
    _fsync_directory(path)
    _after_step("pointer synced")
    if earlier is not None and earlier != token and save_directory(path, earlier).is_dir():
        replaced = path / f".replaced-{earlier}"
        os.replace(save_directory(path, earlier), replaced)
        _after_step("earlier renamed")
        shutil.rmtree(replaced)
        _after_step("earlier removed")
    remove_leftovers(path)


def _current_token(path: Path) -> str | None:
    """The token ``CURRENT`` names, or None when there is none (or it is unreadable)."""
    try:
        return json.loads((path / POINTER).read_text())["save"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def leftovers(path: str | os.PathLike) -> list[str]:
    """Names inside ``path`` that this layout wrote and are not part of its current save: interrupted or replaced
    saves, temporary files (never a name it does not write: see ``foreign_entries``)."""
    path = Path(path)
    if not path.is_dir():
        return []
    current = _current_token(path)
    keep = {POINTER, README, LOCK} | ({f"save-{current}"} if current else set())
    return sorted(child.name for child in path.iterdir() if own_name(child.name) and child.name not in keep)


def remove_leftovers(path: str | os.PathLike) -> list[str]:
    """Remove ``leftovers(path)`` (after a successful save: nothing else writes to ``path`` then); returns their names."""
    names = leftovers(path)
    for name in names:
        child = Path(path) / name
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
    return names


def current_save(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The directory of the save ``path`` holds and its checked metadata (files not yet read).

    Raises:
        CheckpointError: no such path, no finished save, an unreadable or edited ``CURRENT`` or ``metadata.json``,
            another format, or a file the world size requires missing from the metadata.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: check the path (a sharded checkpoint is a directory, e.g. epoch=0-step=10.ckpt)")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a lightning-nnscaler sharded checkpoint directory: load it as a plain checkpoint")
    pointer_path = path / POINTER
    if not pointer_path.exists():
        if (path / METADATA).exists():
            raise CheckpointError(
                f"{path} is a lightning-nnscaler checkpoint of format v1 (no content hashes, no {POINTER}): this version reads v{VERSION}. "
                "Load it with the lightning-nnscaler that wrote it and save it again"
            )
        found = sorted(child.name for child in path.iterdir())[:5]
        raise CheckpointError(
            f"{path} has no {POINTER}: it is not a finished lightning-nnscaler checkpoint (a save that was interrupted before its "
            f"commit leaves none; found {', '.join(found) or 'nothing'}). Load an earlier checkpoint; the next save to this path removes the leftovers"
        )
    pointer = _read_json(pointer_path, "the pointer to the current save")
    if not isinstance(pointer, dict) or pointer.get("format") != FORMAT or pointer.get("version") != VERSION or "save" not in pointer:
        raise CheckpointError(f"{pointer_path} is not a lightning-nnscaler v{VERSION} pointer ({str(pointer)[:120]}): the checkpoint is damaged; load another")
    directory = save_directory(path, pointer["save"])
    metadata_path = directory / METADATA
    data = read_bytes(metadata_path, "metadata (the save's directory is gone or damaged)")
    check_hash(metadata_path, data, {"size": pointer.get("metadata_size"), "hash": pointer.get("metadata_hash")}, source=str(pointer_path))
    metadata = _parse_json(data, metadata_path)
    _check_metadata(metadata, metadata_path, pointer["save"])
    return directory, metadata


def _read_json(path: Path, what: str) -> Any:
    return _parse_json(read_bytes(path, what), path)


def _parse_json(data: bytes, path: Path) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): the checkpoint is damaged; restore the file or load another checkpoint") from None


def _check_metadata(metadata: Any, metadata_path: Path, token: str) -> None:
    """Format, save token and completeness: every file the world size requires is listed."""
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        found = (metadata.get("format"), metadata.get("version")) if isinstance(metadata, dict) else type(metadata).__name__
        raise CheckpointError(f"{metadata_path} is {found}; expected {FORMAT!r} v{VERSION}: load it with the lightning-nnscaler that wrote it")
    if metadata.get("save", {}).get("token") != token:
        raise CheckpointError(f"{metadata_path} is of save {metadata.get('save', {}).get('token')!r}, but {POINTER} names save {token!r}: the checkpoint is damaged")
    world_size = metadata.get("world_size")
    if not isinstance(world_size, int) or world_size < 1:
        raise CheckpointError(f"{metadata_path} has world size {world_size!r}: the metadata is damaged; load another checkpoint")
    missing = [name for name in required_files(world_size) if name not in metadata.get("files", {})]
    if missing:
        raise CheckpointError(
            f"{metadata_path} lists no {', '.join(missing)}, which a save of world size {world_size} requires: the checkpoint is "
            "incomplete; load another checkpoint"
        )
