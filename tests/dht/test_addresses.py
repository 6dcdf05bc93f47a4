"""Addresses across machines: interface discovery, the all-interfaces default, address errors.

Real sockets and the real kernel: interface addresses are compared with what ``ip`` reports,
listeners are dialed over TCP at every announced address.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import shutil
import socket
import struct
import subprocess
import threading

import pytest
import trio

from dht import DHT, DHTNode
from dht.kademlia.node import DEFAULT_HOST_MADDRS, check_address_args
from dht.p2p import Host, Identity, MemoryNetwork, Multiaddr, MultiaddrError, TCPTransport
from dht.p2p import transport as tcp

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
GOOD_PEER = f"/ip4/127.0.0.1/tcp/9/p2p/{Identity.generate().peer_id}"


def kernel_addresses(family: str) -> set[str]:
    """Addresses of up interfaces as ``ip`` reports them, minus link-local ones."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    out = subprocess.run(
        ["ip", "-j", family, "addr", "show", "up"], capture_output=True, text=True, check=True
    ).stdout
    found = set()
    for interface in json.loads(out or "[]"):
        for info in interface.get("addr_info", []):
            ip = ipaddress.ip_address(info["local"])
            if not ip.is_link_local and "dadfailed" not in info:
                found.add(str(ip))
    return found


def ip_of(maddr: Multiaddr) -> str:
    return maddr.tcp_endpoint()[0]


# ------------------------------------------------------------------ interface discovery


@pytest.mark.parametrize(
    ("family", "flag"), [(socket.AF_INET, "-4"), (socket.AF_INET6, "-6")], ids=["ipv4", "ipv6"]
)
def test_interface_addresses_are_the_kernels_with_loopback_last(family, flag):
    expected = kernel_addresses(flag)
    if not expected:
        pytest.skip(f"this machine has no {flag} addresses on up interfaces")
    found = tcp.local_ip_addresses(family)
    assert set(found) == expected  # not only the host name's address (often just 127.0.0.1)
    ips = [ipaddress.ip_address(a) for a in found]
    assert not any(ip.is_unspecified or ip.is_link_local for ip in ips)
    loopbacks = [i for i, ip in enumerate(ips) if ip.is_loopback]
    assert loopbacks == list(range(len(ips) - len(loopbacks), len(ips)))  # all at the end
    source = tcp._route_source_address(family)
    if source is not None and not ipaddress.ip_address(source).is_loopback:
        assert found[0] == source  # the address the kernel uses for outbound traffic first


def test_without_netlink_the_ioctls_find_the_same_ipv4_addresses(monkeypatch):
    expected = kernel_addresses("-4")

    def no_netlink(family):
        raise OSError("netlink unavailable (test)")

    monkeypatch.setattr(tcp, "_netlink_addresses", no_netlink)
    assert set(tcp.local_ip_addresses(socket.AF_INET)) == expected


def test_without_any_enumeration_the_route_source_and_loopback_remain(monkeypatch):
    def fail(*args):
        raise OSError("unavailable (test)")

    monkeypatch.setattr(tcp, "_netlink_addresses", fail)
    monkeypatch.setattr(tcp, "_ioctl_ipv4_addresses", fail)
    monkeypatch.setattr(tcp, "_route_source_address", lambda family: "198.51.100.23")
    assert tcp.local_ip_addresses(socket.AF_INET) == ["198.51.100.23", "127.0.0.1"]


def test_many_addresses_are_capped_keeping_loopback(monkeypatch):
    many = [f"10.0.0.{i}" for i in range(1, 30)] + ["127.0.0.1", "169.254.1.1", "0.0.0.0"]
    monkeypatch.setattr(tcp, "_netlink_addresses", lambda family: many)
    monkeypatch.setattr(tcp, "_route_source_address", lambda family: "10.0.0.7")
    found = tcp.local_ip_addresses(socket.AF_INET)
    assert len(found) == tcp.MAX_ANNOUNCED_PER_LISTENER
    assert found[0] == "10.0.0.7" and found[-1] == "127.0.0.1"
    assert "169.254.1.1" not in found and "0.0.0.0" not in found


def _newaddr(family: int, index: int, attrs: list[tuple[int, bytes]], flags: int = 0) -> bytes:
    body = struct.pack("=BBBBI", family, 24, flags, 0, index)
    for kind, value in attrs:
        attr = struct.pack("=HH", 4 + len(value), kind) + value
        body += attr + b"\0" * (-len(attr) % 4)
    return body


