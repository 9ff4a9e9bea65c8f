"""Processes by process group, read from ``/proc`` (Linux): the e2e tests start each script in its own
session, so every process it starts (Lightning's launcher re-runs the script per device) shares its group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def live_members(process_group: int) -> list[int]:
    """Pids of the group's processes that have not exited (zombies, already exited, are left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # exited while we looked
            continue
        state, _parent, group = text[text.rindex(")") + 2 :].split()[:3]  # the name, in parentheses, may hold spaces
        if int(group) == process_group and state != "Z":
            members.append(int(stat.parent.name))
    return members


def wait_until_gone(process_group: int, timeout: float) -> float:
    """Wait until no process of the group is left; returns ``time.time()`` then.

    Raises:
        TimeoutError: listing the pids still alive after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while members := live_members(process_group):
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {members} of group {process_group} still alive after {timeout} s")
        time.sleep(0.1)
    return time.time()


def kill_group(process_group: int) -> None:
    """SIGKILL every process left in the group (nothing happens when none is left)."""
    try:
        os.killpg(process_group, signal.SIGKILL)
    except ProcessLookupError:
        pass
