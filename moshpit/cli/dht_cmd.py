"""``moshpit dht``: run a DHT peer (e.g. a bootstrap node on a small VM). Never imports torch.

Prints the exact ``--initial-peers ...`` line other peers can use to join, keeps its PeerID
across restarts when given ``--identity``, logs peers connecting and disconnecting, and
exits cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import trio

logger = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="multiaddrs to listen on (default: all IPv4 interfaces, random port)",
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="multiaddrs to advertise instead of the listen addresses (e.g. a public IP behind NAT)",
    )
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddrs (with /p2p/<PeerID>) of peers already in the swarm; any one live peer is enough",
    )
    parser.add_argument(
        "--identity", default=None, metavar="PATH", help="Ed25519 key file (created if missing)"
    )
    parser.add_argument(
        "--client-mode",
        action="store_true",
        help="use the DHT without accepting connections (behind NAT)",
    )
    parser.add_argument(
        "--refresh-period",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="bucket refresh period",
    )
    parser.add_argument("--num-replicas", type=int, default=5, help="replicas per stored record")
    parser.add_argument(
        "--status-period",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often to log a status line",
    )


def run(args: argparse.Namespace) -> int:
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # joins/leaves are this command's output
    try:
        return trio.run(_main, args)
    except KeyboardInterrupt:
        return 0


async def _main(args: argparse.Namespace) -> int:
    from dht.kademlia.errors import BootstrapError
    from dht.kademlia.node import DHTNode
    from dht.p2p import Identity

    identity = Identity.load_or_create(args.identity) if args.identity else Identity.generate()
    host_maddrs = args.host_maddrs if not args.client_mode or "--host-maddrs" in sys.argv else None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with DHTNode.open(
                initial_peers=args.initial_peers,
                host_maddrs=host_maddrs,
                announce_maddrs=args.announce_maddrs,
                identity=identity,
                client_mode=args.client_mode,
                refresh_period=args.refresh_period,
                num_replicas=args.num_replicas,
            ) as node:
                _announce(node, args.client_mode)
                node.host.add_connection_observer(
                    lambda peer: logger.info("peer connected: %s", peer),
                    lambda peer: logger.info("peer disconnected: %s", peer),
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_status_loop, node, args.status_period)
                    async for signum in signals:
                        logger.info("received %s, shutting down", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        break
        except BootstrapError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def _announce(node: Any, client_mode: bool) -> None:
    print(f"PeerID: {node.peer_id}", flush=True)
    maddrs = node.get_visible_maddrs()
    if client_mode or not maddrs:
        print("running in client mode: this peer cannot be used as an initial peer", flush=True)
        return
    print("To join this swarm, run peers with:", flush=True)
    print("--initial-peers " + " ".join(str(m) for m in maddrs), flush=True)


async def _status_loop(node: Any, period: float) -> None:
    while True:
        await trio.sleep(period)
        logger.info(
            "%d routing contacts, %d connections, %d records stored (%d bytes)",
            len(node.routing_table),
            len(node.host.connected_peers()),
            node.storage.num_records,
            node.storage.num_bytes,
        )
