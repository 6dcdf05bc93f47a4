"""The DHT's time source.

Expiration times are absolute ``dht_time()`` seconds (wall-clock by default, so that peers on
different machines agree). Simulations under ``trio.testing.MockClock`` need the DHT to follow
trio's virtual clock instead, so the source is a context variable: wrap the simulation in
``with dht_clock(trio_clock): ...`` (before opening nodes: trio tasks copy the context they
were spawned from) and every node, storage and lookup started inside reads virtual time.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import trio

DHTClock = Callable[[], float]

_clock: contextvars.ContextVar[DHTClock] = contextvars.ContextVar(
    "moshpit_dht_clock", default=time.time
)


def get_dht_time() -> float:
    """Current DHT time in seconds: wall clock, or the clock installed with :func:`dht_clock`."""
    return _clock.get()()


def trio_clock() -> float:
    """trio's (possibly virtual) clock; only valid inside ``trio.run``."""
    return trio.current_time()


@contextmanager
def dht_clock(clock: DHTClock) -> Iterator[None]:
    """Make :func:`get_dht_time` read ``clock`` in this context (and tasks spawned from it)."""
    token = _clock.set(clock)
    try:
        yield
    finally:
        _clock.reset(token)
