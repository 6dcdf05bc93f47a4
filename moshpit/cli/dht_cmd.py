"""``moshpit dht``: run a DHT peer (e.g. a bootstrap node on a small VM). Never imports torch.

Prints the exact ``--initial-peers ...`` line other peers can use to join, keeps its PeerID
across restarts when given ``--identity``, logs peers connecting and disconnecting, and
exits cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia.node import DEFAULT_HOST_MADDRS
from dht.p2p import MultiaddrError
from dht.p2p.multiaddr import EXAMPLE_LISTEN_MADDR, Multiaddr, parse_multiaddr_list
from moshpit.cli.preflight import listen_failure

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode
    from dht.p2p.host import Host
    from dht.p2p.identity import PeerID

logger = logging.getLogger(__name__)


# A `moshpit dht` peer is the swarm's bootstrap: the one public peer volunteers at home find
# first, and their only path to each other when their NATs cannot be hole-punched. The
# spec's circuit limits (128 KiB, 2 min: a relay that only helps peers punch) leave such
# volunteers averaging as clients with no one to reduce (a tensor's reduction must fit one
# relayed connection), so this command grants averaging-sized circuits by default; public
# `moshpit train` volunteers keep the spec's limits (they did not volunteer bandwidth).
BOOTSTRAP_RELAY_DATA_MIB = 64.0
BOOTSTRAP_RELAY_SECONDS = 600


def relay_limits(args: argparse.Namespace) -> Any:
    """The RelayLimits this peer serves with, from ``--relay-circuit-*`` (ValueError when
    they are out of range)."""
    from dht.p2p.relay import RelayLimits

    if not args.relay_circuit_data >= 0:  # also NaN
        raise ValueError("--relay-circuit-data must be >= 0 MiB")
    return RelayLimits(
        circuit_data=int(args.relay_circuit_data * 1024 * 1024),
        circuit_duration=args.relay_circuit_duration,
    )


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/0, every IPv4 interface on a "
        "random port; e.g. /ip4/0.0.0.0/tcp/31337 for a fixed port)",
    )
    parser.add_argument(
        "--announce-maddrs",
        nargs="+",
        default=None,
        metavar="MADDR",
        help="addresses to tell other peers instead of this machine's interface addresses: "
        "behind NAT or port forwarding give the public IP and port, "
        "e.g. /ip4/203.0.113.7/tcp/31337",
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
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--client-mode: use the DHT without accepting connections; --no-client-mode: "
        "act as a DHT server whatever AutoNAT finds (default: decided from reachability: "
        "behind NAT the peer is reached through a relay, else it becomes a client)",
    )
    parser.add_argument(
        "--refresh-period",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="bucket refresh period (default: %(default)s)",
    )
    parser.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how long to keep retrying the initial peers (with backoff) before giving up "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--num-replicas",
        type=int,
        default=5,
        help="replicas per stored record (default: %(default)s)",
    )
    parser.add_argument(
        "--status-period",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how often to log a status line (default: %(default)s)",
    )
    _add_relay_arguments(parser.add_argument_group("when this peer relays for peers behind NAT"))
    add_metrics_arguments(parser)


def _add_relay_arguments(parser: argparse._ArgumentGroup) -> None:
    """The limits of each relayed connection: a bootstrap VM's bandwidth is what they spend."""
    parser.add_argument(
        "--relay-circuit-data",
        type=float,
        default=BOOTSTRAP_RELAY_DATA_MIB,
        metavar="MIB",
        help="when it relays: MiB one relayed connection may carry each way (0: no limit; "
        "default: %(default)s, enough for volunteers whose NATs cannot be hole-punched to "
        "average through this peer; the spec's 0.125 lets only small models through)",
    )
    parser.add_argument(
        "--relay-circuit-duration",
        type=int,
        default=BOOTSTRAP_RELAY_SECONDS,
        metavar="SECONDS",
        help="when it relays: how long one relayed connection may last (0: no limit; "
        "default: %(default)s)",
    )


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port`` / ``--metrics-addr`` (also used by ``moshpit train``)."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://ADDR:PORT/metrics (needs "
        "pip install 'moshpit-train[metrics]'; 0: a free port; default: no metrics)",
    )
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint binds to (default: %(default)s, this machine "
        "only; 0.0.0.0 lets a Prometheus elsewhere scrape it)",
    )


