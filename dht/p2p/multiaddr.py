"""Multiaddr: self-describing network addresses (``/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...``).

Text form: ``/<protocol>/<value>`` components. Binary form (multiformats): for each component
the protocol's multicodec code as an unsigned varint, then its value — fixed-size for
addresses and ports, varint-length-prefixed for names and PeerIDs, nothing at all for
``/p2p-circuit`` (a relayed address: ``<relay address>/p2p/<relay>/p2p-circuit/p2p/<target>``).
Only the protocols this project uses are supported; anything else is a clear
``MultiaddrError``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from .errors import IdentityError, MultiaddrError
from .identity import PeerID
from .varint import decode_uvarint, encode_uvarint

MAX_MULTIADDR_BYTES = 1024  # cap on text and binary length of untrusted addresses
MAX_DNS_NAME_BYTES = 255


@dataclass(frozen=True)
class _Protocol:
    name: str
    code: int
    size: int  # bytes of a fixed-size value; -1 = varint-length-prefixed; 0 = no value


_PROTOCOLS = [
    _Protocol("ip4", 4, 4),
    _Protocol("tcp", 6, 2),
    _Protocol("ip6", 41, 16),
    _Protocol("dns", 53, -1),
    _Protocol("dns4", 54, -1),
    _Protocol("dns6", 55, -1),
    _Protocol("p2p", 421, -1),
    _Protocol("p2p-circuit", 290, 0),  # no value: "reach the next /p2p/ through the one before"
    _Protocol("memory", 777, 8),
]
_BY_NAME = {p.name: p for p in _PROTOCOLS}
_BY_NAME["ipfs"] = _BY_NAME["p2p"]  # legacy name for the same code; printed as /p2p
_BY_CODE = {p.code: p for p in _PROTOCOLS}

Value = str | int | PeerID


def _parse_value(proto: _Protocol, text: str, where: str) -> Value:
    """Turn a component's text into its canonical Python value, or raise MultiaddrError."""
    name = proto.name
    if name == "ip4":
        try:
            return str(ipaddress.IPv4Address(text))
        except ValueError:
            raise MultiaddrError(f"invalid IPv4 address {text!r} in {where!r}") from None
    if name == "ip6":
        if "%" in text:
            raise MultiaddrError(f"IPv6 zone ids are not supported ({text!r} in {where!r})")
        try:
            return str(ipaddress.IPv6Address(text))
        except ValueError:
            raise MultiaddrError(f"invalid IPv6 address {text!r} in {where!r}") from None
    if name == "tcp":
        if not (text.isascii() and text.isdigit()) or int(text) > 0xFFFF:
            raise MultiaddrError(f"invalid TCP port {text!r} in {where!r} (expected 0-65535)")
        return int(text)
    if name == "memory":
        if not (text.isascii() and text.isdigit()) or int(text) >= 1 << 64:
            raise MultiaddrError(
                f"invalid memory address {text!r} in {where!r} (expected an unsigned 64-bit int)"
            )
        return int(text)
    if name in ("dns", "dns4", "dns6"):
        _check_dns_name(text, where)
        return text
    if name == "p2p":
        try:
            return PeerID.from_string(text)
        except IdentityError as e:
            raise MultiaddrError(f"{e} (in {where!r})") from None  # e names the bad PeerID
    raise AssertionError(name)  # pragma: no cover - table and parser out of sync


def _check_dns_name(name: str, where: str) -> None:
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: what Python makes of undecodable argv bytes
        raise MultiaddrError(f"invalid DNS name {name!r} in {where!r}: not valid Unicode") from None
    if not name or len(encoded) > MAX_DNS_NAME_BYTES:
        raise MultiaddrError(f"invalid DNS name {name!r} in {where!r}: bad length")
    if "/" in name or any(ord(c) < 0x21 or ord(c) == 0x7F for c in name):
        raise MultiaddrError(f"invalid DNS name {name!r} in {where!r}: illegal character")


def _value_to_bytes(proto: _Protocol, value: Value) -> bytes:
    name = proto.name
    if proto.size == 0:
        return b""
    if name in ("ip4", "ip6"):
        return ipaddress.ip_address(value).packed  # type: ignore[arg-type]
    if name == "tcp":
        return int(value).to_bytes(2, "big")  # type: ignore[arg-type]
    if name == "memory":
        return int(value).to_bytes(8, "big")  # type: ignore[arg-type]
    if name == "p2p":
        raw = value.to_bytes()  # type: ignore[union-attr,call-arg]
    else:
        raw = str(value).encode("utf-8")
    return encode_uvarint(len(raw)) + raw


