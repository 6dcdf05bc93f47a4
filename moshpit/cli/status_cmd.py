"""``moshpit status``: what a run looks like right now, for its operator. Never imports torch.

Joins the DHT as a client (no listening socket, never in anyone's routing table), reads the
run's progress records (``{prefix}.progress``, see ``moshpit/training/progress.py``) and donor
records (``{prefix}.state``, see ``moshpit/training/sharing.py``) through
``moshpit/training/run_records.py`` (which ``moshpit dashboard`` reads them through too),
aggregates them with the same rule every peer uses, and prints a table plus a one-line health
verdict (``--json``: one JSON object instead).

Exit status: 0 when the run is healthy, 1 when it is not (no peers, stalled, a peer reports a
NaN loss or state or failing checkpoints, no donor serves the current state) or the DHT could
not be reached, 2 for a usage error (e.g. a bad address).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

# the record reading moved to moshpit/training/run_records.py (shared with the dashboard)
from moshpit.netutil import short
from moshpit.training.run_records import (  # noqa: F401 - re-exported names
    DIGEST_BYTES,
    MAX_DONOR_RECORDS,
    Donor,
    parse_donor_records,
)

DEFAULT_TIMEOUT = 20.0
DEFAULT_STALL_AFTER = 60.0


class UsageError(ValueError):
    """A command-line value that cannot work (reported in one line, exit status 2)."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Show a run's peers, epochs, throughput and state donors, and whether it is healthy. "
        "Exit status: 0 healthy, 1 unhealthy or unreachable, 2 usage error."
    )
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        required=True,
        metavar="MADDR",
        help="multiaddrs (with /p2p/<PeerID>) of any live peers of the swarm",
    )
    parser.add_argument(
        "--run-id",
        "--prefix",
        dest="prefix",
        required=True,
        help="the run's id: run_id of moshpit.Optimizer, --run-id of moshpit train, prefix of "
        "moshpit.Averager (--prefix is the same option)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (for scripts)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up joining/reading the DHT after this long (default {DEFAULT_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--stall-after",
        type=float,
        default=DEFAULT_STALL_AFTER,
        metavar="SECONDS",
        help="call the run stalled when no peer reported progress for this long "
        f"(default {DEFAULT_STALL_AFTER:.0f})",
    )
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="the run's target batch size, to estimate the time to the next global step",
    )


# ------------------------------------------------------------------------------ the snapshot


@dataclass
class Snapshot:
    """Everything the table, the JSON and the verdict are made from."""

    prefix: str
    now: float
    progress: Any  # moshpit.training.progress.GlobalProgress
    donors: list[Donor] = field(default_factory=list)
    ignored_donors: dict[str, str] = field(default_factory=dict)


async def collect(
    initial_peers: list[Any],
    prefix: str,
    *,
    time_limit: float,
    target_batch_size: int | None = None,
) -> Snapshot:
    """Join as a DHT client, read the run's records and aggregate them.

    Raises ``dht.BootstrapError`` when no initial peer answers and ``trio.TooSlowError``
    after ``time_limit`` seconds.
    """
    from dht.kademlia.node import DHTNode
    from moshpit.training.progress_aggregate import aggregate
    from moshpit.training.run_records import read_run

    with trio.fail_after(time_limit):
        async with DHTNode.open(
            initial_peers=initial_peers, client_mode=True, bootstrap_timeout=time_limit
        ) as node:
            run = await read_run(node, prefix)
    view = aggregate(
        run.progress, now=run.now, target_batch_size=target_batch_size, ignored=run.ignored
    )
    return Snapshot(prefix, run.now, view, run.donors, run.ignored_donors)


# ------------------------------------------------------------------------------ the verdict


STALLED_EPOCHS = 5  # an epoch that lasts this many times the usual one has stopped moving


if TYPE_CHECKING:
    from moshpit.training.progress_record import GlobalProgress


