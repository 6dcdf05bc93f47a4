"""Wire interop with py-libp2p (a third-party libp2p implementation) over real TCP.

py-libp2p runs in a separate process (``libp2p_peer.py``) with Noise as its only security
protocol and yamux as its muxer. The component tests need only our multistream-select and
Noise; the Host tests exercise the whole stack (multistream, Noise, yamux, ping).
"""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import pytest
import trio

from dht.p2p.identity import Identity, PeerID
from dht.p2p.multiaddr import Multiaddr
from dht.p2p.multistream import negotiate_inbound, negotiate_outbound
from dht.p2p.noise import noise_handshake

pytestmark = pytest.mark.interop

PEER_SCRIPT = Path(__file__).with_name("libp2p_peer.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
SEED = bytes(range(32))  # fixed py-libp2p identity, so we know the PeerID to expect
PING = "/ipfs/ping/1.0.0"


def _peer_command(*args: str) -> list[str]:
    return [sys.executable, str(PEER_SCRIPT), *args]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@asynccontextmanager
async def libp2p_listener():
    """Start a py-libp2p listener process; yield its multiaddr; stop it by closing stdin."""
    proc = await trio.lowlevel.open_process(
        _peer_command("listen", "--seed", SEED.hex()),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                if not chunk:
                    err = await proc.stderr.receive_some(65536)
                    raise RuntimeError(f"py-libp2p listener died: {err.decode(errors='replace')}")
                line += chunk
        word, addr = line.decode().split()[:2]
        assert word == "LISTENING", line
        yield Multiaddr(addr)
    finally:
        await proc.stdin.aclose()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _expected_libp2p_peer_id() -> PeerID:
    # py-libp2p derives Ed25519 keys from a 32-byte seed exactly like RFC 8032 does.
    return Identity.from_seed(SEED).peer_id


async def test_our_noise_dialer_against_libp2p_listener():
    async with libp2p_listener() as maddr:
        assert maddr.peer_id == _expected_libp2p_peer_id()
        host, port = maddr.tcp_endpoint()
        raw = await trio.open_tcp_stream(host, port)
        async with raw:
            proto, stream = await negotiate_outbound(raw, ["/tls/1.0.0-unsupported", "/noise"])
            assert proto == "/noise"
            me = Identity.generate()
            session = await noise_handshake(
                stream, me, initiator=True, expected_peer=maddr.peer_id, timeout=20
            )
            assert session.remote_peer == maddr.peer_id
            # multistream inside the encrypted channel: proves transport encryption both ways
            muxer, _ = await negotiate_outbound(session, ["/yamux/1.0.0"], timeout=20)
            assert muxer == "/yamux/1.0.0"


async def test_our_noise_dialer_detects_wrong_peer_against_libp2p():
    from dht.p2p.errors import PeerIDMismatchError

    async with libp2p_listener() as maddr:
        host, port = maddr.tcp_endpoint()
        raw = await trio.open_tcp_stream(host, port)
        async with raw:
            _, stream = await negotiate_outbound(raw, ["/noise"])
            with pytest.raises(PeerIDMismatchError):
                await noise_handshake(
                    stream,
                    Identity.generate(),
                    initiator=True,
                    expected_peer=Identity.generate().peer_id,
                    timeout=20,
                )


async def test_libp2p_dialer_against_our_noise_listener(nursery):
    """py-libp2p dials our bare listener: its multistream + Noise initiator must accept us."""
    me = Identity.generate()
    result: dict = {}
    done = trio.Event()

    async def serve(raw):
        try:
            async with raw:
                _, stream = await negotiate_inbound(raw, {"/noise"}, timeout=20)
                session = await noise_handshake(stream, me, initiator=False, timeout=20)
                result["peer"] = session.remote_peer
                # after Noise, the dialer negotiates its muxer over the encrypted channel
                result["muxer"], _ = await negotiate_inbound(session, {"/yamux/1.0.0"}, timeout=20)
        except Exception as e:  # reported by the assertions below
            result["error"] = e
        finally:
            done.set()

    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    target = f"/ip4/127.0.0.1/tcp/{port}/p2p/{me.peer_id}"
    # The ping cannot complete (this bare listener has no yamux); we only check the upgrade.
    proc = await trio.lowlevel.open_process(
        _peer_command("ping", target, "--count", "1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )
    try:
        with trio.fail_after(30):
            await done.wait()
    finally:
        proc.kill()
        await proc.wait()
    assert "error" not in result, result.get("error")
    assert isinstance(result["peer"], PeerID)
    assert result["muxer"] == "/yamux/1.0.0"


# --- whole stack: our Host <-> py-libp2p host ------------------------------------------------


async def test_our_host_pings_libp2p_host():
    from dht.p2p import Host

    async with libp2p_listener() as maddr:
        async with Host.open() as host:
            pid = await host.connect([maddr], peer_id=maddr.peer_id, timeout=20)
            assert pid == maddr.peer_id
            for _ in range(3):
                rtt = await host.ping(pid, timeout=10)
                assert 0 <= rtt < 10
            # a raw stream to py-libp2p's echo handler, data both ways through Noise + yamux
            stream = await host.new_stream(pid, "/interop/echo/1.0.0", timeout=10)
            payload = os.urandom(300_000)
            received = bytearray()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, payload)
                with trio.fail_after(20):
                    while len(received) < len(payload):
                        chunk = await stream.receive_some()
                        assert chunk
                        received += chunk
            assert received == payload
            await stream.aclose()


async def test_libp2p_host_pings_our_host():
    from dht.p2p import Host

    async with Host.open() as host:
        addrs = await host.listen(["/ip4/127.0.0.1/tcp/0"])
        target = str(addrs[0])
        assert Multiaddr(target).peer_id == host.peer_id
        proc = await trio.run_process(
            _peer_command("ping", target, "--count", "3"),
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_env(),
        )
        out = proc.stdout.decode()
        assert proc.returncode == 0, f"py-libp2p ping failed:\n{out}\n{proc.stderr.decode()}"
        assert out.count("RTT ") == 3 and "DONE" in out
