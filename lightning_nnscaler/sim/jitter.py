"""Waiting for the latest of several noisy ranks: the expected maximum of normal arrival times (Clark, 1961).

On shared cores a rank's compute is not the same from step to step: the scheduler preempts it for the other
ranks' communication threads and the system's own work, so two ranks with the same work reach a collective
milliseconds apart, and the collective starts at the later of them. A deterministic simulation starts it at
the common arrival time, and a plan that synchronizes after long stretches of compute then runs longer than
predicted (the benchmark GPT's dp step here waits 2.4-3.3 ms per rank for its peer in its gradient
all-reduce, where its collective itself takes 4 ms).

The event engine (``sim.events``) keeps, per rank, the standard deviation of its clock: what it has when it
leaves a wait for other ranks (``Machine.meeting_jitter_seconds``: the ranks do not wake at once) plus
``Machine.compute_jitter`` × the compute it ran since (the noise of a stretch of compute is one slowdown,
not independent per op), and starts a collective at the expected maximum of its members' arrival times and
ends the step at the expected latest end (a receive only where ranks outnumber cores: see ``sim.events``).
Where one rank arrives well before the other, the expected maximum is the later arrival and the noise costs
nothing. Both figures are measured (``sim.in_step.arrival_spreads``): how far apart ranks with the same work
reach their collectives, against the compute each ran since it last met the others (the shipped ``cpu``
spec: 2 gloo ranks, each on a core of its own, 0.08 ms + 0.21 × the compute; 4 ranks on 2 cores, 1.36 ms +
0.23 ×).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import cache

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / _SQRT2))


def _pdf(x: float) -> float:
    return _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def later_of(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """The mean and standard deviation of ``max(A, B)`` for independent normal ``A`` and ``B`` given as
    ``(mean, standard deviation)`` (Clark's moments); the plain maximum when neither varies."""
    (mean_a, std_a), (mean_b, std_b) = a, b
    theta = math.hypot(std_a, std_b)
    if theta == 0.0:
        return (max(mean_a, mean_b), 0.0)
    alpha = (mean_a - mean_b) / theta
    p, density = _cdf(alpha), _pdf(alpha)
    mean = mean_a * p + mean_b * (1.0 - p) + theta * density
    second = (mean_a * mean_a + std_a * std_a) * p + (mean_b * mean_b + std_b * std_b) * (1.0 - p) + (mean_a + mean_b) * theta * density
    return (mean, math.sqrt(max(second - mean * mean, 0.0)))


def latest(arrivals: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``later_of`` folded over ``(mean, standard deviation)`` arrivals: the expected latest of them (Clark's
    approximation for more than two: the running maximum is taken as normal)."""
    result: tuple[float, float] | None = None
    for arrival in arrivals:
        result = arrival if result is None else later_of(result, arrival)
    if result is None:
        raise ValueError("latest() of no arrivals")
    return result


def chance_first(a: tuple[float, float], b: tuple[float, float]) -> float:
    """The probability that ``A`` comes before ``B`` (both ``(mean, standard deviation)``, independent normal)."""
    theta = math.hypot(a[1], b[1])
    if theta == 0.0:
        return 1.0 if a[0] < b[0] else 0.0
    return _cdf((b[0] - a[0]) / theta)


@cache
def expected_range(count: int) -> float:
    """The expected distance between the largest and smallest of ``count`` independent standard normal values
    (1.128 for two, 2.059 for four): how far apart ``count`` ranks with the same work arrive, in standard deviations."""
    if count < 2:
        return 0.0
    step, total, x = 1e-3, 0.0, -8.0
    while x < 8.0:
        p = _cdf(x)
        total += (1.0 - p**count - (1.0 - p) ** count) * step
        x += step
    return total