def start_metrics(args: argparse.Namespace, prog: str) -> tuple[Any, int | None]:
    """Start the metrics endpoint if ``--metrics-port`` was given: (server or None, None),
    or (None, exit status) after printing why it could not start."""
    if args.metrics_port is None:
        return None, None
    if not 0 <= args.metrics_port <= 65535:
        print(f"{prog}: --metrics-port must be 0..65535", file=sys.stderr)
        return None, 2
    from moshpit.metrics import MetricsUnavailableError, serve_metrics

    try:
        return serve_metrics(args.metrics_port, args.metrics_addr), None
    except MetricsUnavailableError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None, 2
    except OSError as e:  # the port is taken, or the address is not on this machine
        where = f"{args.metrics_addr}:{args.metrics_port}"
        print(f"{prog}: cannot serve metrics on {where}: {e.strerror or e}", file=sys.stderr)
        return None, 1


def run(args: argparse.Namespace) -> int:
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # joins/leaves are this command's output
    try:
        addresses = _parse_addresses(args)
    except MultiaddrError as e:
        print(f"moshpit dht: {e}", file=sys.stderr)
        return 2
    try:
        relay_limits(args)
    except ValueError as e:  # RelayLimits says which setting and why
        print(f"moshpit dht: {e}", file=sys.stderr)
        return 2
    metrics, status = start_metrics(args, "moshpit dht")
    if status is not None:
        return status
    if metrics is not None:
        _say(f"Prometheus metrics: {metrics.url}")
    try:
        return trio.run(_main, args, *addresses)
    except KeyboardInterrupt:
        return 0
    finally:
        if metrics is not None:
            metrics.close()


def _parse_addresses(args: argparse.Namespace) -> tuple[list[Any], list[Any] | None, Any]:
    """Check every address before starting, so a typo costs one line, not a traceback."""
    initial = parse_multiaddr_list(args.initial_peers, "--initial-peers")
    listen = None
    if args.host_maddrs is not None:
        listen = parse_multiaddr_list(
            args.host_maddrs, "--host-maddrs", example=EXAMPLE_LISTEN_MADDR
        )
    elif not args.client_mode:
        listen = [Multiaddr(a) for a in DEFAULT_HOST_MADDRS]
    announce = None
    if args.announce_maddrs is not None:
        announce = parse_multiaddr_list(
            args.announce_maddrs, "--announce-maddrs", example="/ip4/203.0.113.7/tcp/31337"
        )
        wildcard = [m for m in announce if m.is_tcp() and m.tcp_endpoint()[0] in ("0.0.0.0", "::")]
        if wildcard:
            raise MultiaddrError(
                f"bad --announce-maddrs: {str(wildcard[0])!r} is a wildcard nobody can dial; "
                "give the public or interface address, e.g. /ip4/203.0.113.7/tcp/31337"
            )
    return initial, listen, announce


