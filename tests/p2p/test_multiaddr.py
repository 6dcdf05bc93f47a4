"""Multiaddr parsing, formatting, binary form and errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.p2p.errors import MultiaddrError
from dht.p2p.identity import Identity, PeerID
from dht.p2p.multiaddr import Multiaddr

PID = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"


@pytest.mark.parametrize(
    "text, hex_bytes",
    [
        # binary vectors from the multiaddr spec / go-multiaddr tests
        ("/ip4/127.0.0.1/tcp/4001", "047f000001060fa1"),
        ("/ip4/1.2.3.4/tcp/80", "040102030406" + "0050"),
        ("/ip6/::1/tcp/8080", "29" + "00" * 15 + "01" + "06" + "1f90"),
        ("/dns4/example.com/tcp/443", "36" + "0b" + b"example.com".hex() + "0601bb"),
        ("/dns/localhost/tcp/1", "35" + "09" + b"localhost".hex() + "060001"),
        ("/dns6/h/tcp/1", "3701" + b"h".hex() + "060001"),
        ("/memory/1234", "8906" + (1234).to_bytes(8, "big").hex()),
    ],
)
def test_text_and_binary_vectors(text, hex_bytes):
    ma = Multiaddr(text)
    assert str(ma) == text
    assert ma.to_bytes().hex() == hex_bytes
    assert Multiaddr.from_bytes(bytes.fromhex(hex_bytes)) == ma


def test_p2p_component_and_legacy_ipfs():
    ma = Multiaddr(f"/ip4/10.0.0.1/tcp/31337/p2p/{PID}")
    assert ma.peer_id == PeerID.from_base58(PID)
    # /p2p code 421 = varint a503, then length-prefixed multihash bytes
    pid_bytes = PeerID.from_base58(PID).to_bytes()
    assert ma.to_bytes().endswith(b"\xa5\x03" + bytes([len(pid_bytes)]) + pid_bytes)
    legacy = Multiaddr(f"/ip4/10.0.0.1/tcp/31337/ipfs/{PID}")
    assert legacy == ma and str(legacy) == str(ma) and hash(legacy) == hash(ma)
    assert ma.without_peer_id() == Multiaddr("/ip4/10.0.0.1/tcp/31337")
    assert ma.without_peer_id().peer_id is None
    assert ma.tcp_endpoint() == ("10.0.0.1", 31337)
    assert Multiaddr(f"/p2p/{PID}").peer_id is not None


def test_with_peer_id():
    pid = Identity.generate().peer_id
    base = Multiaddr("/ip4/127.0.0.1/tcp/1")
    full = base.with_peer_id(pid)
    assert full.peer_id == pid and full.with_peer_id(pid) == full
    assert full.without_peer_id() == base
    with pytest.raises(MultiaddrError, match="already names peer"):
        full.with_peer_id(Identity.generate().peer_id)


def test_endpoints():
    assert Multiaddr("/ip6/::1/tcp/5").tcp_endpoint() == ("::1", 5)
    assert Multiaddr("/dns/example.org/tcp/5").tcp_endpoint() == ("example.org", 5)
    assert Multiaddr(f"/memory/7/p2p/{PID}").memory_id() == 7
    assert Multiaddr("/memory/7").is_memory() and not Multiaddr("/memory/7").is_tcp()
    with pytest.raises(MultiaddrError, match="not a TCP address"):
        Multiaddr("/ip4/1.1.1.1").tcp_endpoint()
    with pytest.raises(MultiaddrError, match="not an in-memory address"):
        Multiaddr("/ip4/1.1.1.1/tcp/1").memory_id()


def test_normalization_and_value_semantics():
    assert str(Multiaddr("/ip6/0:0:0:0:0:0:0:1/tcp/01/")) == "/ip6/::1/tcp/1"
    a = Multiaddr("/ip4/1.2.3.4/tcp/5")
    assert Multiaddr(a) == a and {a: 1}[Multiaddr("/ip4/1.2.3.4/tcp/5")] == 1
    assert a != Multiaddr("/ip4/1.2.3.4/tcp/6")
    assert a.protocols() == ["ip4", "tcp"] and a.value_for("tcp") == 5
    with pytest.raises(AttributeError):
        a._components = ()  # type: ignore[misc]


@pytest.mark.parametrize(
    "text, match",
    [
        ("/ip4/300.1.1.1/tcp/1", r"invalid IPv4 address '300.1.1.1' in '/ip4/300.1.1.1/tcp/1'"),
        ("/ip4/1.2.3.4/tcp/65536", r"invalid TCP port '65536'"),
        ("/ip4/1.2.3.4/tcp/-1", r"invalid TCP port '-1'"),
        ("/ip4/1.2.3.4/tcp/ 1", r"invalid TCP port"),
        ("/ip6/fe80::1%eth0/tcp/1", "zone"),
        ("/ip6/1.2.3.4/tcp/1", "invalid IPv6"),
        ("/ip4/1.2.3.4/udp/1", r"unsupported protocol 'udp'"),
        ("ip4/1.2.3.4", "must start with '/'"),
        ("", "must start with '/'"),
        ("/", "empty multiaddr"),
        ("/ip4", "missing its value"),
        ("/ip4//tcp/1", "missing its value"),
        ("/ip4/1.2.3.4//tcp/1", "double"),
        ("/p2p/notapeerid", "invalid PeerID"),
        ("/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWAbc", r"'12D3KooWAbc': it looks truncated: .* 52 "),
        ("/ip4/1.2.3.4/tcp/1/p2p/12D3KooW0bc", r"invalid base58 character '0' at position 8"),
        ("/memory/18446744073709551616", "invalid memory address"),
        ("/dns/" + "a" * 300, "bad length"),
        ("/ip4/1.2.3.4/tcp/1" * 100, "too long"),
    ],
)
def test_parse_errors(text, match):
    with pytest.raises(MultiaddrError, match=match):
        Multiaddr(text)


def test_multiaddr_error_is_value_error():
    with pytest.raises(ValueError):
        Multiaddr("/nope/1")


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x04\x7f\x00", "truncated /ip4"),
        (b"\x63\x00", "unsupported protocol code 99"),
        (b"\x35\x05ab", "truncated /dns"),
        (b"\x35\x02\xff\xfe", "not UTF-8"),
        (b"\xa5\x03\x02\x00\x00", "invalid /p2p value"),
        (b"\x80", "bad protocol code"),
        (b"", "at least one component"),
    ],
)
def test_binary_errors(raw, match):
    with pytest.raises(MultiaddrError, match=match):
        Multiaddr.from_bytes(raw)


_hosts = st.one_of(
    st.ip_addresses(v=4).map(lambda a: f"/ip4/{a}"),
    st.ip_addresses(v=6).map(lambda a: f"/ip6/{a}"),
    st.from_regex(r"[a-z0-9][a-z0-9.-]{0,30}", fullmatch=True).map(lambda n: f"/dns4/{n}"),
)


@given(_hosts, st.integers(0, 65535), st.booleans())
def test_roundtrip_property(host, port, with_pid):
    text = f"{host}/tcp/{port}" + (f"/p2p/{PID}" if with_pid else "")
    ma = Multiaddr(text)
    assert Multiaddr(str(ma)) == ma
    assert Multiaddr.from_bytes(ma.to_bytes()) == ma


@given(st.binary(max_size=64))
def test_random_bytes_never_crash(raw):
    try:
        ma = Multiaddr.from_bytes(raw)
    except MultiaddrError:
        return
    assert Multiaddr.from_bytes(ma.to_bytes()) == ma


@given(st.text(max_size=64))
def test_random_text_never_crash(text):
    try:
        ma = Multiaddr(text)
    except MultiaddrError:
        return
    assert Multiaddr(str(ma)) == ma
