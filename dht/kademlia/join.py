"""Joining the DHT: the checks of a node's address arguments, and reaching its initial peers.

A joiner retries its initial peers until its time limit: a peer still starting, a reset under
load or a bootstrap node busy with a connection flood is worth another try; but a port where
nothing listens (a typo, a peer that is not running) is given up on within a few seconds.
What follows a successful contact (Kademlia's self-lookup and bucket refresh) is the node's:
``DHTNode._bootstrap``. Kept apart from the node because it is the one part of start-up with
its own retry policy and its own error messages for people.
"""

from __future__ import annotations

import logging
import random
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from dht.kademlia.errors import BootstrapError
from dht.kademlia.network import PeerUnreachableError, RPCNetwork
from dht.kademlia.protocol import MAX_ADDRS_PER_PEER

logger = logging.getLogger(__name__)

BOOTSTRAP_RETRY_FIRST = 0.25  # seconds before the second attempt, doubling up to the next
BOOTSTRAP_RETRY_MAX = 2.0
# ... but when every initial peer refuses the connection (its host says nothing listens on that
# port: a mistyped port, or a peer that is not running), only this long: enough for a peer that
# is binding its port right now, not the 30 s a volunteer would otherwise wait for a typo
BOOTSTRAP_REFUSED_GRACE = 5.0

# ping(peer_id, fallback_addrs) -> whether it answered as a DHT peer (DHTNode.ping)
Ping = Callable[[Any, Sequence[bytes]], Awaitable[bool]]


def check_address_args(
    initial_peers: Iterable[Any],
    host_maddrs: Sequence[Any] | None,
    announce_maddrs: Sequence[Any] | None,
    *,
    by_peer_id: bool = False,
) -> tuple[list[Any], list[Any] | None, list[Any] | None]:
    """Parse address arguments before anything starts, so a typo is one specific error.

    Raises ``TypeError`` for a single string where a list belongs and ``MultiaddrError``
    naming the bad entry. ``by_peer_id``: a custom ``network`` addresses initial peers by
    whatever it likes (e.g. PeerIDs on the loopback fabric); only the container is checked.
    """
    from dht.p2p.errors import MultiaddrError
    from dht.p2p.multiaddr import EXAMPLE_LISTEN_MADDR, parse_multiaddr_list

    if by_peer_id:
        if isinstance(initial_peers, str | bytes):
            raise TypeError("initial_peers must be a list, not a single str")
        peers: list[Any] = list(initial_peers)
    else:
        peers = parse_multiaddr_list(initial_peers, "initial_peers")
    listen = None
    if host_maddrs is not None:
        listen = parse_multiaddr_list(host_maddrs, "host_maddrs", example=EXAMPLE_LISTEN_MADDR)
    announce = None
    if announce_maddrs is not None:
        announce = parse_multiaddr_list(
            announce_maddrs, "announce_maddrs", example="/ip4/203.0.113.7/tcp/31337"
        )
        for maddr in announce:
            if maddr.is_tcp() and maddr.tcp_endpoint()[0] in ("0.0.0.0", "::"):
                raise MultiaddrError(
                    f"bad announce_maddrs: {str(maddr)!r} is a wildcard nobody can dial; "
                    "announce the public or interface address, e.g. /ip4/203.0.113.7/tcp/31337"
                )
        if len(announce) > MAX_ADDRS_PER_PEER:
            raise ValueError(
                f"announce_maddrs has {len(announce)} addresses; peers accept at most "
                f"{MAX_ADDRS_PER_PEER} per peer"
            )
    return peers, listen, announce


