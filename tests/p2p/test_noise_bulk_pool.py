"""Bulk receive buffers are recycled between SecureSessions without corrupting pending data."""

from __future__ import annotations

import os
import random
from functools import partial

import trio

from dht.p2p import noise
from dht.p2p.identity import Identity
from dht.p2p.noise import noise_handshake


async def _tcp_pair(nursery):
    id_a, id_b = Identity.generate(), Identity.generate()
    accepted = trio.Event()
    server = {}

    async def handler(stream):
        server["s"] = stream
        accepted.set()
        await trio.sleep_forever()

    listeners = await nursery.start(partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    client = await trio.open_tcp_stream("127.0.0.1", listeners[0].socket.getsockname()[1])
    await accepted.wait()
    out = {}

    async def side(name, stream, ident, initiator):
        out[name] = await noise_handshake(stream, ident, initiator=initiator)

    async with trio.open_nursery() as n:
        n.start_soon(side, "a", client, id_a, True)
        n.start_soon(side, "b", server["s"], id_b, False)
    return out["a"], out["b"]


async def _receive_into(session, n: int, out: bytearray) -> None:
    while n > 0:
        view = await session.receive_view()
        assert view, "stream ended early"
        out.extend(view)  # a borrowed view is valid until the next receive
        n -= len(view)


async def test_sessions_alternating_bulk_and_small_reads_share_buffers_intact(nursery, monkeypatch):
    monkeypatch.setattr(noise, "_BULK_POOL", [])
    fresh = []
    original = noise._bulk_buffer

    def counting() -> bytearray:
        if not noise._BULK_POOL:
            fresh.append(1)
        return original()

    monkeypatch.setattr(noise, "_bulk_buffer", counting)
    pairs = [await _tcp_pair(nursery) for _ in range(2)]
    enters = []
    for _, rx in pairs:
        orig_enter = rx._enter_bulk_mode
        monkeypatch.setattr(
            rx, "_enter_bulk_mode", lambda orig=orig_enter: (enters.append(1), orig())
        )
    rng = random.Random(5)
    for cycle in range(12):
        for tx, rx in pairs:
            # a burst (bulk mode), then small messages (back to per-read buffers)
            payloads = [os.urandom(rng.choice([300_000, 700_000, 1_500_000])), b"small %d" % cycle]
            for payload in payloads:
                got = bytearray()
                async with trio.open_nursery() as n:
                    n.start_soon(tx.send_all, payload)
                    await _receive_into(rx, len(payload), got)
                assert got == payload
    assert len(enters) >= 12, "the receivers never switched to bulk buffers"
    # 2 buffers per session in bulk mode at once, then reused from the pool
    assert len(fresh) <= 6, (len(fresh), len(enters))
    assert len(noise._BULK_POOL) <= noise._BULK_POOL_MAX


async def test_pending_plaintext_survives_leaving_bulk_mode(nursery, monkeypatch):
    """The plaintext buffer is recycled only after what it holds was taken."""
    monkeypatch.setattr(noise, "_BULK_POOL", [])
    tx, rx = await _tcp_pair(nursery)
    payload = os.urandom(2 << 20)
    got = bytearray()
    async with trio.open_nursery() as n:
        n.start_soon(tx.send_all, payload)
        while len(got) < 256 * 1024:
            got += await rx.receive_some()
        if rx._cbuf is None:  # reads came back small: switch as a large read would
            rx._enter_bulk_mode()
        got += await rx.receive_some(1000)  # a bulk read; most of it stays pending
        assert rx._plain and rx._plain.obj is rx._pview.obj
        rx._leave_bulk_mode()  # as after a small read: the pending bytes are still there
        # another session takes every pooled buffer and overwrites it
        for _ in range(noise._BULK_POOL_MAX):
            buf = noise._bulk_buffer()
            buf[:] = b"\xff" * len(buf)
        while len(got) < len(payload):
            got += await rx.receive_some()
    assert got == payload