def test_netlink_messages_prefer_the_local_end_and_skip_bad_ones():
    v4 = socket.AF_INET
    a, b = socket.inet_aton("10.1.0.1"), socket.inet_aton("10.1.0.2")
    # point-to-point: IFA_ADDRESS is the far end, IFA_LOCAL ours
    assert tcp._parse_newaddr(_newaddr(v4, 3, [(1, b), (2, a)]), v4) == ("10.1.0.1", 3)
    assert tcp._parse_newaddr(_newaddr(v4, 3, [(1, a)]), v4) == ("10.1.0.1", 3)
    assert tcp._parse_newaddr(_newaddr(v4, 3, [(1, a[:3])]), v4) is None  # wrong length
    assert tcp._parse_newaddr(_newaddr(v4, 3, [(1, a)], flags=0x08), v4) is None  # DAD failed
    assert tcp._parse_newaddr(_newaddr(socket.AF_INET6, 3, [(1, a)]), v4) is None
    assert tcp._parse_newaddr(b"\x02\x18", v4) is None  # truncated header
    truncated_attr = _newaddr(v4, 3, []) + struct.pack("=HH", 40, 1) + a
    assert tcp._parse_newaddr(truncated_attr, v4) is None


# ------------------------------------------------------------------ listening on all interfaces


async def test_a_wildcard_listener_is_reachable_at_every_announced_address():
    async with Host.open(transport=TCPTransport()) as server:
        addrs = await server.listen(["/ip4/0.0.0.0/tcp/0"])
        ips = [ip_of(a) for a in addrs]
        assert ips == tcp.local_ip_addresses(socket.AF_INET)
        assert "0.0.0.0" not in ips and ips[-1] == "127.0.0.1"
        assert len({a.tcp_endpoint()[1] for a in addrs}) == 1  # one socket, one port
        for addr in addrs:  # each address alone is enough, loopback included
            async with Host.open(transport=TCPTransport()) as client:
                with trio.fail_after(30):
                    assert await client.connect([addr]) == server.peer_id


def test_dht_listens_on_all_interfaces_by_default_and_logs_what_it_announces(caplog):
    assert DEFAULT_HOST_MADDRS == ("/ip4/0.0.0.0/tcp/0",)
    with caplog.at_level(logging.INFO, logger="dht.kademlia.node"), DHT() as first:
        visible = first.get_visible_maddrs()
        assert [ip_of(m) for m in visible] == tcp.local_ip_addresses(socket.AF_INET)
        assert all(m.peer_id == first.peer_id for m in visible)
        announced = [r.getMessage() for r in caplog.records if "announcing" in r.getMessage()]
        assert len(announced) == 1 and all(str(m) in announced[0] for m in visible)
        # a peer on this machine can join through the first (routable) or the loopback address
        for maddr in (visible[0], visible[-1]):
            with DHT(initial_peers=[maddr], host_maddrs=LOOPBACK) as second:
                assert len(second.node.routing_table) >= 1


# ------------------------------------------------------------------ errors a user can act on


def _dht_threads() -> int:
    return sum(t.name == "moshpit-dht" for t in threading.enumerate())


def test_a_malformed_initial_peer_is_one_specific_error_before_anything_starts():
    before = _dht_threads()
    with pytest.raises(MultiaddrError) as info:
        DHT(initial_peers=[GOOD_PEER, "127.0.0.1:31337", GOOD_PEER], host_maddrs=LOOPBACK)
    assert type(info.value) is MultiaddrError  # not an ExceptionGroup of dial failures
    message = str(info.value)
    assert "'127.0.0.1:31337'" in message and "must start with '/'" in message
    assert "expected e.g. /ip4/" in message
    assert _dht_threads() == before  # no thread was started for a doomed node


def test_a_corrupt_peer_id_names_the_bad_address():
    corrupt = GOOD_PEER[:-6]  # the end of a copy-pasted address got lost
    with pytest.raises(MultiaddrError, match="invalid PeerID") as info:
        DHT(initial_peers=[corrupt], host_maddrs=LOOPBACK)
    assert corrupt in str(info.value)


def test_a_truncated_peer_id_says_it_looks_truncated_and_how_long_a_peer_id_is():
    cut = GOOD_PEER[:-30]  # a copy-paste cut short: 22 of the PeerID's 52 characters are left
    peer_id = cut.rsplit("/", 1)[1]
    before = _dht_threads()
    with pytest.raises(MultiaddrError) as info:
        DHT(initial_peers=[cut], host_maddrs=LOOPBACK)
    assert type(info.value) is MultiaddrError
    assert str(info.value) == (
        f"bad initial_peers: invalid PeerID {peer_id!r}: it looks truncated: an Ed25519 PeerID "
        "is 52 characters (12D3KooW + 44 more), this one has 22; copy the whole PeerID "
        f"(in {cut!r}); expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
    )
    assert _dht_threads() == before


