"""Circuit relay v2 over real loopback TCP: reservations, relayed connections (RPC, identity),
byte and time limits, caps, and bad input against the relay and the stop handler."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from dht.p2p import DialError, Host, HostLimits, Identity, Multiaddr, P2PStream
from dht.p2p.errors import P2PError, PeerIDMismatchError, RelayError
from dht.p2p.relay import (
    HOP_PROTOCOL,
    STOP_PROTOCOL,
    RelayClient,
    RelayLimits,
    RelayService,
    circuit_addr,
    dial_circuit,
    enable_relay_service,
    relay_client,
    split_circuit,
)
from dht.p2p.relay_messages import (
    HopMessage,
    HopType,
    Limit,
    PeerInfo,
    RelayMessageError,
    ReservationInfo,
    Status,
    StopMessage,
    StopType,
    decode_hop,
    decode_stop,
    encode_hop,
    encode_stop,
)
from dht.p2p.varint import encode_uvarint

from .conftest import wait_until

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/echo/1.0.0"


async def echo(peer, request):
    return {"peer": peer.to_bytes(), "echo": request}


@asynccontextmanager
async def relay_setup(
    limits: RelayLimits | None = None,
) -> AsyncIterator[tuple[Host, Multiaddr, RelayService, Host, Host]]:
    """A listening relay R and two hosts A (the target) and B that listen nowhere."""
    async with Host.open() as r, Host.open() as a, Host.open() as b:
        (raddr,) = await r.listen(LOCAL)
        service = enable_relay_service(r, limits)
        a.set_rpc_handler(ECHO, echo)
        b.set_rpc_handler(ECHO, echo)
        yield r, raddr, service, a, b


async def hop_request(host: Host, relay, frame: bytes) -> HopMessage:
    """Send raw bytes on a fresh hop stream; the relay's answer."""
    stream = await host.new_stream(relay, HOP_PROTOCOL)
    await stream.send_all(frame)
    with trio.fail_after(5):
        reply = decode_hop(await stream._reader.receive_frame(4096))
    stream.reset()
    return reply


# -- addresses and messages ---------------------------------------------------------------------


def test_circuit_multiaddr_text_and_binary():
    relay, target = Identity.generate().peer_id, Identity.generate().peer_id
    text = f"/ip4/198.51.100.4/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{target}"
    m = Multiaddr(text)
    assert str(m) == text and m.is_circuit() and m.peer_id == target
    assert Multiaddr.from_bytes(m.to_bytes()) == m
    assert b"\xa2\x02" in m.to_bytes()  # p2p-circuit: code 0x0122, no value
    assert str(m.without_peer_id()).endswith("/p2p-circuit")
    assert not m.is_tcp() and not Multiaddr("/ip4/1.2.3.4/tcp/1").is_circuit()
    assert circuit_addr(Multiaddr("/ip4/198.51.100.4/tcp/4001"), relay, target) == m
    assert split_circuit(m) == (relay, Multiaddr("/ip4/198.51.100.4/tcp/4001"), target)
    assert split_circuit(Multiaddr(f"/p2p/{relay}/p2p-circuit")) == (relay, None, None)
    for bad in (
        "/ip4/1.2.3.4/tcp/1/p2p-circuit/p2p/" + str(target),  # no relay id
        f"/p2p/{relay}/p2p-circuit/p2p/{target}/p2p-circuit/p2p/{relay}",  # nested
        f"/p2p/{relay}/p2p-circuit/ip4/1.2.3.4",
    ):
        with pytest.raises(DialError):
            split_circuit(Multiaddr(bad))


