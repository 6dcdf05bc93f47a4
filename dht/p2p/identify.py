"""libp2p identify (``/ipfs/id/1.0.0``): peers tell each other where they listen.

Without it a host knows a peer's listen addresses only if someone told it, so a peer that
only ever dialed us could not be dialed back once its connection is gone. The side that
*accepts* an identify stream writes one length-prefixed protobuf ``Identify`` message and
closes; the opener reads it. Fields (libp2p spec): 1 publicKey, 2 listenAddrs (repeated,
binary multiaddrs), 3 protocols (repeated), 4 observedAddr, 5 protocolVersion,
6 agentVersion. Everything received is bounded and validated; unparsable addresses are
skipped, a public key that does not match the connection's proven PeerID voids the message.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ._proto import WIRE_LEN, ProtobufDecodeError, encode_bytes_field, iter_fields
from .errors import MultiaddrError, ProtocolViolationError
from .identity import PeerID
from .multiaddr import Multiaddr
from .varint import encode_uvarint

PROTOCOL_ID = "/ipfs/id/1.0.0"
PROTOCOL_VERSION = "ipfs/0.1.0"
AGENT_VERSION = "moshpit/0.1.0"
MAX_MESSAGE_SIZE = 64 * 1024
MAX_LISTEN_ADDRS = 32
MAX_PROTOCOLS = 256


@dataclass
class IdentifyInfo:
    listen_addrs: list[Multiaddr] = field(default_factory=list)
    protocols: list[str] = field(default_factory=list)
    observed_addr: Multiaddr | None = None
    public_key: bytes | None = None
    agent_version: str = ""
    protocol_version: str = ""


def encode_identify(info: IdentifyInfo) -> bytes:
    """The message, with its uvarint length prefix (as libp2p's delimited writers send it)."""
    body = bytearray()
    body += encode_bytes_field(5, info.protocol_version.encode())
    body += encode_bytes_field(6, info.agent_version.encode())
    if info.public_key is not None:
        body += encode_bytes_field(1, info.public_key)
    for addr in info.listen_addrs[:MAX_LISTEN_ADDRS]:
        body += encode_bytes_field(2, addr.without_peer_id().to_bytes())
    if info.observed_addr is not None:
        body += encode_bytes_field(4, info.observed_addr.to_bytes())
    for protocol in info.protocols[:MAX_PROTOCOLS]:
        body += encode_bytes_field(3, protocol.encode())
    return encode_uvarint(len(body)) + bytes(body)


def _text(value: bytes, what: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolViolationError(f"identify {what} is not UTF-8") from None


def decode_identify(body: bytes, remote: PeerID) -> IdentifyInfo:
    """Parse an Identify body received from ``remote`` (the PeerID its connection proved)."""
    info = IdentifyInfo()
    try:
        for number, wire, value in iter_fields(body):
            if wire != WIRE_LEN:
                continue  # no varint fields in Identify; ignore unknown ones
            assert isinstance(value, bytes)
            if number == 1:
                info.public_key = value
            elif number == 2 and len(info.listen_addrs) < MAX_LISTEN_ADDRS:
                try:
                    addr = Multiaddr.from_bytes(value).without_peer_id()
                except MultiaddrError:
                    continue  # an address kind we do not support (quic, ws, ...): skip it
                if addr.peer_id is None:  # not /p2p/A/p2p/B: that names no transport either
                    info.listen_addrs.append(addr)
            elif number == 3 and len(info.protocols) < MAX_PROTOCOLS:
                info.protocols.append(_text(value, "protocol"))
            elif number == 4:
                try:
                    info.observed_addr = Multiaddr.from_bytes(value)
                except MultiaddrError:
                    pass
            elif number == 5:
                info.protocol_version = _text(value, "protocolVersion")[:256]
            elif number == 6:
                info.agent_version = _text(value, "agentVersion")[:256]
    except ProtobufDecodeError as e:
        raise ProtocolViolationError(f"malformed identify message: {e}") from None
    if info.public_key is not None:
        try:
            claimed = PeerID.from_public_key_proto(info.public_key)
        except Exception:  # noqa: BLE001 - any undecodable key voids the message
            claimed = None
        if claimed != remote:
            raise ProtocolViolationError("identify public key does not match the peer's PeerID")
    return info


def observed_multiaddr(remote_addr: str) -> Multiaddr | None:
    """``ip:port`` (TCP) or ``/memory/<n>`` as seen on our side, as a multiaddr."""
    if remote_addr.startswith("/"):
        try:
            return Multiaddr(remote_addr)
        except MultiaddrError:
            return None
    host, _, port = remote_addr.rpartition(":")
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
        return Multiaddr(f"/ip{ip.version}/{ip}/tcp/{int(port)}")
    except (ValueError, MultiaddrError):
        return None
