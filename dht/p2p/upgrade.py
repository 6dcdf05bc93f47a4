"""The secure channel under every connection: security negotiation, Noise, muxer negotiation.

libp2p's order on a raw byte stream: multistream-select agrees on a security protocol, the
Noise XX handshake proves both PeerIDs, multistream-select (now encrypted) agrees on
``/yamux/1.0.0``. The dialer proposes the host's ``security_protocols`` in order; between two
moshpit hosts the first, ``/moshpit/noise-aesgcm/1.0.0``, is accepted, a libp2p peer answers
``na`` and gets ``/noise``. The Host runs yamux on what :func:`secure_channel` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import trio

from . import multistream
from .connection import close_quietly
from .errors import HandshakeError, ProtocolNegotiationError
from .identity import Identity, PeerID
from .noise import SECURITY_PROTOCOLS, noise_handshake
from .yamux import PROTOCOL_ID as YAMUX_PROTOCOL


async def secure_channel(
    raw: trio.abc.Stream,
    identity: Identity,
    security_protocols: Sequence[str],
    *,
    outbound: bool,
    expected: PeerID | None,
    timeout: float,  # noqa: ASYNC109 - each negotiation step has its own deadline
    on_security_negotiated: Callable[[], None] | None = None,
) -> tuple[PeerID, trio.abc.HalfCloseableStream]:
    """The remote's proven PeerID and the encrypted stream yamux is to run on.

    ``outbound``: this side initiates multistream-select and Noise. ``expected``: the PeerID
    the remote must prove (None: whoever it is). Against a moshpit listener the first
    proposal is accepted, so this costs the same single round trip as ``/noise`` alone.
    ``on_security_negotiated`` runs once a security protocol is agreed on (the accept path
    then grants the remote the rest of the handshake time). Raises HandshakeError when a
    negotiation fails, Noise's errors when the handshake does."""
    try:
        if outbound:
            security, stream = await multistream.negotiate_outbound(
                raw, security_protocols, timeout
            )
        else:
            security, stream = await multistream.negotiate_inbound(
                raw, frozenset(security_protocols), timeout
            )
    except ProtocolNegotiationError as e:
        raise HandshakeError(f"security negotiation failed: {e}") from e
    if on_security_negotiated is not None:
        on_security_negotiated()
    secure = await noise_handshake(
        stream,
        identity,
        initiator=outbound,
        expected_peer=expected,
        timeout=timeout,
        cipher=SECURITY_PROTOCOLS[security],
    )
    peer_id: PeerID = secure.remote_peer
    try:
        if outbound:
            _, muxed = await multistream.negotiate_outbound(secure, [YAMUX_PROTOCOL], timeout)
        else:
            _, muxed = await multistream.negotiate_inbound(secure, [YAMUX_PROTOCOL], timeout)
    except ProtocolNegotiationError as e:
        await close_quietly(secure)
        raise HandshakeError(f"muxer negotiation with {peer_id.short()} failed: {e}") from e
    if isinstance(muxed, multistream.PrefixedStream) and muxed.inner is secure:
        # The remote's first yamux frames came with its answer. Give them back to the
        # SecureSession so yamux runs on it directly, with its bulk fast paths.
        secure.unread(await muxed.receive_some())  # a PrefixedStream's prefix is non-empty
        muxed = secure
    return peer_id, muxed


def check_security_protocols(protocols: Sequence[str]) -> tuple[str, ...]:
    """Validate a Host's security protocol list (known ids, no repeats, at least one)."""
    if isinstance(protocols, str):
        protocols = (protocols,)
    chosen = tuple(protocols)
    unknown = [p for p in chosen if p not in SECURITY_PROTOCOLS]
    if not chosen or unknown or len(set(chosen)) != len(chosen):
        raise ValueError(
            f"security_protocols must be a non-empty list without repeats drawn from "
            f"{list(SECURITY_PROTOCOLS)}, got {list(chosen)}"
        )
    return chosen


__all__ = ["check_security_protocols", "secure_channel"]