def test_relay_message_round_trip_and_strict_decoding():
    peer = Identity.generate().peer_id
    addr = Multiaddr("/ip4/198.51.100.4/tcp/4001").with_peer_id(peer)
    msg = HopMessage(
        HopType.STATUS,
        reservation=ReservationInfo(expire=1_900_000_000, addrs=[addr], voucher=b"v"),
        limit=Limit(120, 131072),
        status=Status.OK,
    )
    frame = encode_hop(msg)
    assert decode_hop(frame[1:]) == msg  # one-byte length prefix
    stop = StopMessage(StopType.CONNECT, peer=PeerInfo(peer, [addr]), limit=Limit(0, 5))
    assert decode_stop(encode_stop(stop)[1:]) == stop
    assert decode_hop(b"").type == HopType.RESERVE  # proto3: an absent enum is 0
    for bad in (
        b"\xff\xff\xff",  # truncated varint key
        b"\x08\x01\x12\x03\x0a\x01\x00",  # CONNECT with Peer.id that is no PeerID
        b"\x08\x01\x12\x00",  # Peer without its id
        b"\x0a\x00",  # type with the wrong wire type
        b"\x08\x02\x22\x03\x08\x80\x80",  # truncated Limit
        b"\x08\x02\x22\x06\x08\x80\x80\x80\x80\x10",  # Limit.duration beyond uint32
        b"\x08" + b"\x00" * 5000,  # oversized
    ):
        with pytest.raises(RelayMessageError):
            decode_hop(bad)
    rng = __import__("random").Random(7)
    for _ in range(3000):  # junk never escapes as anything but RelayMessageError
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
        for decode in (decode_hop, decode_stop):
            try:
                decode(junk)
            except RelayMessageError:
                pass


def test_messages_match_py_libp2p_protobuf():
    """Byte compatibility with an implementation nobody here wrote (its generated code)."""
    pb = pytest.importorskip("libp2p.relay.circuit_v2.pb.circuit_pb2")
    relay, target = Identity.generate().peer_id, Identity.generate().peer_id
    addr = Multiaddr("/ip4/198.51.100.4/tcp/4001").with_peer_id(relay)
    ours = HopMessage(
        HopType.STATUS,
        reservation=ReservationInfo(expire=1_900_000_000, addrs=[addr]),
        limit=Limit(120, 131072),
        status=Status.OK,
    )
    theirs = pb.HopMessage(
        type=pb.HopMessage.STATUS,
        reservation=pb.Reservation(expire=1_900_000_000, addrs=[addr.to_bytes()]),
        limit=pb.Limit(duration=120, data=131072),
        status=pb.Status.OK,
    )
    assert encode_hop(ours)[1:] == theirs.SerializeToString()
    connect = pb.HopMessage(type=pb.HopMessage.CONNECT, peer=pb.PeerId(id=target.to_bytes()))
    connect.senderRecord = b"unknown to us"  # py-libp2p's extra field: skipped
    assert decode_hop(connect.SerializeToString()) == HopMessage(
        HopType.CONNECT, peer=PeerInfo(target)
    )
    stop = pb.StopMessage(
        type=pb.StopMessage.CONNECT,
        peer=pb.PeerId(id=relay.to_bytes()),
        limit=pb.Limit(duration=60),
    )
    assert decode_stop(stop.SerializeToString()) == StopMessage(
        StopType.CONNECT, peer=PeerInfo(relay), limit=Limit(60, 0)
    )
    parsed = pb.StopMessage()
    parsed.ParseFromString(encode_stop(StopMessage(StopType.STATUS, status=Status.OK))[1:])
    assert parsed.type == pb.StopMessage.STATUS and parsed.status == pb.Status.OK


# -- relayed connections ------------------------------------------------------------------------


