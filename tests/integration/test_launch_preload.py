"""``launch(..., preload=...)`` forks ranks from a server that imported the modules once; they still get
the caller's environment and working directory as they are at the call (as spawned ranks do), although
the server was started earlier. (tests/integration/test_faults.py launches spawned ranks.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.ranks import launch_ranks

from workers import where_am_i  # noqa: E402 - tests/integration is on sys.path


@pytest.mark.timeout(120)
def test_forked_ranks_see_the_callers_environment_and_directory_at_the_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launch_ranks(where_am_i, 2, "LNN_LAUNCH_PROBE", timeout=100)  # the server is running before the variable is set
    monkeypatch.setenv("LNN_LAUNCH_PROBE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert launch_ranks(where_am_i, 2, "LNN_LAUNCH_PROBE", timeout=100) == [(str(tmp_path), str(tmp_path), True)] * 2
