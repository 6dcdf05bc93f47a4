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
    "hole_coordinate",
    "key_offset",
    "line_coordinate",
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
# keys a new or lonely peer reads on the longer grid before it declares (follow_longer_now)
FOLLOW_READS = 4
# other keys of its own grid a peer still alone part way into a round reads, for a group with
# room (GroupKeyManager.sibling_keys): on 3 bits (groups of 8) that is every key
SIDE_READS = 7
MAX_PROBE_DIMS = 3  # an empty longer key sends the next probe up to this many dimensions on
# rounds along an axis that size its line for the hole rule (GroupKeyManager._line_length): a
# member of the line missed one of them with chance ~8% at p = 0.01 and lines of 8
SAME_AXIS_ROUNDS = 2


def coordinate_bits(target_group_size: int) -> int:
    """Bits needed to write a position in a group of ``target_group_size`` (at least 1)."""
    if target_group_size < 1:
        raise ValueError(f"target_group_size must be >= 1, got {target_group_size}")
    return max(1, math.ceil(math.log2(target_group_size)))


def default_num_bits(target_group_size: int, expected_num_peers: int | None = None) -> int:
    """Number of key bits for a swarm of about ``expected_num_peers`` peers.

    A grid with ``M = target_group_size`` peers per side and ``d`` dimensions spreads the
    peers over ``M**(d-1)`` keys; the key holds the other ``d - 1`` coordinates. ``d`` is the
    largest for which a key holds at least ``max(2, M / 2)`` peers on average: a half-full
    grid still averages well (the paper's 512 peers on 32 x 32), a crowded key forms several
    full groups, but keys of a few peers form groups of a few, round after round. With
    ``d = ceil(log_M N)``, 300 peers in groups of 16 got a 3-d grid of 256 keys (~1.2 peers
    each) and took 40 rounds to a variance of 1e-9; 1024 in groups of 16, 15; 150 in groups
    of 32, 32. With this rule: 8.6, 7.9 and 6.4 (``benchmarks/sim_rounds.py --placement
    random``). Without an estimate we use 0 bits: every peer declares under the same key
    and groups of up to ``M`` form at random each round. That is what small swarms need;
    large swarms should pass ``expected_num_peers`` (or let the grid adapt).
    """
    b = coordinate_bits(target_group_size)
    if expected_num_peers is None:
        return 0
    if expected_num_peers <= max(target_group_size, 1):
        return 0
    m = max(2, target_group_size)
    per_key = max(2.0, m / 2)
    dims = 1
    while dims * b < MAX_GROUP_BITS and expected_num_peers >= per_key * m**dims:
        dims += 1
    return min(MAX_GROUP_BITS, (dims - 1) * b)


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