async def test_reservation_and_relayed_rpc_end_to_end_encrypted():
    async with relay_setup() as (r, raddr, service, a, b):
        seen = bytearray()
        service.tap = lambda circuit, way, data: seen.extend(data)
        rsvp = await relay_client(a).reserve(r.peer_id, [raddr])
        assert rsvp.relay == r.peer_id and 3590 < rsvp.seconds_left() <= 3600
        assert rsvp.limit == Limit(120, 128 * 1024)
        assert rsvp.relay_addrs == (raddr,)
        (caddr,) = rsvp.circuit_addrs
        assert caddr == circuit_addr(raddr.without_peer_id(), r.peer_id, a.peer_id)
        assert service.has_reservation(a.peer_id) and service.reservation_count == 1
        assert a.listen_addrs == []  # a one-shot reservation advertises nothing

        assert await b.connect([caddr]) == a.peer_id
        conn = b._best_connection(a.peer_id)
        assert conn is not None and conn.relayed and conn.outbound
        assert conn.relay_limit == Limit(120, 128 * 1024)
        secret = os.urandom(8).hex().encode() * 8
        reply = await b.call(a.peer_id, ECHO, secret)
        # A saw B's Noise-proven PeerID, B reached A's (the dial expected it)
        assert reply == {"peer": b.peer_id.to_bytes(), "echo": secret}
        # the relay only spliced ciphertext: the payload never crossed it in the clear
        assert len(seen) > len(secret) and secret not in bytes(seen)
        await wait_until(lambda: a.is_connected(b.peer_id))
        back = a._best_connection(b.peer_id)
        assert back is not None and back.relayed and not back.outbound
        assert back.remote_addr.endswith(f"/p2p/{r.peer_id}/p2p-circuit")
        # and the other way round over the same relayed connection
        assert (await a.call(b.peer_id, ECHO, 5))["peer"] == a.peer_id.to_bytes()
        assert len(service.circuits) == 1 and service.stats.circuits_opened == 1
        (circuit,) = service.circuits
        assert circuit.src == b.peer_id and circuit.dst == a.peer_id
        assert sum(circuit.forwarded) == len(seen) == service.stats.bytes_forwarded
        # closing the relayed connection ends the circuit at the relay
        await b.disconnect(a.peer_id)
        await wait_until(lambda: not service.circuits and not a.is_connected(b.peer_id))
        assert service.stats.circuits_cut_data == 0


async def test_a_relayed_connection_knows_how_much_of_its_data_limit_is_left():
    # issue 31 item 4: the limit is per connection, spent over its life
    async with relay_setup(RelayLimits(circuit_data=256 * 1024)) as (r, raddr, service, a, b):
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        conn = b._best_connection(a.peer_id)
        fresh = conn.relay_room
        assert fresh is not None and 0 < 256 * 1024 - fresh < 4096  # the handshakes
        blob = b"\x01" * (64 * 1024)
        assert (await b.call(a.peer_id, ECHO, blob))["echo"] == blob
        # both ways carried the blob: what is left is the limit less what the relay counted
        # (give or take a window update or ping still in flight)
        (circuit,) = service.circuits
        assert abs(conn.relay_room - (256 * 1024 - max(circuit.forwarded))) < 256
        assert conn.relay_room < fresh - len(blob)


async def test_relay_cannot_swap_the_target(caplog):
    """A relay that splices B to the wrong peer: Noise proves who answered, B refuses."""

    class SwappingRelay(RelayService):
        async def _connect(self, stream, msg):
            msg.peer = PeerInfo(self.swap_to)
            await super()._connect(stream, msg)

    async with Host.open() as r, Host.open() as a, Host.open() as b:
        (raddr,) = await r.listen(LOCAL)
        evil = SwappingRelay(r)
        evil.swap_to = a.peer_id
        await relay_client(a).reserve(r.peer_id, [raddr])
        wanted = Identity.generate().peer_id
        with caplog.at_level(logging.WARNING), pytest.raises(PeerIDMismatchError):
            await dial_circuit(b, wanted, circuit_addr(raddr.without_peer_id(), r.peer_id, wanted))
        assert not b.is_connected(wanted) and not b.is_connected(a.peer_id)


async def test_connect_without_reservation_is_refused():
    async with relay_setup() as (r, raddr, service, a, b):
        target = circuit_addr(raddr.without_peer_id(), r.peer_id, a.peer_id)
        with pytest.raises(RelayError) as info:
            await dial_circuit(b, a.peer_id, target.without_peer_id())
        assert info.value.status == Status.NO_RESERVATION
        with pytest.raises(DialError, match="NO_RESERVATION"):
            await b.connect([target])
        assert service.stats.circuits_refused == 2 and not service.circuits
        # a peer connected to the relay but without a reservation is not reachable either
        await a.connect([raddr])
        with pytest.raises(DialError, match="NO_RESERVATION"):
            await b.connect([target])


