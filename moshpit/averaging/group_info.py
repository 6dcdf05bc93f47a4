"""Who is in an all-reduce group, in which role, and how fast they are.

A :class:`GroupInfo` is built by the group leader (matchmaking) and sent to every member; all
members must hold the *same* value, because the partition of the flattened tensors into parts
(one per reducing member) is computed deterministically from it on every member.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moshpit.averaging.errors import AveragingError

if TYPE_CHECKING:  # dht.p2p is imported lazily so this module stays cheap to import
    from dht.p2p import PeerID

MODE_NODE = "node"  # contributes tensors and reduces a part
MODE_CLIENT = "client"  # contributes tensors, reduces nothing (cannot accept inbound streams)
MODE_AUX = "aux"  # reduces a part, contributes no tensors (weight 0)
MODES = (MODE_NODE, MODE_CLIENT, MODE_AUX)

MAX_GROUP_SIZE = 256
MAX_GROUP_ID_BYTES = 64
MAX_ADDRS_PER_MEMBER = 16
MAX_ADDR_CHARS = 256
MAX_BYTES_PER_VALUE = 16.0  # float64 with framing to spare; anything above is nonsense


def valid_rate(value: object) -> bool:
    """A finite positive number of bytes/s (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )


def valid_bytes_per_value(value: object) -> bool:
    """A finite number in (0, MAX_BYTES_PER_VALUE] (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and 0 < value <= MAX_BYTES_PER_VALUE
    )


class GroupInfoError(AveragingError, ValueError):
    """A GroupInfo (built locally or received from the network) is inconsistent."""


def _check_per_member(
    name: str, values: tuple[Any, ...], n: int, valid: Callable[[object], bool], rule: str
) -> None:
    """An optional per-member field: empty (nobody said), or one entry per member, each
    None (not known) or ``valid``."""
    if not values:
        return
    if len(values) != n:
        raise GroupInfoError(f"{name} must be empty or have one entry per member")
    for value in values:
        if value is not None and not valid(value):
            raise GroupInfoError(f"{rule}, got {value!r}")


@dataclass(frozen=True)
class GroupInfo:
    """The members of one all-reduce round, in the same order on every member.

    ``bandwidths[i]`` is member i's advertised bandwidth in bytes/s (``None`` = unknown); it
    decides part sizes, and the slowest adds to the round's time budget. ``gathered[i]`` is
    opaque msgpack-able metadata that member i sent the leader (passed through to the user,
    e.g. for progress tracking); empty or one per member.
    ``addrs[i]`` are multiaddr strings where member i can be dialed (empty, or one tuple per
    member): members found through different DHT lookups may not know each other's addresses,
    so the leader passes them along and the all-reduce adds them to the host's peerstore.
    ``bytes_per_value[i]`` is what member i's codec put on the wire per value in its last
    round (``None`` = not known yet; empty = nobody said); with the bandwidths it tells every
    member alike how long a round's transfers take, which decides the chunk size.
    ``measured_uplinks[i]`` is the send rate (bytes/s) member i reached in its recent rounds,
    shared by members that stated no bandwidth (``None`` = not known; empty = nobody said):
    a lower bound of its uplink that sizes the round's time allowance only, never its parts.
    """

    group_id: bytes
    members: tuple[PeerID, ...]
    modes: tuple[str, ...]
    bandwidths: tuple[float | None, ...]
    gathered: tuple[Any, ...] = ()
    addrs: tuple[tuple[str, ...], ...] = ()
    bytes_per_value: tuple[float | None, ...] = ()
    measured_uplinks: tuple[float | None, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, bytes) or not 0 < len(self.group_id) <= MAX_GROUP_ID_BYTES:
            raise GroupInfoError(f"group_id must be 1..{MAX_GROUP_ID_BYTES} bytes")
        n = len(self.members)
        if not 0 < n <= MAX_GROUP_SIZE:
            raise GroupInfoError(f"a group has 1..{MAX_GROUP_SIZE} members, got {n}")
        if len(set(self.members)) != n:
            raise GroupInfoError("group members must be distinct")
        if len(self.modes) != n or len(self.bandwidths) != n:
            raise GroupInfoError("members, modes and bandwidths must have the same length")
        if self.gathered and len(self.gathered) != n:
            raise GroupInfoError("gathered must be empty or have one entry per member")
        if self.addrs:
            if len(self.addrs) != n:
                raise GroupInfoError("addrs must be empty or have one entry per member")
            for member_addrs in self.addrs:
                if not isinstance(member_addrs, tuple) or len(member_addrs) > MAX_ADDRS_PER_MEMBER:
                    raise GroupInfoError(
                        f"each member has a tuple of <= {MAX_ADDRS_PER_MEMBER} addrs"
                    )
                if not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in member_addrs):
                    raise GroupInfoError(f"addrs must be strings of <= {MAX_ADDR_CHARS} chars")
        _check_per_member(
            "bytes_per_value", self.bytes_per_value, n, valid_bytes_per_value,
            f"bytes_per_value must be None or a number in (0, {MAX_BYTES_PER_VALUE}]",
        )  # fmt: skip
        _check_per_member(
            "measured_uplinks", self.measured_uplinks, n, valid_rate,
            "a measured uplink must be None or a finite positive number",
        )  # fmt: skip
        for mode in self.modes:
            if mode not in MODES:
                raise GroupInfoError(f"unknown member mode {mode!r}; expected one of {MODES}")
        for bw in self.bandwidths:
            if bw is not None and not valid_rate(bw):
                raise GroupInfoError(
                    f"bandwidth must be None or a finite positive number, got {bw!r}"
                )

    @property
    def size(self) -> int:
        return len(self.members)

    def index_of(self, peer: PeerID) -> int:
        """Position of ``peer`` in the group; raises GroupInfoError if it is not a member."""
        try:
            return self.members.index(peer)
        except ValueError:
            raise GroupInfoError(f"{peer} is not a member of this group") from None

    @property
    def reducer_indices(self) -> tuple[int, ...]:
        """Members that reduce a part (node and aux), in group order."""
        return tuple(i for i, m in enumerate(self.modes) if m != MODE_CLIENT)

    @property
    def sender_indices(self) -> tuple[int, ...]:
        """Members that contribute tensors (node and client), in group order."""
        return tuple(i for i, m in enumerate(self.modes) if m != MODE_AUX)

    # ---- wire form (the leader sends this to every member) ----

    def to_msg(self) -> dict[str, Any]:
        """A msgpack-ready dict; PeerIDs travel as their multihash bytes."""
        return {
            "gid": self.group_id,
            "members": [p.to_bytes() for p in self.members],
            "modes": list(self.modes),
            "bw": [None if b is None else float(b) for b in self.bandwidths],
            "gathered": list(self.gathered),
            "addrs": [list(a) for a in self.addrs],
            "bpv": [None if b is None else float(b) for b in self.bytes_per_value],
            "mbw": [None if b is None else float(b) for b in self.measured_uplinks],
        }

    @classmethod
    def from_msg(cls, msg: Any) -> GroupInfo:
        """Parse and validate an untrusted message produced by :meth:`to_msg`."""
        from dht.p2p import PeerID

        if not isinstance(msg, Mapping):
            raise GroupInfoError("group info must be a map")
        try:
            members_raw, modes, bws = msg["members"], msg["modes"], msg["bw"]
            gid, gathered, addrs = msg["gid"], msg.get("gathered", []), msg.get("addrs", [])
            bpvs, measured = msg.get("bpv", []), msg.get("mbw", [])
        except KeyError as e:
            raise GroupInfoError(f"group info lacks field {e.args[0]!r}") from None
        for name, value in (
            ("members", members_raw),
            ("modes", modes),
            ("bw", bws),
            ("bpv", bpvs),
            ("mbw", measured),
        ):
            if not isinstance(value, (list, tuple)) or len(value) > MAX_GROUP_SIZE:
                raise GroupInfoError(
                    f"group info field {name!r} must be a list of <= {MAX_GROUP_SIZE}"
                )
        if not isinstance(gathered, (list, tuple)):
            raise GroupInfoError("group info field 'gathered' must be a list")
        if not isinstance(addrs, (list, tuple)) or not all(
            isinstance(a, (list, tuple)) for a in addrs
        ):
            raise GroupInfoError("group info field 'addrs' must be a list of lists")
        if not all(isinstance(m, str) for m in modes):
            raise GroupInfoError("member modes must be strings")
        members = []
        for raw in members_raw:
            if not isinstance(raw, bytes):
                raise GroupInfoError("member PeerIDs must be bytes")
            try:
                members.append(PeerID.from_bytes(raw))
            except Exception as e:  # the PeerID parser's own error type, whatever it is
                raise GroupInfoError(f"invalid member PeerID: {e}") from e
        return cls(
            group_id=gid,
            members=tuple(members),
            modes=tuple(modes),
            bandwidths=tuple(bws),
            gathered=tuple(gathered),
            addrs=tuple(tuple(a) for a in addrs),
            bytes_per_value=tuple(bpvs),
            measured_uplinks=tuple(measured),
        )
