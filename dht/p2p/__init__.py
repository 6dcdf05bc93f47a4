"""libp2p-compatible transport stack: identity, multiaddr, multistream-select, Noise, yamux, Host.

Layers, bottom up: the codecs and the secure channel (``identity``, ``multiaddr``,
``multistream``, ``noise``, ``yamux``, ``transport``, ``memory``); the pure state the Host
keeps (``connection``, ``admission``, ``reachability``); the Host (``host.py``); the protocols
built on its public surface (``relay``, ``dcutr``, ``autonat``), which ``host.py`` never
imports. Every Host that ``Host.open`` starts gets the extensions registered below.
"""

from . import dcutr, relay
from .dcutr import HolePunchConfig, HolePuncher
from .errors import (
    DialError,
    DialRefusedError,
    HandshakeError,
    IdentityError,
    IdentityInUseError,
    MessageTooLargeError,
    MultiaddrError,
    P2PError,
    P2PTimeoutError,
    PeerIDMismatchError,
    ProtocolNegotiationError,
    ProtocolViolationError,
    RelayError,
    RemoteError,
    ResourceLimitError,
    StreamClosedError,
    StreamResetError,
)
from .host import Host, HostLimits, P2PStream, add_host_extension
from .identity import Identity, PeerID
from .memory import MemoryNetwork
from .multiaddr import Multiaddr
from .peerstore import PeerStore
from .transport import TCPTransport

# what every Host runs beside identify and ping: dialing /p2p-circuit addresses through
# relays, and hole punching per Host.open(hole_punching=...)
add_host_extension(relay.dial_circuits)
add_host_extension(dcutr.start_hole_punching)

__all__ = [
    "DialError",
    "DialRefusedError",
    "HandshakeError",
    "HolePunchConfig",
    "HolePuncher",
    "Host",
    "HostLimits",
    "Identity",
    "IdentityError",
    "IdentityInUseError",
    "MemoryNetwork",
    "MessageTooLargeError",
    "Multiaddr",
    "MultiaddrError",
    "P2PError",
    "P2PStream",
    "P2PTimeoutError",
    "PeerID",
    "PeerIDMismatchError",
    "PeerStore",
    "ProtocolNegotiationError",
    "ProtocolViolationError",
    "RelayError",
    "RemoteError",
    "ResourceLimitError",
    "StreamClosedError",
    "StreamResetError",
    "TCPTransport",
]
