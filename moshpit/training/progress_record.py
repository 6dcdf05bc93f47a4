"""The progress record on the wire: what one peer publishes under ``{prefix}.progress``.

Its own module because it is the contract between peers, read by more than the tracker
(:mod:`moshpit.training.progress`): ``moshpit status`` and the dashboard (through
:mod:`moshpit.training.run_records`) parse it without running a tracker. Records are untrusted: :func:`parse_progress_record` turns one into a :class:`PeerProgress`
or a reason to ignore it, never an exception. Torch-free and trio-free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

__all__ = [
    "GlobalProgress",
    "PeerProgress",
    "check_name",
    "encode_progress_record",
    "owner_subkey",
    "parse_progress_record",
    "parse_progress_records",
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
    """The swarm's progress as one reader sees it (the rule:
    :func:`moshpit.training.progress_aggregate.aggregate`)."""

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


def is_int(value: Any, low: int, high: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


class _Malformed(ValueError):
    """Why a record is ignored: raised by the steps of :func:`parse_progress_record`."""


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
    try:
        epoch, samples, sps, when = _position(
            value,
            expiration_time,
            now=now,
            max_clock_skew=max_clock_skew,
            max_lifetime=max_lifetime,
        )
        loss, finite, failures = _health(value)
        schema = _schema(value)
        step, catching_up, since, per_epoch = _timing(value, latest=now + max_clock_skew)
    except _Malformed as e:
        return None, str(e)
    client = value.get("client")
    record = PeerProgress(
        peer_id,
        epoch,
        samples,
        sps,
        when,
        loss,
        finite,
        failures,
        schema,
        valid_name(value.get("name")),
        client if isinstance(client, bool) else None,
        step,
        since,
        per_epoch,
        catching_up,
    )
    return record, None


def _position(
    value: Mapping[Any, Any],
    expiration_time: float,
    *,
    now: float,
    max_clock_skew: float,
    max_lifetime: float,
) -> tuple[int, int, float, float]:
    """Epoch, samples, samples/s and report time: the fields every record has."""
    epoch, samples = value.get("epoch"), value.get("samples")
    sps, when = value.get("sps"), value.get("time")
    if not is_int(epoch, 0, MAX_EPOCH):
        raise _Malformed(f"epoch {epoch!r} is not an integer in [0, 2**53)")
    if not is_int(samples, 0, MAX_SAMPLES):
        raise _Malformed(f"samples {samples!r} is not an integer in [0, 2**53)")
    if not is_number(sps) or not math.isfinite(sps) or not 0 <= sps <= MAX_SAMPLES_PER_SECOND:
        raise _Malformed(f"samples/s {sps!r} is not a finite number in [0, 1e12]")
    if not is_number(when) or not math.isfinite(when):
        raise _Malformed(f"time {when!r} is not a finite number")
    if when > now + max_clock_skew:
        raise _Malformed(f"time is {when - now:.0f}s in the future")
    if expiration_time - max(when, now) > max_lifetime:
        raise _Malformed(
            f"expires {expiration_time - now:.0f}s from now (more than {max_lifetime:.0f}s)"
        )
    return int(epoch), int(samples), float(sps), float(when)


def _health(value: Mapping[Any, Any]) -> tuple[float | None, bool, int]:
    """Loss (clamped; a NaN one is a health report, not malformed), finite, checkpoint failures."""
    loss, finite, failures = value.get("loss"), value.get("ok", True), value.get("ckf", 0)
    if loss is not None:
        if not is_number(loss):
            raise _Malformed(f"loss {loss!r} is not a number")
        if not math.isfinite(loss):
            loss, finite = None, False
        else:
            loss = max(-MAX_LOSS, min(MAX_LOSS, float(loss)))
    if not isinstance(finite, bool):
        raise _Malformed(f"ok {finite!r} is not a bool")
    if not is_int(failures, 0, MAX_CHECKPOINT_FAILURES):
        raise _Malformed(f"ckf {failures!r} is not an integer in [0, 2**31)")
    return loss, finite, failures


def _schema(value: Mapping[Any, Any]) -> bytes | None:
    schema = value.get("s")
    if schema is not None and not (
        isinstance(schema, bytes) and 0 < len(schema) <= MAX_SCHEMA_BYTES
    ):
        raise _Malformed(f"schema is not 1..{MAX_SCHEMA_BYTES} bytes")
    return schema


def _timing(
    value: Mapping[Any, Any], *, latest: float
) -> tuple[float | None, int | None, float | None, float | None]:
    """Seconds per step, the epoch being loaded, since when at this epoch, seconds per epoch
    (all optional; ``latest``: the last DHT time a peer may claim)."""
    step = value.get("spt")
    if step is not None and not (
        is_number(step) and math.isfinite(step) and 0 < step <= MAX_STEP_SECONDS
    ):
        raise _Malformed(f"spt {step!r} is not a number of seconds in (0, {MAX_STEP_SECONDS:g}]")
    catching_up = value.get("cu")
    if catching_up is not None and not is_int(catching_up, 0, MAX_EPOCH):
        raise _Malformed(f"cu {catching_up!r} is not an epoch")
    since, per_epoch = value.get("es"), value.get("et")
    if since is not None and not (is_number(since) and math.isfinite(since) and since <= latest):
        raise _Malformed(f"es {since!r} is not a past DHT time")
    if per_epoch is not None and not (
        is_number(per_epoch) and math.isfinite(per_epoch) and 0 < per_epoch <= MAX_STEP_SECONDS
    ):
        raise _Malformed(
            f"et {per_epoch!r} is not a number of seconds in (0, {MAX_STEP_SECONDS:g}]"
        )
    return (
        float(step) if step is not None else None,
        catching_up,
        float(since) if since is not None else None,
        float(per_epoch) if per_epoch is not None else None,
    )


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
            note_reason(ignored, str(subkey)[:80], "subkey is not [owner:<PeerID>] (unsigned)")
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
            note_reason(ignored, peer, reason)
        elif record is not None:
            peers.append(record)
    return peers, ignored


def note_reason(ignored: dict[str, str], peer: str, reason: str) -> None:
    """Keep ``reason`` for ``peer``, at most ``MAX_IGNORED_REASONS`` peers (junk stays small)."""
    if len(ignored) < MAX_IGNORED_REASONS or peer in ignored:
        ignored[peer] = reason


def encode_progress_record(mine: PeerProgress, client: Any) -> dict[str, Any]:
    """What a peer stores for ``mine`` (optional fields only when set; ``client``: the DHT
    node's ``client_mode``, sent when it is a bool)."""
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
    if isinstance(client, bool):
        value["client"] = client
    return value
