"""What the dashboard remembers of a run, and the JSON it serves (``/api/run.json``).

:class:`RunHistory` takes one :class:`~moshpit.training.run_records.RunRecords` per read of the
DHT and keeps, within fixed bounds:

- the live peers as last read, with each one's samples/s **after the tracker's clamp**
  (:func:`moshpit.training.progress.aggregate`, the rule every peer applies);
- one point per read: the swarm's samples/s (the sum of the clamped rates), the global epoch,
  the live peers, the loss across peers (median and quartiles), the samples contributed;
- a contributions board: the samples each peer added *while the dashboard watched*, counted
  from the increments between two of its records, each at most ``throughput_tolerance`` x its
  clamped samples/s x the time between them (the shorter of the time its records claim and
  the time the dashboard saw pass), so a peer that lies about its samples or its clock
  cannot be credited more than its clamped rate for the time it was watched. A peer's count
  restarts at each of its epochs (sync: each global step; local and diloco: each averaging
  round): then the samples it made before the restart, which no read saw, are estimated at
  its clamped rate for that time (within the same bound).

Everything here is torch-free and network-free (the reading loop lives in ``server.py``).
"""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from moshpit.training.progress_aggregate import aggregate
from moshpit.training.progress_record import GlobalProgress, PeerProgress
from moshpit.training.run_records import RunRecords

__all__ = ["JSON_VERSION", "Contribution", "RunHistory", "quantile", "short_id"]

JSON_VERSION = 1  # bumped when a field of /api/run.json changes meaning or goes away
DEFAULT_HISTORY = 1800  # points (one per read): an hour at the default 2 s interval
MAX_PEERS = 1024  # live peers listed in the JSON (the swarm's totals count every peer)
MAX_CONTRIBUTORS = 4096  # peers remembered on the contributions board
TOP_CONTRIBUTORS = 100  # of them in the JSON
MAX_NOTES = 64  # clamped or ignored records listed, with the reason


def short_id(peer_id: str) -> str:
    """The last 6 characters of a PeerID, as the logs and ``moshpit status`` show it."""
    return peer_id[-6:]


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted, non-empty ``ordered`` (linear interpolation)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Contribution:
    """One peer's line on the contributions board."""

    peer_id: str
    name: str | None
    first_seen: float  # DHT time of the first read that listed it
    last_seen: float  # ... and of the last one
    epoch: int  # its last record counted: epoch, samples, record time, and when we read it
    samples_then: int
    record_time: float
    read_at: float
    samples: int = 0  # credited
    withheld: int = 0  # claimed beyond the bound, not credited