def key_offset(key: str, axis: int) -> int:
    """A coordinate in ``range(axis)`` drawn from the key (SHA-256): the rotation of
    :func:`line_coordinate`, the same for every member of the line."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % axis


def line_coordinate(key: str, position: int, axis: int, rotate: bool) -> int:
    """The coordinate a member at ``position`` of a group under ``key`` shifts in.

    Without ``rotate`` it is the position itself: a line of ``n`` peers takes coordinates
    ``0..n-1``. That keeps a balanced grid exact (a half-full 32 x 32 grid of lines of 16
    becomes 16 lines of 32, each holding one peer of every line of 16: the exact mean after 2
    rounds), but it packs uneven lines: the next round's key ``k`` holds one peer of each line
    longer than ``k`` (the line lengths' conjugate), so low keys are crowded, high keys hold a
    peer or two, and that shape stays round after round. With ``rotate`` every line starts at
    its own offset (:func:`key_offset`, modulo ``axis``), so uneven lines spread over all the
    keys: random key bits (``expected_num_peers``) at the paper's sizes, 512 / 768 / 900 peers
    on 32 x 32 with p = 0.01, took 9.4 / 8.5 / 7.4 rounds to a variance of 1e-9 packed and
    7.0 / 6.3 / 6.1 rotated (20 seeds) (the paper: 8.8 / 6.9 / 6.5; ``benchmarks/sim_rounds.py``). A
    whole line (``axis`` peers) takes every coordinate either way, so a full grid is exact
    after ``d`` rounds with or without rotation.
    """
    if not 0 <= position < axis:
        raise ValueError(f"position {position} out of range for an axis of {axis}")
    return (position + key_offset(key, axis)) % axis if rotate else position


def hole_coordinate(key: str, line: int, axis: int, rotate: bool) -> int:
    """Where a peer goes after missing a round in which its line (under ``key``) held
    ``line`` peers, itself included: the others took :func:`line_coordinate` of positions
    ``0..line-2``; position ``line - 1`` is the one nobody took, so the next round's lines are
    what they would have been with the peer there (on a full grid, every group whole)."""
    return line_coordinate(key, min(max(line, 1), axis) - 1, axis, rotate)


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
        rotate_lines: bool | None = None,
    ):
        if not prefix or ".0b" in prefix:
            raise ValueError(f"invalid averaging prefix {prefix!r} (non-empty, without '.0b')")
        self.prefix = prefix
        self.coord_bits = coordinate_bits(target_group_size)
        self._rng = rng or random.Random()
        if adaptive is None:
            adaptive = initial_group_bits is None and expected_num_peers is None
        # random key bits make uneven lines: spread them over the keys (line_coordinate);
        # a grid the user laid out keeps its lines (a balanced partial grid stays exact)
        self.rotate_lines = initial_group_bits is None if rotate_lines is None else rotate_lines
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
        # (estimate, whether its count was 1: nobody else seen; see _wanted_dimensions)
        self._estimates: deque[tuple[float, bool]] = deque(maxlen=ESTIMATE_WINDOW)
        self._since_resize = 0
        # the length of our line in recent rounds (the group we averaged in, or the line we
        # missed), newest last, and rounds missed since the last group: they say where a peer
        # that missed one round finds a free place (see update_without_group)
        self._line_lengths: deque[int] = deque(maxlen=MAX_GROUP_BITS + 1)  # 0: unknown
        self._missed = 0
        # the first round's line length, from the size hint (None: unknown)
        self._first_line = (
            min(self.axis, -(-expected_num_peers // self._keys_in_use()))
            if expected_num_peers
            else None
        )
        # peers were seen on a grid this many dimensions longer than ours (observe_longer)
        self._grow_by = 0
        self._rounds_to_probe = PROBE_EVERY
        # the first call probes too: a peer that starts (or restarts after a preemption) on
        # the shared key while the swarm already averages on a longer grid finds it at once
        self._first_look = True
        self._probe_dims = 1  # dimensions the next longer_key adds
        self._probing = 0  # dimensions the last longer_key added (0: none yet)
        self._probe_bits = ""  # the bits of the last longer_key
        self._grouped = False  # averaged in a group at least once
        self._last_count: int | None = None  # peers seen under our key in the last round
        self._unshifted = self.bits  # the key before the last shift dropped a coordinate
        self._pending_dims = 0  # dimensions still to grow, one per round (_resize)

    @property
    def axis(self) -> int:
        """Coordinates in use per grid axis: group positions (< M) that fit in the bits."""
        return max(2, min(self.target_group_size, 1 << self.coord_bits))

    @property
    def key(self) -> str:
        return make_group_key(self.prefix, self.bits)

    def _shift_in(self, coordinate: int) -> str:
        coord = format(coordinate % (1 << self.coord_bits), f"0{self.coord_bits}b")
        self._unshifted = self.bits + coord  # nothing dropped: what a growing key keeps
        if self.num_bits == 0:
            return self.key
        self.bits = self._unshifted[-self.num_bits :]
        return self.key

    @property
    def dimensions(self) -> int:
        """Grid dimensions ``d``: the key holds ``d - 1`` coordinates."""
        return self.num_bits // self.coord_bits + 1

    @property
    def swarm_size_estimate(self) -> float | None:
        """Median of the recent per-round estimates (None before the first observation)."""
        return statistics.median(e for e, _ in self._estimates) if self._estimates else None

    def _keys_in_use(self) -> int:
        # coordinates are positions in groups of <= M (or random below 2**coord_bits)
        return int(self.axis ** (self.dimensions - 1))

    def observe_declared(self, count: int) -> None:
        """Record that ``count`` distinct peers (us included) were declared under our key."""
        if not self.adaptive or count < 1:
            return
        self._estimates.append((float(count * self._keys_in_use()), count == 1))
        self._since_resize += 1

    def _level(self, estimate: float) -> float:
        return math.log(max(estimate, 1.0)) / math.log(self.target_group_size)

    def _wanted_dimensions(self) -> int:
        """Shrink on the median of all recent estimates; grow on the median of those from
        counts that saw someone else (on the shared key, the newest where larger). A count
        of 1 says our key was empty (or our read of it failed), which argues for a smaller
        grid but says nothing against a larger one:
        150 peers in groups of 16 read ~150 on the shared key, and a peer that had also
        counted 1 in a round it was cut off held a median of 75, stayed on the shared key
        while the rest grew, and kept a cluster of 5 apart for 2-4 rounds (10.2 rounds to a
        variance of 1e-9, now 9.1; 256 peers 7.85, now 6.3, with the two changes beside it:
        ``sim_rounds.py --adaptive``). On the shared key a count only misses peers (a read
        sees the declarations stored so far, a peer stops reading once its group is whole,
        and a record left by an earlier round names a peer of the swarm all the same), so
        growth takes the newest count there where it is above that median: a peer whose
        block filled within its first read of a swarm's first round counted 8 of 64, held a
        median of 35 after round 2 (below the margin, groups of 8), and stayed on the
        shared key with the two others of its group while the other 61 grew (the full
        stack, 64 peers: a round as a pair, then a round to follow the swarm ahead). Not
        the largest of the window: a swarm that shrank would grow on a count from before.
        Not on a grid key, whose count includes the last round's peers of that key, who
        have moved on (64 peers in groups of 4: 29 grew a dimension too far)."""
        est = self.swarm_size_estimate
        d = self.dimensions
        if est is None or self._since_resize < MIN_ESTIMATES or self.target_group_size < 2:
            return d
        level = self._level(est)
        seen_others = [e for e, alone in self._estimates if not alone]
        if seen_others:
            seen = statistics.median(seen_others)
            if self.num_bits == 0:  # the shared key: counts only miss peers
                seen = max(seen, seen_others[-1])
            level_seen = self._level(seen)
            if level_seen > d + DIMENSION_MARGIN:
                level = level_seen
        if d - DIMENSION_MARGIN <= level <= d + DIMENSION_MARGIN:
            return d
        max_dims = MAX_GROUP_BITS // self.coord_bits + 1
        return min(max_dims, max(1, round(level)))

    def longer_key(self) -> str | None:
        """A key one or more grid dimensions longer than ours (ours plus random coordinates;
        see :meth:`observe_longer` for how many), or None (a fixed grid, no room, or not this round: one call in
        ``PROBE_EVERY`` gives a key, every call while we find no group). The averager reads
        it: peers that grew their grid before us sit under such keys, and we never meet them
        under ours."""
        if not self.adaptive:
            return None
        dims = min(self._probe_dims, (MAX_GROUP_BITS - self.num_bits) // self.coord_bits)
        if dims < 1:
            return None
        self._rounds_to_probe -= 1
        # alone round after round: the swarm may have left our key for good (a peer that
        # missed the first round stays on the shared key while the rest grow their grid)
        if self._rounds_to_probe > 0 and self._missed < 2 and not self._first_look:
            return None
        if not self._first_look:  # (an extra look: the schedule of the others stays)
            self._rounds_to_probe = PROBE_EVERY
        self._first_look = False
        self._probing = dims
        coords = (self._rng.randrange(self.axis) for _ in range(dims))
        self._probe_bits = self.bits + "".join(format(c, f"0{self.coord_bits}b") for c in coords)
        return make_group_key(self.prefix, self._probe_bits)

    @property
    def probe_before_declaring(self) -> bool:
        """Whether the averager should read our key and :meth:`longer_key` before it
        declares, and move there at once (:meth:`follow_longer_now`): true in a peer's first
        round, and once it was alone twice in a row with nobody else under its key the last
        time. For those, the swarm having grown without them is the likely story, and a round
        spent alone under a key nobody else uses is a round lost (the others probe while
        they declare). Not for a peer left over on a crowded key: the reads would make it
        declare last, and the last to declare on a full key is the one left over again (the
        full stack, 64 peers in groups of 8: the same two peers alone round after round)."""
        first_round = not self._grouped and self._missed == 0
        stranded = self._missed >= 2 and self._last_count in (None, 1)
        return self.adaptive and self._probing > 0 and (first_round or stranded)

    def other_longer_keys(self) -> list[str]:
        """Up to ``FOLLOW_READS - 1`` more keys of the last :meth:`longer_key`'s length
        under our bits (all of them where the longer grid has that few). A peer about to
        follow the swarm reads them too: one key of a grid whose keys hold a few peers each
        may hold nobody still looking (its group full and started, or its peers elsewhere
        this round)."""
        dims = self._probing
        if not self.adaptive or dims < 1:
            return []
        width = dims * self.coord_bits
        base, probed = self._probe_bits[:-width], self._probe_bits[-width:]
        choices = self.axis**dims
        picks = self._rng.sample(range(choices), min(FOLLOW_READS, choices))
        drawn = (self._coordinates(v, dims) for v in picks)
        others = [c for c in drawn if c != probed][: FOLLOW_READS - 1]
        return [make_group_key(self.prefix, base + c) for c in others]

    def _coordinates(self, value: int, count: int) -> str:
        """``value`` as ``count`` digits in base ``axis``, ``coord_bits`` bits each."""
        digits = []
        for _ in range(count):
            value, digit = divmod(value, self.axis)
            digits.append(format(digit, f"0{self.coord_bits}b"))
        return "".join(reversed(digits))

    def sibling_keys(self) -> list[str]:
        """Up to ``SIDE_READS`` other keys of our grid (our key's length), drawn at random.

        A peer still alone part way into a round reads them for a group with room, and moves
        there (:meth:`move_sideways`). On a grid whose keys hold a group each, one peer too
        many under one key leaves a key a peer short somewhere else: the group of the first
        fills and starts, the peer left over goes to where its line's free place would be,
        which is taken, and the pattern of one key of 9 and one of 7 (groups of 8) came back
        round after round, a peer alone each time (the full stack, 64 peers in groups of 8,
        ``sim_swarm.py``). Where the key holds no whole coordinates (a grid the user laid
        out with fewer bits than a coordinate), random bits of our length."""
        n = self.num_bits
        if n == 0:
            return []
        count, rest = divmod(n, self.coord_bits)
        if rest:
            picks = self._rng.sample(range(1 << n), min(SIDE_READS + 1, 1 << n))
            drawn = [format(v, f"0{n}b") for v in picks]
        else:
            choices = self.axis**count
            picks = self._rng.sample(range(choices), min(SIDE_READS + 1, choices))
            drawn = [self._coordinates(v, count) for v in picks]
        return [make_group_key(self.prefix, b) for b in drawn if b != self.bits][:SIDE_READS]

    def key_with_room(self, looking: list[tuple[int, str]]) -> str | None:
        """Of ``(peers looking now, key)`` read under :meth:`sibling_keys`, a key whose group
        has room for us (at least 2 looking, fewer than the target), drawn at random: the
        peers left over in one round read the same counts at about the same moment, and the
        fullest one for each sent all of them to one key (the full stack, 64 peers in groups
        of 8: three of them onto one key of 7, two left over again). None: no such key."""
        with_room = sorted(k for c, k in looking if 2 <= c < self.target_group_size)
        return self._rng.choice(with_room) if with_room else None

    def move_sideways(self, key: str) -> None:
        """Take ``key`` (one of :meth:`sibling_keys`) for this round: the group we find
        there places us after the round, as it places its other members."""
        prefix, bits = parse_group_key(key)
        if prefix != self.prefix or len(bits) != self.num_bits:
            raise ValueError(f"{key!r} is not a key of our grid ({self.key!r})")
        logger.info("alone under %s: moving to %s, where a group has room", self.key, key)
        self.bits = bits

    def would_follow(self, count: int, own: int) -> bool:
        """Whether :meth:`follow_longer_now` would move us (asked before leaving a search
        under our key part way into a round, which only pays if we move)."""
        return self.adaptive and self._probing > 0 and own <= 1 and count >= 2

    def follow_longer_now(self, count: int, own: int, key: str | None = None) -> bool:
        """Before declaring: ``count`` distinct peers are under ``key`` (:meth:`longer_key`,
        or one of :meth:`other_longer_keys`), ``own`` under ours (us included). If nobody
        else is under ours and the longer key holds a group (``count >= 2``), take that
        key's bits for this round and return True; its peers are the swarm we lost.
        Otherwise nothing changes (the probe still counts after the round,
        :meth:`observe_longer`).

        Without it, a volunteer restarting after a preemption sat alone under the shared
        key for its first three rounds while the swarm averaged on its grid (a lone round,
        a second to start probing every round, a third before the grown key applied); and
        1024 peers in groups of 16 needed a 9th round to a variance of 1e-9 in about 1 run
        in 11 (100 seeds), when a peer cut off in both of the first two rounds was left behind
        (``benchmarks/sim_rounds.py --adaptive``)."""
        if not self.would_follow(count, own):
            return False
        dims = self._probing
        bits = self._probe_bits
        if key is not None:
            prefix, bits = parse_group_key(key)
            width = dims * self.coord_bits
            if (
                prefix != self.prefix
                or len(bits) != len(self._probe_bits)
                or (bits[: len(bits) - width] != self._probe_bits[: len(bits) - width])
            ):
                raise ValueError(f"{key!r} is not a key of the grid we looked at")
        old_key = self.key
        self.bits = bits
        self._probing = 0  # used up: observe_longer after the round has nothing to add
        self._estimates.clear()  # they measured a key the swarm has left
        self._on_new_grid()
        logger.info(
            "nobody under %s, %d peer(s) under %s: following them this round", old_key, count,
            self.key,
        )  # fmt: skip
        return True

    def observe_longer(self, count: int, own: int) -> None:
        """``count`` distinct peers were under :meth:`longer_key` this round, ``own`` under
        ours (us included). The longer grid has ``M**k`` times our number of keys (``k``
        dimensions more), so it holds about ``count * M**k`` peers for our ``own``: if that
        is more (and ``count >= 2``), most of the swarm grew its grid without us (our
        estimates, from a crowded key read early, stayed low), and the two parts would
        average apart for good, never meeting under one key. We follow the larger part after
        this round. An empty longer key sends the next probe one dimension further (up to
        ``MAX_PROBE_DIMS``): a swarm that grew by two dimensions at once (1024 peers in
        groups of 8 go from the shared key to 6 bits) leaves nobody one dimension longer."""
        dims = self._probing
        if not self.adaptive or dims < 1:
            return
        if count >= 2 and count * self.axis**dims > own:
            self._grow_by = max(self._grow_by, dims)
            self._probe_dims = 1
        elif count < 2 and (self._grouped or self._missed >= 2):
            # (a new peer's first look finds nobody ahead when the whole swarm is new)
            self._probe_dims = dims % MAX_PROBE_DIMS + 1

    def _on_new_grid(self) -> None:
        """Bookkeeping once ``bits`` changed length (a resize, or following a longer key)."""
        self.num_bits = len(self.bits)
        self._since_resize = 0
        self._probe_dims = 1  # the next look ahead starts one dimension on
        # the axes changed: older line lengths belong to another grid (the newest one stays,
        # a rough guess until this grid has its own)
        while len(self._line_lengths) > 1:
            self._line_lengths.popleft()

    def _resize(self) -> None:
        """Grow or shrink the key to the wanted number of dimensions after a round.

        Growing keeps the coordinate this round's shift dropped (on the shared key: the
        position just shifted in), so the new key's coordinates are all positions in groups:
        distinct within each group, which spreads its members evenly. A grid wanted two or
        more dimensions longer grows one dimension per round: a random coordinate in place
        of a position filled the keys unevenly (Poisson), and groups of the target size
        could not form on the crowded and the sparse keys alike (64 peers in groups of 4 go
        from the shared key to 4 bits: 14.3 rounds to a variance of 1e-9 with one random
        coordinate, 9.25 one dimension per round; ``sim_rounds.py --adaptive``). A peer that
        follows a swarm found ahead of it (``observe_longer``) jumps at once: it has to land
        on the swarm's grid, not on a stage of its own."""
        wanted = self._wanted_dimensions()
        jump = False
        if self._grow_by:
            if wanted < self.dimensions + self._grow_by:
                wanted = self.dimensions + self._grow_by
                self._estimates.clear()  # they were why we stayed behind
                jump = True
            self._grow_by = 0
        elif self._pending_dims and wanted <= self.dimensions:
            wanted = self.dimensions + self._pending_dims
        self._pending_dims = 0
        if wanted == self.dimensions:
            return
        old_key, old_dims = self.key, self.dimensions
        if wanted > self.dimensions:
            extra = wanted - self.dimensions - 1
            coords = [self._rng.randrange(self.axis) for _ in range(extra)] if jump else []
            if not jump:
                self._pending_dims = extra
            self.bits = self._unshifted + "".join(format(c, f"0{self.coord_bits}b") for c in coords)
        else:
            keep = (wanted - 1) * self.coord_bits
            self.bits = self.bits[len(self.bits) - keep :] if keep else ""  # drop the oldest
        self._on_new_grid()
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
        self._line_lengths.append(len(members))
        self._missed = 0
        self._grouped = True
        self._last_count = declared
        self._first_look = False  # not new any more (if it never looked, no need now)
        if declared is not None:
            self.observe_declared(declared)
        coordinate = self._coordinate(position)
        self._shift_in(coordinate)
        if self.adaptive:
            self._resize()
        return self.key

    def _coordinate(self, position: int) -> int:
        return line_coordinate(self.key, position % self.axis, self.axis, self.rotate_lines)

    def _line_length(self, declared: int | None) -> int | None:
        """How many peers our line held this round, us included (None: no idea).

        ``declared`` (the peers a read of our key saw, us included) counts them when it saw
        anyone else, but only from below: a read early in the round misses the peers that
        declare later (the full stack, 32 peers on 8 x 8: a peer cut off in round 1 had
        seen part of its line, went to a taken place, and left one line too long and a peer
        alone every second round for the rest of the run). On a grid the user laid out the
        larger of the count and our history below answers; with rotated lines, whose lengths
        differ from key to key, the count alone. Without a count (we read nothing, or we
        were alone) our own history answers:
        on a ``d``-dimensional grid the key cycles through the axes, and on a partly filled
        one each axis has its own line length (a half-full 8 x 8 grid alternates between
        lines of 4 and of 8), so the last group, which ran along another axis, gives the
        wrong length; the line we ran along ``d`` rounds ago, the last time our key ran along
        this axis, gives the right one. Before ``d`` rounds of history:

        - lines that keep their positions (``rotate_lines`` off, a grid the user laid out)
          are full from the second round on: the first round's lines of ``n`` hand out
          positions ``0..n-1``, and the next ``d - 1`` rounds' keys hold one peer of every
          line that reached them, ``M`` per key while the swarm is below ``M**d``;
        - rotated lines are all about as long as each other, every round: the last group;
        - in the first round, the size hint (``expected_num_peers``) spread over the keys.
        """
        counted = declared if declared is not None and declared > 1 else None
        if counted is not None and self.rotate_lines:
            return counted  # rotated lines differ from key to key: our history says little
        d = self.dimensions
        history = list(self._line_lengths)
        # a group is shorter than its line when a member of it missed the round: of the last
        # two rounds along this axis, the longer one
        same_axis = [n for n in history[len(history) - d :: -d][:SAME_AXIS_ROUNDS] if n]
        known = [n for n in history if n]
        guess: int | None
        if len(history) >= d and same_axis:
            guess = max(same_axis)
        elif not known:
            guess = self._first_line
        else:
            guess = known[-1] if self.rotate_lines else self.axis
        if counted is None:
            return guess
        return max(counted, guess or 0)

    def update_without_group(self, declared: int | None = None) -> str:
        """No group formed: move to the key where this peer's line leaves a free place.

        The peers of our line that did form a group shift in positions ``0..n-2`` of a group
        of ``n - 1``; position ``n - 1`` is the one nobody takes. Next round that key holds
        one peer less than it would have held with us, so moving there keeps every line of
        the next round as long as a round without the miss would have made it; on a full grid
        it is the only key short of a peer, and every group is whole again at once. A random
        key would be full (its group starts without us) with chance ``(M - 1) / M``, round
        after round. ``n`` is the length of our line this round (:meth:`_line_length`): the
        peers a read of our key counted (``declared``, us included) when it saw anyone else,
        or else the line we ran along the last time our key ran along this axis (``d`` rounds
        ago). The last group ran along another axis, whose lines on a partly filled grid are
        twice or half as long: sized from it, a peer that missed a round of short lines went
        to a key that is empty in the next round, and was alone every second round (8 x 8 at
        32 / 48 / 56 peers, p = 0.01: 33 / 30 / 10% of runs above 8 rounds to a variance of
        1e-9, now 1 / 1 / 0%; ``benchmarks/sim_rounds.py --placement lines``).

        After a second miss in a row the line is not the explanation (an empty corner of the
        grid, a full key): move to a random neighbouring key, so lonely peers find company.
        """
        if declared is not None:
            self.observe_declared(declared)
        self._last_count = declared
        self._missed += 1
        line = self._line_length(declared)
        if self._missed == 1 and line is not None:
            coordinate = hole_coordinate(self.key, line, self.axis, self.rotate_lines)
        else:
            coordinate = self._rng.randrange(1 << self.coord_bits)
        self._line_lengths.append(line if line is not None else 0)
        self._shift_in(coordinate)
        if self.adaptive:
            self._resize()
        return self.key
