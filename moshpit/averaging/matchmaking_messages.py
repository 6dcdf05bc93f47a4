"""What matchmaking peers say to each other, and strict validation of all of it they receive.

Two kinds of message (see ``matchmaking.py`` for the protocol they make up): the declaration
a peer stores in the DHT under its group key (:class:`Declaration`), and the messages of a
join stream (:class:`JoinRequest`, then the leader's replies). Everything here is pure: no
sockets, no DHT, no trio; what comes from another peer is checked before it is used, and a
malformed message raises :class:`MatchmakingError` with a reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moshpit.averaging.errors import AveragingError
from moshpit.averaging.group_info import (
    MAX_ADDR_CHARS,
    MAX_ADDRS_PER_MEMBER,
    MAX_BYTES_PER_VALUE,
    MAX_GROUP_SIZE,
    MODES,
    GroupInfo,
    valid_bytes_per_value,
    valid_rate,
)

if TYPE_CHECKING:
    from dht.p2p.identity import PeerID

MATCHMAKING_PROTOCOL = "/moshpit/matchmaking/1.0.0"
MAX_REQUEST_BYTES = 256 * 1024  # join request incl. gathered metadata
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a GroupInfo with everyone's gathered metadata
MAX_GATHER_BYTES = 64 * 1024
MAX_KEY_CHARS = 512
MAX_ADDRS = MAX_ADDRS_PER_MEMBER
MAX_DEADLINE_SECONDS = 24 * 3600.0
# a leader tells each accepted follower (that asked for it) "still here" this often, at most;
# a follower that hears nothing for 3 intervals (at least its request timeout) stops waiting.
# Over a stalled link (a VM paused or powered off, a cable pulled) nothing else arrives, not
# even a close, and the followers of such a leader waited for its group until their deadline
HEARTBEAT_SECONDS = 1.0
MAX_HEARTBEAT_SECONDS = 60.0
# a withdrawn declaration expires this long after the declaration it replaces (the later
# expiration is what makes it win over the declaration in every replica and reader); the
# next declaration under the same key must expire later still (see Matchmaker._search)
WITHDRAWN_EXTRA_SECONDS = 0.01
MAX_SCHEMA_BYTES = 64  # a tensor-schema hash (the averager sends 16 bytes)
MAX_WHY_CHARS = 512  # a reject reason we keep from another peer
RETRY = "retry"  # outcome of a join attempt worth repeating later in the round
BUSY_NOW = "busy now"  # the candidate was asking a leader itself: ask again at the next poll
# what one join attempt ends with: a group, RETRY or BUSY_NOW, a redirect (peer, its
# addresses) or None
JoinOutcome = GroupInfo | tuple["PeerID", tuple[str, ...]] | str | None
BUSY = "busy: asking another leader, retry shortly"
SCHEMA_MISMATCH = "tensor schema mismatch"  # prefix of the reject reason for other tensors


class MatchmakingError(AveragingError):
    """A matchmaking message from another peer was malformed."""


def check_finite(x: Any, name: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise MatchmakingError(f"{name} must be a finite number, got {type(x).__name__}")
    if not lo <= x <= hi:
        raise MatchmakingError(f"{name}={x} out of range [{lo}, {hi}]")
    return float(x)


def check_schema(x: Any) -> bytes | None:
    if x is None:
        return None
    if not isinstance(x, bytes) or not 0 < len(x) <= MAX_SCHEMA_BYTES:
        raise MatchmakingError(f"schema must be 1..{MAX_SCHEMA_BYTES} bytes")
    return x


def check_addrs(x: Any) -> tuple[str, ...]:
    if not isinstance(x, (list, tuple)) or len(x) > MAX_ADDRS:
        raise MatchmakingError(f"addrs must be a list of at most {MAX_ADDRS} strings")
    if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in x):
        raise MatchmakingError("addrs must be short strings")
    return tuple(x)


@dataclass(frozen=True)
class Declaration:
    """One peer's "I am looking for a group" record read from the DHT."""

    peer: PeerID
    order: float
    addrs: tuple[str, ...]
    mode: str
    schema: bytes | None = None  # hash of the declarer's tensor shapes (None: not declared)
    # False: withdrawn, its round's group formed; kept until it expires so that it
    # supersedes the declaration (and still counts for the swarm-size estimate)
    looking: bool = True

    @classmethod
    def from_value(cls, peer: PeerID, value: Any) -> Declaration:
        """The declaration ``peer`` stored (its DHT subkey names it): ``{"x": order,
        "a": addrs, "m": mode[, "s": schema][, "w": True]}`` (``w``: withdrawn)."""
        if not isinstance(value, Mapping) or value.get("m") not in MODES:
            raise MatchmakingError("declaration must be a map with a valid mode")
        withdrawn = value.get("w", False)
        if not isinstance(withdrawn, bool):
            raise MatchmakingError("declaration's 'w' must be a bool")
        return cls(
            peer,
            check_finite(value.get("x"), "order"),
            check_addrs(value.get("a", [])),
            value["m"],
            check_schema(value.get("s")),
            looking=not withdrawn,
        )