async def test_data_limit_cuts_the_circuit():
    limit = 32 * 1024
    async with relay_setup(RelayLimits(circuit_data=limit)) as (r, raddr, service, a, b):
        received = [0]

        async def sink(stream: P2PStream):
            while data := await stream.receive_some(65536):
                received[0] += len(data)

        a.set_stream_handler("/sink/1.0.0", sink)
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        stream = await b.new_stream(a.peer_id, "/sink/1.0.0")
        with trio.fail_after(10), pytest.raises((P2PError, trio.BrokenResourceError)):
            for _ in range(64):  # 256 KiB, eight times the limit
                await stream.send_all(b"\x00" * 4096)
            await stream.receive_some()
        await wait_until(lambda: not service.circuits)
        assert service.stats.circuits_cut_data == 1
        # each direction carried at most the limit, exactly
        assert 0 < service.stats.bytes_forwarded <= 2 * limit
        assert received[0] < limit
        await wait_until(lambda: not b.is_connected(a.peer_id) and not a.is_connected(b.peer_id))
        # the reservation survives; a new circuit can be opened at once
        assert service.has_reservation(a.peer_id)
        await b.connect([caddr])
        assert (await b.call(a.peer_id, ECHO, 1))["echo"] == 1


async def test_data_limit_is_exact_per_direction():
    limit = 20_000
    async with relay_setup(RelayLimits(circuit_data=limit)) as (r, raddr, service, a, b):
        circuits = []
        service.tap = lambda circuit, way, data: circuits.append(circuit)

        async def firehose(stream: P2PStream):
            while True:
                await stream.send_all(b"\x01" * 8192)

        a.set_stream_handler("/firehose/1.0.0", firehose)
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        stream = await b.new_stream(a.peer_id, "/firehose/1.0.0")
        with trio.fail_after(10), pytest.raises((P2PError, trio.BrokenResourceError)):
            while await stream.receive_some(65536):
                pass
        await wait_until(lambda: not service.circuits)
        circuit = circuits[0]
        assert circuit.forwarded[1] == limit  # target -> initiator hit the cap exactly
        assert circuit.forwarded[0] <= limit
        assert circuit.cut_reason == f"data limit of {limit} bytes"


async def test_duration_limit_with_mock_clock(mock_clock):
    mock_clock.rate = 1.0  # real time flows (sockets, handshakes); jump() skips ahead
    async with relay_setup(RelayLimits(circuit_duration=60)) as (r, raddr, service, a, b):
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        assert (await b.call(a.peer_id, ECHO, "x"))["echo"] == "x"
        mock_clock.jump(30)
        await trio.sleep(0.05)
        assert len(service.circuits) == 1  # half-way: still open
        mock_clock.jump(31)
        await wait_until(lambda: not service.circuits)
        assert service.stats.circuits_cut_duration == 1
        await wait_until(lambda: not b.is_connected(a.peer_id) and not a.is_connected(b.peer_id))
        assert service.has_reservation(a.peer_id)


async def test_reservation_caps_and_refresh():
    limits = RelayLimits(max_reservations=2)
    async with relay_setup(limits) as (r, raddr, service, a, b), Host.open() as c:
        await relay_client(a).reserve(r.peer_id, [raddr])
        await relay_client(b).reserve(r.peer_id, [raddr])
        with pytest.raises(RelayError, match="RESERVATION_REFUSED") as info:
            await relay_client(c).reserve(r.peer_id, [raddr])
        assert info.value.status == Status.RESERVATION_REFUSED
        again = await relay_client(a).reserve(r.peer_id)  # a refresh is not a new slot
        assert again.seconds_left() > 3590 and service.reservation_count == 2
        # a reservation lasts only as long as its connection: the slot frees up
        await b.disconnect(r.peer_id)
        await wait_until(lambda: service.reservation_count == 1)
        await relay_client(c).reserve(r.peer_id, [raddr])
        assert service.stats.reservations_refused == 1


