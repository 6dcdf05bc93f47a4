"""The accept path of a Host: from a listener's sockets to registered connections, kept
joinable under connection floods.

Each accepted socket is offered to an inbound claim first (hole punching takes over sockets
from the peer it is punching to), then needs room under the connection limit, then a slot
among the pending handshakes (``admission.py`` decides which older one to drop instead of
refusing it), then is upgraded as the responder under two deadlines: the dialer must speak
within ``handshake_start_timeout`` and finish within ``handshake_timeout``. Every refusal
and drop is logged through the Host's rate-limited logger, so a flood costs a few lines.

:class:`Acceptor` uses the Host's public surface only (``upgrade``, ``serve_connection``,
``make_room``, ``closing``, ``start_soon``); the Host owns one and starts its loop per
listener.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from .._logging import RateLimitedLogger
from .admission import Admission, Eviction, Handshake
from .connection import Connection, close_quietly, source_key
from .errors import P2PError, error_reason
from .identity import PeerID

logger = logging.getLogger(__name__)

InboundClaim = Callable[[trio.abc.Stream, str], bool]


class _Host(Protocol):
    """What the accept path needs of its Host (all public)."""

    limits: Any  # HostLimits

    @property
    def closing(self) -> bool: ...

    def make_room(self) -> bool: ...

    def start_soon(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...

    async def upgrade(
        self,
        raw: trio.abc.Stream,
        expected: PeerID | None,
        *,
        outbound: bool,
        name: str,
        on_security_negotiated: Callable[[], None] | None = None,
    ) -> Connection: ...

    async def serve_connection(self, conn: Connection) -> None: ...


class _Inbound(Handshake):
    """An inbound connection in its handshake: admission's record and the cancel scope of
    the task running it (cancelled when it is evicted, or when its deadline passes)."""

    __slots__ = ("scope",)

    def __init__(self, source: str, remote: str, started: float, deadline: float) -> None:
        super().__init__(source, remote, started)
        self.scope = trio.CancelScope(deadline=deadline)


class Acceptor:
    """The accept path of one Host (see the module docstring).

    ``claims``: inbound claims by exact remote ``ip:port`` (``Host.claim_inbound`` fills it);
    ``admission``: the pending handshakes; ``log``: the Host's rate-limited logger;
    ``handle(raw, remote, pending)``: the task run per admitted socket (default
    :meth:`handle`; the Host routes it through its own method so it can be wrapped)."""

    def __init__(
        self,
        host: _Host,
        log: RateLimitedLogger,
        handle: Callable[[trio.abc.Stream, str, Any], Awaitable[None]] | None = None,
    ) -> None:
        limits = host.limits
        self.host = host
        self._handle_task = handle if handle is not None else self.handle
        self.limits = limits
        self.log = log
        self.claims: dict[str, InboundClaim] = {}
        self.admission = Admission(
            limits.max_pending_handshakes,
            limits.max_silent_connections,
            limits.max_pending_handshakes_per_source,
        )
        self._flusher_started = False

    def fit_silent_cap_to_file_limit(self) -> None:
        """Hold at most a quarter of the open-file limit in silent sockets, so a flood of them
        can never make ``accept`` fail for lack of descriptors (raising the limit first)."""
        soft = raise_open_file_limit()
        if soft <= 0:
            return
        cap = min(self.limits.max_silent_connections, max(1, soft // 4))
        if cap < self.limits.max_silent_connections and cap != self.admission.max_silent:
            self.log.logger.info(
                "holding at most %d silent inbound sockets (open-file limit %d)", cap, soft
            )
        self.admission.max_silent = cap

    async def run(self, listener: Any) -> None:
        """Accept from ``listener`` until it closes (a task in the host's nursery)."""
        if not self._flusher_started:
            self._flusher_started = True
            self.host.start_soon(self._flush_logs)
        while True:
            try:
                raw, remote = await listener.accept()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            except OSError as e:  # e.g. EMFILE under a connection flood
                self.log.warning("accept-failed", "accept on %s failed: %s", listener.multiaddr, e)
                await trio.sleep(0.1)
                continue
            if self.host.closing:
                await close_quietly(raw)
                return
            claim = self.claims.get(remote)
            if claim is not None and claim(raw, remote):
                continue  # a hole punch in progress upgrades it (dcutr.py)
            if not self.host.make_room():
                self.log.warning(
                    "refused-busy",
                    "refusing inbound connection from %s: connection limit reached "
                    "(%d connections, all busy)",
                    remote,
                    self.limits.max_connections,
                )
                await close_quietly(raw)
                continue
            pending = self._admit(remote)
            self.host.start_soon(self._handle_task, raw, remote, pending)

    async def _flush_logs(self) -> None:
        """Report the counts of rate-limited log records once their interval is over."""
        while True:
            await trio.sleep(self.limits.log_interval)
            self.log.flush()

    # -- admission (the decisions are admission.py's) -------------------------------------
    def _admit(self, remote: str) -> _Inbound:
        """Take a slot for a new inbound connection, never refusing it: admission picks
        older handshakes to drop instead (see admission.py for the rules and why)."""
        limits = self.limits
        now = trio.current_time()
        first_step = min(limits.handshake_start_timeout, limits.handshake_timeout)
        pending = _Inbound(source_key(remote), remote, now, now + first_step)
        for eviction in self.admission.admit(pending):
            self._evict(eviction, remote)
        return pending

    def _spoke(self, pending: _Inbound) -> None:
        """The dialer spoke: from now on it gets the whole handshake_timeout, and a slot
        among the (few) handshakes that cost Noise work; over that cap the oldest goes."""
        if pending.evicted:
            return
        pending.scope.deadline = pending.started + self.limits.handshake_timeout
        for eviction in self.admission.spoke(pending):
            self._evict(eviction, pending.remote)

    def _evict(self, eviction: Eviction, newcomer: str) -> None:
        """Carry out admission's decision: the victim's task closes its socket."""
        victim = eviction.victim
        assert isinstance(victim, _Inbound)
        victim.scope.cancel()
        self.log.warning(
            "evicted",
            "dropping inbound connection from %s (%s, pending for %.1fs) to admit %s: %s",
            victim.remote,
            "after its /noise proposal" if victim.negotiated else "no /noise proposal yet",
            trio.current_time() - victim.started,
            newcomer,
            eviction.why,
        )

    async def _abandon(self, raw: trio.abc.Stream, pending: _Inbound) -> None:
        """Free the slot first (a newcomer may take it at once), then close the socket."""
        self.admission.forget(pending)
        await close_quietly(raw)

    # -- one socket ------------------------------------------------------------------------
    async def handle(self, raw: trio.abc.Stream, remote: str, pending: _Inbound) -> None:
        """Upgrade one accepted socket as the responder and serve it until it closes."""
        try:
            with pending.scope:
                try:
                    conn = await self.host.upgrade(
                        raw,
                        None,
                        outbound=False,
                        name=remote,
                        on_security_negotiated=lambda: self._spoke(pending),
                    )
                except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                    self.log.warning(
                        "handshake-failed",
                        "dropping inbound connection from %s: %s",
                        remote,
                        error_reason(e),
                    )
                    await self._abandon(raw, pending)
                    return
                except Exception as e:
                    # A bug reachable from untrusted input must not take the whole host down.
                    self.log.warning(
                        "handshake-bug",
                        "dropping inbound connection from %s: unexpected %s",
                        remote,
                        error_reason(e),
                        exc_info=True,
                    )
                    await self._abandon(raw, pending)
                    return
            if pending.scope.cancelled_caught:  # timed out or evicted
                self._log_cut_short(remote, pending)
                await self._abandon(raw, pending)
                return
        except BaseException:
            await self._abandon(raw, pending)  # cancelled (host closing): still close
            raise
        finally:
            self.admission.forget(pending)
        await self.host.serve_connection(conn)

    def _log_cut_short(self, remote: str, pending: _Inbound) -> None:
        """Why a handshake's deadline passed (an evicted one was logged by _evict)."""
        if pending.evicted:
            return
        limits = self.limits
        if pending.negotiated:
            self.log.warning(
                "handshake-timeout",
                "dropping inbound connection from %s: handshake did not finish within %.1fs",
                remote,
                limits.handshake_timeout,
            )
        else:
            self.log.warning(
                "handshake-silent",
                "dropping inbound connection from %s: no multistream header and /noise "
                "proposal within %.1fs (handshake did not start)",
                remote,
                min(limits.handshake_start_timeout, limits.handshake_timeout),
            )


def raise_open_file_limit(wanted: int = 65536) -> int:
    """Raise this process' soft limit on open files towards the hard limit; returns the new
    soft limit. A listening host holds one descriptor per connection and per socket that has
    not spoken yet, so the common default of 1024 would let a few hundred idle sockets make
    ``accept`` fail for everyone; servers raise it at start for the same reason."""
    try:
        import resource
    except ImportError:  # not on POSIX: nothing to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            logger.debug("could not raise the open-file limit from %d: %s", soft, e)
            return soft
        return target
    return soft


__all__ = ["Acceptor", "InboundClaim", "raise_open_file_limit"]
