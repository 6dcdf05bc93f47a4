"""Signal handling the demo commands share."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["sigint_ignored"]


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C inside the block, on the main thread (where Python delivers signals): the
    demos' shutdown must finish stopping their peers even if the user presses it again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
