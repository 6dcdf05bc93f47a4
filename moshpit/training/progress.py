"""``ProgressTracker``: the swarm's training progress, without a coordinator.

Every peer publishes one small record under ``{prefix}.progress`` in the DHT (subkey
``[owner:<PeerID>]``, so only that peer can write it): its epoch, the samples it accumulated
toward that epoch, its throughput and when it last reported. Every reader aggregates those
records into a :class:`GlobalProgress`: the global epoch, the samples toward the target batch,
the live peers and the time to the next global step. Records are untrusted: see
:func:`aggregate` for the rule that keeps one lying peer from moving the swarm, and
docs/training-state.md ("Progress") for the rationale.

A record also carries the hash of the peer's model schema (``"s"``: the names and shapes of
its training state, see :meth:`ProgressTracker.set_schema`). A peer of another schema trains
another model under the same run name: it can neither average nor share state with us, so a
reader that knows its own schema leaves it out of everything (epoch, samples, peers) and only
lists it in :attr:`GlobalProgress.other_schemas`. Otherwise the training modes would wait for
it in every round (it never joins one) and count its samples toward our batch.

A record may also carry a display ``name`` its volunteer chose (at most
:data:`MAX_NAME_CHARS` printable characters; see :func:`check_name`) and whether the peer is a
DHT ``client`` (not reachable: behind a NAT) or a server, for dashboards (``moshpit
dashboard``). Both are cosmetic: a malformed name is dropped, never the record.

Torch-free on purpose: ``moshpit status`` uses :func:`aggregate` on a bootstrap-sized VM.

Two ways to drive it, as with the averager:

- a ``dht.DHT`` facade: the publishing loop runs as a service on the DHT's trio thread;
  :meth:`ProgressTracker.report` only records numbers and wakes that loop;
- a ``DHTNode`` (trio code): ``async with ProgressTracker(node, prefix) as tracker:`` runs the
  loop in a nursery of its own (or ``await nursery.start(tracker.run)``); without either,
  :meth:`ProgressTracker.arefresh` publishes pending changes itself before it reads.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import trio

from dht.kademlia.clock import get_dht_time
from moshpit.critical import CriticalLock

logger = logging.getLogger(__name__)

__all__ = [
    "GlobalProgress",
    "PeerProgress",
    "ProgressTracker",
    "aggregate",
    "check_name",
    "owner_subkey",
    "parse_progress_record",
    "peer_of_subkey",
    "progress_key",
]

MAX_EPOCH = 2**53  # beyond this an epoch (or sample count) is not a number a trainer produces
MAX_SAMPLES = 2**53
MAX_SAMPLES_PER_SECOND = 1e12
MAX_RECORDS = 4096  # records read per key (what one DHT node stores per key, too)
MAX_IGNORED_REASONS = 64  # cap on GlobalProgress.ignored (a flood of junk subkeys stays small)
MAX_LOSS = 1e12  # a published loss is clamped to +-this (a number, not a verdict)
MAX_CHECKPOINT_FAILURES = 2**31
MAX_SCHEMA_BYTES = 64  # a model-schema hash (trainers send 16 bytes)
# samples/s averages the reports of about this many seconds of training (exponential weights by
# time, not by report: a peer reporting 600 steps/s would otherwise be judged on its last 16 ms,
# and a GC pause or a scheduler tick swung its published rate from 2k to 60k samples/s)
RATE_WINDOW = 5.0
MAX_NAME_CHARS = 32  # a volunteer's display name (ProgressTracker(name=...))
MAX_STEP_SECONDS = 86400.0  # a step time beyond a day is not a training step


def check_name(name: Any) -> str | None:
    """A volunteer's display name as published: None, or 1..``MAX_NAME_CHARS`` printable
    characters without leading or trailing spaces (``str.isprintable``: no control, format or
    separator characters but the space, so no newlines and no right-to-left overrides).
    Raises ``ValueError`` for anything else (readers use :func:`valid_name`)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ValueError(f"name must be a string, got {type(name).__name__}")
    if not 0 < len(name) <= MAX_NAME_CHARS:
        raise ValueError(f"name must be 1..{MAX_NAME_CHARS} characters, got {len(name)}")
    if not name.isprintable() or name != name.strip():
        raise ValueError(
            f"name must be printable characters without leading/trailing spaces, got {name!r}"
        )
    return name


def valid_name(name: Any) -> str | None:
    """``name`` if it passes :func:`check_name`, else None (an untrusted record's name)."""
    try:
        return check_name(name)
    except ValueError:
        return None


def progress_key(prefix: str) -> str:
    return f"{prefix}.progress"


def owner_subkey(peer_id: Any) -> str:
    return f"[owner:{peer_id.to_base58()}]"


def peer_of_subkey(subkey: Any) -> str | None:
    """The base58 PeerID in an ``[owner:<PeerID>]`` subkey; None for anything else.

    The DHT only stores such a subkey with that peer's signature, so the PeerID is proven.
    """
    if not isinstance(subkey, str) or not (subkey.startswith("[owner:") and subkey.endswith("]")):
        return None
    peer = subkey[len("[owner:") : -1]
    if not 0 < len(peer) <= 128 or "[" in peer or "]" in peer:
        return None
    return peer


