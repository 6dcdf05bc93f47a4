"""AutoNAT v1: the codec with bad bytes, the server's rules, and real Hosts over loopback TCP."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import pytest
import trio

from dht.p2p import Host, Identity, Multiaddr
from dht.p2p._proto import encode_bytes_field, encode_varint_field
from dht.p2p.autonat import (
    MAX_MESSAGE_SIZE,
    MAX_REQUEST_ADDRS,
    PROTOCOL_ID,
    AutoNAT,
    AutoNATConfig,
    AutoNATMessageError,
    DialRequest,
    DialResponse,
    ObservedAddrs,
    ReachabilityStatus,
    ResponseStatus,
    decode_message,
    dial_targets,
    encode_dial,
    encode_dial_response,
    frame,
)
from dht.p2p.varint import encode_uvarint

from .conftest import wait_until

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
FAST = AutoNATConfig(dial_timeout=3.0, response_timeout=6.0, request_timeout=2.0)


def _peer() -> object:
    return Identity.generate().peer_id


# -- codec ----------------------------------------------------------------------------------------


def test_dial_and_response_round_trip() -> None:
    me = _peer()
    addrs = [Multiaddr("/ip4/203.0.113.7/tcp/4001"), Multiaddr("/ip6/2001:db8::1/tcp/4002")]
    request = decode_message(encode_dial(me, addrs))
    assert request == DialRequest(me, tuple(addrs), 0)
    response = DialResponse(ResponseStatus.OK, "fine", addrs[0])
    assert decode_message(encode_dial_response(response)) == response
    refused = DialResponse(ResponseStatus.E_DIAL_REFUSED, "x" * 1000)
    assert decode_message(encode_dial_response(refused)).text == "x" * 256  # capped


def _msg(type_: int | None, field: int | None = None, body: bytes = b"") -> bytes:
    out = b"" if type_ is None else encode_varint_field(1, type_)
    return out + (encode_bytes_field(field, body) if field is not None else b"")


def _dial_body(peer_info: bytes) -> bytes:
    return encode_bytes_field(1, peer_info)


_ADDR = Multiaddr("/ip4/127.0.0.1/tcp/1").to_bytes()
BAD_MESSAGES = {
    "truncated": encode_dial(Identity.generate().peer_id, [])[:-3],
    "type as bytes": encode_bytes_field(1, b"\x00"),
    "unknown type": _msg(7),
    "type out of range": _msg(1 << 40),
    "dial without dial field": _msg(0),
    "dial field as varint": encode_varint_field(1, 0) + encode_varint_field(2, 5),
    "dial without peer": _msg(0, 2, b""),
    "peer id garbage": _msg(0, 2, _dial_body(encode_bytes_field(1, b"\xff\x00junk"))),
    "addrs as varint": _msg(0, 2, _dial_body(encode_varint_field(2, 3))),
    "too many addrs": _msg(
        0,
        2,
        _dial_body(b"".join(encode_bytes_field(2, _ADDR) for _ in range(MAX_REQUEST_ADDRS + 1))),
    ),
    "repeated dial": _msg(0, 2, _dial_body(b"")) + encode_bytes_field(2, _dial_body(b"")),
    "response without status": _msg(1, 3, encode_bytes_field(2, b"ok")),
    "status text not utf-8": _msg(1, 3, encode_varint_field(1, 0) + encode_bytes_field(2, b"\xff")),
    "oversized": _msg(0, 2, _dial_body(encode_bytes_field(9, b"\0" * MAX_MESSAGE_SIZE))),
    "wire type 3 (group)": bytes([1 << 3 | 3]),
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
def test_bad_bytes_are_refused_with_a_reason(name: str) -> None:
    with pytest.raises(AutoNATMessageError) as e:
        decode_message(BAD_MESSAGES[name])
    assert str(e.value)


def test_unknown_fields_and_unsupported_addrs_are_skipped() -> None:
    me = _peer()
    quic = bytes.fromhex("047f000001") + bytes.fromhex("9102") + b"\x0f\xa1"  # udp 4001... quic
    info = encode_bytes_field(1, me.to_bytes()) + encode_bytes_field(2, quic)
    info += encode_bytes_field(2, _ADDR) + encode_varint_field(15, 9)
    request = decode_message(_msg(0, 2, _dial_body(info)) + encode_bytes_field(20, b"future"))
    assert isinstance(request, DialRequest)
    assert request.addrs == (Multiaddr.from_bytes(_ADDR),) and request.skipped == 1


# -- the server's address rule --------------------------------------------------------------------


def test_dial_targets_never_leave_the_observed_ip() -> None:
    import ipaddress

    me, other = _peer(), _peer()
    requested = [
        Multiaddr("/ip4/10.9.9.9/tcp/4001"),  # another IP: its port, at the observed IP
        Multiaddr("/ip4/198.51.100.4/tcp/4001"),  # same port again: no repeat
        Multiaddr(f"/ip4/198.51.100.4/tcp/4002/p2p/{other}"),  # another peer's: skipped
        Multiaddr("/dns4/victim.example/tcp/80"),  # a name could resolve anywhere: skipped
        Multiaddr(f"/ip4/10.0.0.1/tcp/5/p2p/{other}/p2p-circuit"),  # relayed: skipped
        Multiaddr("/ip6/2001:db8::1/tcp/4003"),
        Multiaddr("/ip4/198.51.100.4/tcp/4004"),
        Multiaddr("/ip4/198.51.100.4/tcp/4005"),
        Multiaddr("/ip4/198.51.100.4/tcp/4006"),
    ]
    seen = ipaddress.ip_address("198.51.100.4")
    got = dial_targets(requested, seen, me, 4)
    assert [str(a) for a in got] == [
        "/ip4/198.51.100.4/tcp/4001",
        "/ip4/198.51.100.4/tcp/4003",
        "/ip4/198.51.100.4/tcp/4004",
        "/ip4/198.51.100.4/tcp/4005",
    ]


# -- observed addresses ---------------------------------------------------------------------------


def test_observed_addrs_need_two_peers_and_never_trust_loopback() -> None:
    now = [0.0]
    book = ObservedAddrs(ttl=100.0, max_observers=3, clock=lambda: now[0])
    a, b, c, d = (_peer() for _ in range(4))
    listen = [Multiaddr("/ip4/192.168.1.5/tcp/4001"), Multiaddr("/ip4/0.0.0.0/tcp/4002")]
    assert not book.record(a, Multiaddr("/ip4/127.0.0.1/tcp/5000"))
    assert not book.record(a, Multiaddr("/ip4/169.254.3.3/tcp/5000"))
    assert not book.record(a, Multiaddr("/ip6/fe80::1/tcp/5000"))
    assert not book.record(a, Multiaddr("/memory/7"))
    assert not book.record(a, None)
    assert book.record(a, Multiaddr("/ip4/203.0.113.9/tcp/50001"))
    assert book.record(a, Multiaddr("/ip4/203.0.113.9/tcp/50002"))  # the same peer again
    assert book.candidates(listen) == []  # one peer's word is not enough
    assert book.record(b, Multiaddr("/ip4/203.0.113.9/tcp/61000"))
    assert [str(x) for x in book.candidates(listen)] == [
        "/ip4/203.0.113.9/tcp/4001",
        "/ip4/203.0.113.9/tcp/4002",
    ]
    # private ranges count too (a test bed's "public" net may use them), once confirmed
    book.record(c, Multiaddr("/ip4/10.0.0.7/tcp/1"))
    assert [str(ip) for ip in book.confirmed_ips()] == ["203.0.113.9"]
    book.record(d, Multiaddr("/ip4/10.0.0.7/tcp/2"))  # over max_observers: a's report goes
    assert sorted(map(str, book.confirmed_ips())) == ["10.0.0.7"]
    now[0] = 1000.0  # every report expired
    assert book.candidates(listen) == [] and book.observed() == {}


# -- real hosts over loopback TCP -----------------------------------------------------------------


async def _connected_hosts(stack: AsyncExitStack, n: int) -> list[Host]:
    hosts = [await stack.enter_async_context(Host.open()) for _ in range(n)]
    for h in hosts:
        await h.listen(LOCAL)
    return hosts


async def _exchange(client: Host, server: Host, raw: bytes) -> DialResponse:
    stream = await client.new_stream(server.peer_id, PROTOCOL_ID)
    await stream.send_all(raw)
    with trio.fail_after(5):
        body = await stream._reader.receive_frame(MAX_MESSAGE_SIZE)
    response = decode_message(body)
    assert isinstance(response, DialResponse)
    return response


async def test_server_answers_bad_requests_with_e_bad_request_and_logs_why(caplog) -> None:
    caplog.set_level(logging.INFO, logger="dht.p2p.autonat")
    async with AsyncExitStack() as stack:
        client, server = await _connected_hosts(stack, 2)
        AutoNAT(server, AutoNATConfig(max_requests_per_peer=10)).serve()
        await client.connect(server.listen_addrs)
        cases = [
            (encode_uvarint(MAX_MESSAGE_SIZE + 1) + b"\0" * 16, "exceeds the cap"),
            (frame(BAD_MESSAGES["type as bytes"]), "wire type 2"),
            (frame(encode_dial_response(DialResponse(0))), "expected a DIAL message"),
            (frame(encode_dial(_peer(), [])), "names another peer"),
        ]
        for raw, reason in cases:
            response = await _exchange(client, server, raw)
            assert response.status == ResponseStatus.E_BAD_REQUEST, reason
            assert reason in response.text
            assert any(
                "autonat: dropping request" in r.getMessage() and reason in r.getMessage()
                for r in caplog.records
            ), reason
        # the second malformed request within the log interval: answered, its log line counted
        records = len(caplog.records)
        response = await _exchange(client, server, frame(BAD_MESSAGES["too many addrs"]))
        assert response.status == ResponseStatus.E_BAD_REQUEST and "at most 32" in response.text
        assert len(caplog.records) == records
        # addresses that name only a peer, or only DNS names: nothing to dial, no crash
        odd = [Multiaddr(f"/p2p/{client.peer_id}"), Multiaddr("/dns4/localhost/tcp/1")]
        response = await _exchange(client, server, frame(encode_dial(client.peer_id, odd)))
        assert response.status == ResponseStatus.E_DIAL_ERROR, response
        assert client.is_connected(server.peer_id)  # a bad request costs its stream only


async def test_public_when_three_peers_dial_back_on_new_connections() -> None:
    async with AsyncExitStack() as stack:
        client, *servers = await _connected_hosts(stack, 4)
        for s in servers:
            AutoNAT(s, FAST).serve()
            await client.connect(s.listen_addrs)
        accepted: list[str] = []
        real_inbound = client._handle_inbound

        async def counting_inbound(raw, remote, pending):
            accepted.append(remote)
            await real_inbound(raw, remote, pending)

        client._handle_inbound = counting_inbound
        registered = []
        real_register = client._register

        def recording_register(conn):
            registered.append(conn.peer_id)
            real_register(conn)

        client._register = recording_register
        nat = AutoNAT(client, FAST)
        result = await nat.probe()
        assert client.reachability.status is ReachabilityStatus.PUBLIC, result
        assert client.reachability.confirmations == 3 and "3 of 3 peers" in str(client.reachability)
        assert client.reachability.public_addrs == tuple(
            a.without_peer_id() for a in client.listen_addrs
        )
        # every dial-back was a new TCP connection to the listen port (none reused), under
        # a PeerID of its own: new streams to the servers never pick these doomed connections
        assert len(accepted) == 3
        await wait_until(lambda: len(registered) == 3)
        assert not set(registered) & {s.peer_id for s in servers}
        assert all(len(client._conns[s.peer_id]) == 1 for s in servers)


async def test_private_when_the_listen_port_is_closed() -> None:
    async with AsyncExitStack() as stack:
        client, *servers = await _connected_hosts(stack, 4)
        for s in servers:
            AutoNAT(s, FAST).serve()
            await client.connect(s.listen_addrs)
        for listener in client._listeners:  # still announced, nobody accepts: like a firewall
            await listener.aclose()
        changes = []
        nat = AutoNAT(client, FAST)
        nat.add_observer(changes.append)
        result = await nat.probe()
        assert client.reachability.status is ReachabilityStatus.PRIVATE, result
        assert [a.status for a in result.answers] == [ResponseStatus.E_DIAL_ERROR] * 3
        assert changes == [client.reachability]
        # an inconclusive round (fewer servers than the threshold) keeps the decision
        await nat.probe([servers[0].peer_id])
        assert client.reachability.status is ReachabilityStatus.PRIVATE


async def test_unknown_below_the_threshold_and_with_refusals() -> None:
    async with AsyncExitStack() as stack:
        client, s1, s2, plain = await _connected_hosts(stack, 4)
        for s in (s1, s2):
            AutoNAT(s, FAST).serve()
            await client.connect(s.listen_addrs)
        await client.connect(plain.listen_addrs)  # does not speak autonat
        result = await AutoNAT(client, FAST).probe()
        assert client.reachability.status is ReachabilityStatus.UNKNOWN
        assert sorted(a.status is not None for a in result.answers) == [False, True, True]
        assert "2 of 3 peers dialed back" in client.reachability.reason


async def test_server_rate_limits_per_peer_and_never_dials_another_ip(monkeypatch) -> None:
    async with AsyncExitStack() as stack:
        client, server = await _connected_hosts(stack, 2)
        AutoNAT(server, AutoNATConfig(max_requests_per_peer=2, dial_timeout=3.0)).serve()
        await client.connect(server.listen_addrs)
        dialed: list[list[Multiaddr]] = []
        real = server.dial_new_connection

        async def spy(peer, addrs, timeout=10.0, **kw):  # noqa: ASYNC109 - the spied signature
            dialed.append(list(addrs))
            return await real(peer, addrs, timeout, **kw)

        monkeypatch.setattr(server, "dial_new_connection", spy)
        port = client.listen_addrs[0].tcp_endpoint()[1]
        request = frame(encode_dial(client.peer_id, [Multiaddr(f"/ip4/192.0.2.50/tcp/{port}")]))
        first = await _exchange(client, server, request)
        assert first.status == ResponseStatus.OK, first
        assert dialed == [[Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]]  # the IP we came from
        second = await _exchange(client, server, frame(encode_dial(client.peer_id, [])))
        assert second.status == ResponseStatus.E_DIAL_ERROR  # nothing dialable
        third = await _exchange(client, server, request)
        assert third.status == ResponseStatus.E_DIAL_REFUSED and "too many" in third.text
        assert len(dialed) == 1


async def test_identify_feeds_observed_addrs_but_not_from_loopback() -> None:
    async with AsyncExitStack() as stack:
        a, b = await _connected_hosts(stack, 2)
        await a.connect(b.listen_addrs)
        await wait_until(lambda: all(c.identified.is_set() for c in a._conns[b.peer_id]))
        assert a.observed_addrs.observed() == {}  # b saw us at 127.0.0.1: never trusted
        assert AutoNAT(a).offered_addrs() == [x.without_peer_id() for x in a.listen_addrs]