@pytest.mark.parametrize("argument", ["initial_peers", "host_maddrs", "announce_maddrs"])
def test_a_string_instead_of_a_list_is_a_type_error(argument):
    kwargs = {"host_maddrs": LOOPBACK, argument: GOOD_PEER}
    before = _dht_threads()
    with pytest.raises(TypeError, match=rf"{argument} must be a list of multiaddrs.*\[") as info:
        DHT(**kwargs)
    assert str(GOOD_PEER) in str(info.value)  # shows how to write it as a list
    assert _dht_threads() == before


def test_bad_listen_and_announce_addresses_are_refused_up_front():
    with pytest.raises(MultiaddrError, match="bad host_maddrs.*udp"):
        check_address_args([], ["/ip4/0.0.0.0/udp/5"], None)
    with pytest.raises(MultiaddrError, match="wildcard nobody can dial"):
        check_address_args([], None, ["/ip4/0.0.0.0/tcp/31337"])
    with pytest.raises(ValueError, match="at most 16"):
        check_address_args([], None, [f"/ip4/203.0.113.{i}/tcp/1" for i in range(17)])
    with pytest.raises(MultiaddrError, match="names no transport"):
        check_address_args([f"/p2p/{Identity.generate().peer_id}"], None, None)
    with pytest.raises(TypeError, match="str or Multiaddr, not int"):
        check_address_args([31337], None, None)
    peers, listen, announce = check_address_args(
        (GOOD_PEER,), LOOPBACK, ["/dns4/example.org/tcp/31337"]
    )
    assert peers == [Multiaddr(GOOD_PEER)] and listen == [Multiaddr(LOOPBACK[0])]
    assert announce == [Multiaddr("/dns4/example.org/tcp/31337")]


async def test_the_async_api_raises_the_specific_error_for_any_number_of_peers():
    network = MemoryNetwork()
    async with DHTNode.open(transport=network.transport(), host_maddrs=["/memory/0"]) as first:
        good = str(first.get_visible_maddrs()[0])
        with pytest.raises(MultiaddrError, match="bad initial_peers: invalid PeerID"):
            async with DHTNode.open(
                transport=network.transport(),
                host_maddrs=["/memory/0"],
                initial_peers=[good, "/memory/1/p2p/notapeer", good],
            ):
                pytest.fail("a node with a malformed initial peer started")


async def test_a_remote_peers_loopback_and_link_local_addresses_are_not_kept_or_passed_on():
    """A loopback address names the machine of whoever uses it, a link-local one its link:
    learned from a peer on another machine they would make us (and everyone we tell) dial
    ourselves. They are kept only from informants we reach over such an address too."""
    from types import SimpleNamespace

    from dht.kademlia.network import HostNetwork

    async with Host.open() as host:
        network = HostNetwork(host)
        remote = Identity.generate().peer_id
        local = Identity.generate().peer_id
        host._conns[remote] = [SimpleNamespace(alive=True, remote_addr="10.9.8.7:4001")]
        # an accepted connection names its remote "ip:port", a dialed one by its multiaddr
        host._conns[local] = [SimpleNamespace(alive=True, remote_addr="/ip4/127.0.0.1/tcp/4001")]
        announced = [
            Multiaddr(a).to_bytes()
            for a in (
                "/ip4/10.9.8.7/tcp/4001",
                "/ip4/127.0.0.1/tcp/4001",
                "/ip6/::1/tcp/4001",
                "/ip4/169.254.1.2/tcp/4001",
                "/ip6/fe80::1/tcp/4001",
                f"/ip4/127.0.0.1/tcp/4002/p2p/{local}/p2p-circuit",
                f"/ip4/10.9.8.1/tcp/4002/p2p/{local}/p2p-circuit",
            )
        ]
        kept = [str(Multiaddr.from_bytes(a)) for a in network.usable_addrs(announced, remote)]
        assert kept == [
            "/ip4/10.9.8.7/tcp/4001",
            f"/ip4/10.9.8.1/tcp/4002/p2p/{local}/p2p-circuit",
        ]
        # from a peer on this machine, its loopback addresses are real ways in
        assert network.usable_addrs(announced, local) == tuple(
            a for a in announced if b"\xa9\xfe" not in a[:3] and not a.startswith(b")\xfe\x80")
        )
        # a peer that connected from one of this machine's own addresses runs here too
        here = Identity.generate().peer_id
        network._local_ips_cache = (float("inf"), frozenset({"10.9.8.250"}))
        host._conns[here] = [SimpleNamespace(alive=True, remote_addr="10.9.8.250:50000")]
        assert network.usable_addrs(announced, here) == network.usable_addrs(announced, local)
        # and remember_addrs applies the same rule (what the DHT calls for every contact)
        network.remember_addrs(remote, announced, informant=remote)
        assert not any("127.0.0.1" in str(a) for a in host.peerstore.get_addrs(remote))
        host._conns.clear()
