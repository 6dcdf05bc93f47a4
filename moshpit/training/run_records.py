"""Reading what a run's peers publish, for the tools that watch a run. Never imports torch.

Two keys per run (``prefix`` = the run's id):

- ``{prefix}.progress``: one progress record per peer (``moshpit/training/progress.py``);
- ``{prefix}.state``: one donor record per peer that serves the training state
  (``moshpit/training/sharing.py``).

Both hold ``[owner:<PeerID>]`` subkeys, so every record is signed by the peer it names; what a
record *says* is still untrusted: :func:`read_run` validates each record (malformed ones are
listed in ``ignored`` with a reason) and leaves the aggregation, with its clamps, to
:func:`moshpit.training.progress.aggregate`. ``moshpit status`` (one read) and
``moshpit dashboard`` (a read every few seconds) both read a run through here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from moshpit.training.progress_record import PeerProgress, parse_progress_records, peer_of_subkey

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode

__all__ = [
    "DIGEST_BYTES",
    "MAX_DONOR_RECORDS",
    "Donor",
    "RunRecords",
    "parse_donor_records",
    "read_run",
    "state_key",
]

MAX_DONOR_RECORDS = 4096
DIGEST_BYTES = 32  # a state root is a SHA-256 (moshpit/training/manifest.py)
# a reader has no ttl of its own: allow the default tracker's (30 s) lifetime bound
MAX_CLOCK_SKEW = 15.0
MAX_LIFETIME = 300.0


def state_key(prefix: str) -> str:
    return f"{prefix}.state"


@dataclass(frozen=True)
class Donor:
    peer_id: str
    epoch: int
    nbytes: int
    complete: bool
    root: str  # hex


@dataclass
class RunRecords:
    """One read of a run: validated progress and donor records, and what was left out."""

    prefix: str
    now: float  # DHT time of the read
    progress: list[PeerProgress] = field(default_factory=list)
    ignored: dict[str, str] = field(default_factory=dict)  # progress records left out: why
    donors: list[Donor] = field(default_factory=list)
    ignored_donors: dict[str, str] = field(default_factory=dict)


def parse_donor_records(found: Any) -> tuple[list[Donor], dict[str, str]]:
    """Donor records from ``node.get(f"{prefix}.state")``, validated (untrusted)."""
    donors: list[Donor] = []
    ignored: dict[str, str] = {}
    value = getattr(found, "value", None)
    if not isinstance(value, Mapping):
        return donors, ignored
    for subkey, entry in list(value.items())[:MAX_DONOR_RECORDS]:
        peer = peer_of_subkey(subkey)
        record = getattr(entry, "value", None)
        if peer is None:
            ignored[str(subkey)[:80]] = "subkey is not [owner:<PeerID>] (unsigned)"
            continue
        if record is None:
            continue  # withdrawn
        reason = _donor_problem(record)
        if reason is not None:
            ignored[peer] = reason
            continue
        donors.append(
            Donor(
                peer,
                record["epoch"],
                record["bytes"],
                record["complete"],
                record["root"].hex(),
            )
        )
    return donors, ignored


def _donor_problem(record: Any) -> str | None:
    if not isinstance(record, Mapping):
        return f"record is a {type(record).__name__}, not a map"
    root, epoch = record.get("root"), record.get("epoch")
    nbytes, complete = record.get("bytes"), record.get("complete")
    if not isinstance(root, bytes) or len(root) != DIGEST_BYTES:
        return f"root is not {DIGEST_BYTES} bytes"
    for name, number in (("epoch", epoch), ("bytes", nbytes)):
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 2**53:
            return f"{name} {number!r} is not an integer in [0, 2**53)"
    if not isinstance(complete, bool):
        return f"complete {complete!r} is not a bool"
    return None


async def read_run(
    node: DHTNode,
    prefix: str,
    *,
    max_clock_skew: float = MAX_CLOCK_SKEW,
    max_lifetime: float = MAX_LIFETIME,
) -> RunRecords:
    """Read both keys of run ``prefix`` at once through ``node`` (a ``DHTNode``) and validate
    them. No timeout of its own: callers wrap it in one (a lookup ends by itself, but a slow
    network makes it slow)."""
    from dht.kademlia.clock import get_dht_time
    from moshpit.training.progress_record import progress_key

    found: dict[str, Any] = {}

    async def read(key: str) -> None:
        found[key] = await node.get(key, latest=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read, progress_key(prefix))
        nursery.start_soon(read, state_key(prefix))
    now = get_dht_time()
    records, ignored = parse_progress_records(
        found[progress_key(prefix)],
        now=now,
        max_clock_skew=max_clock_skew,
        max_lifetime=max_lifetime,
    )
    donors, ignored_donors = parse_donor_records(found[state_key(prefix)])
    return RunRecords(prefix, now, records, ignored, donors, ignored_donors)
