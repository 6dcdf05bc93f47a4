"""Chaos: `moshpit train` volunteers killed, preempted and paused at random; does the swarm's
epoch keep moving, and does every peer keep up?

``--peers`` (6) volunteers run ``moshpit train --json --mode MODE`` on loopback, each with its
own key file and checkpoint directory. Every ``--every`` seconds (on average, exponential) one
random live peer gets one of: SIGTERM (it leaves cleanly and is restarted with the same key and
directory after ``--down`` s), SIGKILL (likewise, without a goodbye), SIGSTOP for ``--pause`` s
then SIGCONT (a VM frozen by its host, a laptop lid). The same ``--seed`` plays the same events.

What it reports, one JSON object per line: an ``event`` line per fault, then a ``summary``:
the swarm's epoch (the highest epoch any two live peers reported) over time, the longest time
it did not move while at least two peers were live (``longest_stall_s``), each peer's epoch at
the end and its distance to the swarm's, and ``stalled``: true when the swarm's epoch did not
move for ``--stall-after`` seconds. Exit status 1 when it stalled or a live peer ended more than
``--max-behind`` epochs behind.

    python benchmarks/chaos_volunteers.py --seconds 180 --seed 3
    python benchmarks/chaos_volunteers.py --mode diloco --target-batch-size 4096
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("SIGTERM", "SIGKILL", "SIGSTOP")


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Volunteer:
    """One `moshpit train` peer and what it reported; restarted in place after a fault."""

    def __init__(self, index: int, workdir: Path, args: argparse.Namespace) -> None:
        self.index = index
        self.workdir = workdir
        self.args = args
        self.proc: subprocess.Popen | None = None
        self.epoch = -1
        self.epoch_at = 0.0  # monotonic time of its last progress report
        self.addr: str | None = None
        self.paused_until = 0.0
        self.down_until = 0.0
        self.exits: list[int] = []
        self.lock = threading.Lock()

    def start(self, bootstrap: str | None) -> None:
        args = self.args
        cmd = [
            sys.executable, "-m", "moshpit", *(["-v"] if args.verbose else []), "train", "--json",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--identity", str(self.workdir / f"peer{self.index}.key"),
            "--checkpoint-dir", str(self.workdir / f"peer{self.index}"),
            "--mode", args.mode, "--report-every", "0.5", "--seed", str(self.index),
            "--max-rate", str(args.max_rate), "--group-size", str(args.peers),
            "--checkpoint-every", "5",
        ]  # fmt: skip
        if args.target_batch_size:
            cmd += ["--target-batch-size", str(args.target_batch_size)]
        if bootstrap:
            cmd += ["--initial-peers", bootstrap]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        stderr: Any = subprocess.DEVNULL
        if args.log_dir:  # one file per peer, appended across its restarts
            stderr = open(Path(args.log_dir) / f"peer{self.index}.log", "a")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        if args.log_dir:
            stderr.close()  # the child holds its own copy
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.lock:
                if row.get("event") == "joined":
                    self.addr = row["addr"]
                if "epoch" in row and isinstance(row["epoch"], int):
                    self.epoch = row["epoch"]
                    self.epoch_at = time.monotonic()
        code = proc.wait()
        with self.lock:
            self.exits.append(code)

    @property
    def live(self) -> bool:
        """Running and not paused (a paused peer is alive but reports nothing)."""
        return (
            self.proc is not None
            and self.proc.poll() is None
            and time.monotonic() >= self.paused_until
        )


def swarm_epoch(peers: list[Volunteer]) -> int:
    """The highest epoch at least two live peers reported (the progress tracker's rule)."""
    epochs = sorted((p.epoch for p in peers if p.live and p.epoch >= 0), reverse=True)
    return epochs[1] if len(epochs) >= 2 else (epochs[0] if epochs else -1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("sync", "local", "diloco"), default="sync")
    parser.add_argument("--target-batch-size", type=int, default=0, help="0: the CLI's default")
    parser.add_argument("--max-rate", type=float, default=800.0)
    parser.add_argument("--every", type=float, default=8.0, help="mean s between faults")
    parser.add_argument("--down", type=float, default=4.0, help="s before a restart")
    parser.add_argument("--pause", type=float, default=20.0, help="s a SIGSTOP lasts")
    parser.add_argument("--warmup", type=float, default=20.0, help="s before the first fault")
    parser.add_argument(
        "--settle", type=float, default=20.0,
        help="s at the end without faults: every live peer must catch up by then",
    )  # fmt: skip
    parser.add_argument("--stall-after", type=float, default=45.0)
    parser.add_argument("--max-behind", type=int, default=2)
    parser.add_argument("--log-dir", help="keep each peer's log (stderr) here")
    parser.add_argument("--verbose", action="store_true", help="peers log at INFO")
    args = parser.parse_args()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)

    rng = random.Random(args.seed)
    workdir = Path(tempfile.mkdtemp(prefix="moshpit-chaos-"))
    peers = [Volunteer(i, workdir, args) for i in range(args.peers)]
    peers[0].start(None)
    deadline = time.monotonic() + 120
    while peers[0].addr is None and time.monotonic() < deadline:
        time.sleep(0.1)
    bootstrap = peers[0].addr
    for peer in peers[1:]:
        peer.start(bootstrap)
    started = time.monotonic()
    next_fault = started + args.warmup
    history: list[tuple[float, int]] = []
    last_move, last_epoch, longest_stall = started, -1, 0.0
    try:
        while time.monotonic() - started < args.seconds:
            now = time.monotonic()
            for peer in peers:  # restarts and resumes that are due
                if peer.proc is not None and peer.proc.poll() is not None:
                    if now >= peer.down_until:
                        peer.start(bootstrap)
                        _emit(
                            {"event": "restart", "peer": peer.index, "t": round(now - started, 1)}
                        )
                elif peer.paused_until and now >= peer.paused_until:
                    assert peer.proc is not None
                    peer.proc.send_signal(signal.SIGCONT)
                    peer.paused_until = 0.0
                    _emit({"event": "SIGCONT", "peer": peer.index, "t": round(now - started, 1)})
            if now >= next_fault and now - started < args.seconds - args.settle:
                candidates = [p for p in peers if p.live and p.index != 0]  # 0: the bootstrap
                if candidates:
                    victim = rng.choice(candidates)
                    fault = rng.choice(FAULTS)
                    assert victim.proc is not None
                    victim.proc.send_signal(getattr(signal, fault))
                    if fault == "SIGSTOP":
                        victim.paused_until = now + args.pause
                    else:
                        victim.down_until = now + args.down
                    _emit(
                        {"event": fault, "peer": victim.index, "t": round(now - started, 1),
                         "epoch": victim.epoch}
                    )  # fmt: skip
                next_fault = now + rng.expovariate(1 / args.every)
            epoch = swarm_epoch(peers)
            if epoch != last_epoch:
                history.append((round(now - started, 1), epoch))
                last_epoch, last_move = epoch, now
            elif sum(p.live for p in peers) >= 2:
                longest_stall = max(longest_stall, now - last_move)
            time.sleep(0.2)
    finally:
        final = {p.index: p.epoch for p in peers}
        live = {p.index for p in peers if p.live}
        peer_lines = {
            p.index: {
                "epoch": p.epoch,
                "live": p.index in live,
                "report_age_s": round(time.monotonic() - p.epoch_at, 1) if p.epoch_at else None,
                "exits": list(p.exits),
            }
            for p in peers
        }
        for peer in peers:
            if peer.proc is not None and peer.proc.poll() is None:
                if peer.paused_until:
                    peer.proc.send_signal(signal.SIGCONT)
                peer.proc.kill()
                peer.proc.wait()
    top = max((final[i] for i in live), default=-1)
    behind = {i: top - final[i] for i in live}
    stalled = longest_stall >= args.stall_after
    summary = {
        "summary": "chaos",
        "mode": args.mode,
        "seed": args.seed,
        "seconds": args.seconds,
        "epochs_reached": last_epoch,
        "longest_stall_s": round(longest_stall, 1),
        "stalled": stalled,
        "behind": behind,
        "peers": peer_lines,
        "epoch_history": history[-40:],
    }
    _emit(summary)
    return 1 if stalled or any(b > args.max_behind for b in behind.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
