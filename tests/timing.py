"""Waits that stretch with the machine's load, instead of wall-clock constants.

A test that waits "30 s for the verdict" encodes how fast an idle machine is. Beside other
work (a user's laptop, a CI box running two test processes) the same steps take longer, and
the test fails although nothing is wrong. :func:`patience` scales a wait by how much of a core
this process gets right now (measured, not assumed): on an idle machine it is the wait itself.
"""

from __future__ import annotations

import time

MAX_STRETCH = 8.0  # a machine this starved fails the test: a hang must still end
_SAMPLE_SECONDS = 0.1
_REMEMBER_SECONDS = 10.0
_cached: tuple[float, float] | None = None  # (monotonic time measured, stretch)


def cpu_share(sample: float = _SAMPLE_SECONDS) -> float:
    """The fraction of one core a busy loop in this process gets now (0 < share <= 1)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    x = 0
    while time.perf_counter() - wall0 < sample:
        for _ in range(1000):
            x += 1
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return min(1.0, max(cpu / wall, 1e-3))


def stretch() -> float:
    """How much slower than an idle machine this one runs now: 1 / cpu_share, at most
    ``MAX_STRETCH`` (measured at most every 10 s)."""
    global _cached
    now = time.monotonic()
    if _cached is None or now - _cached[0] > _REMEMBER_SECONDS:
        _cached = (now, min(MAX_STRETCH, 1.0 / cpu_share()))
    return _cached[1]


def patience(seconds: float) -> float:
    """``seconds`` on an idle machine, longer on a busy one (see the module docstring)."""
    return seconds * stretch()
