"""How often a training mode reads the swarm's progress from the DHT: every read moves every
peer's record over this peer's uplink, so far from an epoch's end a young view is reused."""

from __future__ import annotations

import types

from dht.kademlia.clock import get_dht_time
from moshpit.training.modes.base import TrainingMode


class _Tracker:
    """The tracker's surface ``TrainingMode._view`` uses; counts the reads."""

    max_refresh_period = 5.0
    request_timeout = 1.0

    def __init__(self) -> None:
        self.reads = 0
        self.global_progress = self.view(age=1e6, eta=None)

    @staticmethod
    def view(age: float, eta: float | None) -> types.SimpleNamespace:
        return types.SimpleNamespace(time=get_dht_time() - age, eta_seconds=eta)

    def refresh(self, timeout: float | None = None) -> types.SimpleNamespace:
        self.reads += 1
        return self.global_progress


def _mode() -> tuple[TrainingMode, _Tracker]:
    tracker = _Tracker()
    mode = TrainingMode(types.SimpleNamespace(tracker=tracker))  # type: ignore[arg-type]
    return mode, tracker


def test_a_young_view_far_from_the_epochs_end_is_not_read_again():
    mode, tracker = _mode()
    # the tracker's loop read 1 s ago and the swarm needs 20 s more: a quarter of that (capped
    # at max_refresh_period, 5 s) has not passed, though refresh_period (0.5 s) has
    tracker.global_progress = tracker.view(age=1.0, eta=20.0)
    assert mode._view() is tracker.global_progress and tracker.reads == 0
    # the same age 1 s before the epoch's end: read (a quarter of 1 s passed long ago)
    tracker.global_progress = tracker.view(age=1.0, eta=1.0)
    mode._view()
    assert tracker.reads == 1
    # the cap: 30 s to go, a 6-s-old view is read again (max_refresh_period 5 s)
    mode._last_refresh = -float("inf")
    tracker.global_progress = tracker.view(age=6.0, eta=30.0)
    mode._view()
    assert tracker.reads == 2


def test_refresh_period_still_bounds_the_reads_and_force_always_reads():
    mode, tracker = _mode()
    mode._view()  # no estimate of the time left: read
    assert tracker.reads == 1
    mode._view()  # within refresh_period of the last read
    assert tracker.reads == 1
    tracker.global_progress = tracker.view(age=1.0, eta=20.0)
    mode._view(force=True)  # who a round must hold: always a new read
    mode._view(force=True)
    assert tracker.reads == 3
