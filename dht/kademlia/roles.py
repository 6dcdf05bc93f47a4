"""NAT roles: what a DHT node does with AutoNAT's verdict (see ``DHTNode.open``, "Roles").

A *public* peer serves circuit relay v2 for the others; a *private* one keeps slots on up to
``max_relays`` relays and announces its ``/p2p-circuit`` addresses, or acts as a DHT client
while no relay takes it. :class:`NatRoles` is that logic for one node: it wakes on each
verdict and relay address change (and every ``check_interval``), starts or stops the relay
service, keeps the reservations (replacing a relay whose slot stays void for
``failover_after`` seconds) and decides the DHT role (:class:`RoleDecision`).

It reads the node's public state (host, network, routing table, ``client_mode_setting``) and
tells the node through two callbacks: its announced addresses changed, a new role was taken.
Kademlia itself (``node.py``) knows nothing of relays.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from dht.kademlia.network import HostNetwork

if TYPE_CHECKING:
    from dht.kademlia.node import DHTNode
    from dht.p2p.autonat import AutoNAT
    from dht.p2p.host import Host
    from dht.p2p.relay import RelayClient, RelayLimits, RelayService
    from dht.p2p.relay_messages import Limit

logger = logging.getLogger(__name__)

# A peer that refused a reservation, or runs no relay, is asked again after RELAY_RETRY_AFTER
# seconds; each pass asks at most this many peers, each within RELAY_RESERVE_TIMEOUT seconds.
RELAY_RETRY_AFTER = 30.0
RELAY_CANDIDATES_PER_PASS = 8
RELAY_RESERVE_TIMEOUT = 5.0
MAX_REMEMBERED_REFUSALS = 4096


@dataclass(frozen=True)
class RoleDecision:
    """What a node made of AutoNAT's verdict (``DHTNode.role``; see ``DHTNode.open``)."""

    reachability: Any  # dht.p2p.reachability.Reachability
    client_mode: bool  # the node's DHT role now: True = client (no records, not routable)
    explicit: bool  # client_mode was the caller's choice, not the automatic one
    circuit_addrs: tuple[Any, ...]  # announced /p2p-circuit addresses (relays holding a slot)
    direct_addrs_hidden: bool  # own listen addresses not announced (nobody could dial them)
    serving_relay: bool  # this node relays for peers behind NAT
    relay_limit: Limit | None = None  # granted per relayed connection, when serving
    public_by_configuration: str = ""  # why the caller says peers can dial it ("": it did not)

    @property
    def key(self) -> tuple[Any, ...]:
        """What tells one decision from another (the reason's wording may vary by round)."""
        status = getattr(self.reachability, "status", None)
        return (status, self.client_mode, self.circuit_addrs, self.serving_relay)

    def describe(self) -> str:
        """One line: the verdict and why, the way in, the role (for logs and the CLIs)."""
        reach = self.reachability
        parts = [f"Reachability: {reach.status.value} ({reach.reason})"]
        if self.circuit_addrs:
            first = str(self.circuit_addrs[0].without_peer_id())
            more = len(self.circuit_addrs) - 1
            parts.append(f"reachable via relay {first}" + (f" (+{more} more)" if more else ""))
        elif reach.is_private and not (self.explicit and self.client_mode):
            parts.append("no relay holds a slot for this peer")
        if self.serving_relay:
            relay = "serving as a relay for peers behind NAT"
            if self.relay_limit is not None:
                relay += f" ({describe_limit(self.relay_limit)})"
            if self.public_by_configuration and not reach.is_public:
                relay += f", public by configuration: {self.public_by_configuration}"
            parts.append(relay)
        if self.client_mode:
            why = (
                "client mode was set explicitly"
                if self.explicit
                else "other peers cannot connect to it"
            )
            parts.append(f"acting as a DHT client ({why})")
        elif self.circuit_addrs and self.direct_addrs_hidden:
            parts.append("acting as a DHT server reached through the relay")
        elif reach.is_private and self.explicit:
            parts.append("acting as a DHT server (client_mode=False was set explicitly)")
        else:
            parts.append("acting as a DHT server")
        return "; ".join(parts)