async def test_reservations_per_source_and_rate_limit():
    limits = RelayLimits(max_reservations_per_source=1, request_burst=3, request_rate=0.01)
    async with relay_setup(limits) as (r, raddr, service, a, b):
        await relay_client(a).reserve(r.peer_id, [raddr])
        with pytest.raises(RelayError, match="RESERVATION_REFUSED"):
            await relay_client(b).reserve(r.peer_id, [raddr])  # same 127.0.0.1
        await relay_client(a).reserve(r.peer_id)
        await relay_client(a).reserve(r.peer_id)
        with pytest.raises(RelayError) as info:  # fourth request of a within the burst
            await relay_client(a).reserve(r.peer_id)
        assert info.value.status == Status.RESOURCE_LIMIT_EXCEEDED


async def test_circuits_per_peer_cap():
    async with relay_setup(RelayLimits(max_circuits_per_peer=1)) as (r, raddr, service, a, b):
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        async with Host.open() as c:
            with pytest.raises(RelayError) as info:
                await dial_circuit(c, a.peer_id, caddr.without_peer_id())
            assert info.value.status == Status.RESOURCE_LIMIT_EXCEEDED
        assert len(service.circuits) == 1


async def test_bad_hop_input_gets_a_status_and_the_relay_keeps_serving(caplog):
    async with relay_setup() as (r, raddr, service, a, b), Host.open() as m:
        await m.connect([raddr])
        bad_peer = b"\x0a\x03\x00\x01\x02"  # Peer.id that is no PeerID
        cases = [
            (encode_uvarint(100_000) + b"\x08" * 64, Status.MALFORMED_MESSAGE, "exceeds the cap"),
            (encode_uvarint(3) + b"\xff\xff\xff", Status.MALFORMED_MESSAGE, "malformed"),
            (
                encode_hop(HopMessage(HopType.STATUS, status=Status.OK)),
                Status.UNEXPECTED_MESSAGE,
                "STATUS",
            ),
            (
                encode_uvarint(2) + b"\x08\x07",
                Status.MALFORMED_MESSAGE,
                "unknown hop message type 7",
            ),
            (encode_hop(HopMessage(HopType.CONNECT)), Status.MALFORMED_MESSAGE, "without a peer"),
            (
                encode_uvarint(7) + b"\x08\x01\x12" + bytes([len(bad_peer)]) + bad_peer,
                Status.MALFORMED_MESSAGE,
                "not a valid PeerID",
            ),
        ]
        with caplog.at_level(logging.WARNING, logger="dht.p2p.relay"):
            for frame, status, reason in cases:
                reply = await hop_request(m, r.peer_id, frame)
                assert reply.type == HopType.STATUS and reply.status == status, reason
        messages = [rec.getMessage() for rec in caplog.records]
        # rate-limited per status: the first record of each kind is logged with its reason
        assert any("MALFORMED_MESSAGE" in t and "exceeds the cap" in t for t in messages)
        assert any("UNEXPECTED_MESSAGE" in t for t in messages)
        assert service.stats.malformed_requests == len(cases)
        assert m.is_connected(r.peer_id)  # answered, not dropped
        # a silent hop stream times out without holding anything
        # the relay still serves well-behaved peers
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        assert (await b.call(a.peer_id, ECHO, "ok"))["echo"] == "ok"


async def test_silent_hop_stream_times_out_and_service_close_cuts_circuits():
    limits = RelayLimits(message_timeout=0.3)
    async with relay_setup(limits) as (r, raddr, service, a, b), Host.open() as m:
        await m.connect([raddr])
        silent = await m.new_stream(r.peer_id, HOP_PROTOCOL)
        with trio.fail_after(5), pytest.raises(P2PError):
            await silent.receive_some()  # reset by the relay after message_timeout
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        assert len(service.circuits) == 1
        service.close()
        await wait_until(lambda: not service.circuits and not b.is_connected(a.peer_id))
        assert not service.has_reservation(a.peer_id)
        with pytest.raises(DialError):
            await b.connect([caddr])


