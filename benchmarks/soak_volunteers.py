"""Soak: uncapped README volunteers on a loaded machine, one joining after the first trained
alone; does any peer's loss ever go NaN, does any peer fail?

Each peer is ``moshpit train --json`` (no ``--max-rate``: as fast as it can), on loopback; the
first trains alone for ``--alone`` seconds before the others join, one every few seconds.
``--load N`` starts N busy-looping processes beside them (a loaded machine: slow rounds, the
condition under which Adam's second moments used to go negative). Prints one JSON object per
peer and one summary object; exit status 1 if any peer saw a NaN loss or exited non-zero.

    python benchmarks/soak_volunteers.py --peers 2 --minutes 10 --load 1
    python benchmarks/soak_volunteers.py --peers 4 --minutes 10 --load 1 --uplink-mbit 5
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


class Peer:
    def __init__(self, name: str, workdir: Path, extra: list[str]) -> None:
        self.name = name
        cmd = [
            sys.executable, "-m", "moshpit", "train", "--json",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--identity", str(workdir / f"{name}.key"),
            "--checkpoint-dir", str(workdir / name),
            "--report-every", "1", *extra,
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.rows: list[dict] = []
        self.stderr_lines = 0
        self.stderr_tail: list[str] = []
        self.addr: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            self.rows.append(row)
            if row.get("event") == "joined":
                self.addr = row["addr"]
                self.ready.set()

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr_lines += 1
            self.stderr_tail = (self.stderr_tail + [line.rstrip()])[-5:]

    def report(self) -> dict:
        progress = [r for r in self.rows if r.get("event") == "progress"]
        nan = [r for r in progress if not math.isfinite(r["loss"])]
        final = next((r for r in self.rows if r.get("event") in ("final", "preempted")), {})
        return {
            "peer": self.name,
            "exit_code": self.proc.returncode,
            "progress_rows": len(progress),
            "nan_rows": len(nan),
            "epoch": final.get("epoch", progress[-1]["epoch"] if progress else None),
            "samples": final.get("samples"),
            "accuracy": final.get("accuracy", progress[-1]["accuracy"] if progress else None),
            "stderr_lines": self.stderr_lines,
            "stderr_tail": self.stderr_tail if self.proc.returncode else [],
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--alone", type=float, default=20.0, help="s the first peer trains alone")
    parser.add_argument("--load", type=int, default=1, help="busy-looping processes beside")
    parser.add_argument("--uplink-mbit", type=float, default=0.0)
    args = parser.parse_args()
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=burn, args=(stop,)) for _ in range(args.load)]
    for b in burners:
        b.start()
    peers: list[Peer] = []
    started = time.monotonic()
    extra = ["--uplink-mbit", str(args.uplink_mbit)] if args.uplink_mbit else []
    end = started + 60 * args.minutes
    try:
        with tempfile.TemporaryDirectory(prefix="moshpit-soak-") as tmp:
            workdir = Path(tmp)
            first = Peer("p0", workdir, [*extra, "--duration", str(60 * args.minutes)])
            peers.append(first)
            if not first.ready.wait(120):
                raise SystemExit("the first peer did not start")
            time.sleep(args.alone)
            for i in range(1, args.peers):
                left = end - time.monotonic()
                peers.append(
                    Peer(
                        f"p{i}",
                        workdir,
                        [*extra, "--initial-peers", first.addr, "--duration", f"{left:.0f}"],
                    )
                )
                time.sleep(3)
            for peer in peers:
                try:
                    peer.proc.wait(timeout=max(60.0, end - time.monotonic() + 90))
                except subprocess.TimeoutExpired:
                    peer.proc.send_signal(signal.SIGKILL)
                    peer.proc.wait()
            time.sleep(0.5)  # the reader threads take the last lines
    finally:
        stop.set()
        for b in burners:
            b.join()
        for peer in peers:
            if peer.proc.poll() is None:
                peer.proc.kill()
    failed = False
    for peer in peers:
        row = peer.report()
        failed |= bool(row["nan_rows"]) or row["exit_code"] != 0
        print(json.dumps({"bench": "soak_volunteers", **row}), flush=True)
    summary = {
        "bench": "soak_volunteers",
        "summary": True,
        "peers": args.peers,
        "minutes": args.minutes,
        "load_processes": args.load,
        "uplink_mbit": args.uplink_mbit,
        "nan_rows": sum(p.report()["nan_rows"] for p in peers),
        "failed_peers": sum(p.proc.returncode != 0 for p in peers),
        "wall_s": round(time.monotonic() - started, 1),
        "ok": not failed,
    }
    print(json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
