"""Writing generated modules to disk under a content hash, and loading them back checked."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import linecache
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from lightning_nnscaler.ir.errors import NnScalerError


class StaleCodeError(NnScalerError, RuntimeError):
    """A generated file does not match the hash recorded when it was generated."""


MANIFEST = "manifest.json"


def digest(text: str) -> str:
    """sha256 of a text, hex."""
    return hashlib.sha256(text.encode()).hexdigest()


def save_sources(directory: str | os.PathLike[str], plan_hash: str, sources: Sequence[str]) -> Path:
    """Write ``rank{r}.py`` files and a manifest under ``directory/<plan_hash>``; reuse it if it holds exactly these sources.

    Returns the plan's code directory. Files are written atomically (temp file + rename).

    Raises:
        StaleCodeError: the directory holds code that is not these sources (edited, or re-hashed).
    """
    root = Path(directory) / plan_hash
    manifest_path = root / MANIFEST
    if manifest_path.exists():
        check_manifest(root, sources)
        return root
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"plan": plan_hash, "files": {}}
    for rank, source in enumerate(sources):
        name = f"rank{rank}.py"
        _write_atomically(root / name, source)
        manifest["files"][name] = digest(source)
    _write_atomically(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return root


def check_manifest(root: Path, sources: Sequence[str]) -> dict:
    """Raise StaleCodeError unless every ``rank{r}.py`` under ``root`` is ``sources[r]``, as the manifest records.

    The check is against the plan's own sources, not only the manifest: a manifest re-hashed after an
    edit does not make the edited code this plan's.
    """
    manifest = json.loads((root / MANIFEST).read_text())
    expected = {f"rank{rank}.py": digest(source) for rank, source in enumerate(sources)}
    if manifest.get("files") != expected:
        changed = sorted(name for name in {*expected, *manifest.get("files", {})} if manifest.get("files", {}).get(name) != expected.get(name))
        raise StaleCodeError(
            f"{root / MANIFEST} does not record this plan's code ({', '.join(changed)} differ: edited and re-hashed, or another plan's); "
            f"delete {root} to regenerate it"
        )
    for name, wanted in expected.items():
        path = root / name
        if not path.exists() or digest(path.read_text()) != wanted:
            raise StaleCodeError(
                f"generated file {path} was edited or removed after generation (its hash is not this plan's code); "
                f"delete {root} to regenerate it"
            )
    return manifest


def load_rank_module(root: str | os.PathLike[str], rank: int, sources: Sequence[str]) -> ModuleType:
    """Import ``rank{rank}.py`` from a plan's code directory, after checking that it is ``sources[rank]``
    (the plan's own generated code: ``Plan.sources``)."""
    root = Path(root)
    if not 0 <= rank < len(sources):
        raise StaleCodeError(f"the plan has code for {len(sources)} ranks, not for rank {rank}")
    manifest = check_manifest(root, sources)
    name = f"rank{rank}.py"
    return module_from_source((root / name).read_text(), f"lnn_plan_{manifest['plan'][:12]}_rank{rank}")


def module_from_source(source: str, name: str) -> ModuleType:
    """Execute generated source as a fresh module (not added to sys.modules; its lines are in ``linecache``)."""
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    filename = f"<{name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # tracebacks show the op's line
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - our own generated code
    return module


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        handle.write(text)
        temporary = handle.name
    os.replace(temporary, path)