@dataclass(frozen=True)
class PeerProgress:
    """One peer's record as published (after validation; clamping shows in ``ignored``).

    The health fields are optional on the wire (older peers do not send them): ``loss`` is
    the peer's recent training loss (clamped to +-``MAX_LOSS``), ``finite`` is False when its
    loss or state went NaN/Inf, ``checkpoint_failures`` counts its background checkpoints
    that failed in a row (a full or read-only disk). ``schema`` hashes the names and shapes
    of its training state (None: an older peer that does not send it). ``name`` is the display
    name its volunteer chose (None: none, or a malformed one); ``client`` is True for a DHT
    client (not reachable), False for a server, None when the peer does not say.
    """

    peer_id: str
    epoch: int
    samples: int
    samples_per_second: float
    time: float
    loss: float | None = None
    finite: bool = True
    checkpoint_failures: int = 0
    schema: bytes | None = None
    name: str | None = None
    client: bool | None = None
    # seconds between its reports (one per step), averaged like samples/s; None when the
    # peer does not say: how long a round must wait for this peer's current step to end
    step_seconds: float | None = None
    # DHT time at which it entered its epoch, and its recent seconds per epoch (None: the
    # peer does not say, or has not seen two epochs yet): `moshpit status` tells a swarm
    # whose epoch stopped moving from one that is merely slow
    epoch_since: float | None = None
    epoch_seconds: float | None = None
    # the epoch whose state it is loading from donors (None: it is not loading)
    catching_up: int | None = None

    @property
    def problem(self) -> str | None:
        """Why this peer is unhealthy, in a few words; None when it looks fine."""
        if not self.finite:
            return "its loss or state is NaN/Inf"
        if self.checkpoint_failures:
            return f"its last {self.checkpoint_failures} checkpoint(s) failed"
        return None


@dataclass(frozen=True)
class GlobalProgress:
    """The swarm's progress as one reader sees it (see :func:`aggregate` for the rule)."""

    epoch: int
    samples_accumulated: int
    target_batch_size: int | None
    num_peers: int
    samples_per_second: float
    eta_seconds: float | None
    peers: list[PeerProgress] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)
    time: float = 0.0  # DHT time of the aggregation
    # peers of the run whose model has another schema than the reader's: {peer: schema hex},
    # left out of everything above (at most MAX_IGNORED_REASONS of them listed)
    other_schemas: dict[str, str] = field(default_factory=dict)
    # each listed peer's samples/s after the throughput clamp (see aggregate)
    throughput: dict[str, float] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """True when the samples at the global epoch reached the target batch."""
        return (
            self.target_batch_size is not None
            and self.samples_accumulated >= self.target_batch_size
        )