def _value_from_bytes(proto: _Protocol, raw: bytes, where: str) -> Value:
    name = proto.name
    if proto.size == 0:
        return ""
    if name == "ip4":
        return str(ipaddress.IPv4Address(raw))
    if name == "ip6":
        return str(ipaddress.IPv6Address(raw))
    if name == "tcp" or name == "memory":
        return int.from_bytes(raw, "big")
    if name == "p2p":
        try:
            return PeerID.from_bytes(raw)
        except IdentityError as e:
            raise MultiaddrError(f"invalid /p2p value in binary multiaddr {where}: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MultiaddrError(f"/{name} value is not UTF-8 in binary multiaddr {where}") from None
    _check_dns_name(text, where)
    return text


def _format_component(name: str, value: Value) -> str:
    if _BY_NAME[name].size == 0:
        return f"/{name}"
    return f"/{name}/{value.to_base58() if isinstance(value, PeerID) else value}"


class Multiaddr:
    """An immutable, hashable, parsed multiaddr.

    ``Multiaddr("/ip4/127.0.0.1/tcp/4001")``; equality is by components (``/ipfs`` and ``/p2p``
    are the same protocol and compare equal).
    """

    __slots__ = ("_components", "_text")
    _components: tuple[tuple[str, Value], ...]
    _text: str | None

    def __init__(self, addr: str | Multiaddr) -> None:
        if isinstance(addr, Multiaddr):
            components: tuple[tuple[str, Value], ...] = addr._components
        elif isinstance(addr, str):
            components = _parse_text(addr)
        else:
            raise MultiaddrError(f"a multiaddr must be str, not {type(addr).__name__}")
        object.__setattr__(self, "_components", components)
        object.__setattr__(self, "_text", None)

    @classmethod
    def _from_components(cls, components: tuple[tuple[str, Value], ...]) -> Multiaddr:
        if not components:
            raise MultiaddrError("a multiaddr needs at least one component")
        self = cls.__new__(cls)
        object.__setattr__(self, "_components", components)
        object.__setattr__(self, "_text", None)
        return self

    @classmethod
    def from_bytes(cls, data: bytes) -> Multiaddr:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise MultiaddrError(f"binary multiaddr must be bytes, not {type(data).__name__}")
        data = bytes(data)
        if len(data) > MAX_MULTIADDR_BYTES:
            raise MultiaddrError(f"binary multiaddr too long ({len(data)} bytes)")
        components: list[tuple[str, Value]] = []
        pos = 0
        while pos < len(data):
            where = f"at byte {pos}"
            try:
                code, pos = decode_uvarint(data, pos)
            except ValueError as e:
                raise MultiaddrError(
                    f"bad protocol code in binary multiaddr {where}: {e}"
                ) from None
            proto = _BY_CODE.get(code)
            if proto is None:
                raise MultiaddrError(
                    f"unsupported protocol code {code} in binary multiaddr {where}"
                )
            size = proto.size
            if size < 0:
                try:
                    size, pos = decode_uvarint(data, pos)
                except ValueError as e:
                    raise MultiaddrError(f"bad /{proto.name} length {where}: {e}") from None
            if pos + size > len(data):
                raise MultiaddrError(f"truncated /{proto.name} value in binary multiaddr {where}")
            components.append((proto.name, _value_from_bytes(proto, data[pos : pos + size], where)))
            pos += size
        return cls._from_components(tuple(components))

    # -- forms ---------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        out = bytearray()
        for name, value in self._components:
            proto = _BY_NAME[name]
            out += encode_uvarint(proto.code)
            out += _value_to_bytes(proto, value)
        return bytes(out)

    def __str__(self) -> str:
        if self._text is None:
            text = "".join(_format_component(n, v) for n, v in self._components)
            object.__setattr__(self, "_text", text)
        return self._text  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"Multiaddr({str(self)!r})"

    # -- accessors -----------------------------------------------------------------------------
    @property
    def components(self) -> tuple[tuple[str, Value], ...]:
        """``((protocol_name, value), ...)``; values are str (addresses, names; ``""`` for
        ``p2p-circuit``, which has none), int (ports, memory ids) or PeerID."""
        return self._components

    def protocols(self) -> list[str]:
        return [name for name, _ in self._components]

    def value_for(self, protocol: str) -> Value | None:
        """Value of the first component of ``protocol`` (``"ipfs"`` means ``"p2p"``), or None."""
        protocol = "p2p" if protocol == "ipfs" else protocol
        for name, value in self._components:
            if name == protocol:
                return value
        return None

    @property
    def peer_id(self) -> PeerID | None:
        """The PeerID of a trailing ``/p2p/<id>`` component, if any."""
        name, value = self._components[-1]
        return value if name == "p2p" else None  # type: ignore[return-value]

    def with_peer_id(self, peer_id: PeerID) -> Multiaddr:
        """This address ending in ``/p2p/<peer_id>``.

        Raises MultiaddrError if it already names a *different* peer (a caller mixing up
        addresses of two peers is a bug worth surfacing).
        """
        if not isinstance(peer_id, PeerID):
            raise TypeError(f"peer_id must be a PeerID, not {type(peer_id).__name__}")
        current = self.peer_id
        if current == peer_id:
            return self
        if current is not None:
            raise MultiaddrError(f"{self} already names peer {current}, not {peer_id}")
        return Multiaddr._from_components(self._components + (("p2p", peer_id),))

    def without_peer_id(self) -> Multiaddr:
        """This address without its trailing ``/p2p/<id>`` (the transport part to dial)."""
        if self.peer_id is None:
            return self
        if len(self._components) == 1:
            raise MultiaddrError(f"{self} is only a peer id; it has no transport address")
        return Multiaddr._from_components(self._components[:-1])

    def tcp_endpoint(self) -> tuple[str, int]:
        """``(host, port)`` of a ``/ip4|ip6|dns|dns4|dns6/<host>/tcp/<port>[/p2p/<id>]`` address."""
        parts = self.without_peer_id()._components
        if len(parts) != 2 or parts[1][0] != "tcp" or parts[0][0] not in _TCP_HOSTS:
            raise MultiaddrError(f"{self} is not a TCP address (/ip4|ip6|dns*/<host>/tcp/<port>)")
        return str(parts[0][1]), int(parts[1][1])  # type: ignore[arg-type]

    def is_tcp(self) -> bool:
        try:
            self.tcp_endpoint()
        except MultiaddrError:
            return False
        return True

    def memory_id(self) -> int:
        """The id of a ``/memory/<id>[/p2p/<peer>]`` address (in-memory network)."""
        parts = self.without_peer_id()._components
        if len(parts) != 1 or parts[0][0] != "memory":
            raise MultiaddrError(f"{self} is not an in-memory address (/memory/<id>)")
        return int(parts[0][1])  # type: ignore[arg-type]

    def is_memory(self) -> bool:
        try:
            self.memory_id()
        except MultiaddrError:
            return False
        return True

    def is_circuit(self) -> bool:
        """True for a relayed address (it has a ``/p2p-circuit`` component)."""
        return any(name == "p2p-circuit" for name, _ in self._components)

    # -- value semantics -----------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Multiaddr is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Multiaddr, (str(self),))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Multiaddr):
            return NotImplemented
        return self._components == other._components

    def __hash__(self) -> int:
        return hash(self._components)


_TCP_HOSTS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})