class _Keeper:
    """One relay reservation kept by ``RelayClient.keep_reservation`` in its own scope."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.started = False
        self.done = False  # the keeper task ended (it is replaced)
        self.lost_since: float | None = None  # trio time the slot was found void


class _StartedHook:
    """A task_status that notes whether the task started (errors before that go to
    ``nursery.start``'s caller; after it, the task handles them itself)."""

    def __init__(self, status: Any, keeper: _Keeper) -> None:
        self._status = status
        self._keeper = keeper

    def started(self, value: Any = None) -> None:
        self._keeper.started = True
        self._status.started(value)


def describe_limit(limit: Any) -> str:
    """A relay's per-connection ``Limit`` for people: "per relayed connection: 128 KiB each
    way, 120 s" (0 means no limit)."""
    data = int(getattr(limit, "data", 0) or 0)
    duration = int(getattr(limit, "duration", 0) or 0)
    if data and data % (1024 * 1024) == 0:
        size = f"{data // (1024 * 1024)} MiB each way"
    elif data and data % 1024 == 0:
        size = f"{data // 1024} KiB each way"
    elif data:
        size = f"{data} bytes each way"
    else:
        size = "no data limit"
    return f"per relayed connection: {size}, " + (f"{duration} s" if duration else "no time limit")


def public_by_configuration(host_maddrs: Any, announce_maddrs: Any) -> str:
    """Why the addresses a node was told to use say other peers can dial it, or "" if they
    do not: explicit ``announce_maddrs`` (the operator vouches for them), or a listen address
    on a globally routable IP (not a wildcard: which interface answers is not known yet)."""
    if announce_maddrs:
        return "announce_maddrs given"
    from dht.p2p.reachability import globally_routable, ip_of

    for addr in host_maddrs or ():
        ip = ip_of(str(addr))
        if ip is not None and globally_routable(ip):
            return f"listening on the global address {ip}"
    return ""


def check_relay_setting(setting: object) -> bool | RelayLimits | None:
    """Check ``DHTNode.open``'s ``relay``: None, a bool, or a RelayLimits."""
    if setting is None or isinstance(setting, bool):
        return setting
    from dht.p2p.relay import RelayLimits

    if not isinstance(setting, RelayLimits):
        raise TypeError(f"relay must be None, True, False or a RelayLimits, not {setting!r}")
    return setting


def start_autonat(node: DHTNode, setting: object) -> AutoNAT | None:
    """An AutoNAT for the node's Host per ``setting`` (see :meth:`DHTNode.open`), or None;
    its verdicts go to ``node.roles``."""
    host = node.host
    if setting is False or host is None or not hasattr(host, "dial_new_connection"):
        return None
    from dht.p2p import TCPTransport
    from dht.p2p.autonat import AutoNAT, AutoNATConfig

    if setting is None and not isinstance(host.transport, TCPTransport):
        return None  # the in-memory network has no NATs (and simulations no spare cycles)
    config = setting if isinstance(setting, AutoNATConfig) else None
    autonat = AutoNAT(host, config)
    if not node.client_mode:
        autonat.serve()
    autonat.add_observer(node.roles.on_reachability)
    return autonat


def _is_direct(raw: bytes) -> bool:
    """An announced address (bytes) that is not a relayed one."""
    from dht.p2p.multiaddr import Multiaddr

    try:
        return not Multiaddr.from_bytes(raw).is_circuit()
    except ValueError:
        return False


class NatRoles:
    """The role logic of one :class:`DHTNode` (see the module docstring).

    ``on_addrs_changed()``: what the node announces may differ now (drop caches).
    ``on_role(decision)``: a new decision; the node takes its ``client_mode`` (and tells its
    neighbourhood where it is when it is a server). Observers added with
    :meth:`add_observer` hear of it afterwards.
    """

    def __init__(
        self,
        node: DHTNode,
        *,
        max_relays: int,
        failover_after: float,
        check_interval: float,
        on_addrs_changed: Callable[[], None],
        on_role: Callable[[RoleDecision], None],
    ) -> None:
        if max_relays < 1:
            raise ValueError(f"max_relays must be at least 1, got {max_relays}")
        if not failover_after > 0 or not check_interval > 0:
            raise ValueError("relay_failover_after and relay_check_interval must be positive")
        self.node = node
        self.max_relays = max_relays
        self.failover_after = failover_after
        self.check_interval = check_interval
        self._on_addrs_changed = on_addrs_changed
        self._on_role = on_role
        self.relay_setting: bool | RelayLimits | None = None  # DHTNode.open's ``relay``
        # DHTNode.open's ``public_by_configuration``: why its addresses say peers can dial it
        # ("" if they do not); such a node serves relays at once, not after AutoNAT decides
        self.public_by_configuration = ""
        self.relay_service: RelayService | None = None  # while we serve as a relay
        self.relay_client: RelayClient | None = None  # once the loop runs
        self.role: RoleDecision | None = None  # the last decision (None: nothing decided yet)
        self._keepers: dict[Any, _Keeper] = {}
        self._keepers_nursery: trio.Nursery | None = None
        self._refused_until: dict[Any, float] = {}  # peer -> trio time to ask it again
        self._wakeup = trio.Event()
        self._observers: list[Callable[[RoleDecision], None]] = []

    # -- observers and readings -------------------------------------------------------------
    def add_observer(self, on_change: Callable[[RoleDecision], None]) -> None:
        """Call ``on_change(decision)`` with each new :class:`RoleDecision` (and at once with
        the current one, if any)."""
        self._observers.append(on_change)
        if self.role is not None:
            on_change(self.role)

    def remove_observer(self, on_change: Callable[[RoleDecision], None]) -> None:
        if on_change in self._observers:
            self._observers.remove(on_change)

    @property
    def relay_limit(self) -> Limit | None:
        """The most restrictive ``Limit`` among the relays holding a slot for this node while
        peers can reach it only through them, else None (see ``DHTNode.relay_limit``)."""
        if getattr(self.node.network, "direct_reachable", True) or self.relay_client is None:
            return None
        from dht.p2p.relay_messages import Limit

        limits = [
            r.limit if r.limit is not None else Limit(0, 0)
            for r in self.relay_client.reservations.values()
            if r.seconds_left() > 0
        ]
        if not limits:
            return None

        def room(limit: Limit) -> tuple[float, float]:
            return (limit.data or math.inf, limit.duration or math.inf)

        return min(limits, key=room)

    @property
    def host(self) -> Host:
        """The node's Host: roles run only on one (see :meth:`enabled`)."""
        host = self.node.host
        assert host is not None, "NAT roles need a dht.p2p Host"
        return host

    def _announces_explicitly(self) -> bool:
        return bool(getattr(self.node.network, "announces_explicitly", False))

    def enabled(self) -> bool:
        """Roles need a real Host (relays, reservations) and something to act on: AutoNAT's
        verdicts, or an explicit ``relay`` setting."""
        host, network = self.node.host, self.node.network
        if host is None or not hasattr(host, "dial_new_connection"):
            return False
        if not isinstance(network, HostNetwork):
            return False
        return (
            self.node.autonat is not None
            or self.relay_setting not in (None, False)
            or bool(self.public_by_configuration and self.relay_setting is not False)
        )

    # -- events -----------------------------------------------------------------------------
    def on_reachability(self, reachability: Any) -> None:
        """AutoNAT decided: say what it means, and let the role logic act on it."""
        node = self.node
        if reachability.is_private and not node.client_mode:
            if node.client_mode_setting is None and not self._announces_explicitly():
                logger.info(
                    "other peers cannot connect to this peer (%s): it no longer announces "
                    "itself as a DHT server at its own addresses; looking for a relay to be "
                    "reached through (without one it acts as a DHT client)",
                    reachability.reason,
                )
            else:
                logger.warning(
                    "other peers cannot connect to this peer (%s), yet it announces itself as "
                    "a DHT server; behind NAT run it with client_mode=True (--client-mode), "
                    "leave client_mode unset (the role then follows reachability) or forward "
                    "a port and pass announce_maddrs",
                    reachability.reason,
                )
        self._wakeup.set()

    def _on_relay_addrs(self) -> None:
        """Our circuit addresses changed (a slot gained, moved or lost)."""
        self._on_addrs_changed()
        self._wakeup.set()

    # -- the loop ---------------------------------------------------------------------------
    async def run(self) -> None:
        """Act on reachability: serve a relay, hold reservations, pick the DHT role. Wakes on
        each AutoNAT verdict and relay address change, and every check_interval."""
        from dht.p2p.relay import relay_client

        self.relay_client = relay_client(self.host)
        self.relay_client.add_observer(self._on_relay_addrs)
        try:
            async with trio.open_nursery() as keepers:
                self._keepers_nursery = keepers
                while True:
                    wakeup = self._wakeup = trio.Event()
                    await self._apply()
                    with trio.move_on_after(self.check_interval):
                        await wakeup.wait()
        finally:
            self._keepers_nursery = None
            self._keepers.clear()
            self.relay_client.remove_observer(self._on_relay_addrs)
            if self.relay_service is not None:
                self.relay_service.close()
                self.relay_service = None

    async def _apply(self) -> None:
        reach = self.host.reachability
        setting, relay = self.node.client_mode_setting, self.relay_setting
        serve = (
            relay is not False
            and setting is not True
            and (
                reach.is_public
                or bool(self.public_by_configuration)
                or (relay is not None and self.node.autonat is None)
            )
        )
        if serve and self.relay_service is None:
            self._start_relay_service()
        elif not serve and self.relay_service is not None:
            logger.info("no longer serving as a relay (%s)", reach)
            self.relay_service.close()
            self.relay_service = None
        if reach.is_private and setting is not True:
            await self._keep_relays()
        elif self._keepers:
            for keeper in self._keepers.values():
                keeper.scope.cancel()  # withdraws its circuit addresses
            self._keepers.clear()
        self._decide()

    def _start_relay_service(self) -> None:
        from dht.p2p.relay import HOP_PROTOCOL, RelayLimits, RelayService

        if self.node.network.serves(HOP_PROTOCOL):  # type: ignore[attr-defined]
            return  # someone enabled a relay on this Host already: that one serves
        limits = self.relay_setting if isinstance(self.relay_setting, RelayLimits) else None
        announce = None
        if self._announces_explicitly():
            announce = [a.without_peer_id() for a in self.node.get_visible_maddrs()]
            announce = [a for a in announce if not a.is_circuit()] or None
        self.relay_service = RelayService(self.host, limits, announce)
        logger.info(
            "serving as a relay for peers behind NAT (%s)%s",
            describe_limit(self.relay_service.limits.limit),
            f"; public by configuration: {self.public_by_configuration}"
            if self.public_by_configuration
            else "",
        )

    # -- reservations -----------------------------------------------------------------------
    async def _keep_relays(self) -> None:
        """Hold slots on up to ``max_relays`` relays; replace those void for too long."""
        client = self.relay_client
        assert client is not None, "run() sets the relay client first"
        now = trio.current_time()
        for relay, keeper in list(self._keepers.items()):
            rsvp = client.reservations.get(relay)
            if (
                not keeper.done
                and rsvp is not None
                and rsvp.seconds_left() > 0
                and self.host.is_connected(relay)
            ):
                keeper.lost_since = None
                continue
            if keeper.lost_since is None:
                keeper.lost_since = now
            if keeper.done or now - keeper.lost_since >= self.failover_after:
                logger.info(
                    "relay %s holds no slot for this peer any more (for %.0fs): moving to "
                    "another relay",
                    relay,
                    now - keeper.lost_since,
                )
                keeper.scope.cancel()
                del self._keepers[relay]
                self._refused(relay, now)
        live = [relay for relay, k in self._keepers.items() if k.lost_since is None]
        for relay in live[self.max_relays :]:  # a lost relay came back beside its successor
            self._keepers.pop(relay).scope.cancel()
        active = min(len(live), self.max_relays)
        for candidate in self._candidates(now):
            if active >= self.max_relays:
                break
            if await self._start_keeper(candidate):
                active += 1

    def _refused(self, peer: Any, now: float) -> None:
        if len(self._refused_until) >= MAX_REMEMBERED_REFUSALS:
            self._refused_until = {p: t for p, t in self._refused_until.items() if t > now}
            if len(self._refused_until) >= MAX_REMEMBERED_REFUSALS:
                self._refused_until.clear()
        self._refused_until[peer] = now + RELAY_RETRY_AFTER

    def _candidates(self, now: float) -> list[Any]:
        """Peers to ask for a slot: those we hold a direct connection to (we reached them, so
        they accept connections; the ones we dialed first), then DHT contacts announcing a
        direct address. Not ourselves, not current relays, not recent refusers."""
        node = self.node
        out: list[Any] = []

        def consider(peer: Any) -> None:
            if peer == node.peer_id or peer in self._keepers or peer in out:
                return
            if self._refused_until.get(peer, -math.inf) > now:
                return
            out.append(peer)

        for peer in node.network.direct_peers():  # type: ignore[attr-defined]
            consider(peer)
        for contact in node.routing_table.nearest(node.node_id, node.bucket_size):
            if any(_is_direct(raw) for raw in contact.addrs):
                consider(contact.peer_id)
        return out[:RELAY_CANDIDATES_PER_PASS]

    async def _start_keeper(self, relay: Any) -> bool:
        """Reserve on ``relay`` and keep the slot in a task of its own; False if refused."""
        from dht.p2p import P2PError

        assert self._keepers_nursery is not None
        keeper = _Keeper()
        error: BaseException | None = None
        with trio.move_on_after(RELAY_RESERVE_TIMEOUT) as scope:
            try:
                await self._keepers_nursery.start(self._run_keeper, relay, keeper)
            except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                error = e
            except Exception as e:  # a bug reachable from a peer's answer must not stop us
                logger.warning(
                    "reserving a relay slot on %s: unexpected %r", relay, e, exc_info=True
                )
                error = e
        if error is None and not scope.cancelled_caught:
            self._keepers[relay] = keeper
            return True
        why = f"no answer within {RELAY_RESERVE_TIMEOUT:.0f}s" if error is None else str(error)
        logger.debug("no relay slot on %s: %s", relay, why)
        self._refused(relay, trio.current_time())
        return False

    async def _run_keeper(
        self, relay: Any, keeper: _Keeper, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        from dht.p2p import P2PError

        assert self.relay_client is not None, "run() sets the relay client first"
        try:
            with keeper.scope:
                await self.relay_client.keep_reservation(
                    relay, task_status=_StartedHook(task_status, keeper)
                )
        except Exception as e:
            if not keeper.started:
                raise  # nursery.start's caller learns why
            expected = (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)
            logger.log(
                logging.INFO if isinstance(e, expected) else logging.WARNING,
                "keeping the relay slot on %s failed: %r",
                relay,
                e,
                exc_info=not isinstance(e, expected),
            )
        finally:
            keeper.done = True

    # -- the decision -----------------------------------------------------------------------
    def _decide(self) -> None:
        """The DHT role and announced addresses from the verdict and the relay slots."""
        node = self.node
        reach = self.host.reachability
        setting = node.client_mode_setting
        hide_direct = reach.is_private and setting is None and not self._announces_explicitly()
        node.network.direct_reachable = not hide_direct  # type: ignore[attr-defined]
        circuits = tuple(a for a in self.host.listen_addrs if a.is_circuit())
        client_mode = setting if setting is not None else hide_direct and not circuits
        decision = RoleDecision(
            reachability=reach,
            client_mode=client_mode,
            explicit=setting is not None,
            circuit_addrs=circuits,
            direct_addrs_hidden=hide_direct,
            serving_relay=self.relay_service is not None,
            relay_limit=self.relay_service.limits.limit if self.relay_service else None,
            public_by_configuration=self.public_by_configuration,
        )
        self._on_addrs_changed()
        previous = self.role
        if previous is not None and previous.key == decision.key:
            return
        if previous is None and reach.status.value == "unknown" and not decision.serving_relay:
            return  # nothing decided yet
        self.role = decision
        self._on_role(decision)
        logger.info("%s", decision.describe())
        for callback in list(self._observers):
            try:
                callback(decision)
            except Exception:
                logger.exception("role observer failed")


__all__ = [
    "NatRoles",
    "RoleDecision",
    "check_relay_setting",
    "describe_limit",
    "public_by_configuration",
    "start_autonat",
]
