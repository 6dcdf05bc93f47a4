"""Dialing a peer's addresses "happy eyeballs" style (RFC 8305): staggered, first success wins.

A peer announces several addresses, some of which may be black holes (a LAN address seen
from outside, a stale port). Dialing them one after the other would cost a whole handshake
timeout per dead address; dialing all at once would open connections only to close them.
:func:`dial_first` starts attempt i when attempt i-1 failed or :data:`DIAL_STAGGER` seconds
after it started, whichever comes first; the first success cancels the rest. It knows
nothing of how one address is dialed: the Host passes that in.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import trio

from .connection import Connection
from .errors import DialError, DialRefusedError, P2PError, PeerIDMismatchError, error_reason
from .identity import PeerID
from .multiaddr import Multiaddr

DIAL_STAGGER = 0.25  # seconds between starting dials to successive addresses (RFC 8305)
MAX_DIAL_ADDRS = 16


async def dial_first(
    addrs: Sequence[Multiaddr],
    dial_one: Callable[[Multiaddr], Awaitable[Connection]],
    expected: PeerID | None,
    log: logging.Logger,
) -> Connection:
    """The first connection ``dial_one(addr)`` returns over ``addrs`` (without ``/p2p/``, no
    repeats, at most :data:`MAX_DIAL_ADDRS`), dialed in a staggered race; a connection that
    loses the race is closed. ``log`` takes the warnings (the caller's logger).

    Raises PeerIDMismatchError if some address answered with another peer, DialRefusedError
    if every address refused the connection (nothing listens there), else DialError listing
    each address' failure."""
    failures: list[str] = []
    refusals: list[str] = []
    mismatches: list[PeerIDMismatchError] = []
    targets = list(dict.fromkeys(a.without_peer_id() for a in addrs))[:MAX_DIAL_ADDRS]
    failed = [trio.Event() for _ in targets]
    winner: list[Connection] = []

    async def attempt(i: int, nursery: trio.Nursery) -> None:
        if i > 0:
            with trio.move_on_after(DIAL_STAGGER):
                await failed[i - 1].wait()
        target = targets[i]
        try:
            conn = await dial_one(target)
        except PeerIDMismatchError as e:
            log.warning("dial %s: %s", target, e)
            mismatches.append(e)
            failures.append(f"{target}: {e}")
            failed[i].set()
            return
        except (P2PError, trio.TooSlowError, trio.BrokenResourceError, OSError) as e:
            failures.append(f"{target}: {error_reason(e)}")
            if isinstance(e, ConnectionRefusedError):
                refusals.append(str(target))
            failed[i].set()
            return
        except Exception as e:  # a bug reachable from a remote must not kill the host
            log.warning("dial %s: unexpected %s", target, error_reason(e), exc_info=True)
            failures.append(f"{target}: {error_reason(e)}")
            failed[i].set()
            return
        if winner:
            await conn.session.aclose()  # lost the race; never started
            return
        winner.append(conn)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(targets)):
            nursery.start_soon(attempt, i, nursery)
    if winner:
        return winner[0]
    if mismatches:
        raise PeerIDMismatchError(f"{mismatches[0]} (all addresses: {'; '.join(failures)})")
    who = expected.short() if expected is not None else "peer"
    if refusals and len(refusals) == len(failures):
        raise DialRefusedError(
            f"could not connect to {who}: connection refused at {', '.join(refusals)} "
            "(nothing listens on that port)"
        )
    raise DialError(f"could not connect to {who}: " + "; ".join(failures or ["no addresses"]))


__all__ = ["DIAL_STAGGER", "MAX_DIAL_ADDRS", "dial_first"]
