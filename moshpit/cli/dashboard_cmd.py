"""``moshpit dashboard``: serve a live web page of a run. Never imports torch.

Joins the DHT as a client (like ``moshpit status``), reads the run's progress and donor
records every ``--interval`` seconds and serves one page at ``http://ADDR:PORT/`` that shows
them (peers, throughput and epoch over time, loss across peers, contributions), plus the JSON
it is drawn from at ``/api/run.json``. See docs/dashboard.md.

Exit status: 0 when stopped with Ctrl-C, 1 when the DHT could not be joined, 2 for a usage
error (a bad address, a port in use, the ``dashboard`` extra not installed).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import trio

from moshpit.cli.status_cmd import UsageError, _parse_initial_peers

DEFAULT_PORT = 8080
DEFAULT_ADDR = "127.0.0.1"
DEFAULT_TIMEOUT = 20.0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from moshpit.dashboard.history import DEFAULT_HISTORY
    from moshpit.dashboard.server import DEFAULT_INTERVAL

    parser.description = (
        "Serve a live web page of a run: its peers, throughput, epoch and loss over time, and "
        "who contributed how many samples, from what the peers publish in the DHT. "
        "Needs the 'dashboard' extra (pip install 'moshpit-train[dashboard]')."
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
        help="the run's id (run_id of moshpit.Optimizer, --run-id of moshpit train)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port of the page (default: %(default)s; 0: any free port)",
    )
    parser.add_argument(
        "--addr",
        default=DEFAULT_ADDR,
        help="address to listen on (default: %(default)s, this machine only; 0.0.0.0 shows "
        "the page to everyone who can reach this machine)",
    )
    parser.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help="seconds between two reads of the run (default: %(default)s)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=DEFAULT_HISTORY,
        metavar="POINTS",
        help="points kept for the charts, one per read (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"give up joining the DHT after this long (default {DEFAULT_TIMEOUT:.0f})",
    )


def check_args(args: argparse.Namespace) -> list[Any]:
    """The parsed initial peers; raises UsageError for a value that cannot work."""
    initial_peers = _parse_initial_peers(args.initial_peers)
    if not args.prefix:
        raise UsageError("--run-id must not be empty")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, not {args.port}")
    if not (math.isfinite(args.interval) and 0.1 <= args.interval <= 3600):
        raise UsageError(f"--interval must be 0.1..3600 seconds, not {args.interval}")
    if not 1 <= args.history <= 1_000_000:
        raise UsageError(f"--history must be 1..1000000 points, not {args.history}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be a positive number of seconds, not {args.timeout}")
    return initial_peers


def run(args: argparse.Namespace) -> int:
    from dht.kademlia.errors import BootstrapError
    from moshpit.dashboard.app import is_loopback
    from moshpit.dashboard.server import (
        MissingDashboardDependency,
        bind_socket,
        require_hypercorn,
        run_dashboard,
        single_exception,
    )

    try:
        initial_peers = check_args(args)
        require_hypercorn()
    except (UsageError, MissingDashboardDependency) as e:
        print(f"moshpit dashboard: {e}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.addr, args.port)
    except OSError as e:
        print(f"moshpit dashboard: {e} (another --port? 0 takes any free one)", file=sys.stderr)
        return 2
    if not is_loopback(sock.getsockname()[0]):
        print(
            f"moshpit dashboard: listening on {args.addr}: anyone who can reach this machine "
            "can read the page",
            file=sys.stderr,
        )

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(
                lambda task_status: run_dashboard(
                    initial_peers,
                    args.prefix,
                    sock=sock,
                    interval=args.interval,
                    history=args.history,
                    bootstrap_timeout=args.timeout,
                    task_status=task_status,
                )
            )
            # one unwrapped line a user (or a test) can copy the address from
            sys.stdout.write(f"dashboard of run {args.prefix!r}: {url} (Ctrl-C stops it)\n")
            sys.stdout.flush()

    try:
        try:
            trio.run(main)
        except BaseException as error:  # nurseries wrap what they raise: the one inside
            raise single_exception(error) from None
    except BootstrapError as e:
        print(f"moshpit dashboard: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()  # a no-op once hypercorn took it over
    return 0