def _is_int(value: Any, low: int, high: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_progress_record(
    peer_id: str,
    value: Any,
    expiration_time: float,
    *,
    now: float,
    max_clock_skew: float,
    max_lifetime: float,
) -> tuple[PeerProgress | None, str | None]:
    """Validate one untrusted record: (progress, None), (None, None) for a tombstone, or
    (None, reason) when it is malformed or absurd."""
    if value is None:
        return None, None  # withdrawn
    if not isinstance(value, Mapping):
        return None, f"record is a {type(value).__name__}, not a map"
    epoch, samples = value.get("epoch"), value.get("samples")
    sps, when = value.get("sps"), value.get("time")
    if not _is_int(epoch, 0, MAX_EPOCH):
        return None, f"epoch {epoch!r} is not an integer in [0, 2**53)"
    if not _is_int(samples, 0, MAX_SAMPLES):
        return None, f"samples {samples!r} is not an integer in [0, 2**53)"
    if not _is_number(sps) or not math.isfinite(sps) or not 0 <= sps <= MAX_SAMPLES_PER_SECOND:
        return None, f"samples/s {sps!r} is not a finite number in [0, 1e12]"
    if not _is_number(when) or not math.isfinite(when):
        return None, f"time {when!r} is not a finite number"
    if when > now + max_clock_skew:
        return None, f"time is {when - now:.0f}s in the future"
    if expiration_time - max(when, now) > max_lifetime:
        return (
            None,
            f"expires {expiration_time - now:.0f}s from now (more than {max_lifetime:.0f}s)",
        )
    loss, finite, failures = value.get("loss"), value.get("ok", True), value.get("ckf", 0)
    if loss is not None:
        if not _is_number(loss):
            return None, f"loss {loss!r} is not a number"
        if not math.isfinite(loss):
            loss, finite = None, False  # a NaN loss is a health report, not malformed
        else:
            loss = max(-MAX_LOSS, min(MAX_LOSS, float(loss)))
    if not isinstance(finite, bool):
        return None, f"ok {finite!r} is not a bool"
    if not _is_int(failures, 0, MAX_CHECKPOINT_FAILURES):
        return None, f"ckf {failures!r} is not an integer in [0, 2**31)"
    schema = value.get("s")
    if schema is not None and not (
        isinstance(schema, bytes) and 0 < len(schema) <= MAX_SCHEMA_BYTES
    ):
        return None, f"schema is not 1..{MAX_SCHEMA_BYTES} bytes"
    client = value.get("client")
    step = value.get("spt")
    if step is not None and not (
        _is_number(step) and math.isfinite(step) and 0 < step <= MAX_STEP_SECONDS
    ):
        return None, f"spt {step!r} is not a number of seconds in (0, {MAX_STEP_SECONDS:g}]"
    catching_up = value.get("cu")
    if catching_up is not None and not _is_int(catching_up, 0, MAX_EPOCH):
        return None, f"cu {catching_up!r} is not an epoch"
    since, per_epoch = value.get("es"), value.get("et")
    if since is not None and not (
        _is_number(since) and math.isfinite(since) and since <= now + max_clock_skew
    ):
        return None, f"es {since!r} is not a past DHT time"
    if per_epoch is not None and not (
        _is_number(per_epoch) and math.isfinite(per_epoch) and 0 < per_epoch <= MAX_STEP_SECONDS
    ):
        return None, f"et {per_epoch!r} is not a number of seconds in (0, {MAX_STEP_SECONDS:g}]"
    record = PeerProgress(
        peer_id,
        int(epoch),
        int(samples),
        float(sps),
        float(when),
        loss,
        finite,
        failures,
        schema,
        valid_name(value.get("name")),
        client if isinstance(client, bool) else None,
        float(step) if step is not None else None,
        float(since) if since is not None else None,
        float(per_epoch) if per_epoch is not None else None,
        catching_up,
    )
    return record, None


def parse_progress_records(
    found: Any, *, now: float, max_clock_skew: float, max_lifetime: float
) -> tuple[list[PeerProgress], dict[str, str]]:
    """Parse what ``node.get(progress_key(prefix))`` returned (None, a plain value or a dict)."""
    peers: list[PeerProgress] = []
    ignored: dict[str, str] = {}
    value = getattr(found, "value", None)
    if not isinstance(value, Mapping):
        if value is not None:
            ignored["?"] = "the progress key holds a plain value, not per-peer records"
        return peers, ignored
    for subkey, entry in list(value.items())[:MAX_RECORDS]:
        peer = peer_of_subkey(subkey)
        if peer is None:
            _note(ignored, str(subkey)[:80], "subkey is not [owner:<PeerID>] (unsigned)")
            continue
        record, reason = parse_progress_record(
            peer,
            getattr(entry, "value", None),
            float(getattr(entry, "expiration_time", now)),
            now=now,
            max_clock_skew=max_clock_skew,
            max_lifetime=max_lifetime,
        )
        if reason is not None:
            _note(ignored, peer, reason)
        elif record is not None:
            peers.append(record)
    return peers, ignored


def _note(ignored: dict[str, str], peer: str, reason: str) -> None:
    if len(ignored) < MAX_IGNORED_REASONS or peer in ignored:
        ignored[peer] = reason


def median_without(ordered: list[float], index: int) -> float:
    """The median of sorted ``ordered`` without its element at ``index`` (len >= 2)."""
    remaining = len(ordered) - 1

    def kth(k: int) -> float:
        return ordered[k] if k < index else ordered[k + 1]

    return (kth((remaining - 1) // 2) + kth(remaining // 2)) / 2


def _upper_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def aggregate(
    records: Iterable[PeerProgress],
    *,
    now: float,
    own: PeerProgress | None = None,
    target_batch_size: int | None = None,
    epoch_started_at: Mapping[int, float] | None = None,
    max_throughput_ratio: float = 10.0,
    throughput_tolerance: float = 1.5,
    clamp_slack: float = 10.0,
    ignored: Mapping[str, str] | None = None,
    schema: bytes | None = None,
) -> GlobalProgress:
    """The swarm's view from validated records (``own``: this peer's local, trusted state).

    - **Schema**: with ``schema`` (default: ``own.schema``), a record of another schema is
      another model's: it is left out of everything below and listed in ``other_schemas``.
      Records without a schema (older peers) count.
    - **Global epoch**: the highest epoch that at least two distinct peers have reached (the
      second-highest epoch among peers), never below ``own.epoch``; a lone peer's epoch when
      it is the only one. So one peer never moves the global epoch on its own.
    - **Throughput clamp**: a peer's samples/s counts at most ``max_throughput_ratio`` times
      the median samples/s of the *other* peers (no clamp when there are no others).
    - **Samples clamp**: a peer's samples at the global epoch count at most what its clamped
      throughput could have produced since the epoch started:
      ``throughput_tolerance * sps * (record.time - start + clamp_slack)``. ``start`` comes
      from ``epoch_started_at`` (when this reader saw the epoch begin) or, when unknown, is the
      upper median of the peers' implied starts ``time - samples / sps``.
    - ``own`` is never clamped (it is this peer's own count).
    - ``eta_seconds``: samples still missing (after extrapolating each peer's count to now) /
      total clamped samples/s at the global epoch; None without a target or throughput.
    """
    notes: dict[str, str] = dict(ignored or {})
    if schema is None and own is not None:
        schema = own.schema
    others: dict[str, str] = {}
    by_peer: dict[str, PeerProgress] = {}
    for record in records:
        if own is not None and record.peer_id == own.peer_id:
            continue  # our own local state is newer than what the DHT holds for us
        if schema is not None and record.schema is not None and record.schema != schema:
            _note(others, record.peer_id, record.schema.hex()[:12])
            continue  # another model under our run name: not one of ours
        known = by_peer.get(record.peer_id)
        if known is None or record.time > known.time:
            by_peer[record.peer_id] = record
    peers = list(by_peer.values())
    everyone = peers + ([own] if own is not None else [])
    if not everyone:
        return GlobalProgress(
            epoch=0,
            samples_accumulated=0,
            target_batch_size=target_batch_size,
            num_peers=0,
            samples_per_second=0.0,
            eta_seconds=None,
            peers=[],
            ignored=notes,
            time=now,
            other_schemas=others,
        )

    epochs = sorted((p.epoch for p in everyone), reverse=True)
    epoch = epochs[1] if len(epochs) >= 2 else epochs[0]
    if own is not None:
        epoch = max(epoch, own.epoch)

    # throughput clamp against the median of the others (O(n log n): records are many)
    ordered = sorted(p.samples_per_second for p in everyone)
    clamped_sps: dict[str, float] = {}
    for p in everyone:
        sps = p.samples_per_second
        if p is not own and len(ordered) > 1:
            cap = max_throughput_ratio * median_without(ordered, bisect.bisect_left(ordered, sps))
            if sps > cap:
                _note(notes, p.peer_id, f"samples/s {sps:.4g} clamped to {cap:.4g} (x median)")
                sps = cap
        clamped_sps[p.peer_id] = sps

    at_epoch = [p for p in everyone if p.epoch == epoch]
    start = (epoch_started_at or {}).get(epoch)
    if start is None:
        implied = [
            p.time - p.samples / clamped_sps[p.peer_id]
            for p in at_epoch
            if clamped_sps[p.peer_id] > 0
        ]
        start = _upper_median(implied) if implied else now

    total_samples = 0
    total_sps = 0.0
    projected = 0.0
    for p in at_epoch:
        sps = clamped_sps[p.peer_id]
        samples = p.samples
        if p is not own:
            plausible = throughput_tolerance * sps * max(0.0, p.time - start + clamp_slack)
            if samples > plausible:
                _note(
                    notes,
                    p.peer_id,
                    f"samples {samples} clamped to {int(plausible)} "
                    f"(more than {sps:.4g} samples/s since the epoch began)",
                )
                samples = int(plausible)
        total_samples += samples
        total_sps += sps
        projected += samples + sps * max(0.0, now - p.time)

    eta: float | None = None
    if target_batch_size is not None:
        missing = target_batch_size - projected
        if missing <= 0:
            eta = 0.0
        elif total_sps > 0:
            eta = missing / total_sps
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=total_samples,
        target_batch_size=target_batch_size,
        num_peers=len(everyone),
        samples_per_second=total_sps,
        eta_seconds=eta,
        peers=sorted(everyone, key=lambda p: (-p.epoch, p.peer_id)),
        ignored=notes,
        time=now,
        other_schemas=others,
        throughput=clamped_sps,
    )


class ProgressTracker:
    """Publishes this peer's progress in the DHT and aggregates everyone's (module docstring).

    :param dht: a ``dht.DHT`` facade (sync) or a ``DHTNode`` (trio: use the ``a*`` methods).
    :param prefix: the run's name; the record lives under ``{prefix}.progress``.
    :param target_batch_size: samples the swarm accumulates per global step (for ``eta``).
    :param ttl: lifetime of a published record; a peer that stops republishing (dead) drops
        out after at most this long. Records are republished every ``ttl / 3``.
    :param min_refresh_period: the fewest seconds between two publications (rate limit on
        reports) and between two reads of the DHT.
    :param max_refresh_period: the most seconds between two reads of the DHT.
    :param name: a display name for dashboards (``moshpit dashboard``), published with the
        record: 1..32 printable characters (see :func:`check_name`), or None.
    """

    def __init__(
        self,
        dht: Any,
        prefix: str,
        *,
        target_batch_size: int | None = None,
        ttl: float = 30.0,
        min_refresh_period: float = 0.5,
        max_refresh_period: float = 5.0,
        start: bool = True,
        max_throughput_ratio: float = 10.0,
        throughput_tolerance: float = 1.5,
        max_clock_skew: float = 15.0,
        request_timeout: float | None = None,
        name: str | None = None,
    ):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if target_batch_size is not None and not _is_int(target_batch_size, 1, MAX_SAMPLES):
            raise ValueError(f"target_batch_size must be a positive int, got {target_batch_size!r}")
        if not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        if not (0 < min_refresh_period <= max_refresh_period and math.isfinite(max_refresh_period)):
            raise ValueError(
                "need 0 < min_refresh_period <= max_refresh_period (finite), got "
                f"{min_refresh_period!r}, {max_refresh_period!r}"
            )
        if not (max_throughput_ratio >= 1 and throughput_tolerance >= 1):
            raise ValueError("max_throughput_ratio and throughput_tolerance must be >= 1")
        self.prefix = prefix
        self.key = progress_key(prefix)
        self.target_batch_size = target_batch_size
        self.ttl = float(ttl)
        self.min_refresh_period = float(min_refresh_period)
        self.max_refresh_period = float(max_refresh_period)
        self.max_throughput_ratio = float(max_throughput_ratio)
        self.throughput_tolerance = float(throughput_tolerance)
        self.max_clock_skew = float(max_clock_skew)
        # readers drop records that claim to live much longer than a republished one would
        self.max_lifetime = 10 * self.ttl
        # a reader notices a new epoch up to one refresh late: that much slack in the clamp
        self.clamp_slack = 2 * self.max_refresh_period
        self.request_timeout = (
            float(request_timeout) if request_timeout is not None else max(1.0, min(10.0, ttl / 3))
        )
        self._facade: Any = dht if hasattr(dht, "run_coroutine") else None
        self._node: Any = None if self._facade is not None else dht

        # local state: written by the user's thread, read by trio; a CriticalLock because leaving
        # on SIGTERM (withdraw) takes it too, maybe while the training thread holds it
        self._lock = CriticalLock()
        self._epoch: int | None = None
        self._samples = 0
        self._report_time = 0.0
        self._ewma_samples = 0.0
        self._ewma_seconds = 0.0
        self._ewma_reports = 0.0  # the reports behind those sums: seconds per step
        self._catching_up: int | None = None  # the epoch whose state we are loading
        self._epoch_since: float | None = None  # when we entered our epoch (DHT time)
        self._epoch_seconds: float | None = None  # our recent seconds per epoch
        self._reports = 0
        self._version = 0  # bumped by every report that changed what we would publish
        self._published_version = -1
        # the latest expiration any store of ours carried, acknowledged or not: a store that
        # no replica acknowledged (timed out) may still have landed, and a withdrawal must beat it
        self._last_expiration = -math.inf
        self._withdrawn = False
        self._read_soon = False
        self._discard_next = False
        self._epoch_started_at: dict[int, float] = {}
        self._global = GlobalProgress(0, 0, target_batch_size, 0, 0.0, None, [], {}, 0.0)
        # health, published with the next record (a change of it alone does not force one)
        self._loss: float | None = None
        self._finite = True
        self._checkpoint_failures = 0
        # hash of this peer's model schema (set_schema); records of other schemas are not ours
        self._schema: bytes | None = None
        self._schema_description = ""
        self._warned_schemas: set[str] = set()  # other schemas already warned about (bounded)
        self._name = check_name(name)

        self._token: trio.lowlevel.TrioToken | None = None
        self._wakeup: trio.Event | None = None
        self._wake_pending = False
        self._publish_lock: trio.Lock | None = None
        self._scope: trio.CancelScope | None = None
        self._service: concurrent.futures.Future[None] | None = None
        self._running = False
        self._closed = False
        if start and self._facade is not None:
            self.start()

    # ------------------------------------------------------------------ local state

    @property
    def peer_id(self) -> Any:
        return self._facade.peer_id if self._facade is not None else self._node.peer_id

    def report(self, epoch: int, samples: int) -> None:
        """Record this peer's epoch and the samples accumulated toward it (non-blocking).

        The background loop publishes the change soon (at most once per
        ``min_refresh_period``). samples/s is an average over recent reports.
        """
        if not _is_int(epoch, 0, MAX_EPOCH):
            raise ValueError(f"epoch must be an int in [0, 2**53), got {epoch!r}")
        if not _is_int(samples, 0, MAX_SAMPLES):
            raise ValueError(f"samples must be an int in [0, 2**53), got {samples!r}")
        if self._closed:
            raise RuntimeError("the progress tracker was shut down")
        now = get_dht_time()
        with self._lock:
            # the first report: read the swarm at once, so that the view holds this peer
            # from its first steps (a lone peer saw "0 peers" until the next periodic read)
            self._read_soon = self._read_soon or self._epoch is None
            if self._epoch is None or epoch != self._epoch:
                # a new epoch: the time since the last report went to averaging/loading,
                # not to producing these samples, so it does not enter samples/s
                if self._epoch is not None and epoch > self._epoch:
                    self._epoch_started_at.setdefault(epoch, now)  # we saw it begin
                    self._note_epoch_change(epoch - self._epoch, now)
                else:
                    self._epoch_since = now
            elif (self._samples == 0 and self._reports == 1) or self._discard_next:
                # the first interval ever: a trainer reports 0 when it starts, right after
                # computing its first batch, so this interval holds no compute time (it made
                # the first estimate thousands of samples/s); or the caller said so
                pass
            elif samples >= self._samples and now > self._report_time:
                elapsed = now - self._report_time
                kept = math.exp(-elapsed / RATE_WINDOW)
                self._ewma_samples = kept * self._ewma_samples + (samples - self._samples)
                self._ewma_seconds = kept * self._ewma_seconds + elapsed
                self._ewma_reports = kept * self._ewma_reports + 1.0
            changed = self._withdrawn or epoch != self._epoch or samples != self._samples
            self._discard_next = False
            self._epoch, self._samples, self._report_time = epoch, samples, now
            self._reports += 1
            self._withdrawn = False
            if changed:
                self._version += 1
        if changed:
            self._wake()

    def _note_epoch_change(self, epochs: int, now: float) -> None:
        """Seconds per epoch, averaged over the last few epochs (the caller holds the lock)."""
        if self._epoch_since is not None:
            took = (now - self._epoch_since) / epochs
            previous = self._epoch_seconds
            self._epoch_seconds = took if previous is None else 0.7 * previous + 0.3 * took
        self._epoch_since = now

    def discard_next_interval(self) -> None:
        """The samples of the next report were made before now (the batch a training loop
        computed before its first ``step()``, which reports 0 first): count them toward the
        epoch, not toward samples/s. Otherwise that interval holds no compute time, and 8
        samples in a millisecond read as 10,000 samples/s for the next seconds."""
        with self._lock:
            self._discard_next = True

    def mark_idle(self) -> None:
        """The time since the last report was not spent producing samples (waiting for a
        round, loading state): leave it out of samples/s."""
        with self._lock:
            self._report_time = get_dht_time()

    def report_health(
        self,
        *,
        loss: float | None = None,
        finite: bool | None = None,
        checkpoint_failures: int | None = None,
    ) -> None:
        """Record this peer's recent loss, whether its state is finite, and how many of its
        checkpoints failed in a row; they travel with the next published record. A change of
        ``finite`` or of the failure count publishes soon, a new loss only with the next
        record (every ``min_refresh_period`` while training)."""
        with self._lock:
            urgent = False
            if loss is not None:
                self._loss = float(loss)
            if finite is not None and finite != self._finite:
                self._finite, urgent = bool(finite), True
            if checkpoint_failures is not None and checkpoint_failures != self._checkpoint_failures:
                self._checkpoint_failures, urgent = int(checkpoint_failures), True
            if urgent:
                self._version += 1
        if urgent:
            self._wake()

    @property
    def schema(self) -> bytes | None:
        return self._schema

    def set_schema(self, schema: bytes | None, description: str = "") -> None:
        """Publish ``schema`` (a hash of this peer's model: its state's tensor names and
        shapes) with our record, and leave peers of another schema out of the view: they
        train another model under the same run name (``moshpit.Optimizer`` sets it)."""
        if schema is not None and not (
            isinstance(schema, bytes) and 0 < len(schema) <= MAX_SCHEMA_BYTES
        ):
            raise ValueError(f"schema must be 1..{MAX_SCHEMA_BYTES} bytes, got {schema!r}")
        with self._lock:
            if schema != self._schema:
                self._schema = schema
                self._schema_description = str(description)
                self._version += 1

    @property
    def name(self) -> str | None:
        return self._name

    def set_catching_up(self, epoch: int | None) -> None:
        """Publish (at once) that this peer is loading the state of ``epoch`` (None: it is
        not): the peers at that epoch then wait for it for a while, instead of moving on
        while it downloads and leaving it behind again (see ``epoch_rounds``)."""
        if epoch is not None and not _is_int(epoch, 0, MAX_EPOCH):
            raise ValueError(f"epoch must be an int in [0, 2**53), got {epoch!r}")
        with self._lock:
            changed = epoch != self._catching_up
            if changed:
                self._catching_up = epoch
                self._version += 1
        if changed:
            self._wake()

    def set_name(self, name: str | None) -> None:
        """Publish ``name`` (or none) as this peer's display name with the next record."""
        name = check_name(name)
        with self._lock:
            changed = name != self._name
            if changed:
                self._name = name
                self._version += 1
        if changed:
            self._wake()

    @property
    def samples_per_second(self) -> float:
        with self._lock:
            return self._ewma_samples / self._ewma_seconds if self._ewma_seconds > 0 else 0.0

    @property
    def step_seconds(self) -> float | None:
        """Seconds between this peer's reports while training (one per step); None before
        two reports."""
        with self._lock:
            return self._ewma_seconds / self._ewma_reports if self._ewma_reports > 0 else None

    def local_progress(self) -> PeerProgress | None:
        """What this peer publishes (None before the first report)."""
        sps = self.samples_per_second
        step = self.step_seconds
        with self._lock:
            if self._epoch is None or self._withdrawn:
                return None
            loss = self._loss
            finite = self._finite and (loss is None or math.isfinite(loss))
            return PeerProgress(
                str(self.peer_id),
                self._epoch,
                self._samples,
                sps,
                self._report_time,
                loss if loss is not None and math.isfinite(loss) else None,
                finite,
                self._checkpoint_failures,
                self._schema,
                self._name,
                step_seconds=step,
                epoch_since=self._epoch_since,
                epoch_seconds=self._epoch_seconds,
                catching_up=self._catching_up,
            )

    @property
    def global_progress(self) -> GlobalProgress:
        """The last aggregated view (no network access)."""
        with self._lock:
            return self._global

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the background loop on the DHT facade's thread (trio code: ``async with``)."""
        if self._running or self._closed:
            return
        if self._facade is None:
            raise RuntimeError(
                "a tracker on a DHTNode runs its loop in a nursery: use `async with tracker:` "
                "or `await nursery.start(tracker.run)`"
            )
        self._running = True
        self._service = self._facade.start_service(self._service_main)

    async def _service_main(self) -> None:
        await self.run()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The background loop: publish on change and every ttl/3, read every refresh period.

        Runs until cancelled (``shutdown``/leaving ``async with``); network errors are logged
        and retried on the next period, never raised.
        """
        self._token = trio.lowlevel.current_trio_token()
        self._wakeup = trio.Event()
        self._running = True
        next_read = trio.current_time()
        last_publish = -math.inf
        with trio.CancelScope() as scope:
            self._scope = scope
            task_status.started()
            while not self._closed:
                now = trio.current_time()
                with self._lock:
                    pending = self._epoch is not None and not self._withdrawn
                    dirty = pending and self._version != self._published_version
                if pending and (
                    (dirty and now >= last_publish + self.min_refresh_period)
                    or now >= last_publish + self.ttl / 3
                ):
                    last_publish = now
                    await self._guarded(self._apublish)
                with self._lock:
                    read_soon, self._read_soon = self._read_soon, False
                if now >= next_read or read_soon:
                    await self._guarded(self._aread)
                    next_read = trio.current_time() + self._read_period()
                deadline = next_read
                if pending:
                    deadline = min(deadline, last_publish + self.ttl / 3)
                    with self._lock:
                        if self._version != self._published_version:
                            deadline = min(deadline, last_publish + self.min_refresh_period)
                with trio.move_on_at(deadline):
                    await self._wakeup.wait()
                self._wakeup = trio.Event()
                self._wake_pending = False
        self._scope = None

    def _read_period(self) -> float:
        eta = self._global.eta_seconds
        period = self.max_refresh_period if eta is None else min(self.max_refresh_period, eta / 2)
        return max(self.min_refresh_period, period)

    async def _guarded(self, fn: Any) -> None:
        with trio.move_on_after(self.request_timeout) as scope:
            try:
                await fn()
            except Exception as e:  # noqa: BLE001 - the loop must survive network trouble
                logger.warning("progress tracker (%s): %s failed: %r", self.prefix, fn.__name__, e)
        if scope.cancelled_caught:
            logger.info("progress tracker (%s): %s timed out", self.prefix, fn.__name__)

    def _wake(self) -> None:
        """Wake the background loop from any thread (cheap; coalesced)."""
        token, event = self._token, self._wakeup
        if token is None or event is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            token.run_sync_soon(lambda: self._wakeup.set() if self._wakeup is not None else None)
        except trio.RunFinishedError:
            pass

    async def __aenter__(self) -> ProgressTracker:
        if self._facade is not None:
            self.start()
            return self
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        await nursery.start(self.run)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        if self._facade is not None:
            self.shutdown()
            return None
        try:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.request_timeout):
                    await self.awithdraw()
        finally:
            self._closed = True
            if self._scope is not None:
                self._scope.cancel()
            result = await self._nursery_cm.__aexit__(*exc_info)
        return result

    def __enter__(self) -> ProgressTracker:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the background loop and withdraw our record (sync facade). Idempotent."""
        if self._closed:
            return
        if self._facade is None:
            self._closed = True
            if self._scope is not None:
                self._scope.cancel()
            return
        if _in_trio():  # on the DHT's own thread: waiting for the loop would deadlock
            logger.info("progress tracker (%s): shut down from trio, not withdrawn", self.prefix)
        else:
            try:
                self.withdraw()
            except (RuntimeError, concurrent.futures.CancelledError, TimeoutError) as e:
                logger.info("progress tracker (%s): could not withdraw: %r", self.prefix, e)
        self._closed = True
        if self._service is not None:
            self._service.cancel()

    # ------------------------------------------------------------------ DHT I/O

    def _call(self, async_fn: Any, timeout: float | None) -> Any:
        if self._facade is None:
            raise RuntimeError("this tracker runs on a DHTNode: await the a* methods")
        if _in_trio():
            raise RuntimeError("this blocks on the DHT's loop: from trio code await the a* methods")

        async def run(_dht: Any, _node: Any) -> Any:
            return await async_fn()

        future = self._facade.run_coroutine(run, return_future=True)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the DHT did not answer within {timeout}s") from None

    def _get_node(self) -> Any:
        if self._facade is not None:
            return self._facade.node
        return self._node

    async def _apublish(self) -> None:
        """Store our record now (signed by the DHT because of the owner subkey)."""
        if self._publish_lock is None:
            self._publish_lock = trio.Lock()
        async with self._publish_lock:
            with self._lock:
                version = self._version
            mine = self.local_progress()
            if mine is None:
                return
            now = get_dht_time()
            value: dict[str, Any] = {
                "epoch": mine.epoch,
                "samples": mine.samples,
                "sps": mine.samples_per_second,
                "time": mine.time,
                "ok": mine.finite,
            }
            if mine.loss is not None:
                value["loss"] = max(-MAX_LOSS, min(MAX_LOSS, mine.loss))
            if mine.checkpoint_failures:
                value["ckf"] = min(mine.checkpoint_failures, MAX_CHECKPOINT_FAILURES - 1)
            if mine.schema is not None:
                value["s"] = mine.schema
            if mine.name is not None:
                value["name"] = mine.name
            if mine.step_seconds is not None:
                value["spt"] = min(mine.step_seconds, MAX_STEP_SECONDS)
            if mine.epoch_since is not None:
                value["es"] = mine.epoch_since
            if mine.epoch_seconds is not None:
                value["et"] = min(mine.epoch_seconds, MAX_STEP_SECONDS)
            if mine.catching_up is not None:
                value["cu"] = mine.catching_up
            node = self._get_node()
            client = getattr(node, "client_mode", None)
            if isinstance(client, bool):
                value["client"] = client
            expiration = max(now + self.ttl, self._last_expiration + 1e-3)
            self._last_expiration = expiration
            stored = await node.store(
                self.key, value, expiration, subkey=owner_subkey(node.peer_id)
            )
            if stored:
                with self._lock:
                    if not self._withdrawn:
                        self._published_version = version
            else:
                logger.info("progress tracker (%s): no replica accepted our record", self.prefix)

    async def _aread(self) -> GlobalProgress:
        node = self._get_node()
        found = await node.get(self.key, latest=True)
        now = get_dht_time()
        records, ignored = parse_progress_records(
            found, now=now, max_clock_skew=self.max_clock_skew, max_lifetime=self.max_lifetime
        )
        own = self.local_progress()
        with self._lock:
            started = dict(self._epoch_started_at)
        view = aggregate(
            records,
            now=now,
            own=own,
            target_batch_size=self.target_batch_size,
            epoch_started_at=started,
            max_throughput_ratio=self.max_throughput_ratio,
            throughput_tolerance=self.throughput_tolerance,
            clamp_slack=self.clamp_slack,
            ignored=ignored,
            schema=self._schema,
        )
        self._warn_other_schemas(view)
        with self._lock:
            previous = self._global
            # we saw the swarm enter this epoch only if we already knew an earlier one
            if view.epoch > previous.epoch and previous.num_peers > 0:
                self._epoch_started_at.setdefault(view.epoch, now)
            for old in [e for e in self._epoch_started_at if e < view.epoch - 1]:
                del self._epoch_started_at[old]
            self._global = view
        return view

    def _warn_other_schemas(self, view: GlobalProgress) -> None:
        """One WARNING per other schema seen (not per read: the peer stays for hours)."""
        new = {s for s in view.other_schemas.values() if s not in self._warned_schemas}
        if not new or self._schema is None or len(self._warned_schemas) >= MAX_IGNORED_REASONS:
            return
        self._warned_schemas |= new
        peers = [p for p, s in view.other_schemas.items() if s in new]
        logger.warning(
            "%d peer(s) of run %r train a model of another shape (schema %s; ours is %s%s): "
            "they are left out of this peer's progress and rounds, and cannot average or "
            "share state with it. Check that every peer of the run trains the same model "
            "(e.g. %s)",
            len(peers),
            self.prefix,
            ", ".join(sorted(new)),
            self._schema.hex()[:12],
            f", {self._schema_description}" if self._schema_description else "",
            peers[0][-6:],
        )

    async def arefresh(self) -> GlobalProgress:
        """Publish a pending change, then read and aggregate the swarm's records now."""
        with self._lock:
            dirty = (
                self._epoch is not None
                and not self._withdrawn
                and self._version != self._published_version
            )
        if dirty and not self._running:
            await self._apublish()
        return await self._aread()

    def refresh(self, timeout: float | None = None) -> GlobalProgress:
        """Read the swarm's progress now (sync facade); TimeoutError after ``timeout``."""
        return cast(GlobalProgress, self._call(self.arefresh, timeout))

    async def awithdraw(self) -> None:
        """Replace our record with a tombstone now: readers drop us at once."""
        with self._lock:
            self._withdrawn = True  # no publish starts after this
        if self._publish_lock is None:
            self._publish_lock = trio.Lock()
        # under the publish lock: a publish in flight when we were called has finished, so
        # its record (even one stored without an acknowledgement) is known and overwritten
        async with self._publish_lock:
            if self._last_expiration == -math.inf:
                return  # nothing of ours was ever sent
            node = self._get_node()
            expiration = max(self._last_expiration, get_dht_time()) + 1.0
            await node.store(self.key, None, expiration, subkey=owner_subkey(node.peer_id))
            self._last_expiration = expiration

    def withdraw(self, timeout: float | None = None) -> None:
        """Sync :meth:`awithdraw`. A later :meth:`report` publishes again."""
        self._call(self.awithdraw, timeout if timeout is not None else self.request_timeout)


def _in_trio() -> bool:
    """True on a thread that runs a trio loop (where blocking on the DHT would deadlock)."""
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True
