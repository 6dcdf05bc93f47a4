"""Moshpit group keys: which DHT key a peer declares itself under for the next round.

A key is ``{prefix}.0b{bits}``. The bits are the peer's last ``d - 1`` grid coordinates (``b``
bits each, ``b = ceil(log2(target_group_size))``); peers that share all of them form a group.
After a round every member shifts in a new coordinate (its position in a permutation of the
group seeded by the group ID, hence distinct within the group) and drops the oldest one, so
former groupmates are spread over different groups for the next ``d - 1`` rounds. On a full
grid (``N = M**d`` peers, groups of ``M``) every peer then holds the exact mean after ``d``
rounds (the Moshpit All-Reduce paper, Ryabinin et al., 2021).

Without ``expected_num_peers`` (and without ``initial_group_bits``) the key length adapts
(:class:`GroupKeyManager` ``adaptive``): every round the averager reports how many distinct
peers it saw declared under its key; ``count * M**(d-1)`` estimates the swarm size (peers are
spread over ``M**(d-1)`` keys), and when the median of recent estimates leaves the band around
``M**d`` the grid gains or loses a dimension. A default swarm of 64 with ``M = 4`` starts with
one shared key and moves to a 4x4x4 grid (4 bits) after two rounds. Pure logic: no I/O, no torch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import re
import statistics
from collections import deque
from collections.abc import Sequence

__all__ = [
    "GroupKeyManager",
    "coordinate_bits",
    "default_num_bits",
    "group_position",
    "make_group_key",
    "parse_group_key",
]

logger = logging.getLogger(__name__)

_BITS_RE = re.compile(r"^[01]*\Z")  # \Z, not $: "$" also matches before a final newline
MAX_GROUP_BITS = 64  # 2**64 groups is far beyond any swarm; bounds key length
ESTIMATE_WINDOW = 5  # swarm-size estimates (one per round) the median is taken over
MIN_ESTIMATES = 2  # estimates needed before the grid first changes
# hysteresis, in grid dimensions: with d dimensions, grow once log_M(N) > d + margin and shrink
# once log_M(N) < d - margin, to round(log_M(N)); 0.75 keeps a noisy estimate of N = M**d
# (e.g. 64 peers, M = 4) from flapping between d and d + 1, and leaves swarms up to M**1.75
# (11 peers for M = 4) on one shared key, where random groups of M average them fine
DIMENSION_MARGIN = 0.75
# rounds between two looks at the grid one dimension longer (GroupKeyManager.longer_key):
# a split heals within this many rounds, and the other rounds cost no extra DHT read
PROBE_EVERY = 4


def coordinate_bits(target_group_size: int) -> int:
    """Bits needed to write a position in a group of ``target_group_size`` (at least 1)."""
    if target_group_size < 1:
        raise ValueError(f"target_group_size must be >= 1, got {target_group_size}")
    return max(1, math.ceil(math.log2(target_group_size)))


def default_num_bits(target_group_size: int, expected_num_peers: int | None = None) -> int:
    """Number of key bits for a swarm of about ``expected_num_peers`` peers.

    A grid with ``M = target_group_size`` peers per side needs ``d = ceil(log_M(N))``
    dimensions; the key holds the other ``d - 1`` coordinates. Without an estimate we use
    0 bits: every peer declares under the same key and groups of up to ``M`` form at random
    each round. That is what small swarms need (with more bits than the swarm can fill,
    peers would sit alone under empty keys); large swarms should pass ``expected_num_peers``.
    """
    b = coordinate_bits(target_group_size)
    if expected_num_peers is None:
        return 0
    if expected_num_peers <= max(target_group_size, 1):
        return 0
    m = max(2, target_group_size)
    dims = math.ceil(math.log(expected_num_peers) / math.log(m) - 1e-9)
    return min(MAX_GROUP_BITS, max(0, (dims - 1) * b))


def make_group_key(prefix: str, bits: str) -> str:
    """``{prefix}.0b{bits}``."""
    if not _BITS_RE.match(bits):
        raise ValueError(f"group bits must be a string of 0/1, got {bits!r}")
    return f"{prefix}.0b{bits}"


def parse_group_key(key: str) -> tuple[str, str]:
    """Inverse of :func:`make_group_key` -> ``(prefix, bits)``; ``ValueError`` if malformed."""
    prefix, sep, bits = key.rpartition(".0b")
    if not sep or not prefix or not _BITS_RE.match(bits):
        raise ValueError(f"not a group key: {key!r} (expected '<prefix>.0b<bits>')")
    return prefix, bits


def group_position(group_id: bytes, num_members: int, index: int) -> int:
    """Position of member ``index`` in a permutation of ``range(num_members)`` seeded by ``group_id``.

    Every member computes the same permutation from the group ID, so positions are distinct
    within the group and reproducible; hashing (not ``random``) keeps it stable across
    Python versions and machines.
    """
    if not 0 <= index < num_members:
        raise ValueError(f"member index {index} out of range for a group of {num_members}")
    order = sorted(
        range(num_members),
        key=lambda i: hashlib.sha256(group_id + i.to_bytes(4, "big")).digest(),
    )
    return order.index(index)


class GroupKeyManager:
    """Holds one peer's current group bits and moves them after each round."""

    def __init__(
        self,
        prefix: str,
        target_group_size: int,
        initial_group_bits: str | None = None,
        *,
        expected_num_peers: int | None = None,
        rng: random.Random | None = None,
        adaptive: bool | None = None,
    ):
        if not prefix or ".0b" in prefix:
            raise ValueError(f"invalid averaging prefix {prefix!r} (non-empty, without '.0b')")
        self.prefix = prefix
        self.coord_bits = coordinate_bits(target_group_size)
        self._rng = rng or random.Random()
        if adaptive is None:
            adaptive = initial_group_bits is None and expected_num_peers is None
        if initial_group_bits is None:
            n = default_num_bits(target_group_size, expected_num_peers)
            initial_group_bits = "".join(self._rng.choice("01") for _ in range(n))
        if not _BITS_RE.match(initial_group_bits) or len(initial_group_bits) > MAX_GROUP_BITS:
            raise ValueError(
                f"initial_group_bits must be at most {MAX_GROUP_BITS} characters of 0/1, "
                f"got {initial_group_bits!r}"
            )
        self.bits = initial_group_bits
        self.num_bits = len(initial_group_bits)
        self.target_group_size = target_group_size
        # adapt the key length to the observed swarm unless the user sized the grid
        self.adaptive = adaptive
        self._estimates: deque[float] = deque(maxlen=ESTIMATE_WINDOW)
        self._since_resize = 0
        # size of the last group we averaged in (None before the first), and rounds missed
        # since: they say where a peer that missed one round finds a free place (see
        # update_without_group)
        self._last_group_size: int | None = None
        self._missed = 0
        # peers were seen on a grid one dimension longer than ours (see observe_longer)
        self._grid_grew_without_us = False
        self._rounds_to_probe = PROBE_EVERY

    @property
    def axis(self) -> int:
        """Coordinates in use per grid axis: group positions (< M) that fit in the bits."""
        return max(2, min(self.target_group_size, 1 << self.coord_bits))

    @property
    def key(self) -> str:
        return make_group_key(self.prefix, self.bits)

    def _shift_in(self, coordinate: int) -> str:
        if self.num_bits == 0:
            return self.key
        coord = format(coordinate % (1 << self.coord_bits), f"0{self.coord_bits}b")
        self.bits = (self.bits + coord)[-self.num_bits :]
        return self.key

    @property
    def dimensions(self) -> int:
        """Grid dimensions ``d``: the key holds ``d - 1`` coordinates."""
        return self.num_bits // self.coord_bits + 1

    @property
    def swarm_size_estimate(self) -> float | None:
        """Median of the recent per-round estimates (None before the first observation)."""
        return statistics.median(self._estimates) if self._estimates else None

    def _keys_in_use(self) -> int:
        # coordinates are positions in groups of <= M (or random below 2**coord_bits)
        return int(self.axis ** (self.dimensions - 1))

    def observe_declared(self, count: int) -> None:
        """Record that ``count`` distinct peers (us included) were declared under our key."""
        if not self.adaptive or count < 1:
            return
        self._estimates.append(float(count * self._keys_in_use()))
        self._since_resize += 1

    def _wanted_dimensions(self) -> int:
        est = self.swarm_size_estimate
        d = self.dimensions
        if est is None or self._since_resize < MIN_ESTIMATES or self.target_group_size < 2:
            return d
        level = math.log(max(est, 1.0)) / math.log(self.target_group_size)
        if d - DIMENSION_MARGIN <= level <= d + DIMENSION_MARGIN:
            return d
        max_dims = MAX_GROUP_BITS // self.coord_bits + 1
        return min(max_dims, max(1, round(level)))

    def longer_key(self) -> str | None:
        """A key one grid dimension longer than ours (ours plus a random coordinate), or None
        (a fixed grid, no room, or not this round: one call in ``PROBE_EVERY`` gives a key).
        The averager reads it: peers that grew their grid before us sit under such keys, and
        we never meet them under ours."""
        if not self.adaptive or self.num_bits + self.coord_bits > MAX_GROUP_BITS:
            return None
        self._rounds_to_probe -= 1
        if self._rounds_to_probe > 0:
            return None
        self._rounds_to_probe = PROBE_EVERY
        coordinate = self._rng.randrange(self.axis)
        return make_group_key(self.prefix, self.bits + format(coordinate, f"0{self.coord_bits}b"))

    def observe_longer(self, count: int, own: int) -> None:
        """``count`` distinct peers were under :meth:`longer_key` this round, ``own`` under
        ours (us included). The longer grid has ``M`` times our number of keys, so it holds
        about ``count * M`` peers for our ``own``: if that is more (and ``count >= 2``), most
        of the swarm grew its grid without us (our estimates, from a crowded key read early,
        stayed low), and the two parts would average apart for good, never meeting under one
        key. We follow the larger part after this round."""
        if self.adaptive and count >= 2 and count * self.axis > own:
            self._grid_grew_without_us = True

    def _resize(self, first_coordinate: int | None) -> None:
        """Grow or shrink the key to the wanted number of dimensions after a round."""
        wanted = self._wanted_dimensions()
        if self._grid_grew_without_us:
            self._grid_grew_without_us = False
            if wanted <= self.dimensions:
                wanted = self.dimensions + 1
                self._estimates.clear()  # they were why we stayed behind
        if wanted == self.dimensions:
            return
        old_key, old_dims = self.key, self.dimensions
        if wanted > self.dimensions:
            axis = self.axis
            coords = []
            for k in range(wanted - self.dimensions):
                # the first new coordinate is the position in the group we just averaged in
                # (distinct within the group, so its members spread out); the rest are random
                c = first_coordinate if k == 0 and first_coordinate is not None else None
                coords.append(c if c is not None else self._rng.randrange(axis))
            self.bits += "".join(
                format(c % (1 << self.coord_bits), f"0{self.coord_bits}b") for c in coords
            )
        else:
            keep = (wanted - 1) * self.coord_bits
            self.bits = self.bits[len(self.bits) - keep :] if keep else ""  # drop the oldest
        self.num_bits = len(self.bits)
        self._since_resize = 0
        logger.info(
            "swarm size estimate %.0f peers (group size %d): grid of %d -> %d dimension(s), "
            "key %s -> %s",
            self.swarm_size_estimate or 0,
            self.target_group_size,
            old_dims,
            self.dimensions,
            old_key,
            self.key,
        )

    def update_after_round(
        self,
        group_id: bytes,
        members: Sequence[object],
        me: object,
        declared: int | None = None,
    ) -> str:
        """Shift in this peer's coordinate from the group it just averaged with; returns the new key.

        ``declared``: distinct peers seen under the key this round (adaptive grids only).
        """
        members = list(members)
        position = group_position(group_id, len(members), members.index(me))
        self._last_group_size, self._missed = len(members), 0
        if declared is not None:
            self.observe_declared(declared)
        self._shift_in(position)
        if self.adaptive:
            self._resize(position)
        return self.key

    def update_without_group(self, declared: int | None = None) -> str:
        """No group formed: move to the key where this peer's line leaves a free place.

        The peers of our line that did form a group shift in positions ``0..n-2`` of a group
        of ``n - 1``; position ``n - 1`` is the one nobody takes. On a full grid that is the
        only key of the next round short of a peer, so moving there makes every group whole
        again at once; a random key would be full (its group starts without us) with chance
        ``(M - 1) / M``, round after round. ``n`` is the larger of our last group's size and
        the peers seen under the key this round (``declared``, us included).

        After a second miss in a row the line is not the explanation (an empty corner of the
        grid, a full key): move to a random neighbouring key, so lonely peers find company.
        """
        if declared is not None:
            self.observe_declared(declared)
        self._missed += 1
        line = max(self._last_group_size or 0, declared or 0)
        if self._missed == 1 and line >= 1:
            coordinate = min(line, self.axis) - 1
        else:
            coordinate = self._rng.randrange(1 << self.coord_bits)
        self._shift_in(coordinate)
        if self.adaptive:
            self._resize(None)
        return self.key
