"""Critical sections: code on the training thread that a SIGTERM must not interrupt.

Python runs a signal handler on the main thread between two bytecodes, wherever that thread
is. moshpit's preemption handler leaves the swarm from there, and leaving takes locks the
training thread also takes (the progress tracker's, the averager's tensors). Had the signal
landed while the training thread held one of them, leaving would wait on its own thread
forever. So a handler that finds the main thread inside a critical section only
:func:`defer`\\ s its work, which runs when the outermost section ends; and every lock the
training thread takes is a :class:`CriticalLock`, which holds a section while held.

Handing work to the DHT's loop is one more such place (trio holds a lock there that other
threads need): this module installs :func:`critical_section` as the DHT facade's
``handoff_section``.

This module sits below ``moshpit.averaging`` and ``moshpit.training`` so both can use it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dht.facade

__all__ = ["CriticalLock", "critical_section", "defer", "in_critical_section"]

_local = threading.local()
_deferred: Callable[[], None] | None = None


def in_critical_section() -> bool:
    """True if the calling thread is inside a critical section."""
    return getattr(_local, "depth", 0) > 0


def defer(action: Callable[[], None]) -> None:
    """Run ``action`` on the main thread when its outermost critical section ends."""
    global _deferred
    _deferred = action


def _enter() -> None:
    _local.depth = getattr(_local, "depth", 0) + 1


def _exit() -> None:
    global _deferred
    _local.depth -= 1
    if _local.depth == 0 and _deferred is not None and _is_main_thread():
        action, _deferred = _deferred, None
        action()  # may raise (the preemption handler raises Preempted)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def critical_section() -> Iterator[None]:
    """Code that must not be cut in half by a preemption (e.g. applying a state update).

    A SIGTERM arriving inside is handled right after the outermost section ends.
    """
    _enter()
    try:
        yield
    finally:
        _exit()


dht.facade.handoff_section = critical_section


class CriticalLock:
    """A ``threading.Lock`` whose holder is in a critical section for as long as it holds it.

    The section starts before the lock is taken and ends after it is released, so there is
    no bytecode at which the lock is held outside a section.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        _enter()
        try:
            acquired = self._lock.acquire(blocking, timeout)
        except BaseException:
            _exit()
            raise
        if not acquired:
            _exit()
        return acquired

    def release(self) -> None:
        self._lock.release()
        _exit()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()
