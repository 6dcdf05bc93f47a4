"""Bulk throughput of the secure channel between two processes over loopback TCP.

Modes, all measured in the same run (interleaved) so the results read as ratios:
  raw              trio TCP, no security (the baseline)
  noise            multistream /noise + Noise XX with ChaChaPoly, bulk data via SecureSession
  noise-aesgcm     the same with /moshpit/noise-aesgcm/1.0.0 (Noise XX with AES-256-GCM)
  host             the full stack: Host -> Noise -> yamux stream; two moshpit Hosts agree on
                   AES-256-GCM
  host-chachapoly  the full stack with the dialer offering only /noise (ChaChaPoly)

Prints one JSON object per measurement and a summary line per mode with the median, range
and CPU over the repetitions and the median's ratio to the raw median. Usage:
  python benchmarks/bench_secure_channel.py [--mb 256] [--reps 5]
      [--modes raw,noise,noise-aesgcm,host,host-chachapoly]
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
from dht.p2p.noise import (  # noqa: E402
    AESGCM_PROTOCOL_ID,
    PROTOCOL_ID,
    SECURITY_PROTOCOLS,
    noise_handshake,
)

CHUNK = 1 << 20
PROTOCOL = "/bench/bulk/1.0.0"
MODES = ("raw", "noise", "noise-aesgcm", "host", "host-chachapoly")
# security protocol a bare-Noise mode negotiates; what a Host mode's dialer offers
NOISE_MODES = {"noise": PROTOCOL_ID, "noise-aesgcm": AESGCM_PROTOCOL_ID}
HOST_MODES = {"host": None, "host-chachapoly": (PROTOCOL_ID,)}  # None: the Host's default


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
        if mode in HOST_MODES:
            from dht.p2p import Host

            async with Host.open() as host:  # a default Host accepts both ciphers

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
            if mode in NOISE_MODES:
                protocol, stream = await negotiate_inbound(raw, set(SECURITY_PROTOCOLS))
                stream = await noise_handshake(
                    stream,
                    Identity.generate(),
                    initiator=False,
                    cipher=SECURITY_PROTOCOLS[protocol],
                )
            await _drain(stream, total)
            done.set()

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, handle, 0)
            queue.put(listeners[0].socket.getsockname()[1])
            await done.wait()
            await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    trio.run(main)


async def _pump(stream, total: int) -> tuple[float, float, float, str]:
    buf = os.urandom(CHUNK)
    cpu0 = _cpu()
    t0 = time.perf_counter()
    sent = 0
    while sent < total:
        await stream.send_all(buf)
        sent += CHUNK
    server_cpu = float((await stream.receive_some()).decode())
    return time.perf_counter() - t0, _cpu() - cpu0, server_cpu, ""


def _client(mode: str, total: int, where) -> tuple[float, float, float, str]:
    async def main():
        if mode in HOST_MODES:
            from dht.p2p import Host, Multiaddr

            offer = HOST_MODES[mode]
            kwargs = {} if offer is None else {"security_protocols": offer}
            async with Host.open(**kwargs) as host:
                pid = await host.connect([Multiaddr(where)])
                stream = await host.new_stream(pid, PROTOCOL)
                (conn,) = host._conns[pid]
                cipher = conn.session.conn.cipher.name  # what was negotiated, as a check
                return (*(await _pump(stream, total))[:3], cipher)
        raw = await trio.open_tcp_stream("127.0.0.1", where)
        stream = raw
        cipher = ""
        if mode in NOISE_MODES:
            protocol, stream = await negotiate_outbound(raw, [NOISE_MODES[mode]])
            stream = await noise_handshake(
                stream, Identity.generate(), initiator=True, cipher=SECURITY_PROTOCOLS[protocol]
            )
            cipher = stream.cipher.name
        async with raw:
            return (*(await _pump(stream, total))[:3], cipher)

    return trio.run(main)


def run_once(mode: str, total: int) -> dict:
    queue = mp.Queue()
    proc = mp.Process(target=_server, args=(mode, total, queue))
    proc.start()
    try:
        seconds, client_cpu, server_cpu_total, cipher = _client(mode, total, queue.get(timeout=60))
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return {
        "mode": mode,
        "cipher": cipher or None,
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
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    total = args.mb << 20
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.reps):
        # interleaved, rotating the order each round, so load changes hit every mode alike
        for mode in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
            result = run_once(mode, total)
            results[mode].append(result)
            print(json.dumps(result), flush=True)
    baseline = (
        statistics.median(r["MB_per_s"] for r in results["raw"]) if "raw" in results else None
    )
    for mode in modes:
        rates = [r["MB_per_s"] for r in results[mode]]
        client_cpu = [r["client_cpu_s"] for r in results[mode]]
        median = statistics.median(rates)
        summary = {
            "mode": mode,
            "summary": True,
            "cipher": results[mode][0]["cipher"],
            "median_MB_per_s": round(median, 1),
            "range_MB_per_s": [min(rates), max(rates)],
            "client_cpu_s_range": [min(client_cpu), max(client_cpu)],
            "load_average": round(os.getloadavg()[0], 2),
        }
        if baseline:
            summary["ratio_vs_raw"] = round(median / baseline, 3)
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
