"""Averaging over shaped links: moshpit (none / fp16 / 8-bit / top-k) vs gloo all_reduce.

N peer processes, each in its own network namespace of a :class:`wan_testbed.WanTestbed`
(per-peer link shaped with ``tc tbf`` up and down, e.g. 100 Mbit/s or 1 Gbit/s), run the same
worker as ``bench_averaging.py``: a gloo ``all_reduce`` baseline and ``Averager.step()`` for each
codec over the same links in the same run. One JSON line per result (the rows of
``bench_averaging.py`` plus ``rate``), then one ``{"kind": "wan_summary", ...}`` line per rate
with the ratios the issue's goals are stated in (moshpit all-reduce time / gloo time).

    python benchmarks/bench_wan.py                          # 4 peers, 100mbit and 1gbit, 4M fp32
    python benchmarks/bench_wan.py --rates 100mbit --codecs none uint8 --rounds 2

Needs root (network namespaces); prints one ``{"kind": "skipped", "reason": ...}`` line and
exits 0 where namespaces are not permitted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_averaging import CODECS, Proc, run_configs  # noqa: E402
from wan_testbed import WanTestbed, unavailable_reason  # noqa: E402

GLOO_PORT = 29517  # inside the namespaces only: no clash with anything on the host


def run_rate(
    num_peers: int, rate: str, numel: int, codecs: list[str], rounds: int, gloo_reps: int
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
        rows = run_configs(procs, num_peers, [numel], codecs, rounds, gloo_reps, extra)
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
            out[f"{r['codec']}_s"] = r["allreduce_s"]
            out[f"{r['codec']}_vs_gloo"] = r["allreduce_vs_gloo"]
            out[f"{r['codec']}_ok"] = r["all_ok"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rates", nargs="*", default=["100mbit", "1gbit"])
    parser.add_argument("--numel", type=int, default=4 << 20)
    parser.add_argument("--codecs", nargs="*", choices=CODECS, default=list(CODECS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gloo-reps", type=int, default=3)
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        print(json.dumps({"kind": "skipped", "reason": reason}), flush=True)
        return 0
    for rate in args.rates:
        rows = run_rate(args.peers, rate, args.numel, args.codecs, args.rounds, args.gloo_reps)
        print(json.dumps(summarize(rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