async def test_stop_handler_accepts_only_reserved_relays():
    async with Host.open() as a, Host.open() as m:
        (maddr,) = await m.listen(LOCAL)
        relay_client(a)
        await a.connect([maddr])
        stream = await m.new_stream(a.peer_id, STOP_PROTOCOL)
        request = StopMessage(StopType.CONNECT, peer=PeerInfo(Identity.generate().peer_id))
        await stream.send_all(encode_stop(request))
        with trio.fail_after(5):
            reply = decode_stop(await stream._reader.receive_frame(4096))
        assert reply.type == StopType.STATUS and reply.status == Status.PERMISSION_DENIED
        assert relay_client(a).inbound_circuits == 0


async def test_stop_handler_rejects_garbage_from_its_relay():
    async with Host.open() as a, Host.open() as m:
        (maddr,) = await m.listen(LOCAL)
        client = RelayClient(a)
        client._trust(m.peer_id)  # as after a reservation there
        await a.connect([maddr])
        for frame, status in (
            (encode_uvarint(9999), Status.MALFORMED_MESSAGE),
            (
                encode_stop(StopMessage(StopType.STATUS, status=Status.OK)),
                Status.UNEXPECTED_MESSAGE,
            ),
            (encode_stop(StopMessage(StopType.CONNECT)), Status.MALFORMED_MESSAGE),
        ):
            stream = await m.new_stream(a.peer_id, STOP_PROTOCOL)
            await stream.send_all(frame)
            with trio.fail_after(5):
                reply = decode_stop(await stream._reader.receive_frame(4096))
            assert reply.status == status
        # CONNECT accepted, then junk instead of a Noise handshake: dropped, nothing leaks
        stream = await m.new_stream(a.peer_id, STOP_PROTOCOL)
        src = Identity.generate().peer_id
        await stream.send_all(encode_stop(StopMessage(StopType.CONNECT, peer=PeerInfo(src))))
        with trio.fail_after(5):
            reply = decode_stop(await stream._reader.receive_frame(4096))
            assert reply.status == Status.OK
            await stream.send_all(b"\x13/multistream/1.0.0\n" + b"\x00" * 64)
            while True:
                try:
                    if not await stream.receive_some():
                        break
                except P2PError:
                    break
        await wait_until(lambda: client.inbound_circuits == 0)
        assert not a.is_connected(src)


async def test_keep_reservation_advertises_and_recovers():
    async with relay_setup() as (r, raddr, service, a, b):
        client = relay_client(a)
        async with trio.open_nursery() as nursery:
            rsvp = await nursery.start(client.keep_reservation, r.peer_id, [raddr])
            (caddr,) = rsvp.circuit_addrs
            assert a.listen_addrs == [caddr] and client.circuit_addrs() == [caddr]
            # the relay drops us: the keeper reserves again at once
            await a.disconnect(r.peer_id)
            await wait_until(lambda: not service.has_reservation(a.peer_id))
            await wait_until(
                lambda: service.has_reservation(a.peer_id) and a.is_connected(r.peer_id)
            )
            # identify tells a connected peer about the circuit address
            assert await b.connect([caddr]) == a.peer_id
            await wait_until(lambda: caddr.without_peer_id() in b.peerstore.get_addrs(a.peer_id))
            nursery.cancel_scope.cancel()
        assert a.listen_addrs == []


async def test_a_relay_that_stops_serving_loses_our_slot_within_a_refresh():
    # issue 31 item 4: the relay closes its service but keeps the connection; the slot (and
    # the circuit addresses through it) used to stay advertised until it expired (1 h), the
    # failed refreshes taken for hiccups, one every 15 min
    async with relay_setup() as (r, raddr, service, a, b):
        client = RelayClient(a, max_refresh_interval=0.5)
        async with trio.open_nursery() as nursery:
            await nursery.start(client.keep_reservation, r.peer_id, [raddr])
            assert client.circuit_addrs()
            service.close()
            await wait_until(lambda: not client.circuit_addrs(), limit=10)
            assert a.is_connected(r.peer_id)  # noticed without the connection dropping
            assert a.listen_addrs == []
            nursery.cancel_scope.cancel()


