"""py-libp2p's circuit relay v2, run as a separate process for ``test_interop_relay.py``.

Built on ``libp2p_peer.py``'s host (Noise only, yamux). py-libp2p's relay code is used as a
library, wired as its own examples wire it: ``CircuitV2Protocol`` (hop and stop handlers)
and ``CircuitV2Transport`` (the client: RESERVE, and dialing ``/p2p-circuit`` addresses).

    python libp2p_relay_peer.py relay [--seed HEX] [--data BYTES]
        a relay: prints "LISTENING <multiaddr with /p2p/...>" and serves the hop protocol
        until stdin closes. ``--data`` is the Limit.data it grants (default 1 MiB).
    python libp2p_relay_peer.py reserve <relay multiaddr> [--seed HEX]
        a target behind a relay: connects to the relay, reserves a slot with py-libp2p's
        client, prints "RESERVED <expire> <circuit multiaddr>" and then accepts relayed
        connections (ping and /interop/echo/1.0.0) until stdin closes.
    python libp2p_relay_peer.py dial <circuit multiaddr> [--count N]
        dials through the relay with py-libp2p's transport, pings N times, prints
        "RTT <s>" per ping and "DONE"; if the relay refuses the circuit, prints
        "REFUSED <status code>" and exits with 2.

Every line is flushed; errors go to stderr with a non-zero exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys

import multiaddr
import trio
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import PingService, handle_ping
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service
from libp2p_peer import ECHO_PROTOCOL, _echo, _make_host

LOCAL = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
DURATION = 120  # seconds per circuit, granted and announced by the relay


def _limits(data: int = 1 << 20) -> RelayLimits:
    return RelayLimits(duration=DURATION, data=data, max_circuit_conns=8, max_reservations=8)


async def _serve_until_stdin_closes() -> None:
    await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


async def relay(seed: bytes | None, data: int) -> None:
    host = _make_host(seed)
    protocol = CircuitV2Protocol(host, limits=_limits(data), allow_hop=True)
    async with host.run([LOCAL]), background_trio_service(protocol):
        with trio.fail_after(10):
            await protocol.event_started.wait()
        host.set_stream_handler(PING_PROTOCOL_ID, handle_ping)
        addrs = [a for a in host.get_addrs() if "/tcp/" in str(a)]
        print(f"LISTENING {addrs[0]}", flush=True)
        await _serve_until_stdin_closes()


async def reserve(relay_addr: str, seed: bytes | None) -> int:
    host = _make_host(seed)
    # the stop handler (accepting relayed connections) lives in the protocol service
    protocol = CircuitV2Protocol(host, limits=_limits(), allow_hop=False)
    config = RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=_limits())
    async with host.run([LOCAL]), background_trio_service(protocol), trio.open_nursery() as n:
        host.set_stream_handler(PING_PROTOCOL_ID, handle_ping)
        host.set_stream_handler(ECHO_PROTOCOL, _echo)
        transport = CircuitV2Transport(host, protocol, config)
        info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
        with trio.fail_after(20):
            await protocol.event_started.wait()
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [HOP_PROTOCOL_ID])
            if not await transport.reserve(stream, info.peer_id, n):
                print(f"could not reserve a slot on {info.peer_id}", file=sys.stderr, flush=True)
                return 1
            await stream.close()
        expire = transport._reservations[info.peer_id]
        circuit = f"{relay_addr}/p2p-circuit/p2p/{host.get_id()}"
        print(f"RESERVED {expire} {circuit}", flush=True)
        await _serve_until_stdin_closes()
        n.cancel_scope.cancel()  # the reservation refresher
    return 0


def _relay_status(error: BaseException) -> int | None:
    """The relay's STATUS code behind a failed dial (py-libp2p wraps it in ConnectionError)."""
    seen: BaseException | None = error
    while seen is not None:
        code = getattr(seen, "status_code", None)
        if code is not None:
            return int(code)
        seen = seen.__cause__ or seen.__context__
    return None


async def dial(addr: str, count: int) -> int:
    host = _make_host(None)
    protocol = CircuitV2Protocol(host, limits=_limits(), allow_hop=False)
    # CLIENT would make the dialer RESERVE first; a plain dialer needs no slot of its own
    config = RelayConfig(roles=RelayRole.STOP, limits=_limits())
    async with host.run([LOCAL]), background_trio_service(protocol):
        transport = CircuitV2Transport(host, protocol, config)
        target = ID.from_base58(multiaddr.Multiaddr(addr).get_peer_id())
        with trio.fail_after(20):
            try:
                conn = await transport.dial(multiaddr.Multiaddr(addr))
            except ConnectionError as e:
                status = _relay_status(e)
                if status is None:
                    raise
                print(f"REFUSED {status}", flush=True)
                return 2  # exiting here would reach the caller wrapped in an ExceptionGroup
            rtts = await PingService(host).ping(target, ping_amt=count)
        for rtt in rtts:
            print(f"RTT {rtt}", flush=True)
        if len(rtts) != count:
            print(f"expected {count} pings, got {len(rtts)}", file=sys.stderr, flush=True)
            return 1
        print("DONE", flush=True)
        await conn.close()
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p_relay = sub.add_parser("relay")
    p_relay.add_argument("--seed", default=None)
    p_relay.add_argument("--data", type=int, default=1 << 20)
    p_reserve = sub.add_parser("reserve")
    p_reserve.add_argument("relay_addr")
    p_reserve.add_argument("--seed", default=None)
    p_dial = sub.add_parser("dial")
    p_dial.add_argument("addr")
    p_dial.add_argument("--count", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    seed = bytes.fromhex(args.seed) if getattr(args, "seed", None) else None
    if args.mode == "relay":
        trio.run(relay, seed, args.data)
    elif args.mode == "reserve":
        sys.exit(trio.run(reserve, args.relay_addr, seed))
    else:
        sys.exit(trio.run(dial, args.addr, args.count))


if __name__ == "__main__":
    main()
