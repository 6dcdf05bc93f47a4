"""A request beside bulk transfers on a slow uplink: how long until it is answered?

Two peers, each in its own network namespace of a :class:`wan_testbed.WanTestbed` (tc tbf
up and down, 1 Mbit/s by default). Peer 1 serves ``/bulk`` (reads and drops) and ``/echo``.
Peer 0 keeps ``B`` streams of ``/bulk`` busy (64-KiB writes, as an all-reduce's chunks) and
every 0.5 s opens a new ``/echo`` stream, sends 100 bytes and waits for them back (as a DHT
RPC does). The baseline is the same probe with no bulk stream, in the same run. One JSON line
per number of bulk streams: the probes' round trips (p50, max), how many took longer than the
DHT's RPC timeout (3 s), and the bulk rate its sender's writes were accepted at.

    python benchmarks/bench_link_priority.py                    # 1mbit; 0, 1 and 3 bulk streams
    python benchmarks/bench_link_priority.py --rate 10mbit --seconds 30

Needs root (network namespaces); prints one ``{"kind": "skipped", ...}`` line otherwise.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import trio

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from dht.p2p import Identity  # noqa: E402
from dht.p2p.host import Host  # noqa: E402
from dht.p2p.transport import TCPTransport  # noqa: E402

SERVER_SEED = bytes(32)  # the server's identity, so the client knows its peer id
PORT = 4100
RPC_TIMEOUT = 3.0  # the DHT's default rpc_timeout


async def serve(host_addr: str) -> None:
    async def drop(stream) -> None:
        while await stream.receive_some(1 << 20):
            pass

    async def echo(stream) -> None:
        await stream.send_msg(await stream.receive_msg())
        await stream.aclose()

    async with Host.open(identity=Identity.from_seed(SERVER_SEED), transport=TCPTransport()) as h:
        h.set_stream_handler("/bulk", drop)
        h.set_stream_handler("/echo", echo)
        await h.listen([f"/ip4/{host_addr}/tcp/{PORT}"])
        print("ready", flush=True)
        await trio.sleep_forever()


async def probe(server_addr: str, bulk_streams: int, seconds: float) -> dict:
    server = Identity.from_seed(SERVER_SEED).peer_id
    rtts: list[float] = []
    sent = 0
    async with Host.open(transport=TCPTransport()) as host:
        await host.connect([f"/ip4/{server_addr}/tcp/{PORT}"], server)

        async def bulk() -> None:
            nonlocal sent
            stream = await host.new_stream(server, "/bulk")
            payload = b"x" * (64 * 1024)
            while True:
                await stream.send_all(payload)
                sent += len(payload)

        async def ask() -> None:
            while True:
                began = time.monotonic()
                with trio.move_on_after(30):
                    stream = await host.new_stream(server, "/echo")
                    await stream.send_msg({"t": "ping", "pad": b"p" * 100})
                    await stream.receive_msg()
                    rtts.append(time.monotonic() - began)
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            for _ in range(bulk_streams):
                nursery.start_soon(bulk)
            nursery.start_soon(ask)
            await trio.sleep(seconds)
            nursery.cancel_scope.cancel()
    rtts.sort()
    return {
        "bulk_streams": bulk_streams,
        "probes": len(rtts),
        "rtt_p50_s": round(rtts[len(rtts) // 2], 3) if rtts else None,
        "rtt_max_s": round(rtts[-1], 3) if rtts else None,
        "over_rpc_timeout": sum(r > RPC_TIMEOUT for r in rtts),
        "bulk_accepted_KBps": round(sent / seconds / 1e3, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="1mbit", help="per-peer link rate, tc syntax")
    parser.add_argument("--bulk", type=int, nargs="+", default=[0, 1, 3])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--serve", metavar="ADDR", help=argparse.SUPPRESS)
    parser.add_argument("--probe", metavar="ADDR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.serve)
        return 0
    if args.probe:
        result = trio.run(probe, args.probe, args.bulk[0], args.seconds)
        print(json.dumps(result), flush=True)
        return 0
    from wan_testbed import WanTestbed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(json.dumps({"kind": "skipped", "reason": reason}))
        return 0
    me = [sys.executable, str(Path(__file__).resolve())]
    with WanTestbed(2, args.rate) as tb:
        server = tb.popen(1, [*me, "--serve", tb.addr(1)], stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout is None or server.stdout.readline().strip() != "ready":
                raise RuntimeError("the server did not start")
            for bulk in args.bulk:
                argv = [*me, "--probe", tb.addr(1), "--bulk", str(bulk)]
                argv += ["--seconds", str(args.seconds)]
                out = tb.run(0, argv, capture_output=True, text=True, timeout=args.seconds + 60)
                row = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps({"kind": "link_priority", "rate": args.rate, **row}), flush=True)
        finally:
            server.kill()
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
