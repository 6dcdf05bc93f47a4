"""Transport benchmark: our Host (TCP + Noise + yamux) vs raw trio TCP, two processes each.

Prints one JSON object per result line:
  (a) bulk throughput of one stream (default 512 MiB), Host vs raw TCP -> ratio (target >= 0.4),
      for each cipher (``--ciphers``): AES-256-GCM (what two moshpit Hosts negotiate) and
      ChaChaPoly (``/noise``, what libp2p peers get), runs interleaved with raw TCP; one
      ``bulk_run`` line per run, then a ``bulk_one_stream`` summary per cipher (best run, and
      the range over runs: the machine may be shared)
  (b) unary RPC round trip on a warm connection, p50/p99 (target p50 <= 0.5 ms), with a raw
      TCP ping-pong of the same request size as the baseline
  (c) connection setup (TCP + Noise + yamux) p50, with a raw TCP connect as the baseline, per
      security offer: AES-GCM accepted at once, /noise only, and AES-GCM refused by a
      /noise-only listener (the fallback: one more round trip); rounds interleaved

Usage: python benchmarks/bench_transport.py [--bulk-mib 512] [--rpc-calls 3000] [--connects 100]
       [--repeats 3] [--ciphers aesgcm,chachapoly] [--bulk-only]
       [--host-only (our bulk runs only, e.g. under py-spy/perf)]
The server side of every measurement runs in a child process (this script with --serve).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dht.p2p import Host, Multiaddr, P2PStream  # noqa: E402
from dht.p2p.noise import AESGCM_PROTOCOL_ID, PROTOCOL_ID  # noqa: E402

CHUNK = 1024 * 1024
RPC_PAYLOAD = b"x" * 64
REPLY = struct.Struct(">Qd")  # bytes received, receiver CPU seconds spent on them
# what the dialing Host offers, per cipher; the default server accepts both
OFFERS: dict[str, tuple[str, ...]] = {
    "aesgcm": (AESGCM_PROTOCOL_ID, PROTOCOL_ID),
    "chachapoly": (PROTOCOL_ID,),
}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# -- server processes --------------------------------------------------------------------
async def serve_host(security: tuple[str, ...] = OFFERS["aesgcm"]) -> None:
    async with Host.open(security_protocols=security) as host:
        (addr,) = await host.listen(["/ip4/127.0.0.1/tcp/0"])

        async def sink(stream: P2PStream) -> None:
            total = 0
            cpu = cpu_seconds()
            while True:
                data = await stream.receive_some()
                if not data:
                    break
                total += len(data)
            await stream.send_all(REPLY.pack(total, cpu_seconds() - cpu))

        async def echo(peer, request):
            return request

        host.set_stream_handler("/bench/sink/1.0.0", sink)
        host.set_rpc_handler("/bench/echo/1.0.0", echo)
        print(str(addr), flush=True)
        await trio.sleep_forever()


async def serve_raw() -> None:
    async def handle(stream: trio.SocketStream) -> None:
        mode = await stream.receive_some(1)
        if mode == b"B":  # bulk: count until EOF, answer the count
            total = 0
            cpu = cpu_seconds()
            while True:
                data = await stream.receive_some(CHUNK)
                if not data:
                    break
                total += len(data)
            await stream.send_all(REPLY.pack(total, cpu_seconds() - cpu))
        elif mode == b"P":  # ping-pong: echo fixed-size requests
            n = len(RPC_PAYLOAD)
            buf = b""
            while True:
                data = await stream.receive_some(65536)
                if not data:
                    break
                buf += data
                while len(buf) >= n:
                    await stream.send_all(buf[:n])
                    buf = buf[n:]
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    print(port, flush=True)
    await trio.serve_listeners(handle, listeners)


def start_server(kind: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", kind],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"{kind} server did not start")
    return proc, line


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- measurements ------------------------------------------------------------------------
def payload_chunk() -> bytes:
    return bytes(range(256)) * (CHUNK // 256)


async def read_reply(stream: trio.abc.ReceiveStream) -> tuple[int, float]:
    got = b""
    while len(got) < REPLY.size:
        data = await stream.receive_some(REPLY.size - len(got))
        assert data, "server closed early"
        got += data
    return REPLY.unpack(got)


async def bulk_raw(port: int, size: int) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver CPU seconds)"""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    chunk = payload_chunk()
    start, cpu = time.perf_counter(), cpu_seconds()
    await stream.send_all(b"B")
    for _ in range(size // CHUNK):
        await stream.send_all(chunk)
    await stream.send_eof()
    received, receiver_cpu = await read_reply(stream)
    elapsed, sender_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    assert received == size, "raw TCP lost bytes"
    await stream.aclose()
    return elapsed, sender_cpu, receiver_cpu


async def bulk_host(
    addr: str, size: int, offer: tuple[str, ...] = OFFERS["aesgcm"]
) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver CPU seconds)"""
    async with Host.open(security_protocols=offer) as host:
        pid = await host.connect([Multiaddr(addr)])
        stream = await host.new_stream(pid, "/bench/sink/1.0.0")
        chunk = payload_chunk()
        start, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(size // CHUNK):
            await stream.send_all(chunk)
        await stream.send_eof()
        received, receiver_cpu = await read_reply(stream)
        elapsed, sender_cpu = time.perf_counter() - start, cpu_seconds() - cpu
        assert received == size, "host stream lost bytes"
        return elapsed, sender_cpu, receiver_cpu


async def rpc_raw(port: int, calls: int) -> list[float]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"P")
    n = len(RPC_PAYLOAD)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await stream.send_all(RPC_PAYLOAD)
        got = 0
        while got < n:
            got += len(await stream.receive_some(n - got))
        times.append(time.perf_counter() - start)
    await stream.aclose()
    return times


async def rpc_host(addr: str, calls: int) -> list[float]:
    async with Host.open() as host:
        pid = await host.connect([Multiaddr(addr)])
        for _ in range(100):  # warm-up
            await host.call(pid, "/bench/echo/1.0.0", RPC_PAYLOAD)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            reply = await host.call(pid, "/bench/echo/1.0.0", RPC_PAYLOAD)
            times.append(time.perf_counter() - start)
            assert reply == RPC_PAYLOAD
        return times


async def connect_raw(port: int, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        times.append(time.perf_counter() - start)
        await stream.send_all(b"P")
        await stream.aclose()
    return times


async def connect_host(addr: str, n: int, offer: tuple[str, ...] = OFFERS["aesgcm"]) -> list[float]:
    maddr = Multiaddr(addr)
    times = []
    async with Host.open(security_protocols=offer) as host:
        for _ in range(n):
            start = time.perf_counter()
            pid = await host.connect([maddr])
            times.append(time.perf_counter() - start)
            await host.disconnect(pid)
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", choices=["host", "host-noise-only", "raw"])
    parser.add_argument("--bulk-mib", type=int, default=512)
    parser.add_argument("--rpc-calls", type=int, default=3000)
    parser.add_argument("--connects", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3, help="bulk runs; the best is reported")
    parser.add_argument(
        "--ciphers", default="aesgcm,chachapoly", help=f"bulk/connect variants of {list(OFFERS)}"
    )
    parser.add_argument("--bulk-only", action="store_true", help="skip the RPC and connect runs")
    parser.add_argument("--host-only", action="store_true", help="bulk via Host only (profiling)")
    args = parser.parse_args()
    if args.serve == "host":
        trio.run(serve_host)
        return
    if args.serve == "host-noise-only":
        trio.run(serve_host, OFFERS["chachapoly"])
        return
    if args.serve == "raw":
        trio.run(serve_raw)
        return

    size = args.bulk_mib * CHUNK
    raw_proc, port_text = start_server("raw")
    host_proc, addr = start_server("host")
    port = int(port_text)
    try:
        if args.host_only:
            for _ in range(args.repeats):
                wall, sender_cpu, receiver_cpu = trio.run(bulk_host, addr, size)
                emit(
                    bench="bulk_host_only",
                    bytes=size,
                    host_MBps=round(size / wall / 1e6, 1),
                    host_sender_cpu_s=round(sender_cpu, 3),
                    host_receiver_cpu_s=round(receiver_cpu, 3),
                )
            return
        ciphers = args.ciphers.split(",")
        runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v in ["raw", *ciphers]}
        variants = list(runs)
        for rep in range(args.repeats):
            # interleaved, order rotated per round, so load from others hits every variant alike
            for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
                if variant == "raw":
                    result = trio.run(bulk_raw, port, size)
                else:
                    result = trio.run(bulk_host, addr, size, OFFERS[variant])
                runs[variant].append(result)
                emit(
                    bench="bulk_run",
                    variant=variant,
                    bytes=size,
                    MBps=round(size / result[0] / 1e6, 1),
                    sender_cpu_s=round(result[1], 3),
                    receiver_cpu_s=round(result[2], 3),
                    load_average=round(os.getloadavg()[0], 2),
                )
        raw_runs = runs["raw"]
        raw_best = min(raw_runs)
        raw_mbps = size / raw_best[0] / 1e6
        # CPU-bound rate: what one core per process would sustain (independent of other load)
        raw_cpu_mbps = size / max(raw_best[1], raw_best[2]) / 1e6
        for cipher in ciphers:
            host_runs = runs[cipher]
            host_best = min(host_runs)
            host_mbps = size / host_best[0] / 1e6
            host_cpu_mbps = size / max(host_best[1], host_best[2]) / 1e6
            emit(
                bench="bulk_one_stream",
                cipher=cipher,
                bytes=size,
                host_MBps=round(host_mbps, 1),
                raw_tcp_MBps=round(raw_mbps, 1),
                ratio=round(host_mbps / raw_mbps, 3),
                target_ratio=0.4,
                met=host_mbps / raw_mbps >= 0.4,
                host_sender_cpu_s=round(host_best[1], 3),
                host_receiver_cpu_s=round(host_best[2], 3),
                raw_sender_cpu_s=round(raw_best[1], 3),
                raw_receiver_cpu_s=round(raw_best[2], 3),
                host_cpu_bound_MBps=round(host_cpu_mbps, 1),
                raw_cpu_bound_MBps=round(raw_cpu_mbps, 1),
                cpu_bound_ratio=round(host_cpu_mbps / raw_cpu_mbps, 3),
                host_MBps_range=[
                    round(size / max(r[0] for r in host_runs) / 1e6, 1),
                    round(host_mbps, 1),
                ],
                host_sender_cpu_s_range=[
                    round(min(r[1] for r in host_runs), 3),
                    round(max(r[1] for r in host_runs), 3),
                ],
                host_receiver_cpu_s_range=[
                    round(min(r[2] for r in host_runs), 3),
                    round(max(r[2] for r in host_runs), 3),
                ],
                runs_host_s=[round(r[0], 3) for r in host_runs],
                runs_raw_s=[round(r[0], 3) for r in raw_runs],
                load_average=round(os.getloadavg()[0], 2),
            )
        if args.bulk_only:
            return

        raw_rtt = trio.run(rpc_raw, port, args.rpc_calls)
        host_rtt = trio.run(rpc_host, addr, args.rpc_calls)
        emit(
            bench="rpc_round_trip_warm",
            calls=args.rpc_calls,
            request_bytes=len(RPC_PAYLOAD),
            host_p50_ms=round(pct(host_rtt, 0.5) * 1e3, 4),
            host_p99_ms=round(pct(host_rtt, 0.99) * 1e3, 4),
            raw_tcp_p50_ms=round(pct(raw_rtt, 0.5) * 1e3, 4),
            raw_tcp_p99_ms=round(pct(raw_rtt, 0.99) * 1e3, 4),
            ratio_p50=round(pct(host_rtt, 0.5) / pct(raw_rtt, 0.5), 2),
            target_p50_ms=0.5,
            met=pct(host_rtt, 0.5) <= 0.5e-3,
        )

        # Connection setup per security offer, in interleaved rounds of 10 connects each.
        # "fallback": a default dialer against a /noise-only listener (a libp2p peer's view:
        # AES-GCM is refused with "na", then /noise costs one more round trip).
        noise_proc, noise_addr = start_server("host-noise-only")
        try:
            setups: dict[str, list[float]] = {
                "raw": [],
                "aesgcm": [],
                "chachapoly": [],
                "fallback": [],
            }
            order = list(setups)
            for i in range(max(1, args.connects // 10)):
                for variant in order[i % len(order) :] + order[: i % len(order)]:
                    if variant == "raw":
                        setups[variant] += trio.run(connect_raw, port, 10)
                    elif variant == "fallback":
                        setups[variant] += trio.run(connect_host, noise_addr, 10, OFFERS["aesgcm"])
                    else:
                        setups[variant] += trio.run(connect_host, addr, 10, OFFERS[variant])
        finally:
            stop_server(noise_proc)
        raw_conn = setups["raw"]
        for variant in ("aesgcm", "chachapoly", "fallback"):
            host_conn = setups[variant]
            emit(
                bench="connection_setup",
                variant=variant,
                connects=len(host_conn),
                host_p50_ms=round(statistics.median(host_conn) * 1e3, 3),
                host_p99_ms=round(pct(host_conn, 0.99) * 1e3, 3),
                raw_tcp_p50_ms=round(statistics.median(raw_conn) * 1e3, 3),
                ratio_p50=round(statistics.median(host_conn) / statistics.median(raw_conn), 1),
            )
    finally:
        stop_server(raw_proc)
        stop_server(host_proc)


if __name__ == "__main__":
    main()
