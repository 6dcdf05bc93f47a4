"""Averaging over shaped links: moshpit (none / fp16 / 8-bit / top-k) vs gloo all_reduce.

N peer processes, each in its own network namespace of a :class:`wan_testbed.WanTestbed`
(per-peer link shaped with ``tc tbf`` up and down, e.g. 100 Mbit/s or 1 Gbit/s), run the same
worker as ``bench_averaging.py``: a gloo ``all_reduce`` baseline and ``Averager.step()`` for each
codec over the same links in the same run. One JSON line per result (the rows of
``bench_averaging.py`` plus ``rate``), then one ``{"kind": "wan_summary", ...}`` line per rate
with the ratios the issue's goals are stated in (moshpit all-reduce time / gloo time).

    python benchmarks/bench_wan.py                          # 4 peers, 100mbit and 1gbit, 4M fp32
    python benchmarks/bench_wan.py --rates 100mbit --codecs none uint8 --rounds 2
    python benchmarks/bench_wan.py --rates 100mbit --codecs none --uplinks   # + link use

Every codec runs twice: with TCP alone sharing each peer's uplink, and ``_paced`` (each peer's
``bandwidth`` set to its link rate, so the round caps its connections at shares of it; see
``moshpit/averaging/pacing.py``); ``--no-pace`` skips the paced rows.

``--uplinks`` adds one more round of each (gloo included) while a thread samples every peer's
uplink byte counter every 10 ms, and prints ``{"kind": "uplinks", ...}``: each peer's share of
the link rate used over the round (``utilization``) and the share of 10 ms intervals in which
its uplink sent less than a tenth of the rate (``idle_share``). gloo's row covers its warm-up
and timed all_reduce with the barrier between them.

Needs root (network namespaces); prints one ``{"kind": "skipped", "reason": ...}`` line and
exits 0 where namespaces are not permitted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_averaging import CODECS, Proc, _all, run_configs  # noqa: E402
from wan_testbed import WanTestbed, unavailable_reason  # noqa: E402

GLOO_PORT = 29517  # inside the namespaces only: no clash with anything on the host
SAMPLE_S = 0.01


def _tx_bytes(pid: int) -> int:
    """Bytes sent on eth0 of the network namespace process ``pid`` lives in."""
    with open(f"/proc/{pid}/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
    raise RuntimeError(f"process {pid} has no eth0")


class UplinkSampler:
    """Every peer's uplink byte counter, sampled in a thread while a round runs."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), [_tx_bytes(p) for p in self.pids]))
            self._stop.wait(SAMPLE_S)

    def __enter__(self) -> UplinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, rate_bps: int) -> dict:
        """Link use from the first to the last interval in which any uplink was busy."""
        capacity = rate_bps / 8  # bytes per second
        deltas = [
            (t1 - t0, [b - a for a, b in zip(v0, v1, strict=True)])
            for (t0, v0), (t1, v1) in itertools.pairwise(self.samples)
        ]
        busy = [i for i, (dt, d) in enumerate(deltas) if max(d) > 0.1 * capacity * dt]
        if not busy:
            return {"span_s": 0.0, "utilization": [], "idle_share": []}
        window = deltas[busy[0] : busy[-1] + 1]
        span = sum(dt for dt, _ in window)
        peers = range(len(self.pids))
        sent = [sum(d[i] for _, d in window) for i in peers]
        idle = [sum(1 for dt, d in window if d[i] < 0.1 * capacity * dt) for i in peers]
        return {
            "span_s": round(span, 3),
            "utilization": [round(b / (capacity * span), 3) for b in sent],
            "idle_share": [round(n / len(window), 3) for n in idle],
        }


