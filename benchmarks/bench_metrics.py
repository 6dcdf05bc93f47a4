"""What Prometheus metrics cost on the hot path: averaging rounds with metrics on and off.

P peer processes (default 4) on loopback each run a ``moshpit.DHT`` and an ``Averager`` of N
float32 values (default 16M = 64 MB) in one group. Rounds alternate between the two
configurations in the same run, ABBA-interleaved so that drift (a warming cache, another load
on the machine) hits both alike:

- ``metrics_off``: no metrics in the process (the observer lists are empty);
- ``metrics_on``: ``moshpit.metrics`` enabled in every peer, its ``/metrics`` endpoint served,
  and a thread in each peer scraping it every ``--scrape-interval`` seconds (default 1 s, 15x
  Prometheus' usual rate: a pessimistic load) for as long as the configuration runs.

Per configuration one JSON line: medians over rounds of the slowest peer's ``step()`` and
all-reduce time, the CPU seconds per peer (``time.process_time``: every thread of the worker,
the scraper and HTTP server included), then one line with the ratios on/off. A ``micro`` line
times the two pieces of code metrics add, in isolation: the round observer (per step) and one
scrape (collect + encode) of a peer with a DHT and an averager.

    python benchmarks/bench_metrics.py                       # 4 peers, 16M floats, 8+8 rounds
    python benchmarks/bench_metrics.py --numel 1000000 --rounds 4   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("metrics_off", "metrics_on")


# ---------------------------------------------------------------------------------------------
# worker


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bootstrap", default=None)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--numel", type=int, required=True)
    p.add_argument("--scrape-interval", type=float, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # P processes share the cores

    import torch

    import moshpit.metrics as metrics
    from dht import DHT
    from moshpit.averaging.averager import Averager

    torch.set_num_threads(1)

    def emit(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    dht = DHT(
        initial_peers=[args.bootstrap] if args.bootstrap else [],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        startup_timeout=120,
    )
    emit({"event": "dht", "maddr": str(dht.get_visible_maddrs()[0])})
    averager = Averager(
        [torch.randn(args.numel)],
        dht,
        prefix="bench-metrics",
        target_group_size=args.world,
        min_group_size=args.world,
        min_matchmaking_time=30.0,
        request_timeout=10.0,
        allreduce_timeout=600.0,
        matchmaking_timeout=60.0,
        initial_group_bits="",
    )
    server = metrics.serve_metrics(0)  # turns metrics on ...
    metrics.disable()  # ... and off: the first configuration decides
    scraping = threading.Event()
    scrapes = [0]

    def scraper() -> None:
        while True:
            scraping.wait()
            with urllib.request.urlopen(server.url, timeout=30) as response:
                response.read()
            scrapes[0] += 1
            time.sleep(args.scrape_interval)

    threading.Thread(target=scraper, daemon=True).start()
    emit({"event": "ready"})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "config":
            if cmd["config"] == "metrics_on":
                metrics.enable()
                scraping.set()
            else:
                scraping.clear()
                metrics.disable()
            emit({"event": "config"})
        elif cmd["cmd"] == "step":
            t0 = time.perf_counter()
            c0 = time.process_time()
            scrapes_before = scrapes[0]
            res = averager.step()
            emit(
                {
                    "event": "step",
                    "ok": res.succeeded and not res.failed,
                    "group": res.group_size,
                    "step_s": time.perf_counter() - t0,
                    "cpu_s": time.process_time() - c0,
                    "allreduce_s": res.allreduce_seconds,
                    "scrapes": scrapes[0] - scrapes_before,
                }
            )
        elif cmd["cmd"] == "exit":
            break
    scraping.clear()
    server.close()
    averager.shutdown()
    dht.shutdown()
    return 0


# ---------------------------------------------------------------------------------------------
# parent


class Proc:
    def __init__(self, cmd: list[str]) -> None:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        self.p = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    def send(self, obj: dict) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self, event: str) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited (waiting for {event!r})")
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if obj.get("event") == event:
                return obj


def _all(procs: list[Proc], cmd: dict, event: str) -> list[dict]:
    for proc in procs:
        proc.send(cmd)
    return [proc.recv(event) for proc in procs]


def micro(numel: int) -> dict:
    """The observer's cost per step and one scrape's, in this process (no network)."""
    import torch

    import moshpit.metrics as metrics
    from dht import DHT
    from moshpit.averaging.averager import Averager, StepResult

    metrics.enable()
    m = metrics._metrics
    averager = type("A", (), {"compression": None})()
    result = StepResult(
        True,
        "k",
        group_id=b"g",
        members=(1, 2, 3, 4),
        matchmaking_seconds=0.1,
        allreduce_seconds=1.0,
        bytes_sent=3 * numel,
        bytes_received=3 * numel,
    )
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        m.on_averager("step", averager, result)
    observer_us = (time.perf_counter() - t0) / n * 1e6
    from prometheus_client.exposition import generate_latest

    with DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) as dht:
        av = Averager([torch.zeros(16)], dht, "micro", target_group_size=2)
        generate_latest(m.registry)  # warm
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            body = generate_latest(m.registry)
        scrape_ms = (time.perf_counter() - t0) / reps * 1e3
        av.shutdown()
    metrics.disable()
    return {
        "kind": "micro",
        "observer_us_per_step": round(observer_us, 2),
        "scrape_ms": round(scrape_ms, 3),
        "scrape_bytes": len(body),
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--numel", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per configuration")
    parser.add_argument("--scrape-interval", type=float, default=1.0, metavar="S")
    args = parser.parse_args()

    def emit(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    emit({**micro(args.numel), "numel": args.numel})
    base = [sys.executable, __file__, "--worker", "--world", str(args.peers)]
    base += ["--numel", str(args.numel), "--scrape-interval", str(args.scrape_interval)]
    first = Proc(base)
    maddr = first.recv("dht")["maddr"]
    procs = [first] + [Proc([*base, "--bootstrap", maddr]) for _ in range(args.peers - 1)]
    try:
        for proc in procs[1:]:
            proc.recv("dht")
        for proc in procs:
            proc.recv("ready")
        # ABBA order; one warm-up round per configuration first, not counted
        order = [c for i in range(args.rounds) for c in (CONFIGS if i % 2 == 0 else CONFIGS[::-1])]
        rows: dict[str, list[dict]] = {c: [] for c in CONFIGS}
        for i, config in enumerate([*CONFIGS, *order]):
            _all(procs, {"cmd": "config", "config": config}, "config")
            steps = _all(procs, {"cmd": "step"}, "step")
            if not all(s["ok"] and s["group"] == args.peers for s in steps):
                emit({"kind": "warning", "round": i, "config": config, "steps": steps})
                continue
            if i >= len(CONFIGS):
                rows[config].append(
                    {
                        "step_s": max(s["step_s"] for s in steps),
                        "allreduce_s": max(s["allreduce_s"] for s in steps),
                        "cpu_s": statistics.mean(s["cpu_s"] for s in steps),
                        "scrapes": sum(s["scrapes"] for s in steps),
                    }
                )
        for proc in procs:
            proc.send({"cmd": "exit"})
    finally:
        for proc in procs:
            try:
                proc.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.p.kill()
    summary = {}
    for config in CONFIGS:
        got = rows[config]
        summary[config] = {
            key: statistics.median(r[key] for r in got)
            for key in ("step_s", "allreduce_s", "cpu_s")
        }
        emit(
            {
                "kind": "averaging",
                "config": config,
                "peers": args.peers,
                "numel": args.numel,
                "rounds": len(got),
                "step_s": round(summary[config]["step_s"], 4),
                "allreduce_s": round(summary[config]["allreduce_s"], 4),
                "cpu_s_per_peer": round(summary[config]["cpu_s"], 4),
                "allreduce_s_all": [round(r["allreduce_s"], 4) for r in got],
                "scrapes_during_rounds": sum(r["scrapes"] for r in got),
                "cores": os.cpu_count(),
            }
        )
    on, off = summary["metrics_on"], summary["metrics_off"]
    emit(
        {
            "kind": "ratio",
            "step_on_vs_off": round(on["step_s"] / off["step_s"], 4),
            "allreduce_on_vs_off": round(on["allreduce_s"] / off["allreduce_s"], 4),
            "cpu_on_vs_off": round(on["cpu_s"] / off["cpu_s"], 4),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