async def _main(
    args: argparse.Namespace,
    initial_peers: list[Any],
    host_maddrs: list[Any] | None,
    announce_maddrs: list[Any] | None,
) -> int:
    from dht.kademlia.errors import BootstrapError
    from dht.p2p import Identity, IdentityError

    held = contextlib.ExitStack()  # the key file stays locked until this peer is gone
    try:
        identity = (
            held.enter_context(Identity.locked(args.identity))
            if args.identity
            else Identity.generate()
        )
    except IdentityError as e:  # also IdentityInUseError: another live peer has this key
        print(f"moshpit dht: {e}", file=sys.stderr)
        return 1
    with held:
        status = 0
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    # also while joining: a slow bootstrap must not delay Ctrl-C
                    async for signum in signals:
                        logger.info("received %s, shutting down", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                try:
                    await _serve(args, identity, initial_peers, host_maddrs, announce_maddrs)
                except BootstrapError as e:
                    print(f"moshpit dht: {e}", file=sys.stderr)
                    status = 1
                except OSError as e:  # e.g. the port is taken or the address is not on this machine
                    where = " ".join(map(str, host_maddrs or ()))
                    what = f"cannot listen on {where}" if where else "network error"
                    print(f"moshpit dht: {what}: {listen_failure(e)}", file=sys.stderr)
                    status = 1
                nursery.cancel_scope.cancel()
        return status


async def _serve(
    args: argparse.Namespace,
    identity: Any,
    initial_peers: list[Any],
    host_maddrs: list[Any] | None,
    announce_maddrs: list[Any] | None,
) -> None:
    """Run the peer until cancelled (by a signal)."""
    from dht.kademlia.node import DHTNode
    from dht.kademlia.roles import public_by_configuration

    async with DHTNode.open(
        initial_peers=initial_peers,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs,
        identity=identity,
        client_mode=args.client_mode,
        bootstrap_timeout=args.bootstrap_timeout,
        refresh_period=args.refresh_period,
        num_replicas=args.num_replicas,
        # a global listen address or explicit announce addresses: relay from the start, so
        # that volunteers behind NATs joining a one-node swarm find a relay at once
        public_by_configuration=public_by_configuration(host_maddrs, announce_maddrs),
        relay=relay_limits(args),
    ) as node:
        _announce(node, args.client_mode)
        # one line per decision, once AutoNAT has decided: what, why, and the role it implies
        node.add_role_observer(lambda decision: _say(decision.describe()))
        if initial_peers:
            _say(f"Joined the swarm: this peer sees {_peer_count(node)} other peer(s)")
        async with trio.open_nursery() as nursery:
            assert node.host is not None  # a node with a network has its host
            log = ConnectionLog(node.host, nursery)
            node.host.add_connection_observer(log.connected, log.disconnected)
            await _status_loop(node, args.status_period)


class ConnectionLog:
    """Logs peers that stay connected for a moment, and their leaving.

    AutoNAT's dial-backs (and port scans) open connections that close within a second,
    under throwaway PeerIDs; logging each as a peer joining and leaving was noise."""

    SETTLE_SECONDS = 1.0

    def __init__(self, host: Host, nursery: trio.Nursery) -> None:
        self.host = host
        self.nursery = nursery
        self.logged: set[Any] = set()

    def connected(self, peer: PeerID) -> None:
        self.nursery.start_soon(self._log_if_still_connected, peer)

    async def _log_if_still_connected(self, peer: PeerID) -> None:
        await trio.sleep(self.SETTLE_SECONDS)
        if self.host.is_connected(peer) and peer not in self.logged:
            self.logged.add(peer)
            logger.info("peer connected: %s", peer)

    def disconnected(self, peer: PeerID) -> None:
        if peer in self.logged:
            self.logged.discard(peer)
            logger.info("peer disconnected: %s", peer)


def _say(line: str) -> None:
    """One whole line on stdout, flushed at once: never wrapped, so it can be copy-pasted."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _peer_count(node: DHTNode) -> int:
    return len(node.routing_table)


def _announce(node: DHTNode, client_mode: bool) -> None:
    _say(f"PeerID: {node.peer_id}")
    maddrs = node.get_visible_maddrs()
    if client_mode or not maddrs:
        _say("running in client mode: this peer cannot be used as an initial peer")
        return
    _say("To join this swarm, run peers with:")
    _say("--initial-peers " + " ".join(str(m) for m in maddrs))


async def _status_loop(node: DHTNode, period: float) -> None:
    while True:
        await trio.sleep(period)
        logger.info(
            "%d routing contacts, %d connections, %d records stored (%d bytes); %s",
            len(node.routing_table),
            len(_host(node).connected_peers()),
            node.storage.num_records,
            node.storage.num_bytes,
            relay_status(node),
        )


def _host(node: DHTNode) -> Host:
    if node.host is None:  # `moshpit dht` always listens on a Host
        raise RuntimeError("the DHT node has no Host")
    return node.host


def relay_status(node: DHTNode) -> str:
    """What the status line says of the relay: its limits and use, or why it does not run."""
    from dht.kademlia.roles import describe_limit

    service = node.relay_service
    if service is None:
        reach = _host(node).reachability
        return f"not relaying (reachability {reach.status.value})"
    stats = service.stats
    return (
        f"relaying ({describe_limit(service.limits.limit)}): "
        f"{service.reservation_count} reservation(s), {len(service.circuits)} circuit(s) open, "
        f"{stats.circuits_opened} opened, {stats.bytes_forwarded} bytes forwarded"
    )