async def reach_initial_peers(
    network: RPCNetwork, ping: Ping, initial_peers: list[Any], time_limit: float
) -> list[Any]:
    """The PeerIDs of the initial peers that answered a DHT ping, retrying with backoff.

    Raises :class:`BootstrapError` when none answered within ``time_limit`` seconds (or
    every one is this node itself), or when every one kept refusing the connection for
    ``BOOTSTRAP_REFUSED_GRACE`` seconds.
    """
    attempts = _Attempts(network, ping, initial_peers, trio.current_time() + time_limit)
    delay = BOOTSTRAP_RETRY_FIRST
    for attempt in range(1, sys.maxsize):
        await attempts.try_all()
        remaining = attempts.deadline - trio.current_time()
        if attempts.joined or not attempts.pending or remaining < 2 * BOOTSTRAP_RETRY_FIRST:
            break
        attempts.give_up_if_nothing_listens()
        # jitter, so that joiners do not retry in step; the last try keeps some time
        wait = min(delay * random.uniform(0.75, 1.25), remaining - BOOTSTRAP_RETRY_FIRST)
        logger.info(
            "no initial peer answered yet (attempt %d: %s); retrying in %.1fs",
            attempt,
            next(iter(attempts.errors.values()), "no answer"),
            wait,
        )
        await trio.sleep(wait)
        delay = min(2 * delay, BOOTSTRAP_RETRY_MAX)
    if not attempts.joined:
        reasons = "; ".join(list(attempts.errors.values())[:3]) or "they are this node itself"
        raise BootstrapError(
            f"could not join the DHT: none of the {len(initial_peers)} initial peers answered "
            f"within {time_limit:g}s ({reasons}); check the addresses "
            "and that at least one of those peers is running"
        )
    return attempts.joined


async def try_initial_peers_once(
    network: RPCNetwork, ping: Ping, initial_peers: list[Any], time_limit: float
) -> list[Any]:
    """One try at each initial peer at once, quietly: the PeerIDs that answered (a node
    rejoining after its routing table emptied; see rejoin.py)."""
    attempts = _Attempts(network, ping, initial_peers, trio.current_time() + time_limit)
    await attempts.try_all()
    return attempts.joined


class _Attempts:
    """What the tries so far found: who answered, the last failure of each, who refused."""

    def __init__(
        self, network: RPCNetwork, ping: Ping, initial_peers: list[Any], deadline: float
    ) -> None:
        self.network = network
        self.ping = ping
        self.deadline = deadline
        own = f"/p2p/{network.peer_id}"
        self.pending = [
            a for a in initial_peers if a != network.peer_id and not str(a).endswith(own)
        ]
        self.joined: list[Any] = []
        self.errors: dict[str, str] = {}  # the last failure of each initial peer
        self.refused: set[str] = set()  # initial peers whose last attempt was refused
        self.refused_since: float | None = None  # since when every initial peer refuses

    async def try_all(self) -> None:
        """One try at every initial peer still pending, all at once."""
        async with trio.open_nursery() as nursery:
            for address in list(self.pending):
                nursery.start_soon(self.try_peer, address)

    async def try_peer(self, address: Any) -> None:
        self.refused.discard(str(address))
        try:
            peer_id, addrs = await self.network.connect(
                address, max(0.0, self.deadline - trio.current_time())
            )
        except PeerUnreachableError as e:
            self.errors[str(address)] = str(e)
            if e.refused:
                self.refused.add(str(address))
            return
        if peer_id == self.network.peer_id:
            self.pending.remove(address)  # ourselves: nothing to retry
            return
        if await self.ping(peer_id, addrs):
            self.joined.append(peer_id)
        else:
            self.errors[str(address)] = f"{address} did not answer a DHT ping"

    def give_up_if_nothing_listens(self) -> None:
        """Raise once every initial peer refused the connection for the grace period."""
        if len(self.refused) < len(self.pending):
            self.refused_since = None
        elif self.refused_since is None:
            self.refused_since = trio.current_time()
            logger.info(
                "every initial peer refused the connection (%s): nothing listens there; "
                "retrying for %gs in case it is starting",
                ", ".join(sorted(self.refused)[:3]),
                BOOTSTRAP_REFUSED_GRACE,
            )
        elif trio.current_time() - self.refused_since >= BOOTSTRAP_REFUSED_GRACE:
            raise BootstrapError(
                "could not join the DHT: nothing listens at "
                f"{', '.join(sorted(self.refused)[:3])} (every initial peer refused the "
                f"connection for {BOOTSTRAP_REFUSED_GRACE:g}s). Check the port in the address, "
                "and that the peer is running"
            )
