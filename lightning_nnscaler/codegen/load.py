"""Writing generated modules to disk under a content hash, and loading them back checked."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import linecache
import os
import tempfile
from pathlib import Path
from types import ModuleType


class StaleCodeError(RuntimeError):
    """A generated file does not match the hash recorded when it was generated."""


MANIFEST = "manifest.json"


def digest(text: str) -> str:
    """sha256 of a text, hex."""
    return hashlib.sha256(text.encode()).hexdigest()


def save_sources(directory: str | os.PathLike[str], plan_hash: str, sources: list[str]) -> Path:
    """Write ``rank{r}.py`` files and a manifest under ``directory/<plan_hash>``; reuse it if present.

    Returns the plan's code directory. Files are written atomically (temp file + rename).
    """
    root = Path(directory) / plan_hash
    manifest_path = root / MANIFEST
    if manifest_path.exists():
        check_manifest(root)
        return root
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"plan": plan_hash, "files": {}}
    for rank, source in enumerate(sources):
        name = f"rank{rank}.py"
        _write_atomically(root / name, source)
        manifest["files"][name] = digest(source)
    _write_atomically(manifest_path, json.dumps(manifest, indent=2, sort_keys=True))
    return root


def check_manifest(root: Path) -> dict:
    """Raise StaleCodeError if any generated file was changed after generation."""
    manifest = json.loads((root / MANIFEST).read_text())
    for name, expected in manifest["files"].items():
        path = root / name
        if not path.exists() or digest(path.read_text()) != expected:
            raise StaleCodeError(
                f"generated file {path} was edited or removed after generation (its hash does not match {MANIFEST}); "
                f"delete {root} to regenerate it"
            )
    return manifest


def load_rank_module(root: str | os.PathLike[str], rank: int) -> ModuleType:
    """Import ``rank{rank}.py`` from a plan's code directory after checking its hash."""
    root = Path(root)
    manifest = check_manifest(root)
    name = f"rank{rank}.py"
    if name not in manifest["files"]:
        raise StaleCodeError(f"{root} has no code for rank {rank}; the plan was generated for {len(manifest['files'])} ranks")
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