@dataclass(frozen=True)
class JoinRequest:
    """A validated request to join a leader's group."""

    key: str
    order: float
    seconds_left: float
    mode: str
    bandwidth: float | None
    gathered: Any
    size: int
    addrs: tuple[str, ...] = ()
    schema: bytes | None = None
    bytes_per_value: float | None = None
    heartbeats: bool = False  # the joiner understands "wait" messages while it follows
    measured_uplink: float | None = None  # bytes/s its recent rounds sent (no stated bandwidth)
    min_group_size: int = 1  # the smallest group it (or a member it brings) may run in

    def to_msg(self, prefix: str) -> dict[str, Any]:
        msg = {
            "prefix": prefix,
            "key": self.key,
            "x": self.order,
            "dl": self.seconds_left,
            "m": self.mode,
            "bw": self.bandwidth,
            "g": self.gathered,
            "n": self.size,
            "a": list(self.addrs),
        }
        if self.schema is not None:
            msg["s"] = self.schema
        if self.bytes_per_value is not None:
            msg["bpv"] = self.bytes_per_value
        if self.heartbeats:
            msg["hb"] = True
        if self.measured_uplink is not None:
            msg["mbw"] = self.measured_uplink
        if self.min_group_size > 1:
            msg["min"] = self.min_group_size
        return msg

    @classmethod
    def from_msg(cls, msg: Mapping[str, Any]) -> JoinRequest:
        try:
            key, mode, bw, size = msg["key"], msg["m"], msg.get("bw"), msg.get("n", 1)
            order = check_finite(msg["x"], "order")
            seconds_left = check_finite(msg["dl"], "deadline", 0.0, MAX_DEADLINE_SECONDS)
        except KeyError as e:
            raise MatchmakingError(f"join request lacks field {e.args[0]!r}") from None
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS:
            raise MatchmakingError("join request key must be a short string")
        if mode not in MODES:
            raise MatchmakingError(f"unknown mode {mode!r}")
        if bw is not None:
            bw = check_finite(bw, "bandwidth", 0.0)
            if bw <= 0:
                raise MatchmakingError("bandwidth must be positive")
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_GROUP_SIZE:
            raise MatchmakingError(f"group size must be an int in 1..{MAX_GROUP_SIZE}")
        bpv = msg.get("bpv")
        if bpv is not None and not valid_bytes_per_value(bpv):
            raise MatchmakingError(
                f"bytes per value must be a number in (0, {MAX_BYTES_PER_VALUE}]"
            )
        heartbeats = msg.get("hb", False)
        if not isinstance(heartbeats, bool):
            raise MatchmakingError("'hb' must be a bool")
        measured = msg.get("mbw")
        if measured is not None and not valid_rate(measured):
            raise MatchmakingError("a measured uplink must be a finite positive number of bytes/s")
        minimum = msg.get("min", 1)
        if isinstance(minimum, bool) or not isinstance(minimum, int):
            raise MatchmakingError("'min' (the smallest group the joiner runs in) must be an int")
        if not 1 <= minimum <= MAX_GROUP_SIZE:
            raise MatchmakingError(f"'min' must be in 1..{MAX_GROUP_SIZE}, not {minimum}")
        return cls(
            key,
            order,
            seconds_left,
            mode,
            bw,
            msg.get("g"),
            size,
            check_addrs(msg.get("a", [])),
            check_schema(msg.get("s")),
            None if bpv is None else float(bpv),
            heartbeats,
            None if measured is None else float(measured),
            minimum,
        )


def packed_size(obj: Any) -> int:
    """Bytes of ``obj`` as msgpack (over the gather limit if it cannot be packed)."""
    import msgpack

    try:
        return len(msgpack.packb(obj, use_bin_type=True))
    except (TypeError, ValueError, OverflowError):
        return MAX_GATHER_BYTES + 1