def epoch_stall(view: GlobalProgress, now: float, stall_after: float) -> str | None:
    """Peers that keep stepping while their epoch does not move (they wait for each other,
    or for a state nobody serves) look busy: the verdict compares how long the swarm's
    epoch has lasted with how long epochs usually take, as the peers report them. Medians
    over the peers: one peer's numbers cannot make a swarm look stalled, nor hide a stall."""
    at_epoch = [p for p in view.peers if p.epoch == view.epoch and p.epoch_since is not None]
    usual = sorted(p.epoch_seconds for p in view.peers if p.epoch_seconds is not None)
    if not at_epoch or not usual:
        return None
    since = sorted(p.epoch_since for p in at_epoch if p.epoch_since is not None)[len(at_epoch) // 2]
    per_epoch = usual[len(usual) // 2]
    lasted = now - since
    if lasted <= max(STALLED_EPOCHS * per_epoch, stall_after):
        return None
    return (
        f"stalled: epoch {view.epoch} began {lasted:.0f} s ago and epochs took {per_epoch:.1f} s "
        f"before, while {len(view.peers)} peers keep reporting (they wait for each other, or "
        "for a state no donor serves: see their logs)"
    )


def health_verdict(snapshot: Snapshot, stall_after: float) -> tuple[bool, str]:
    """(healthy, one line for the operator).

    Unhealthy: no peers, no progress for ``stall_after`` s, a peer that reports a NaN/Inf
    loss or state or failing checkpoints, or no donor a joiner could load from. A donor
    counts when it serves the current epoch, a later one, or the one before: a peer
    checkpoints after it stepped, so the newest donor record trails the epoch by one for a
    moment after every step (counting only the current epoch made the verdict flap).
    """
    view = snapshot.progress
    if not view.peers:
        return False, (
            f"no peers report progress under run id {snapshot.prefix!r}: check the run id (the "
            "run_id the peers give moshpit.Optimizer, or --run-id of moshpit train); run ids "
            "are matched whole, not as a prefix"
        )
    quiet = snapshot.now - max(p.time for p in view.peers)
    if quiet > stall_after:
        return False, f"stalled: no progress for {quiet:.0f} s ({len(view.peers)} peers listed)"
    stuck = epoch_stall(view, snapshot.now, stall_after)
    if stuck is not None:
        return False, stuck
    problems = []
    sick = [p for p in view.peers if p.problem is not None]
    if sick:
        problems.append(
            f"{len(sick)} unhealthy peer(s): "
            + ", ".join(f"{short(p.peer_id)} ({p.problem})" for p in sick[:4])
            + (", ..." if len(sick) > 4 else "")
        )
    complete = [d.epoch for d in snapshot.donors if d.complete]
    serving = [e for e in complete if e >= view.epoch - 1]
    if not serving:
        newest = f"newest donor epoch: {max(complete)}" if complete else "no donors at all"
        problems.append(
            f"no donor serves epoch {view.epoch} (or {view.epoch - 1}): joiners cannot load "
            f"the current state ({newest})"
        )
    if problems:
        return False, "unhealthy: " + "; ".join(problems)
    at_epoch = sum(1 for p in view.peers if p.epoch == view.epoch)
    behind = sum(1 for p in view.peers if p.epoch < view.epoch)
    ahead = len(view.peers) - at_epoch - behind  # at most one honest-looking peer, or liars
    tail = (f", {behind} behind" if behind else "") + (f", {ahead} ahead" if ahead else "")
    losses = sorted(p.loss for p in view.peers if p.loss is not None)
    loss = f", median loss {losses[len(losses) // 2]:.4g}" if losses else ""
    return True, (
        f"healthy: {at_epoch} peers at epoch {view.epoch}{tail}{loss}, "
        f"{len(serving)} donors serve epoch {min(serving)}"
        + (f"-{max(serving)}" if max(serving) != min(serving) else "")
    )


def to_json(snapshot: Snapshot, healthy: bool, verdict: str) -> dict[str, Any]:
    view = snapshot.progress
    donor_of = {d.peer_id: d for d in snapshot.donors}
    peers = []
    for p in view.peers:
        donor = donor_of.get(p.peer_id)
        peers.append(
            {
                "peer_id": p.peer_id,
                "name": p.name,
                "epoch": p.epoch,
                "samples": p.samples,
                "samples_per_second": p.samples_per_second,
                "age_seconds": round(snapshot.now - p.time, 3),
                "loss": p.loss,
                "finite": p.finite,
                "checkpoint_failures": p.checkpoint_failures,
                "problem": p.problem,
                "donor": donor is not None,
                "donor_epoch": donor.epoch if donor is not None else None,
            }
        )
    return {
        "prefix": snapshot.prefix,
        "healthy": healthy,
        "verdict": verdict,
        "epoch": view.epoch,
        "num_peers": view.num_peers,
        "samples_accumulated": view.samples_accumulated,
        "samples_per_second": view.samples_per_second,
        "target_batch_size": view.target_batch_size,
        "eta_seconds": view.eta_seconds,
        "peers": peers,
        "donors": [
            {
                "peer_id": d.peer_id,
                "epoch": d.epoch,
                "bytes": d.nbytes,
                "complete": d.complete,
                "root": d.root,
            }
            for d in snapshot.donors
        ],
        "ignored": {**view.ignored, **snapshot.ignored_donors},
        "time": snapshot.now,
    }


def _age(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def print_table(snapshot: Snapshot, verdict: str) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    view = snapshot.progress
    donor_of = {d.peer_id: d for d in snapshot.donors}
    table = Table(title=f"run {snapshot.prefix!r}: global epoch {view.epoch}")
    for name, justify in (
        ("peer", "left"),
        ("epoch", "right"),
        ("samples this epoch", "right"),
        ("samples/s", "right"),
        ("loss", "right"),
        ("updated", "right"),
        ("donor (epoch)", "left"),
        ("health", "left"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    listed = set()
    for p in view.peers:
        donor = donor_of.get(p.peer_id)
        listed.add(p.peer_id)
        # a name is the peer's own text: a Text, never parsed as rich markup
        peer = Text(short(p.peer_id) + (f" {p.name}" if p.name else ""))
        table.add_row(
            peer,
            str(p.epoch),
            str(p.samples),
            f"{p.samples_per_second:.1f}",
            "-" if p.loss is None else f"{p.loss:.4g}",
            _age(snapshot.now - p.time) + " ago",
            _donor_cell(donor),
            "ok" if p.problem is None else p.problem,
        )
    for donor in snapshot.donors:  # donors that do not train (no progress record)
        if donor.peer_id not in listed:
            table.add_row(short(donor.peer_id), "-", "-", "-", "-", "-", _donor_cell(donor), "")
    console = Console(width=max(100, Console().width))
    console.print(table)
    eta = "" if view.eta_seconds is None else f", next global step in ~{view.eta_seconds:.0f}s"
    target = f"/{view.target_batch_size}" if view.target_batch_size else ""
    console.print(
        f"{view.num_peers} live peers, {view.samples_accumulated}{target} samples at epoch "
        f"{view.epoch}, {view.samples_per_second:.1f} samples/s{eta}",
        markup=False,
        highlight=False,
    )
    for peer, reason in sorted({**view.ignored, **snapshot.ignored_donors}.items())[:10]:
        console.print(f"note: {short(peer)}: {reason}", markup=False, highlight=False)
    sys.stdout.write(verdict + "\n")  # plain, unwrapped: the last line is the verdict
    sys.stdout.flush()


def _donor_cell(donor: Donor | None) -> str:
    if donor is None:
        return ""
    return f"yes ({donor.epoch})" if donor.complete else f"partial ({donor.epoch})"


# ------------------------------------------------------------------------------ entry point


def _parse_initial_peers(values: list[str]) -> list[Any]:
    from dht.p2p import MultiaddrError
    from dht.p2p.multiaddr import parse_multiaddr_list  # dht ships in the same distribution

    try:
        return parse_multiaddr_list(values, "--initial-peers")
    except (MultiaddrError, TypeError) as e:
        raise UsageError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from dht.kademlia.errors import BootstrapError

    try:
        initial_peers = _parse_initial_peers(args.initial_peers)
        if not (math.isfinite(args.timeout) and args.timeout > 0):
            raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout}")
        if not (math.isfinite(args.stall_after) and args.stall_after > 0):
            raise UsageError(f"--stall-after must be a positive number, not {args.stall_after}")
        if args.target_batch_size is not None and args.target_batch_size <= 0:
            raise UsageError("--target-batch-size must be a positive integer")
        if not args.prefix:
            raise UsageError("--run-id must not be empty")
    except UsageError as e:
        print(f"moshpit status: {e}", file=sys.stderr)
        return 2
    try:
        snapshot = trio.run(
            lambda: collect(
                initial_peers,
                args.prefix,
                time_limit=args.timeout,
                target_batch_size=args.target_batch_size,
            )
        )
    except BootstrapError as e:
        print(f"moshpit status: {e}", file=sys.stderr)
        return 1
    except trio.TooSlowError:
        print(
            f"moshpit status: no answer from the DHT within {args.timeout:.0f}s "
            "(raise --timeout, or check the addresses)",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 1
    healthy, verdict = health_verdict(snapshot, args.stall_after)
    if args.json:
        sys.stdout.write(json.dumps(to_json(snapshot, healthy, verdict)) + "\n")
        sys.stdout.flush()
    else:
        print_table(snapshot, verdict)
    return 0 if healthy else 1