def measure_uplinks(
    procs: list[Proc],
    rate_bps: int,
    numel: int,
    codecs: list[str],
    extra: dict,
    uplink_rate: float | None = None,
) -> list[dict]:
    """One more round of gloo and of each codec with the uplinks sampled (see --uplinks)."""
    pids = [p.p.pid for p in procs]
    rows = []
    with UplinkSampler(pids) as sampler:
        _all(procs, {"cmd": "gloo", "numel": numel, "reps": 1}, "gloo")
    rows.append({"kind": "uplinks", "impl": "gloo", **sampler.report(rate_bps), **extra})
    rates = (None,) if uplink_rate is None else (None, uplink_rate)
    for codec, bandwidth in [(c, r) for c in codecs for r in rates]:
        impl = codec if bandwidth is None else f"{codec}_paced"
        setup = {"cmd": "setup", "numel": numel, "codec": codec, "prefix": f"uplinks-{impl}"}
        _all(procs, {**setup, "bandwidth": bandwidth}, "setup")
        _all(procs, {"cmd": "step"}, "step")  # warm-up: dials, first-use allocations
        with UplinkSampler(pids) as sampler:
            _all(procs, {"cmd": "step"}, "step")
        _all(procs, {"cmd": "teardown"}, "teardown")
        rows.append({"kind": "uplinks", "impl": impl, **sampler.report(rate_bps), **extra})
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def run_rate(
    num_peers: int,
    rate: str,
    numel: int,
    codecs: list[str],
    rounds: int,
    gloo_reps: int,
    uplinks: bool = False,
    pace: bool = True,
) -> list[dict]:
    worker = [sys.executable, str(HERE / "bench_averaging.py"), "--worker"]
    with WanTestbed(num_peers, rate) as tb:

        def start(rank: int, bootstrap: str | None) -> Proc:
            argv = [*worker, "--rank", str(rank), "--world", str(num_peers),
                    "--gloo-port", str(GLOO_PORT), "--host", tb.addr(rank),
                    "--gloo-addr", tb.addr(0)]  # fmt: skip
            if bootstrap:
                argv += ["--bootstrap", bootstrap]
            # gloo must use the shaped link, not whatever the hostname resolves to
            return Proc(argv, popen=lambda cmd, **kw: tb.popen(rank, cmd, **kw),
                        GLOO_SOCKET_IFNAME="eth0")  # fmt: skip

        first = start(0, None)
        maddr = first.recv("dht")["maddr"]
        procs = [first] + [start(r, maddr) for r in range(1, num_peers)]
        for p in procs:
            p.recv("ready")
        extra = {"rate": rate, "testbed": "netns+tbf"}
        # paced rows: every peer states its uplink (the shaped rate) as its bandwidth
        uplink_rate = tb.rate_bps / 8 if pace else None
        rows = run_configs(procs, num_peers, [numel], codecs, rounds, gloo_reps, extra, uplink_rate)
        if uplinks:
            measure_uplinks(procs, tb.rate_bps, numel, codecs, extra, uplink_rate)
        for p in procs:
            p.send({"cmd": "exit"})
        for p in procs:
            p.p.wait(timeout=60)
    return rows


def summarize(rows: list[dict]) -> dict:
    gloo = next(r for r in rows if r["kind"] == "gloo")
    out: dict = {"kind": "wan_summary", "rate": gloo["rate"], "peers": gloo["peers"],
                 "numel": gloo["numel"], "gloo_s": round(gloo["seconds"], 4)}  # fmt: skip
    for r in rows:
        if r["kind"] == "averaging":
            name = f"{r['codec']}_paced" if r.get("paced") else r["codec"]
            out[f"{name}_s"] = r["allreduce_s"]
            out[f"{name}_vs_gloo"] = r["allreduce_vs_gloo"]
            out[f"{name}_ok"] = r["all_ok"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rates", nargs="*", default=["100mbit", "1gbit"])
    parser.add_argument("--numel", type=int, default=4 << 20)
    parser.add_argument("--codecs", nargs="*", choices=CODECS, default=list(CODECS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gloo-reps", type=int, default=3)
    parser.add_argument(
        "--uplinks", action="store_true", help="also sample every uplink during one more round"
    )
    parser.add_argument(
        "--no-pace",
        action="store_true",
        help="skip the paced rows (each peer's bandwidth set to the link rate)",
    )
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(json.dumps({"kind": "skipped", "reason": reason}), flush=True)
        return 0
    for rate in args.rates:
        rows = run_rate(
            args.peers,
            rate,
            args.numel,
            args.codecs,
            args.rounds,
            args.gloo_reps,
            args.uplinks,
            pace=not args.no_pace,
        )
        print(json.dumps(summarize(rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
