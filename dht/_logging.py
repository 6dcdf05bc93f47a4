"""Rate-limited logging: one record per message category and interval, with a count.

A flood of network abuse (thousands of refused connections a second) must not turn into
thousands of log lines: that fills disks, hides everything else, and costs the CPU the node
needs to keep serving. ``RateLimitedLogger`` logs the first record of a category at once,
swallows repeats for ``interval`` seconds, and then reports how many it swallowed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_INTERVAL = 10.0
DEFAULT_MAX_KEYS = 256


@dataclass
class _Window:
    started: float
    level: int
    suppressed: int = 0
    last_msg: str = ""
    last_args: tuple[Any, ...] = field(default_factory=tuple)


class RateLimitedLogger:
    """Log at most one record per ``key`` per ``interval`` seconds, counting the rest.

    The first record of a key is logged as is and opens a window. Records of the same key
    inside the window are counted, not logged. The next record after the window ends is
    logged with ``(N more like this in the last Xs)`` appended and opens a new window;
    ``flush()`` reports windows that ended with a count but without a later record (call it
    periodically, and once at shutdown with ``force=True``). At most ``max_keys`` windows are
    kept; the oldest one is reported and dropped to make room, so memory stays bounded even
    if callers use unbounded keys.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = DEFAULT_INTERVAL,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = DEFAULT_MAX_KEYS,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        if max_keys < 1:
            raise ValueError(f"max_keys must be at least 1, got {max_keys}")
        self.logger = logger
        self.interval = interval
        self.max_keys = max_keys
        self._clock = clock
        self._windows: dict[Hashable, _Window] = {}

    def log(self, level: int, key: Hashable, msg: str, *args: Any, **kwargs: Any) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval`` ago.

        Returns True if a record was emitted. ``kwargs`` (``exc_info`` ...) go to the logger
        with emitted records only.
        """
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        window = self._windows.get(key)
        if window is not None and now - window.started < self.interval:
            window.suppressed += 1
            window.last_msg, window.last_args = msg, args
            return False
        suppressed = window.suppressed if window is not None else 0
        if window is not None:
            del self._windows[key]  # re-inserted below: dict order stays oldest-first
        elif len(self._windows) >= self.max_keys:
            self._evict_oldest(now)
        self._windows[key] = _Window(started=now, level=level)
        if suppressed:
            assert window is not None
            msg = f"{msg} (%d more like this in the last %.1fs)"
            args = (*args, suppressed, now - window.started)
        self.logger.log(level, msg, *args, **kwargs)
        return True

    def warning(self, key: Hashable, msg: str, *args: Any, **kwargs: Any) -> bool:
        return self.log(logging.WARNING, key, msg, *args, **kwargs)

    def info(self, key: Hashable, msg: str, *args: Any, **kwargs: Any) -> bool:
        return self.log(logging.INFO, key, msg, *args, **kwargs)

    def suppressed(self, key: Hashable) -> int:
        """Records of ``key`` swallowed in its current window (0 if none is open)."""
        window = self._windows.get(key)
        return window.suppressed if window is not None else 0

    def __len__(self) -> int:
        return len(self._windows)

    def flush(self, *, force: bool = False) -> int:
        """Report the counts of windows that ended (every window with ``force``) and forget
        them. Returns the number of records emitted."""
        now = self._clock()
        emitted = 0
        for key, window in list(self._windows.items()):
            if not force and now - window.started < self.interval:
                continue
            del self._windows[key]
            if window.suppressed:
                self._report(window, now)
                emitted += 1
        return emitted

    def _evict_oldest(self, now: float) -> None:
        key = next(iter(self._windows))
        window = self._windows.pop(key)
        if window.suppressed:
            self._report(window, now)

    def _report(self, window: _Window, now: float) -> None:
        self.logger.log(
            window.level,
            "%d more like this in the last %.1fs; the last one: " + window.last_msg,
            window.suppressed,
            max(now - window.started, 0.0),
            *window.last_args,
        )


__all__ = ["RateLimitedLogger"]
