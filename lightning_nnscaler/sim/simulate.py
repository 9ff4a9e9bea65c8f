"""Discrete-event simulation of every rank's task list (``sim.tasks``): step time, busy / communication /
idle per rank, bubble, and the activation peak over the schedule.

Each rank has one compute stream and a communication stream per group (NCCL's stream per communicator).
A rank runs its list in order:
``Compute`` holds the compute stream; ``Send`` posts and goes on (the message occupies the
sender→receiver channel for its transfer time, and arrives a latency later); ``Recv`` waits for the
message; a collective starts when its last member has reached it and every member's stream for that
group is free, and lasts what ``CommunicationModel.collective_seconds`` says. Ranks that share a
node's CPU cores (``Machine.cores_per_node``) share them as processor sharing: with ``k`` ranks
computing on ``c`` cores, each runs at ``min(1, c / k)`` of its speed (a GPU rank has a device of
its own: ``cores_per_node`` None). On shared cores a rank's compute also varies from step to step, and
ranks that meet wait for the latest of them: the event engine starts what several ranks wait for at their
expected latest arrival (``sim.jitter``; ``Machine.compute_jitter``, ``Machine.meeting_jitter_seconds``).

Two engines give the same times where both apply: without shared cores, list scheduling
(``replay.ListRun``: each rank runs as far as it can, a blocked rank sleeps on the one message or
collective it waits for — no global clock, a few microseconds per task); with shared cores, an event
heap in time order (``events.EventRun``), since a rank's speed then depends on what the others do.

Times a rank spends: *busy* in compute; *communication* blocked in a receive or collective once its
peers are there (the transfer); *idle* the rest of the step (waiting for a peer, or after its list
ended). Bubble fraction: ``1 - busy / (ranks × step)``, as ``schedules.metrics.bubble_fraction``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_nnscaler.ir.validate import DeadlockError
from lightning_nnscaler.sim.events import EventRun
from lightning_nnscaler.sim.replay import ListRun
from lightning_nnscaler.sim.results import CommunicationModel, Machine, RankStats, SimResult, Span
from lightning_nnscaler.sim.tasks import Task

__all__ = ["CommunicationModel", "DeadlockError", "Machine", "RankStats", "SimResult", "Span", "simulate"]


def simulate(
    lists: Sequence[Sequence[Task]], comm: CommunicationModel, machine: Machine = Machine(), *, record: bool = False,
) -> SimResult:
    """Run every rank's ``lists[rank]`` as soon as its order, its peers and the streams allow.

    Linear in the number of tasks (see the module docstring for the two engines).

    Raises:
        DeadlockError: naming each stuck rank's task when the lists cannot finish.
    """
    run = (ListRun if machine.cores_per_node is None else EventRun)(lists, comm, machine, record)
    run.go()
    stuck = [rank for rank in range(run.world) if run.cursor[rank] < len(lists[rank])]
    if stuck:
        raise DeadlockError("deadlock: " + "; ".join(f"rank {rank} stuck at task {run.cursor[rank]} {lists[rank][run.cursor[rank]]}" for rank in stuck[:8]))
    step = max((stats.end for stats in run.stats), default=0.0)
    if isinstance(run, EventRun) and run.noisy and run.world:
        step = max(step, run.expected_end())  # the slowest rank's end, the ranks' noise counted (sim.jitter)
    for rank, stats in enumerate(run.stats):
        stats.idle = max(0.0, step - stats.busy - stats.communication)
        if record and step > stats.end:
            run.spans[rank].append(Span("idle", stats.end, step))
    return SimResult(step, run.stats, run.spans if record else [])


