"""Bulk throughput of the secure channel between two processes over loopback TCP.

Modes, all measured in the same run so the results read as ratios:
  raw    trio TCP, no security (the baseline)
  noise  multistream /noise + Noise XX, then bulk data through SecureSession
  host   the full stack: Host -> Noise -> yamux stream (encrypted + muxed)

Prints one JSON object per measurement and a summary line per mode with the median over
the repetitions and its ratio to the raw median. Usage:
  python benchmarks/bench_secure_channel.py [--mb 256] [--reps 5] [--modes raw,noise,host]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dht.p2p.identity import Identity  # noqa: E402
from dht.p2p.multistream import negotiate_inbound, negotiate_outbound  # noqa: E402
from dht.p2p.noise import noise_handshake  # noqa: E402

CHUNK = 1 << 20
PROTOCOL = "/bench/bulk/1.0.0"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _drain(stream, total: int) -> None:
    got = 0
    while got < total:
        data = await stream.receive_some()
        if not data:
            raise RuntimeError(f"EOF after {got} of {total} bytes")
        got += len(data)
    await stream.send_all(f"{_cpu():.4f}".encode())


def _server(mode: str, total: int, queue) -> None:
    async def main() -> None:
        done = trio.Event()
        if mode == "host":
            from dht.p2p import Host

            async with Host.open() as host:

                async def handler(stream) -> None:
                    await _drain(stream, total)
                    done.set()

                host.set_stream_handler(PROTOCOL, handler)
                addrs = await host.listen(["/ip4/127.0.0.1/tcp/0"])
                queue.put(str(addrs[0]))
                await done.wait()
                await trio.sleep(0.2)
            return

        async def handle(raw) -> None:
            stream = raw
            if mode == "noise":
                _, stream = await negotiate_inbound(raw, {"/noise"})
                stream = await noise_handshake(stream, Identity.generate(), initiator=False)
            await _drain(stream, total)
            done.set()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, handle, 0)
            queue.put(listeners[0].socket.getsockname()[1])
            await done.wait()
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _pump(stream, total: int) -> tuple[float, float, float]:
    buf = os.urandom(CHUNK)
    cpu0 = _cpu()
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        await stream.send_all(buf)
        sent += CHUNK
    server_cpu = float((await stream.receive_some()).decode())
    return time.perf_counter() - t0, _cpu() - cpu0, server_cpu


def _client(mode: str, total: int, where) -> tuple[float, float, float]:
    async def main():
        if mode == "host":
            from dht.p2p import Host, Multiaddr

            async with Host.open() as host:
                pid = await host.connect([Multiaddr(where)])
                stream = await host.new_stream(pid, PROTOCOL)
                return await _pump(stream, total)
        raw = await trio.open_tcp_stream("127.0.0.1", where)
        stream = raw
        if mode == "noise":
            _, stream = await negotiate_outbound(raw, ["/noise"])
            stream = await noise_handshake(stream, Identity.generate(), initiator=True)
        async with raw:
            return await _pump(stream, total)

    return trio.run(main)


def run_once(mode: str, total: int) -> dict:
    queue = mp.Queue()
    proc = mp.Process(target=_server, args=(mode, total, queue))
    proc.start()
    try:
        seconds, client_cpu, server_cpu_total = _client(mode, total, queue.get(timeout=60))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return {
        "mode": mode,
        "bytes": total,
        "seconds": round(seconds, 4),
        "MB_per_s": round(total / seconds / 1e6, 1),
        "client_cpu_s": round(client_cpu, 3),
        "server_cpu_s_incl_startup": round(server_cpu_total, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", default="raw,noise,host")
    args = parser.parse_args()
    modes = args.modes.split(",")
    total = args.mb << 20
    results: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.reps):
        for mode in modes:  # interleaved, so load changes hit every mode alike
            result = run_once(mode, total)
            results[mode].append(result["MB_per_s"])
            print(json.dumps(result), flush=True)
    baseline = statistics.median(results["raw"]) if "raw" in results else None
    for mode in modes:
        median = statistics.median(results[mode])
        summary = {"mode": mode, "summary": True, "median_MB_per_s": round(median, 1)}
        if baseline:
            summary["ratio_vs_raw"] = round(median / baseline, 3)
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
