"""A py-libp2p peer (a libp2p implementation we did not write), run as a separate process.

Used by ``test_interop_libp2p.py`` to check wire compatibility over real TCP. Noise is the
only security protocol offered and yamux the muxer, so a successful connection proves our
multistream-select, Noise and yamux speak libp2p.

    python libp2p_peer.py listen [--seed HEX]
        prints "LISTENING <multiaddr with /p2p/...>" and serves /ipfs/ping/1.0.0 plus an
        /interop/echo/1.0.0 handler (echoes until EOF) until stdin closes.
    python libp2p_peer.py ping <multiaddr> [--count N]
        connects, pings N times and prints "RTT <ms>" per ping, then "DONE".

Every line is flushed; errors go to stderr with a non-zero exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.ping import ID as PING_PROTOCOL_ID
from libp2p.host.ping import PingService, handle_ping
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

ECHO_PROTOCOL = "/interop/echo/1.0.0"


def _make_host(seed: bytes | None):
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519

    key_pair = create_new_key_pair(seed)
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
    )


async def _echo(stream) -> None:
    try:
        while True:
            data = await stream.read(65536)
            if not data:
                break
            await stream.write(data)
    finally:
        await stream.close()


async def listen(seed: bytes | None) -> None:
    host = _make_host(seed)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        host.set_stream_handler(PING_PROTOCOL_ID, handle_ping)
        host.set_stream_handler(ECHO_PROTOCOL, _echo)
        addrs = [a for a in host.get_addrs() if "/tcp/" in str(a)]
        print(f"LISTENING {addrs[0]}", flush=True)
        # Serve until the parent closes our stdin (clean shutdown without signals).
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


async def ping(addr: str, count: int) -> None:
    host = _make_host(None)
    async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        with trio.fail_after(20):
            await host.connect(info)
            rtts = await PingService(host).ping(info.peer_id, ping_amt=count)
        for rtt in rtts:
            print(f"RTT {rtt}", flush=True)
        if len(rtts) != count:
            raise SystemExit(f"expected {count} pings, got {len(rtts)}")
        print("DONE", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p_listen = sub.add_parser("listen")
    p_listen.add_argument("--seed", default=None)
    p_ping = sub.add_parser("ping")
    p_ping.add_argument("addr")
    p_ping.add_argument("--count", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.mode == "listen":
        trio.run(listen, bytes.fromhex(args.seed) if args.seed else None)
    else:
        trio.run(ping, args.addr, args.count)


if __name__ == "__main__":
    main()
