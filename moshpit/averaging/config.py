"""An averager's knobs in one validated value: ``AveragerConfig``.

The training layer builds several averagers per run (one per outer epoch, the state's, the
gradients'), each from the options the user gave the Optimizer once. Keeping them in a frozen
dataclass that checks itself on construction means a typo or a negative timeout fails where the
user wrote it, with the option's name, instead of in a background round minutes later; and a
layer that needs a variation (no codec for the state, a wider matchmaking window) says so with
``dataclasses.replace`` rather than by editing a dict.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DEFAULT_MIN_MATCHMAKING_TIME",
    "DEFAULT_REQUEST_TIMEOUT",
    "AveragerConfig",
    "check_integer",
    "check_seconds",
    "default_matchmaking_timeout",
]

DEFAULT_MIN_MATCHMAKING_TIME = 5.0
DEFAULT_REQUEST_TIMEOUT = 3.0


def default_matchmaking_timeout(min_matchmaking_time: float, request_timeout: float) -> float:
    """How long a step looks for a group unless told otherwise: long enough for a leader
    to wait ``min_matchmaking_time`` and then hear from its members."""
    return max(2 * min_matchmaking_time, min_matchmaking_time + request_timeout)


def check_seconds(name: str, value: Any, *, positive: bool, optional: bool = False) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is a finite number of seconds (> 0 if
    ``positive``; None passes if ``optional``). The knobs' dataclasses share it."""
    if optional and value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a finite"
        raise ValueError(f"{name} must be {kind} number of seconds, got {value!r}")


def check_integer(name: str, value: Any, *, minimum: int) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AveragerConfig:
    """Everything about an :class:`~moshpit.Averager` except its tensors, DHT, prefix and
    group size; the fields are the keyword arguments ``Averager`` documents, with the same
    defaults. ``Averager(..., config=c)`` and ``Averager(..., request_timeout=2.0)`` are the
    same thing; ``Optimizer(averager_options=...)`` takes either this or a dict of the same
    names."""

    min_group_size: int = 2
    min_matchmaking_time: float = DEFAULT_MIN_MATCHMAKING_TIME
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    allreduce_timeout: float = 60.0
    compression: Any = None  # a compression codec or TwoWayCompression
    bandwidth: float | None = None  # bytes/s of this peer's uplink
    client_mode: bool = False
    auxiliary: bool = False
    initial_group_bits: str | None = None
    matchmaking_timeout: float | None = None
    expected_num_peers: int | None = None
    sender_timeout: float | None = None
    reducer_timeout: float | None = None
    ban_after_failures: int = 2
    ban_seconds: float = 60.0
    pace_uplink: bool = True
    aggregation: Any = None  # a name of aggregation.AGGREGATIONS or an Aggregator

    def __post_init__(self) -> None:
        if self.client_mode and self.auxiliary:
            raise ValueError("a peer cannot be both client_mode and auxiliary")
        check_integer("min_group_size", self.min_group_size, minimum=1)
        check_seconds("min_matchmaking_time", self.min_matchmaking_time, positive=False)
        for name in ("request_timeout", "allreduce_timeout", "ban_seconds"):
            check_seconds(name, getattr(self, name), positive=True)
        for name in ("matchmaking_timeout", "sender_timeout", "reducer_timeout"):
            check_seconds(name, getattr(self, name), positive=True, optional=True)
        bandwidth = self.bandwidth
        if bandwidth is not None and (
            isinstance(bandwidth, bool)
            or not isinstance(bandwidth, (int, float))
            or not (math.isfinite(bandwidth) and bandwidth > 0)
        ):
            raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
        if self.expected_num_peers is not None:
            check_integer("expected_num_peers", self.expected_num_peers, minimum=1)
        check_integer("ban_after_failures", self.ban_after_failures, minimum=1)
        bits = self.initial_group_bits
        if bits is not None and (not isinstance(bits, str) or set(bits) - {"0", "1"}):
            raise ValueError(f"initial_group_bits must be a string of 0s and 1s, got {bits!r}")

    @property
    def effective_matchmaking_timeout(self) -> float:
        """The matchmaking window a step gets: the one set, or the default for the timings."""
        if self.matchmaking_timeout is not None:
            return float(self.matchmaking_timeout)
        return default_matchmaking_timeout(self.min_matchmaking_time, self.request_timeout)

    @classmethod
    def build(
        cls, base: AveragerConfig | Mapping[str, Any] | None = None, **options: Any
    ) -> AveragerConfig:
        """``base`` (a config, a dict of field names, or nothing) with ``options`` on top.
        An unknown name is a ``TypeError`` that lists the known ones (a typo must not pass
        silently as a default)."""
        if base is None:
            base = cls()
        elif isinstance(base, Mapping):
            options = {**base, **options}
            base = cls()
        elif not isinstance(base, cls):
            raise TypeError(
                f"averager options must be an AveragerConfig or a dict, got {type(base).__name__}"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"unknown averager option(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        return dataclasses.replace(base, **options) if options else base