async def test_relay_client_refreshes_within_a_minute_by_default():
    async with Host.open() as host:
        assert RelayClient(host).max_refresh_interval <= 30


async def test_direct_connection_is_preferred_over_a_relayed_one():
    async with relay_setup() as (r, raddr, service, a, b):
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        await b.connect([caddr])
        await wait_until(lambda: a.is_connected(b.peer_id))
        # b becomes reachable: connecting to its direct address dials beside the relayed one
        (baddr,) = await b.listen(LOCAL)
        assert await a.connect([baddr]) == b.peer_id
        conn = a._best_connection(b.peer_id)
        assert conn is not None and not conn.relayed
        assert sorted(c.relayed for c in a._conns[b.peer_id]) == [False, True]
        await wait_until(
            lambda: (
                b._best_connection(a.peer_id) is not None
                and not b._best_connection(a.peer_id).relayed
            )
        )
        assert (await a.call(b.peer_id, ECHO, 3))["echo"] == 3


async def test_limits_validation():
    with pytest.raises(ValueError, match="max_reservations"):
        RelayLimits(max_reservations=0)
    with pytest.raises(ValueError, match="circuit_data"):
        RelayLimits(circuit_data=-1)
    with pytest.raises(ValueError, match="request_rate"):
        RelayLimits(request_rate=0)
    assert RelayLimits().limit == Limit(120, 131072)
    assert HostLimits()  # unchanged


async def test_dht_peer_reachable_only_through_a_relay():
    """A DHT server that listens nowhere announces its circuit address; another peer finds
    it in the DHT, reaches it through the relay, and both store and read values."""
    from dht.kademlia.clock import get_dht_time
    from dht.kademlia.node import DHTNode

    async with Host.open() as r_host, Host.open() as a_host, Host.open() as b_host:
        (raddr,) = await r_host.listen(LOCAL)
        enable_relay_service(r_host)
        async with trio.open_nursery() as nursery:
            rsvp = await nursery.start(
                relay_client(a_host).keep_reservation, r_host.peer_id, [raddr]
            )
            (caddr,) = rsvp.circuit_addrs
            async with (
                DHTNode.open(host=r_host) as r,
                DHTNode.open(host=a_host, initial_peers=[raddr]) as a,
                DHTNode.open(host=b_host, initial_peers=[raddr]) as b,
            ):
                assert a.get_visible_maddrs() == [caddr]  # the relay is its only way in
                assert b_host.listen_addrs == []
                expiration = get_dht_time() + 60
                assert await a.store("from-a", "hello", expiration)
                assert await b.store("from-b", "world", expiration)
                for node in (a, b, r):
                    assert (await node.get("from-a")).value == "hello"
                    assert (await node.get("from-b")).value == "world"
                # b reached a through its circuit address (neither can dial the other)
                conn = b_host._best_connection(a_host.peer_id)
                assert conn is not None and conn.relayed
                assert a_host.peerstore.get_addrs(b_host.peer_id) == []
                assert r.peer_id == r_host.peer_id
            nursery.cancel_scope.cancel()


async def test_a_full_relay_never_closes_a_reserving_peers_idle_connection():
    """A relay at its connection limit makes room by closing the least recently used idle
    connection; a reserving peer's connection idles between circuits, and closing it voids
    the slot (the spec ties a reservation to its connection). Both ends protect it."""
    limits = HostLimits(max_connections=3)
    async with Host.open(limits=limits) as r, Host.open() as a:
        (raddr,) = await r.listen(LOCAL)
        service = enable_relay_service(r)
        await relay_client(a).reserve(r.peer_id, [raddr])
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(4):  # each newcomer needs a slot: the relay closes idle ones
                other = await stack.enter_async_context(Host.open())
                await other.connect(raddr)
            assert r.is_connected(a.peer_id) and service.has_reservation(a.peer_id)
        assert r.is_protected(a.peer_id) and a.is_protected(r.peer_id)
        await a.disconnect(r.peer_id)
        await wait_until(lambda: not r.is_protected(a.peer_id))
        assert not a.is_protected(r.peer_id)
