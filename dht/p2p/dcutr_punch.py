"""One hole-punching attempt's dials, the sockets it takes over from the accept path, and
their upgrades (``dcutr.py`` runs the exchange around it and says which side dials when).

Kept apart from the exchange: this is the part that touches sockets, ports and the Host's
accept path, and it is the same for both roles apart from who initiates the handshake.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import trio

from .connection import Connection, close_quietly
from .errors import P2PError, P2PTimeoutError, error_reason
from .identity import PeerID
from .multiaddr import Multiaddr

if TYPE_CHECKING:
    from .host import Host

logger = logging.getLogger("dht.p2p.dcutr")  # its records read as the hole puncher's

MAX_DIALS_PER_ADDR = 4  # per attempt: the first dial and up to 3 after an immediate failure
STREAM_ERRORS = (P2PError, trio.BrokenResourceError, trio.ClosedResourceError)


class PunchTimings(Protocol):
    """What an attempt reads of ``dcutr.HolePunchConfig``."""

    punch_timeout: float
    redial_interval: float


class Punch:
    """One attempt's dials, sockets taken over from the accept path, and upgrades (see
    ``HolePuncher._punch`` in ``dcutr.py`` for the rules). ``failures``: why each address failed."""

    def __init__(
        self,
        host: Host,
        config: PunchTimings,
        peer: PeerID,
        *,
        outbound: bool,
        direct: trio.Event,
    ) -> None:
        self.host = host
        self.config = config
        self.peer = peer
        self.outbound = outbound
        self.direct = direct
        self.failures: dict[str, str] = {}
        self.winners: list[Connection] = []
        self._send, self._taken = trio.open_memory_channel[tuple[trio.abc.Stream, str]](4)
        self._claim = self._offer  # one bound method: release_inbound compares identity
        self._claimed: list[str] = []
        self._ended = False

    def claim(self, targets: list[tuple[Multiaddr, int]]) -> None:
        """A: sockets from the targets' addresses come to this punch, not the accept path
        (until :meth:`end`; :meth:`run` takes over those that came before it)."""
        if not self.outbound:
            return
        for target, _ in targets:
            key = ":".join(map(str, target.tcp_endpoint()))  # as accept() names it
            if key not in self._claimed and self.host.claim_inbound(key, self._claim):
                self._claimed.append(key)

    async def end(self) -> None:
        """Release the claims and close what they took and nobody upgraded (once)."""
        self._release()
        if not self._ended:
            self._ended = True
            await self._close_leftovers()

    async def run(self, targets: list[tuple[Multiaddr, int]]) -> Connection | None:
        """Dial ``(address, local port)`` targets for ``punch_timeout``; the first connection
        registered, or None."""
        try:
            self.claim(targets)
            async with trio.open_nursery() as upgrades:
                with trio.move_on_after(self.config.punch_timeout):
                    async with trio.open_nursery() as dials:
                        for target, port in targets:
                            dials.start_soon(self._dial, target, port, upgrades)
                        dials.start_soon(self._watch, dials)
                        if self.outbound:
                            dials.start_soon(self._take_over, upgrades)
                self._release()  # dialing is over: the accept path gets them back
        finally:
            await self.end()
        return self.winners[0] if self.winners else None

    def _offer(self, raw: trio.abc.Stream, remote: str) -> bool:
        """The inbound claim: a socket from one of the peer's addresses (A only)."""
        try:
            self._send.send_nowait((raw, remote))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def _release(self) -> None:
        for key in self._claimed:
            self.host.release_inbound(key, self._claim)
        self._claimed.clear()

    async def _close_leftovers(self) -> None:
        """Close the sockets handed over but never upgraded."""
        self._send.close()
        with trio.CancelScope(shield=True):
            while True:
                try:
                    raw, _ = self._taken.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                await close_quietly(raw)
            self._taken.close()

    async def _upgrade(self, raw: trio.abc.Stream, name: str, upgrades: trio.Nursery) -> None:
        host, outbound = self.host, self.outbound
        try:
            conn = await host.upgrade_raw_connection(raw, self.peer, outbound=outbound, name=name)
        except (*STREAM_ERRORS, OSError) as e:
            self.failures[name] = error_reason(e)
            return
        except Exception as e:  # untrusted input must not take the host down
            logger.warning("dcutr: securing %s failed: unexpected %s", name, error_reason(e))
            self.failures[name] = error_reason(e)
            return
        if outbound and self.winners:
            await close_quietly(conn.session)  # lost the race; never started
            return
        conn.hole_punched = True
        if not await host.add_connection(conn):
            self.failures[name] = "connection limit reached or host closing"
            return
        self.winners.append(conn)
        if outbound:
            upgrades.cancel_scope.cancel()  # the rest of this attempt, dials included

    async def _dial(self, target: Multiaddr, port: int, upgrades: trio.Nursery) -> None:
        name = str(target)
        for _ in range(MAX_DIALS_PER_ADDR):
            try:
                raw = await self.host.transport.dial(
                    target, timeout=self.config.punch_timeout, local_port=port
                )
            except P2PTimeoutError as e:
                self.failures[name] = str(e)
                return
            except OSError as e:
                # refused or unreachable at once: a NAT that reset our SYN before the
                # other side's SYN opened the way; try again while the attempt lasts
                self.failures[name] = error_reason(e)
                await trio.sleep(self.config.redial_interval)
                continue
            upgrades.start_soon(self._upgrade, raw, name, upgrades)
            return

    async def _take_over(self, upgrades: trio.Nursery) -> None:
        async for raw, remote in self._taken:
            upgrades.start_soon(self._upgrade, raw, remote, upgrades)

    async def _watch(self, dials: trio.Nursery) -> None:
        await self.direct.wait()
        dials.cancel_scope.cancel()
