"""Run a function just after another package is imported.

``import lightning_nnscaler`` imports neither torch nor Lightning (the command line's ``--help`` and
``recipes`` start in a fraction of a second), yet the strategies must be registered with Lightning's
``StrategyRegistry`` once Lightning has built it: ``call_after_import``.

This works through one finder at the front of ``sys.meta_path``. For a watched name it asks the other
finders for the module's spec and wraps its loader, so the function runs once the module's own code
has finished (the original loader is put back on the module first). Each function runs once; the
finder answers nothing for names it does not watch.

An "after" function may itself import modules of a package that is being imported at that moment
(``lightning_nnscaler.plan`` imports Lightning, and registering the strategies imports
``lightning_nnscaler.plan``: it would find the module half-executed). ``outside_of=package``
makes it wait until the outermost import of that package's modules in progress has finished; the
finder counts those imports (per thread) by wrapping their loaders while such a function is pending.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

Hook = Callable[[], None]


class _WatchedLoader(importlib.abc.Loader):
    """The loader of a watched module: the module's own loader, and the finder told when it starts and ends."""

    def __init__(self, loader: importlib.abc.Loader, finder: _ImportHookFinder, name: str) -> None:
        self._loader = loader
        self._finder = finder
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        packages = self._finder.entered(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            self._finder.left(packages)
        self._finder.executed(self._name, packages)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_source, ... of the real loader
        return getattr(self._loader, name)


@dataclass
class _After:
    hook: Hook
    outside_of: str | None


class _ImportHookFinder(importlib.abc.MetaPathFinder):
    """The finder behind ``call_after_import``."""

    def __init__(self) -> None:
        self.after: dict[str, list[_After]] = {}
        self.waiting: dict[str, list[Hook]] = {}  # package -> hooks waiting for its outermost import to end
        self._lock = threading.RLock()
        self._depth = threading.local()  # package -> how many of its modules this thread is executing

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.after and not self._counted_packages(fullname):
            return None
        spec = self._spec_from_the_other_finders(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _WatchedLoader(spec.loader, self, fullname)
        return spec

    def entered(self, fullname: str) -> list[str]:
        """Count the start of executing ``fullname``; returns the packages it counts for."""
        packages = self._counted_packages(fullname)
        for package in packages:
            setattr(self._depth, package, getattr(self._depth, package, 0) + 1)
        return packages

    def left(self, packages: list[str]) -> None:
        for package in packages:
            setattr(self._depth, package, getattr(self._depth, package) - 1)

    def executed(self, fullname: str, packages: list[str]) -> None:
        """Run the hooks due now that ``fullname`` has been executed."""
        with self._lock:
            after = self.after.pop(fullname, [])
        for entry in after:
            if entry.outside_of is not None and getattr(self._depth, entry.outside_of, 0):
                with self._lock:
                    self.waiting.setdefault(entry.outside_of, []).append(entry.hook)
            else:
                entry.hook()
        for package in packages:
            if not getattr(self._depth, package, 0):
                with self._lock:
                    waiting = self.waiting.pop(package, [])
                for hook in waiting:
                    hook()

    def _counted_packages(self, fullname: str) -> list[str]:
        """The packages whose imports in progress some pending hook waits for, that ``fullname`` belongs to."""
        with self._lock:
            packages = {entry.outside_of for entries in self.after.values() for entry in entries} | set(self.waiting)
        return [package for package in packages if package is not None and (fullname == package or fullname.startswith(package + "."))]

    def _spec_from_the_other_finders(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


_FINDER = _ImportHookFinder()


def _installed_finder() -> _ImportHookFinder:
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    return _FINDER


def call_after_import(fullname: str, hook: Hook, *, outside_of: str | None = None) -> None:
    """Run ``hook()`` once, as soon as module ``fullname`` has been imported: now, when it already is.

    With ``outside_of`` (a package), when ``fullname`` is imported while modules of that package are
    being imported, ``hook()`` runs once the outermost of those imports has finished instead.
    """
    if fullname in sys.modules:
        hook()
    else:
        _installed_finder().after.setdefault(fullname, []).append(_After(hook, outside_of))
