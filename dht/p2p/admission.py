"""Inbound admission: which connections still in their handshake a listening Host keeps, and
which it drops to admit a newer one.

State and decisions only: no trio, no sockets, no clock (callers pass what they observed), in
the manner of h11's ``_state.py``. ``host.py`` feeds it three events (a socket was accepted,
its dialer spoke, its handshake ended) and carries out what it answers: it cancels the
evicted handshakes' tasks and logs why. ``tests/p2p/test_admission.py`` drives it directly.

Why these rules. An accepted socket is *silent* until its dialer sends the multistream
header and its security proposal, which a well-behaved peer does in the same round trip as
TCP's handshake. Silent sockets cost a descriptor and a task, so many are held
(``max_silent``); a socket that has spoken costs Noise work, so few are
(``max_spoken``). A newcomer is never refused, something older makes room instead:

* over ``max_per_source`` handshakes from one source (an IPv4 address, an IPv6 /64), that
  source's stalest handshake goes, silent ones first: one machine cannot crowd out others;
* over ``max_silent`` silent sockets, fair share: the oldest silent socket of the source
  holding the most of them goes. A flood of idle sockets larger than the cap mostly
  displaces itself, while a newcomer that has not spoken yet keeps its slot;
* over ``max_spoken`` dialers that spoke, the oldest of them goes (it had its chance).

A dialer that spoke is never evicted to make room for silent sockets: it is counted apart.
"""

from __future__ import annotations

from dataclasses import dataclass


class Handshake:
    """One inbound connection still in its handshake, as admission sees it.

    ``source``: what the per-source cap counts (``connection.source_key`` of ``remote``);
    ``started``: when it was accepted, on the caller's clock (reported with evictions)."""

    __slots__ = ("source", "remote", "started", "negotiated", "evicted")

    def __init__(self, source: str, remote: str, started: float) -> None:
        self.source = source
        self.remote = remote
        self.started = started
        self.negotiated = False  # the dialer's multistream header and /noise proposal arrived
        self.evicted = False  # dropped to admit another: its owner must close it


@dataclass(frozen=True)
class Eviction:
    """Drop ``victim`` (already forgotten here): ``why`` names the cap that was full."""

    victim: Handshake
    why: str


class Admission:
    """The pending inbound handshakes of one Host and the caps on them.

    Every table is ordered oldest first (dicts used as ordered sets). ``max_silent`` may be
    lowered at any time (the Host fits it to the open-file limit when it starts listening).
    """

    def __init__(self, max_spoken: int, max_silent: int, max_per_source: int) -> None:
        for name, value in (
            ("max_spoken", max_spoken),
            ("max_silent", max_silent),
            ("max_per_source", max_per_source),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_spoken = max_spoken
        self.max_silent = max_silent
        self.max_per_source = max_per_source
        self.handshakes: dict[Handshake, None] = {}
        # the same grouped by source; a source's entry goes when its last handshake ends
        self.by_source: dict[str, dict[Handshake, None]] = {}
        # split by whether the dialer spoke: silent sockets per source, the sources bucketed by
        # how many silent sockets they hold (the fair-share victim in O(1)), the spoken ones
        self.silent_by_source: dict[str, dict[Handshake, None]] = {}
        self.sources_by_silent_count: dict[int, dict[str, None]] = {}
        self.spoken: dict[Handshake, None] = {}

    @property
    def pending_count(self) -> int:
        return len(self.handshakes)

    @property
    def silent_count(self) -> int:
        """Pending handshakes whose dialer has not spoken yet (every other one has)."""
        return len(self.handshakes) - len(self.spoken)

    # -- the three events ----------------------------------------------------------------------
    def admit(self, handshake: Handshake) -> list[Eviction]:
        """A socket was accepted: take it in, silent; the handshakes dropped to make room."""
        evictions: list[Eviction] = []
        source = handshake.source
        same = self.by_source.get(source)
        if same is not None and len(same) >= self.max_per_source:
            why = f"{self.max_per_source} pending handshakes from {source}"
            evictions.append(self._evict(_stalest(same), why))
        if self.silent_count >= self.max_silent:
            why = f"{self.max_silent} silent connections in all"
            evictions.append(self._evict(self._fair_share_victim(), why))
        self.handshakes[handshake] = None
        self.by_source.setdefault(source, {})[handshake] = None
        self._add_silent(handshake)
        return evictions

    def spoke(self, handshake: Handshake) -> list[Eviction]:
        """The dialer sent its multistream header and security proposal: it leaves the
        silent sockets for the few that cost Noise work; the handshake dropped for it, if
        that table was full. Nothing for one that spoke before, was evicted or is gone."""
        if handshake.negotiated or handshake.evicted or handshake not in self.handshakes:
            return []
        handshake.negotiated = True
        self._remove_silent(handshake)
        evictions: list[Eviction] = []
        if len(self.spoken) >= self.max_spoken:
            why = f"{self.max_spoken} handshakes in progress"
            evictions.append(self._evict(next(iter(self.spoken)), why))
        self.spoken[handshake] = None
        return evictions

    def forget(self, handshake: Handshake) -> None:
        """The handshake ended (done, failed, timed out): free its slot. Idempotent."""
        self.handshakes.pop(handshake, None)
        self.spoken.pop(handshake, None)
        self._remove_silent(handshake)
        group = self.by_source.get(handshake.source)
        if group is not None:
            group.pop(handshake, None)
            if not group:
                del self.by_source[handshake.source]

    # -- bookkeeping ---------------------------------------------------------------------------
    def _evict(self, victim: Handshake, why: str) -> Eviction:
        self.forget(victim)
        victim.evicted = True
        return Eviction(victim, why)

    def _fair_share_victim(self) -> Handshake:
        """The oldest silent socket of the source that holds the most of them."""
        count = max(self.sources_by_silent_count)
        source = next(iter(self.sources_by_silent_count[count]))
        return next(iter(self.silent_by_source[source]))

    def _add_silent(self, handshake: Handshake) -> None:
        group = self.silent_by_source.setdefault(handshake.source, {})
        self._move_bucket(handshake.source, len(group), len(group) + 1)
        group[handshake] = None

    def _remove_silent(self, handshake: Handshake) -> None:
        group = self.silent_by_source.get(handshake.source)
        if group is None or handshake not in group:
            return
        del group[handshake]
        self._move_bucket(handshake.source, len(group) + 1, len(group))
        if not group:
            del self.silent_by_source[handshake.source]

    def _move_bucket(self, source: str, old: int, new: int) -> None:
        buckets = self.sources_by_silent_count
        if old:
            bucket = buckets[old]
            del bucket[source]
            if not bucket:
                del buckets[old]
        if new:
            buckets.setdefault(new, {})[source] = None


def _stalest(handshakes: dict[Handshake, None]) -> Handshake:
    """The oldest handshake whose dialer has not spoken yet, else the oldest one."""
    for handshake in handshakes:  # oldest first
        if not handshake.negotiated:
            return handshake
    return next(iter(handshakes))


__all__ = ["Admission", "Eviction", "Handshake"]
