"""The swarm-wide aggregation rule: validated records in, one :class:`GlobalProgress` out.

Pure logic, apart from the tracker's I/O, so that every reader applies the same rule: the
tracker on each peer, ``moshpit status`` (one read) and the dashboard (its history). The rule
keeps one lying peer from moving the swarm; see :func:`aggregate` and docs/training-state.md
("The aggregation rule").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from moshpit.training.progress_record import GlobalProgress, PeerProgress, note_reason

__all__ = ["aggregate", "median_without"]


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
    peers, others = _latest_of_our_model(records, own, schema)
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
    epoch = _global_epoch(everyone, own)
    clamped_sps = _clamp_throughput(everyone, own, max_throughput_ratio, notes)
    at_epoch = [p for p in everyone if p.epoch == epoch]
    start = (epoch_started_at or {}).get(epoch)
    if start is None:
        start = _implied_start(at_epoch, clamped_sps, now)
    counted = _count_samples(
        at_epoch,
        own,
        clamped_sps,
        notes,
        start=start,
        now=now,
        tolerance=throughput_tolerance,
        slack=clamp_slack,
    )
    return GlobalProgress(
        epoch=epoch,
        samples_accumulated=counted.samples,
        target_batch_size=target_batch_size,
        num_peers=len(everyone),
        samples_per_second=counted.samples_per_second,
        eta_seconds=_eta(target_batch_size, counted),
        peers=sorted(everyone, key=lambda p: (-p.epoch, p.peer_id)),
        ignored=notes,
        time=now,
        other_schemas=others,
        throughput=clamped_sps,
    )


def _latest_of_our_model(
    records: Iterable[PeerProgress], own: PeerProgress | None, schema: bytes | None
) -> tuple[list[PeerProgress], dict[str, str]]:
    """Each other peer's newest record of our schema, and {peer: schema hex} of the others."""
    others: dict[str, str] = {}
    by_peer: dict[str, PeerProgress] = {}
    for record in records:
        if own is not None and record.peer_id == own.peer_id:
            continue  # our own local state is newer than what the DHT holds for us
        if schema is not None and record.schema is not None and record.schema != schema:
            note_reason(others, record.peer_id, record.schema.hex()[:12])
            continue  # another model under our run name: not one of ours
        known = by_peer.get(record.peer_id)
        if known is None or record.time > known.time:
            by_peer[record.peer_id] = record
    return list(by_peer.values()), others


def _global_epoch(everyone: list[PeerProgress], own: PeerProgress | None) -> int:
    """The second-highest epoch (a lone peer's own), never below ``own``'s."""
    epochs = sorted((p.epoch for p in everyone), reverse=True)
    epoch = epochs[1] if len(epochs) >= 2 else epochs[0]
    if own is not None:
        epoch = max(epoch, own.epoch)
    return epoch


def _clamp_throughput(
    everyone: list[PeerProgress],
    own: PeerProgress | None,
    max_throughput_ratio: float,
    notes: dict[str, str],
) -> dict[str, float]:
    """Each peer's samples/s, at most ``max_throughput_ratio`` times the median of the others
    (O(n log n): records are many)."""
    ordered = sorted(p.samples_per_second for p in everyone)
    clamped_sps: dict[str, float] = {}
    for p in everyone:
        sps = p.samples_per_second
        if p is not own and len(ordered) > 1:
            cap = max_throughput_ratio * median_without(ordered, bisect.bisect_left(ordered, sps))
            if sps > cap:
                note_reason(
                    notes, p.peer_id, f"samples/s {sps:.4g} clamped to {cap:.4g} (x median)"
                )
                sps = cap
        clamped_sps[p.peer_id] = sps
    return clamped_sps


def _implied_start(
    at_epoch: list[PeerProgress], clamped_sps: Mapping[str, float], now: float
) -> float:
    """When the epoch began, as the peers' counts imply (the upper median); ``now`` if none can."""
    implied = [
        p.time - p.samples / clamped_sps[p.peer_id] for p in at_epoch if clamped_sps[p.peer_id] > 0
    ]
    return _upper_median(implied) if implied else now


@dataclass
class _Counted:
    """The samples and samples/s at the global epoch, and the samples extrapolated to now."""

    samples: int = 0
    samples_per_second: float = 0.0
    projected: float = 0.0


def _count_samples(
    at_epoch: list[PeerProgress],
    own: PeerProgress | None,
    clamped_sps: Mapping[str, float],
    notes: dict[str, str],
    *,
    start: float,
    now: float,
    tolerance: float,
    slack: float,
) -> _Counted:
    """Sum the peers' samples at the epoch, each at most what its throughput made since
    ``start`` (``own`` is trusted)."""
    counted = _Counted()
    for p in at_epoch:
        sps = clamped_sps[p.peer_id]
        samples = p.samples
        if p is not own:
            plausible = tolerance * sps * max(0.0, p.time - start + slack)
            if samples > plausible:
                note_reason(
                    notes,
                    p.peer_id,
                    f"samples {samples} clamped to {int(plausible)} "
                    f"(more than {sps:.4g} samples/s since the epoch began)",
                )
                samples = int(plausible)
        counted.samples += samples
        counted.samples_per_second += sps
        counted.projected += samples + sps * max(0.0, now - p.time)
    return counted


def _eta(target_batch_size: int | None, counted: _Counted) -> float | None:
    """Seconds until the projected samples reach the target (None: no target or throughput)."""
    if target_batch_size is None:
        return None
    missing = target_batch_size - counted.projected
    if missing <= 0:
        return 0.0
    if counted.samples_per_second > 0:
        return missing / counted.samples_per_second
    return None