class RunHistory:
    """A run as seen by one dashboard, bounded in memory (module docstring).

    :param prefix: the run's id.
    :param interval: seconds between two reads (published in the JSON for pollers).
    :param history: points kept (the oldest go first).
    :param max_peers: live peers listed in the JSON.
    :param max_contributors: peers remembered on the board (beyond: the ones gone, with the
        fewest samples, are forgotten first).
    """

    def __init__(
        self,
        prefix: str,
        *,
        interval: float = 2.0,
        history: int = DEFAULT_HISTORY,
        max_peers: int = MAX_PEERS,
        max_contributors: int = MAX_CONTRIBUTORS,
        max_throughput_ratio: float = 10.0,
        throughput_tolerance: float = 1.5,
        clamp_slack: float = 10.0,
    ) -> None:
        if history < 1 or max_peers < 1 or max_contributors < 1:
            raise ValueError("history, max_peers and max_contributors must be >= 1")
        self.prefix = prefix
        self.interval = float(interval)
        self.history_limit = int(history)
        self.max_peers = int(max_peers)
        self.max_contributors = int(max_contributors)
        self.max_throughput_ratio = float(max_throughput_ratio)
        self.throughput_tolerance = float(throughput_tolerance)
        self.clamp_slack = float(clamp_slack)
        self.started: float | None = None
        self.time: float | None = None
        self.reads = 0
        self.failed_reads = 0
        self.error: str | None = None
        self.error_time: float | None = None
        self.view: GlobalProgress | None = None
        self.run: RunRecords | None = None
        self.samples_per_second = 0.0
        self.loss: tuple[float, float, float] | None = None  # median, p25, p75
        # (t, samples/s, epoch, peers, loss median, loss p25, loss p75, samples contributed)
        self.points: deque[tuple[Any, ...]] = deque(maxlen=self.history_limit)
        self.contributions: dict[str, Contribution] = {}
        self.samples_contributed = 0
        self.notes: dict[str, str] = {}
        self.version = 0
        self._cached: tuple[int, bytes] | None = None

    # ------------------------------------------------------------------ updates

    def update(self, run: RunRecords) -> None:
        """Fold in one read of the run's records."""
        now = run.now
        if self.time is not None and now <= self.time:
            return  # a clock that went backwards: keep the history monotonic
        schemas = Counter(p.schema for p in run.progress if p.schema is not None)
        # the run's model is the one most peers train: a peer of another schema trains
        # another model under the same run id (listed in other_schemas, counted nowhere)
        schema = schemas.most_common(1)[0][0] if schemas else None
        view = aggregate(
            run.progress,
            now=now,
            max_throughput_ratio=self.max_throughput_ratio,
            throughput_tolerance=self.throughput_tolerance,
            clamp_slack=self.clamp_slack,
            ignored=run.ignored,
            schema=schema,
        )
        self.samples_per_second = sum(view.throughput.get(p.peer_id, 0.0) for p in view.peers)
        for peer in view.peers:
            self._credit(peer, view.throughput.get(peer.peer_id, 0.0), now)
        self._forget_contributors({p.peer_id for p in view.peers})
        losses = sorted(p.loss for p in view.peers if p.loss is not None)
        self.loss = (
            (quantile(losses, 0.5), quantile(losses, 0.25), quantile(losses, 0.75))
            if losses
            else None
        )
        loss = self.loss or (None, None, None)
        self.points.append(
            (
                round(now, 3),
                _round(self.samples_per_second),
                view.epoch,
                view.num_peers,
                *(_round(x) if x is not None else None for x in loss),
                self.samples_contributed,
            )
        )
        notes = dict(view.ignored)
        notes.update(run.ignored_donors)
        self.notes = dict(list(notes.items())[:MAX_NOTES])
        self.view, self.run = view, run
        if self.started is None:
            self.started = now
        self.time = now
        self.reads += 1
        self.error = self.error_time = None
        self.version += 1

    def note_error(self, now: float, message: str) -> None:
        """A read that failed: the page says so (the last good view stays)."""
        self.failed_reads += 1
        self.error, self.error_time = message[:200], now
        self.version += 1

    def _credit(self, peer: PeerProgress, rate: float, now: float) -> None:
        known = self.contributions.get(peer.peer_id)
        if known is None:
            # first seen: what it did before we watched is not ours to vouch for
            self.contributions[peer.peer_id] = Contribution(
                peer.peer_id, peer.name, now, now, peer.epoch, peer.samples, peer.time, now
            )
            return
        known.last_seen = now
        known.name = peer.name
        if peer.time <= known.record_time:
            return  # the same record again (or an older copy from a stale replica)
        elapsed = max(0.0, min(peer.time - known.record_time, now - known.read_at))
        bound = int(self.throughput_tolerance * rate * elapsed)
        if peer.epoch == known.epoch and peer.samples >= known.samples_then:
            claimed = credited = peer.samples - known.samples_then
        else:
            # its count started again from zero (a new epoch or round, a restart): what it
            # made between our last read and the restart is unseen; estimate it at its rate
            claimed = credited = max(peer.samples, int(rate * elapsed))
        credited = min(credited, bound)
        known.samples += credited
        known.withheld += claimed - credited
        self.samples_contributed += credited
        known.epoch, known.samples_then = peer.epoch, peer.samples
        known.record_time, known.read_at = peer.time, now

    def _forget_contributors(self, live: set[str]) -> None:
        excess = len(self.contributions) - self.max_contributors
        if excess <= 0:
            return
        # forget a tenth more than needed, so this sort runs once per many new peers
        gone = sorted(
            (c for c in self.contributions.values() if c.peer_id not in live),
            key=lambda c: (c.samples, c.last_seen),
        )
        for c in gone[: excess + self.max_contributors // 10]:
            del self.contributions[c.peer_id]
        # live peers beyond the cap (more peers than max_contributors): the newest go
        if len(self.contributions) > self.max_contributors:
            newest = sorted(self.contributions.values(), key=lambda c: -c.first_seen)
            for c in newest[: len(self.contributions) - self.max_contributors]:
                del self.contributions[c.peer_id]

    # ------------------------------------------------------------------ the JSON

    def to_json(self, since: float | None = None) -> dict[str, Any]:
        """The document of ``/api/run.json`` (docs/dashboard.md describes every field).

        ``since``: only the history points after this time (what a poller already has is
        not sent again)."""
        view = self.view
        median, p25, p75 = self.loss or (None, None, None)
        return {
            "version": JSON_VERSION,
            "run_id": self.prefix,
            "time": self.time,
            "started": self.started,
            "interval": self.interval,
            "reads": self.reads,
            "failed_reads": self.failed_reads,
            "error": self.error,
            "error_time": self.error_time,
            "epoch": view.epoch if view is not None else 0,
            "num_peers": view.num_peers if view is not None else 0,
            "samples_per_second": _round(self.samples_per_second),
            "samples_contributed": self.samples_contributed,
            "loss": None if median is None else {"median": median, "p25": p25, "p75": p75},
            "peers": self._peer_rows(),
            "peers_truncated": view is not None and len(view.peers) > self.max_peers,
            "donors": self._donor_rows(),
            "contributions": self._contribution_rows(),
            "num_contributors": len(self.contributions),
            "history": self._history_columns(since),
            "history_limit": self.history_limit,
            "notes": self.notes,
            "other_schemas": dict(view.other_schemas) if view is not None else {},
        }

    def _peer_rows(self) -> list[dict[str, Any]]:
        """The peers of the last view (at most ``max_peers``), with what we know of each."""
        view, run = self.view, self.run
        if view is None:
            return []
        now = self.time if self.time is not None else 0.0
        donor_of = {d.peer_id: d for d in run.donors} if run is not None else {}
        peers = []
        for p in view.peers[: self.max_peers]:
            rate = view.throughput.get(p.peer_id, p.samples_per_second)
            donor = donor_of.get(p.peer_id)
            known = self.contributions.get(p.peer_id)
            peers.append(
                {
                    "peer_id": p.peer_id,
                    "short": short_id(p.peer_id),
                    "name": p.name,
                    "epoch": p.epoch,
                    "samples": p.samples,
                    "samples_per_second": _round(rate),
                    "claimed_samples_per_second": _round(p.samples_per_second),
                    "clamped": rate < p.samples_per_second,
                    "loss": None if p.loss is None else _round(p.loss),
                    "age_seconds": round(max(0.0, now - p.time), 3),
                    "role": None if p.client is None else ("client" if p.client else "reachable"),
                    "donor": donor is not None,
                    "donor_epoch": donor.epoch if donor is not None else None,
                    "problem": p.problem,
                    "contributed": known.samples if known is not None else 0,
                }
            )
        return peers

    def _donor_rows(self) -> list[dict[str, Any]]:
        return [
            {
                "peer_id": d.peer_id,
                "short": short_id(d.peer_id),
                "epoch": d.epoch,
                "bytes": d.nbytes,
                "complete": d.complete,
            }
            for d in (self.run.donors if self.run is not None else [])[: self.max_peers]
        ]

    def _contribution_rows(self) -> list[dict[str, Any]]:
        """The leaderboard: the ``TOP_CONTRIBUTORS`` peers that contributed most."""
        board = sorted(self.contributions.values(), key=lambda c: (-c.samples, c.peer_id))
        live = {p.peer_id for p in self.view.peers} if self.view is not None else set()
        return [
            {
                "peer_id": c.peer_id,
                "short": short_id(c.peer_id),
                "name": c.name,
                "samples": c.samples,
                "withheld": c.withheld,
                "first_seen": c.first_seen,
                "last_seen": c.last_seen,
                "live": c.peer_id in live,
            }
            for c in board[:TOP_CONTRIBUTORS]
        ]

    def _history_columns(self, since: float | None) -> dict[str, list[Any]]:
        """The history points after ``since``, one list per series (compact in JSON)."""
        points = [pt for pt in self.points if since is None or pt[0] > since]
        columns = list(zip(*points, strict=True)) if points else [()] * 8
        return {
            "t": list(columns[0]),
            "samples_per_second": list(columns[1]),
            "epoch": list(columns[2]),
            "peers": list(columns[3]),
            "loss_median": list(columns[4]),
            "loss_p25": list(columns[5]),
            "loss_p75": list(columns[6]),
            "samples_contributed": list(columns[7]),
        }

    def json_bytes(self, since: float | None = None) -> bytes:
        """:meth:`to_json` encoded (the full document is cached until the next update)."""
        if since is not None:
            return _encode(self.to_json(since))
        if self._cached is None or self._cached[0] != self.version:
            self._cached = (self.version, _encode(self.to_json()))
        return self._cached[1]


def _round(x: float) -> float:
    """Six significant digits: enough for a chart, a third of the bytes of a full float."""
    return float(f"{x:.6g}")


def _encode(document: dict[str, Any]) -> bytes:
    # allow_nan=False: every number was validated finite; a NaN here is a bug, not a value
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
