"""Critical sections and CriticalLock: what a SIGTERM handler may and may not interrupt."""

from __future__ import annotations

import threading

import pytest

from moshpit.critical import CriticalLock, critical_section, defer, in_critical_section


def test_deferred_action_runs_when_the_outermost_section_ends():
    ran = []
    with critical_section():
        with critical_section():
            defer(lambda: ran.append("left"))
        assert ran == []  # an inner section ended: still inside the outer one
    assert ran == ["left"]
    assert not in_critical_section()


def test_a_held_critical_lock_is_a_section_and_release_runs_the_deferred_action():
    lock = CriticalLock()
    ran = []
    with lock:
        assert in_critical_section() and lock.locked()
        defer(lambda: ran.append("left"))
        assert ran == []
    assert ran == ["left"] and not lock.locked() and not in_critical_section()


def test_the_deferred_action_may_raise_out_of_the_release():
    lock = CriticalLock()

    def leave() -> None:
        raise SystemExit(0)

    with pytest.raises(SystemExit):
        with lock:
            defer(leave)
    assert not lock.locked() and not in_critical_section()


def test_failed_non_blocking_acquire_leaves_no_section_open():
    lock = CriticalLock()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(10)
    assert lock.acquire(blocking=False) is False
    assert lock.acquire(timeout=0.01) is False
    assert not in_critical_section()
    release.set()
    thread.join(10)


def test_a_worker_thread_never_runs_the_main_threads_deferred_action():
    """Signal handlers run on the main thread only; their deferred work must run there too."""
    ran = []
    lock = CriticalLock()
    with critical_section():
        defer(lambda: ran.append(threading.current_thread().name))

        def worker() -> None:
            with lock:
                pass

        thread = threading.Thread(target=worker, name="worker")
        thread.start()
        thread.join(10)
        assert ran == []
    assert ran == [threading.main_thread().name]
