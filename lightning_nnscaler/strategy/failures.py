"""Errors across ranks under Lightning's script launcher (see ``runtime.failures`` for the reports).

``ReportingScriptLauncher`` runs each rank's ``trainer.fit`` through ``run_reporting``: a rank's own
error is published to the others, and a rank whose collective then fails raises ``PeerRankFailed``
naming the first failing rank and its error. Rank 0, the launching process, exits last, so its
output ends with that line. Lightning's child-process watcher would SIGKILL rank 0 within 5 s of a
child's failure, maybe before it reports; this launcher's watcher gives rank 0 ``REPORT_GRACE_S``
seconds first. When rank 0's script ends, it waits (up to ``CHILD_EXIT_WAIT_S``) for the other ranks of
its node to end and exits with status 1, naming them, when one ended with an error or by a signal (the
kernel's OOM killer's SIGKILL, after the last collective), so that such a run never exits 0.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _set_num_threads_if_needed

from lightning_nnscaler.runtime.failures import PeerRankFailed, report_failure

REPORT_GRACE_S = 10.0  # rank 0's time to report a child's failure before the watcher kills it
CHILD_EXIT_WAIT_S = 60.0  # how long rank 0, done, waits for the other ranks of its node to end


def failed_children(procs: list[subprocess.Popen], timeout: float = CHILD_EXIT_WAIT_S) -> list[str]:
    """Wait for the launched ranks ``procs`` (local ranks 1, 2, ...) to end; each that exited non-zero or by a
    signal, and how."""
    deadline = time.monotonic() + timeout
    failed = []
    for local_rank, process in enumerate(procs, start=1):
        try:
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue  # still ending; nothing known against it
        if code < 0:
            failed.append(f"local rank {local_rank} (pid {process.pid}) was killed by {signal.Signals(-code).name}")
        elif code > 0:
            failed.append(f"local rank {local_rank} (pid {process.pid}) exited with status {code}")
    return failed


def exit_non_zero_if_a_child_failed(procs: list[subprocess.Popen]) -> None:
    """At the end of rank 0's script (``atexit``): exit with status 1, naming them, if other ranks of this node failed."""
    failed = failed_children(procs)
    if failed:
        hint = " (a SIGKILL is often the kernel's out-of-memory killer: see `dmesg`)" if any("SIGKILL" in line for line in failed) else ""
        print(
            f"ChildRankFailed: {'; '.join(failed)}{hint}; this run's results may be incomplete",
            file=sys.stderr, flush=True,
        )
        sys.stdout.flush()
        os._exit(1)


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
            atexit.register(exit_non_zero_if_a_child_failed, self.procs)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return run_reporting(self.cluster_environment.global_rank, function, *args, **kwargs)


__all__ = ["PeerRankFailed", "ReportingScriptLauncher", "exit_non_zero_if_a_child_failed", "failed_children", "run_reporting"]
