"""Circuit relay v2 interop with py-libp2p (a third-party libp2p), both ways, over real TCP.

py-libp2p runs in separate processes (``libp2p_relay_peer.py``) using its own relay code as a
library: ``CircuitV2Protocol`` as the relay (hop) and the target's stop handler,
``CircuitV2Transport`` to reserve and to dial ``/p2p-circuit`` addresses.

* a py-libp2p relay serves moshpit peers (our RelayClient reserves, our stop handler accepts,
  our dialer's CONNECT is spliced) and a py-libp2p dialer reaching a moshpit target;
* our RelayService serves a py-libp2p target (its client reserves with us) reached by a
  moshpit dialer and by a py-libp2p dialer;
* where the two differ: py-libp2p 0.8.1 enforces ``Limit.data`` over both directions of a
  circuit together, the spec (and we) per direction.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from dht.p2p import Host, Identity, Multiaddr
from dht.p2p.errors import DialError, P2PError, RelayError
from dht.p2p.relay import (
    RelayLimits,
    circuit_addr,
    dial_circuit,
    enable_relay_service,
    relay_client,
)
from dht.p2p.relay_messages import Limit, Status

from .conftest import wait_until

pytestmark = pytest.mark.interop

PEER_SCRIPT = Path(__file__).with_name("libp2p_relay_peer.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
LOCAL = ["/ip4/127.0.0.1/tcp/0"]
ECHO = "/echo/1.0.0"
LIBP2P_ECHO = "/interop/echo/1.0.0"  # served by the py-libp2p target (echoes until EOF)
LIBP2P_LIMIT = Limit(120, 1 << 20)  # what libp2p_relay_peer.py's relay grants by default


def _peer_command(*args: str) -> list[str]:
    return [sys.executable, str(PEER_SCRIPT), *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@asynccontextmanager
async def libp2p_process(tmp_path: Path, *args: str) -> AsyncIterator[list[str]]:
    """Run ``libp2p_relay_peer.py *args``; yield the words of its first output line.

    The process serves until its stdin closes (on exit). Its stderr goes to a file, quoted in
    the error if it dies before saying anything."""
    err_path = tmp_path / f"libp2p-{args[0]}-{time.monotonic_ns()}.err"
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        proc = await trio.lowlevel.open_process(
            _peer_command(*args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            env=_env(),
        )
    finally:
        os.close(err)  # the child holds its own copy
    try:
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                if not chunk:
                    await proc.wait()
                    raise RuntimeError(
                        f"py-libp2p {args[0]} exited ({proc.returncode}): "
                        f"{err_path.read_text(errors='replace')[-4000:]}"
                    )
                line += chunk
        yield line.decode().split()
    finally:
        await proc.stdin.aclose()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def libp2p_relay(tmp_path: Path, *extra: str) -> AsyncIterator[Multiaddr]:
    async with libp2p_process(tmp_path, "relay", *extra) as words:
        assert words[0] == "LISTENING", words
        yield Multiaddr(words[1])


async def libp2p_dial(circuit: Multiaddr, count: int = 3) -> tuple[int, str]:
    """py-libp2p dials ``circuit`` and pings: (exit code, stdout + stderr)."""
    with trio.fail_after(40):
        proc = await trio.run_process(
            _peer_command("dial", str(circuit), "--count", str(count)),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_env(),
        )
    return proc.returncode, proc.stdout.decode() + proc.stderr.decode()


async def echo(peer, request):
    return {"peer": peer.to_bytes(), "echo": request}


# -- (a) a py-libp2p relay serving moshpit peers -------------------------------------------------


async def test_moshpit_peers_connect_through_libp2p_relay(tmp_path):
    """Our RelayClient reserves on py-libp2p's relay; our dialer reaches the target through
    it; RPC and ping run over Noise + yamux on the py-libp2p-spliced circuit."""
    async with libp2p_relay(tmp_path) as raddr, Host.open() as a, Host.open() as b:
        relay = raddr.peer_id
        a.set_rpc_handler(ECHO, echo)
        b.set_rpc_handler(ECHO, echo)
        wanted = circuit_addr(raddr.without_peer_id(), relay, a.peer_id)
        # before A reserves, py-libp2p refuses with the spec's status, which we understand
        with pytest.raises(RelayError) as refused:
            await dial_circuit(b, a.peer_id, wanted)
        assert refused.value.status == Status.NO_RESERVATION
        with pytest.raises(DialError, match="NO_RESERVATION"):
            await b.connect([wanted], timeout=10)

        client = relay_client(a)
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                rsvp = await nursery.start(client.keep_reservation, relay, [raddr])
            # py-libp2p's STATUS: its 1 h TTL, its address (with /p2p/), its Limit, a voucher
            assert rsvp.relay == relay and 3500 < rsvp.seconds_left() <= 3600
            assert rsvp.relay_addrs == (raddr,)
            assert rsvp.circuit_addrs == (wanted,)
            assert rsvp.limit == LIBP2P_LIMIT
            assert rsvp.voucher  # a signed envelope; vouchers are advisory, we keep it unchecked
            assert wanted in a.listen_addrs  # keep_reservation advertises it
            # a refresh on the same connection is accepted and extends the slot
            again = await client.reserve(relay)
            assert again.expire >= rsvp.expire

            with trio.fail_after(10):
                assert await b.connect([wanted]) == a.peer_id
                conn = b._best_connection(a.peer_id)
                assert conn is not None and conn.relayed and conn.outbound
                assert conn.relay_limit == LIBP2P_LIMIT  # the Limit of py-libp2p's CONNECT STATUS
                secret = os.urandom(16).hex()
                # A's handler saw B's Noise-proven PeerID: end-to-end over the circuit
                assert await b.call(a.peer_id, ECHO, secret) == {
                    "peer": b.peer_id.to_bytes(),
                    "echo": secret,
                }
                for _ in range(3):
                    assert 0 <= await b.ping(a.peer_id) < 5
                # the target accepted py-libp2p's STOP CONNECT: a relayed inbound connection
                await wait_until(lambda: a.is_connected(b.peer_id))
                back = a._best_connection(b.peer_id)
                assert back is not None and back.relayed and not back.outbound
                assert back.relay_limit == LIBP2P_LIMIT  # the Limit of py-libp2p's STOP CONNECT
                assert (await b.call(a.peer_id, ECHO, 1))["echo"] == 1
                assert (await a.call(b.peer_id, ECHO, 2))["peer"] == a.peer_id.to_bytes()
            nursery.cancel_scope.cancel()
        assert wanted not in a.listen_addrs  # withdrawn when keep_reservation ends


async def test_libp2p_dialer_reaches_moshpit_target_through_libp2p_relay(tmp_path):
    """Both relay roles py-libp2p's, the target ours: our stop handler and our Noise responder
    against py-libp2p's relay and py-libp2p's Noise initiator on its relayed stream."""
    async with libp2p_relay(tmp_path) as raddr, Host.open() as a:
        inbound: list[tuple[bool, bool]] = []  # (relayed, outbound) of each new peer's link

        def on_connect(peer):
            conn = a._best_connection(peer)
            if peer != raddr.peer_id and conn is not None:
                inbound.append((conn.relayed, conn.outbound))

        a.add_connection_observer(on_connect, lambda peer: None)
        rsvp = await relay_client(a).reserve(raddr.peer_id, [raddr], timeout=10)
        (caddr,) = rsvp.circuit_addrs
        code, out = await libp2p_dial(caddr, count=3)
        assert code == 0, f"py-libp2p dial through its relay failed:\n{out}"
        assert out.count("RTT ") == 3 and "DONE" in out
        # we served those pings on a relayed inbound connection, not some other path
        assert inbound == [(True, False)]


# -- (b) our relay serving a py-libp2p peer ------------------------------------------------------


async def test_libp2p_target_reserves_on_moshpit_relay_and_is_pinged(tmp_path):
    """py-libp2p's client reserves a slot with our RelayService; a moshpit peer dials it
    through us and pings it (/ipfs/ping/1.0.0) and streams data both ways."""
    async with Host.open() as r, Host.open() as b:
        (raddr,) = await r.listen(LOCAL)
        service = enable_relay_service(r, RelayLimits(circuit_data=1 << 20))
        seen = bytearray()
        service.tap = lambda circuit, way, data: seen.extend(data)
        async with libp2p_process(tmp_path, "reserve", str(raddr)) as words:
            assert words[0] == "RESERVED", words
            expire, caddr = int(words[1]), Multiaddr(words[2])
            target = caddr.peer_id
            # py-libp2p read our STATUS: the expiry we granted (UNIX seconds, 1 h)
            assert abs(expire - (time.time() + 3600)) < 30
            assert service.has_reservation(target) and service.reservation_count == 1
            assert caddr == circuit_addr(raddr.without_peer_id(), r.peer_id, target)

            with trio.fail_after(15):
                assert await b.connect([caddr]) == target
                conn = b._best_connection(target)
                assert conn is not None and conn.relayed
                assert conn.relay_limit == Limit(120, 1 << 20)
                for _ in range(3):
                    assert 0 <= await b.ping(target) < 5
                # a raw stream to py-libp2p's echo handler: bytes both ways through the splice
                stream = await b.new_stream(target, LIBP2P_ECHO)
                payload = os.urandom(200_000)
                received = bytearray()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream.send_all, payload)
                    while len(received) < len(payload):
                        chunk = await stream.receive_some()
                        assert chunk
                        received += chunk
                assert received == payload
                await stream.aclose()
            (circuit,) = service.circuits
            assert circuit.src == b.peer_id and circuit.dst == target
            assert min(circuit.forwarded) > len(payload)
            assert payload[:64] not in bytes(seen)  # the relay carried ciphertext only
            await b.disconnect(target)
            await wait_until(lambda: not service.circuits)


async def test_libp2p_dialer_reaches_libp2p_target_through_moshpit_relay(tmp_path):
    """Both ends py-libp2p, the relay ours: its CONNECT and its STOP answer against our hop
    service, including the refusal of a target that holds no reservation."""
    async with Host.open() as r:
        (raddr,) = await r.listen(LOCAL)
        service = enable_relay_service(r)
        nobody = circuit_addr(raddr.without_peer_id(), r.peer_id, Identity.generate().peer_id)
        refused: list[tuple[int, str]] = []

        async def dial_nobody() -> None:
            refused.append(await libp2p_dial(nobody, count=1))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dial_nobody)  # meanwhile the target starts (saves a startup)
            async with libp2p_process(tmp_path, "reserve", str(raddr)) as words:
                assert words[0] == "RESERVED", words
                caddr = Multiaddr(words[2])
                code, out = await libp2p_dial(caddr, count=3)
                assert code == 0, f"py-libp2p dial through our relay failed:\n{out}"
                assert out.count("RTT ") == 3 and "DONE" in out
        # py-libp2p understood our refusal of a peer without a reservation
        ((code, out),) = refused
        assert code == 2 and f"REFUSED {int(Status.NO_RESERVATION)}" in out, out
        assert service.stats.circuits_refused == 1 and service.stats.circuits_opened == 1
        assert service.stats.bytes_forwarded > 0


# -- where py-libp2p departs from the spec -------------------------------------------------------


async def test_libp2p_relay_counts_the_data_limit_over_both_directions(tmp_path):
    """circuit-v2.md: ``Limit.data`` is "the maximum number of bytes allowed to be transmitted
    in each direction". py-libp2p 0.8.1's relay (protocol.py ``_handle_connect``/``_relay_data``)
    spends one budget for both directions together, so a circuit it announced with
    ``data=64 KiB`` dies after ~40 KB each way. Our relay, same Limit, carries it.

    Our ends survive the cut cleanly (the connection is dropped, the reservation stays, a new
    circuit works). If this test fails because the exchange succeeds, py-libp2p has fixed it."""
    budget = 64 * 1024
    half = 40_000  # each direction well under the budget, both together over it

    async def sink(peer, request):
        return len(request)

    async def source(peer, n):
        return os.urandom(n)

    async def exchange(b: Host, a: Host, caddr: Multiaddr) -> None:
        await b.connect([caddr], timeout=10)
        assert await b.call(a.peer_id, "/sink", os.urandom(half), timeout=10) == half
        assert len(await b.call(a.peer_id, "/source", half, timeout=10)) == half

    # ours: per direction, as the spec says
    async with Host.open() as r, Host.open() as a, Host.open() as b:
        (raddr,) = await r.listen(LOCAL)
        service = enable_relay_service(r, RelayLimits(circuit_data=budget))
        a.set_rpc_handler("/sink", sink)
        a.set_rpc_handler("/source", source)
        (caddr,) = (await relay_client(a).reserve(r.peer_id, [raddr])).circuit_addrs
        with trio.fail_after(15):
            await exchange(b, a, caddr)
        (circuit,) = service.circuits
        assert half < min(circuit.forwarded) and max(circuit.forwarded) < budget
        assert sum(circuit.forwarded) > budget

    # py-libp2p's: the same exchange under the same announced Limit is cut
    async with libp2p_relay(tmp_path, "--data", str(budget)) as raddr:
        async with Host.open() as a, Host.open() as b:
            a.set_rpc_handler("/sink", sink)
            a.set_rpc_handler("/source", source)
            rsvp = await relay_client(a).reserve(raddr.peer_id, [raddr], timeout=10)
            assert rsvp.limit == Limit(120, budget)
            (caddr,) = rsvp.circuit_addrs
            with trio.fail_after(15):
                with pytest.raises((P2PError, trio.BrokenResourceError)):
                    await exchange(b, a, caddr)
                await wait_until(
                    lambda: not b.is_connected(a.peer_id) and not a.is_connected(b.peer_id)
                )
                # the cut took only that circuit: A still holds its slot, a new circuit works
                assert (
                    a.is_connected(raddr.peer_id) and raddr.peer_id in relay_client(a).reservations
                )
                await b.connect([caddr], timeout=10)
                assert await b.call(a.peer_id, "/sink", b"x") == 1
