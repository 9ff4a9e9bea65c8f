"""A rank that dies mid-training fails the whole run, fast, and leaves no process behind.

The script runs as a user's would (``strategy="nnscaler"``, ``devices=2``: Lightning's script launcher
re-runs it for rank 1), in its own session so that every process it starts can be found and killed.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from process_groups import kill_group, live_members, wait_until_gone

SCRIPT = Path(__file__).with_name("strategy_scripts.py")
COLLECTIVE_TIMEOUT_S = 30  # NnScalerStrategy(timeout=...): the longest a rank may wait for a dead peer
EXIT_WITHIN_S = 60


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_training_fails_the_run_within_a_minute(tmp_path: Path) -> None:
    death_file = tmp_path / "rank1_died_at"
    log = tmp_path / "run.log"
    with open(log, "w") as output:
        run = subprocess.Popen(
            [sys.executable, str(SCRIPT), "rank_dies", str(COLLECTIVE_TIMEOUT_S), str(death_file)],
            cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        return_code = run.wait(timeout=240)
        all_exited_at = wait_until_gone(run.pid, timeout=EXIT_WITHIN_S)
    finally:
        kill_group(run.pid)
    text = log.read_text()
    assert death_file.exists(), f"rank 1 never reached the step it dies at:\n{text[-3000:]}"
    assert return_code != 0, text[-3000:]
    seconds_to_exit = all_exited_at - float(death_file.read_text())
    assert 0 < seconds_to_exit < EXIT_WITHIN_S, text[-3000:]
    assert live_members(run.pid) == []
    # Rank 0 failed on the dead peer (gloo's connection reset or the collective timeout, in the generated
    # step's communication or in a Lightning collective), or the launcher's observer killed it on seeing rank 1 die.
    failed_on_peer = re.search(r"CommunicationError: rank 0: .* failed or did not complete|DistBackendError|Connection reset", text)
    assert failed_on_peer or return_code == -signal.SIGKILL, text[-3000:]
    print(f"every process exited {seconds_to_exit:.1f} s after rank 1 died; rank 0's exit code {return_code}")


@pytest.mark.timeout(300)
def test_a_rank_that_raises_is_named_with_its_error_in_the_last_lines(tmp_path: Path) -> None:
    return_code, text = run_script(tmp_path, "rank_raises", str(COLLECTIVE_TIMEOUT_S))
    last_lines = "\n".join(text.splitlines()[-10:])
    assert return_code != 0, text[-3000:]
    # Rank 0, the launching process, fails last: on the collective rank 1 left, naming rank 1 and its error.
    assert re.search(r"PeerRankFailed: rank 0 stopped: waiting for rank 1, which failed: ValueError: boom from rank 1 \(in RaiseAtStep", last_lines), text[-3000:]
    assert text.count("ValueError: boom from rank 1") == 2, text  # rank 1's own traceback, and rank 0's last line


@pytest.mark.timeout(300)
def test_a_rank_killed_after_the_last_step_makes_the_run_fail(tmp_path: Path) -> None:
    return_code, text = run_script(tmp_path, "rank_killed_at_the_end", str(COLLECTIVE_TIMEOUT_S))
    assert return_code != 0, text[-3000:]
    # Rank 0 names the dead rank as its script ends, or the launcher's observer killed rank 0 on seeing it die first.
    named = re.search(r"ChildRankFailed: local rank 1 \(pid \d+\) was killed by SIGKILL", text)
    assert named or return_code == -signal.SIGKILL, text[-3000:]


def run_script(tmp_path: Path, *arguments: str) -> tuple[int, str]:
    """``strategy_scripts.py ARGUMENTS`` in its own session: its exit status and output, once every process it started is gone."""
    log = tmp_path / "run.log"
    with open(log, "w") as output:
        run = subprocess.Popen([sys.executable, str(SCRIPT), *arguments], cwd=tmp_path, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return_code = run.wait(timeout=240)
        wait_until_gone(run.pid, timeout=EXIT_WITHIN_S)
    finally:
        kill_group(run.pid)
    return return_code, log.read_text()