def _parse_text(text: str) -> tuple[tuple[str, Value], ...]:
    if len(text) > MAX_MULTIADDR_BYTES:
        raise MultiaddrError(f"multiaddr too long ({len(text)} characters)")
    if not text.startswith("/"):
        raise MultiaddrError(f"multiaddr {text!r} must start with '/'")
    parts = text.split("/")[1:]
    if parts and parts[-1] == "":
        parts.pop()  # tolerate one trailing slash
    if not parts:
        raise MultiaddrError(f"empty multiaddr {text!r}")
    components: list[tuple[str, Value]] = []
    i = 0
    while i < len(parts):
        name = parts[i]
        proto = _BY_NAME.get(name)
        if proto is None:
            if name == "":
                raise MultiaddrError(f"empty protocol name (double '/') in {text!r}")
            raise MultiaddrError(f"unsupported protocol {name!r} in {text!r}")
        if proto.size == 0:
            components.append((proto.name, ""))
            i += 1
            continue
        if i + 1 >= len(parts) or parts[i + 1] == "":
            raise MultiaddrError(f"protocol /{name} is missing its value in {text!r}")
        components.append((proto.name, _parse_value(proto, parts[i + 1], text)))
        i += 2
    return tuple(components)


EXAMPLE_PEER_MADDR = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
EXAMPLE_LISTEN_MADDR = "/ip4/0.0.0.0/tcp/31337"


def parse_multiaddr_list(
    values: Any, what: str, *, example: str = EXAMPLE_PEER_MADDR, dialable: bool = True
) -> list[Multiaddr]:
    """Parse a user-supplied list of addresses up front, with errors that name the bad one.

    ``what`` names the setting in messages (``"initial_peers"``, ``"--initial-peers"``).
    A single ``str``/``Multiaddr`` is refused with ``TypeError`` (iterating it would try each
    character as an address). Each entry must parse and, when ``dialable``, name a transport
    (``/ip4|ip6|dns*/<host>/tcp/<port>`` or ``/memory/<id>``, optionally ``/p2p/<PeerID>``);
    otherwise ``MultiaddrError("bad <what> '<entry>': <why>; expected e.g. <example>")``.
    """
    if isinstance(values, str | bytes | Multiaddr):
        raise TypeError(
            f"{what} must be a list of multiaddrs, not a single {type(values).__name__}; "
            f"write {what}=[{str(values)!r}]"
        )
    try:
        entries = list(values)
    except TypeError:
        raise TypeError(
            f"{what} must be a list of multiaddrs, not {type(values).__name__}"
        ) from None
    parsed = []
    for entry in entries:
        if not isinstance(entry, str | Multiaddr):
            raise TypeError(
                f"each {what} entry must be a str or Multiaddr, not {type(entry).__name__} "
                f"({entry!r})"
            )
        try:
            maddr = Multiaddr(entry)
            if dialable and not (maddr.is_tcp() or maddr.is_memory()):
                raise MultiaddrError(
                    f"{str(maddr)!r} names no transport "
                    "(/ip4|ip6|dns/<host>/tcp/<port> or /memory/<id>)"
                )
        except MultiaddrError as e:  # e quotes the entry
            raise MultiaddrError(f"bad {what}: {e}; expected e.g. {example}") from None
        parsed.append(maddr)
    return parsed
