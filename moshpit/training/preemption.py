"""Leaving cleanly on SIGTERM, the notice a cloud VM gets before it is preempted.

One line in a training script::

    with moshpit.handle_preemption(state_averager, tracker, dht, deadline=25.0):
        for batch in loader: ...

On SIGTERM the handler (running on the main thread, between two Python bytecodes of the
training loop) waits for the end of a moshpit critical section if one is running (a state
update must not be cut in half), then lets every component leave in order — finish or abandon
the current averaging round, write a checkpoint, withdraw DHT declarations, shut down — and
raises :class:`Preempted` (a ``SystemExit`` with code 0) so the script unwinds and exits 0. A
watchdog thread ends the process if leaving takes longer than ``deadline``: the VM would be
killed soon anyway, and a hung exit must not outlive the notice.

Without the handler SIGTERM keeps its default action (the process dies at once); the swarm
copes with that like with any crash: rounds time out on the dead peer and its DHT records
expire.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from typing import Any

from moshpit.critical import critical_section, defer, in_critical_section
from moshpit.training.errors import StateError

logger = logging.getLogger(__name__)

__all__ = ["PreemptionHandler", "Preempted", "critical_section", "handle_preemption"]

DEFAULT_DEADLINE = 25.0
WATCHDOG_EXIT_CODE = 3  # leaving took longer than the deadline


class Preempted(SystemExit):
    """Raised on the main thread after a graceful exit on SIGTERM: exit status 0, or 1 when
    a component could not leave cleanly (``failures``, e.g. the last checkpoint could not be
    written on a full disk; everything else still left)."""

    def __init__(self, signum: int = signal.SIGTERM, failures: tuple[str, ...] = ()) -> None:
        super().__init__(1 if failures else 0)
        self.signum = signum
        self.failures = failures


_active: PreemptionHandler | None = None
# Monitoring (moshpit.metrics adds one): called as ``observer("signal", handler, name)`` with
# the signal's name (e.g. "SIGTERM") when a handler receives the first one. Empty by default.
observers: list[Any] = []


class PreemptionHandler:
    """Installs the SIGTERM handler; see :func:`handle_preemption`."""

    def __init__(
        self,
        *components: Any,
        deadline: float = DEFAULT_DEADLINE,
        signals: tuple[int, ...] = (signal.SIGTERM,),
    ) -> None:
        if not deadline > 0:
            raise ValueError(f"deadline must be a positive number of seconds, got {deadline!r}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "handle_preemption() must be called on the main thread (Python delivers "
                "signals only there)"
            )
        self.components = components
        self.deadline = float(deadline)
        self.signals = signals
        self.requested_at: float | None = None
        self._previous: dict[int, Any] = {}
        self._leaving = False
        self._watchdog_cancelled = threading.Event()

    def install(self) -> PreemptionHandler:
        global _active
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if _active is self:
            _active = None

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.uninstall()

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.requested_at is not None:
            logger.warning("signal %d again: already leaving", signum)
            return
        self.requested_at = time.monotonic()
        self._signum = signum
        for observer in list(observers):
            try:
                observer("signal", self, signal.Signals(signum).name)
            except Exception:  # monitoring must never keep a peer from leaving
                logger.exception("preemption observer failed")
        logger.warning(
            "received %s: leaving the swarm within %.0f s (round, checkpoint, withdraw)",
            signal.Signals(signum).name,
            self.deadline,
        )
        self._start_watchdog()
        if in_critical_section():
            defer(self._leave_and_raise)  # runs when the outermost critical section ends
            return
        self._leave_and_raise()

    def _start_watchdog(self) -> None:
        deadline = self.deadline

        def watchdog() -> None:
            if self._watchdog_cancelled.wait(deadline):
                return
            logger.error(
                "leaving took longer than %.0f s: exiting now; where every thread was waiting "
                "follows (please report it)",
                deadline,
            )
            logging.shutdown()
            with contextlib.suppress(Exception):  # stderr may be closed: exit anyway
                faulthandler.dump_traceback(all_threads=True)
            os._exit(WATCHDOG_EXIT_CODE)

        threading.Thread(target=watchdog, name="moshpit-preemption-watchdog", daemon=True).start()

    def cancel_watchdog(self) -> None:
        """Keep the process alive past the deadline (for code that catches Preempted)."""
        self._watchdog_cancelled.set()

    def remaining(self) -> float:
        """Seconds left before the deadline (the whole deadline before any signal)."""
        if self.requested_at is None:
            return self.deadline
        return max(0.0, self.deadline - (time.monotonic() - self.requested_at))

    def _leave_and_raise(self) -> None:
        if self._leaving:
            return
        self._leaving = True
        failures: list[str] = []
        for component in self.components:
            # each component gets what is left of the deadline, minus a margin for the rest
            budget = max(0.5, self.remaining() - 1.0)
            try:
                _leave(component, budget)
            except (StateError, OSError) as e:  # an expected fault (a full disk): one line
                logger.error("%s", e)
                failures.append(str(e))
            except Exception as e:  # one component failing must not stop the others leaving
                logger.exception("while %r was leaving", component)
                failures.append(f"{type(e).__name__}: {e}")
        self.uninstall()
        if failures:  # each one was logged above: said once, not again here
            logger.warning(
                "left the swarm, but not cleanly (%d problem(s), above); exit status 1",
                len(failures),
            )
        else:
            logger.warning("left the swarm cleanly; exiting")
        raise Preempted(getattr(self, "_signum", signal.SIGTERM), tuple(failures))


def _leave(component: Any, budget: float) -> None:
    """Let one component leave: ``leave_swarm(deadline)``, else withdraw + shutdown."""
    if hasattr(component, "leave_swarm"):
        component.leave_swarm(budget)
        return
    if hasattr(component, "withdraw"):
        component.withdraw()
    if hasattr(component, "shutdown"):
        component.shutdown()
    elif callable(component):
        component()


def handle_preemption(
    *components: Any,
    deadline: float = DEFAULT_DEADLINE,
    signals: tuple[int, ...] = (signal.SIGTERM,),
) -> PreemptionHandler:
    """Leave the swarm cleanly on SIGTERM: see the module docstring.

    ``components`` leave in the order given (e.g. the ``TrainingStateAverager``, then the
    ``ProgressTracker``, then the ``DHT``). Works as a plain call (installs until the process
    ends) or as a ``with`` block (uninstalled at its end).
    """
    return PreemptionHandler(*components, deadline=deadline, signals=signals).install()
