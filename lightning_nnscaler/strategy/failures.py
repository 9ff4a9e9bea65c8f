"""Errors across ranks under Lightning's script launcher (see ``runtime.failures`` for the reports).

``ReportingScriptLauncher`` runs each rank's ``trainer.fit`` through ``run_reporting``: a rank's own
error is published to the others, and a rank whose collective then fails raises ``PeerRankFailed``
naming the first failing rank and its error. Rank 0, the launching process, exits last, so its
output ends with that line. Lightning's child-process watcher would SIGKILL rank 0 within 5 s of a
child's failure, maybe before it reports; this launcher's watcher gives rank 0 ``REPORT_GRACE_S``
seconds first.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _set_num_threads_if_needed

from lightning_nnscaler.runtime.failures import PeerRankFailed, report_failure

REPORT_GRACE_S = 10.0  # rank 0's time to report a child's failure before the watcher kills it


def run_reporting(rank: Callable[[], int], function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)``; an exception goes through ``report_failure``: a communication failure
    after another rank's reported error is raised as ``PeerRankFailed`` alone (its message names the
    communication error in one line; the gloo traceback would only bury the failing rank's error)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        reported = report_failure(rank(), error)
        if reported is error:
            raise
        raise reported from None


class _GracefulChildObserver(_ChildProcessObserver):
    """Lightning's watcher of the script launcher's children, but rank 0 gets ``REPORT_GRACE_S`` seconds
    to fail on its own (and report the child's error) before everything is killed."""

    def _terminate_all(self) -> None:
        time.sleep(REPORT_GRACE_S)  # rank 0 normally exits in this time; this daemon thread with it
        super()._terminate_all()


class ReportingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (the script re-run per device) whose ranks report failures across ranks."""

    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        """As Lightning's ``launch``, with ``run_reporting`` around ``function`` and a watcher that gives
        rank 0 time to report a child's failure."""
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _GracefulChildObserver(child_processes=self.procs, main_pid=os.getpid()).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return run_reporting(self.cluster_environment.global_rank, function, *args, **kwargs)


__all__ = ["PeerRankFailed", "ReportingScriptLauncher", "run_reporting"]
