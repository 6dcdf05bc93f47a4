"""samples/s as `moshpit status` reads it, against each peer's own counter (real processes).

Three `moshpit train --json` peers on loopback: two uncapped (as fast as a core allows, tens of
thousands of samples/s) and one capped at 800 samples/s. Each prints its cumulative sample count
every 0.5 s; `moshpit status --json` reads the rates they published. The published rate must
agree with the peer's own count over the seconds before the read: the same number drives
`sync`'s target-batch projection, the dashboard and the contribution board.
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from moshpit.training.progress import RATE_WINDOW

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
READS = 3
WINDOW = RATE_WINDOW  # the published rate weighs each interval by exp(-age / WINDOW)
TOLERANCE = 0.2  # the peers' pace moves with whatever else the machine runs; a rate averaged
# over the last few steps was off by 2-3x on most reads


class TrainPeer:
    """A `moshpit train --json` process whose progress events are kept with their times."""

    def __init__(self, tmp: Path, name: str, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moshpit", "train", "--json", "--run-id", "rates",
             "--checkpoint-dir", str(tmp / name), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
             "--report-every", "0.5", "--duration", "120", *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.counts: list[tuple[float, int]] = []  # (wall-clock time seen, samples)
        self.peer_id = ""
        self.addr = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            event = json.loads(line)
            if event.get("event") == "joined":
                self.peer_id, self.addr = event["peer"], event["addr"]
            if event.get("event") == "progress":
                self.counts.append((time.time(), event["samples"]))
            self.events.put(event)

    def wait_joined(self) -> None:
        deadline = time.monotonic() + 120
        while not self.addr:
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the peer never joined"
            time.sleep(0.1)

    def wait_counting(self, seconds: float) -> None:
        """Until its own count spans ``seconds``: a joined peer may still be loading the swarm's
        state (CI saw its first step arrive after the reads began), and a rate it published before its steps began to
        fill the window averages fewer seconds than the comparison does."""
        deadline = time.monotonic() + 120
        while not self.counts or self.counts[0][0] > time.time() - seconds:
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, f"no steps for {seconds} s: {self.counts}"
            time.sleep(0.1)

    def own_rate(self, before: float) -> float:
        """samples/s by its own count up to ``before``, weighted as the published rate is: each
        interval by exp(-age / WINDOW). A plain 5 s average differs from it by a third when the
        machine's load changes mid-window (another test starting beside this one)."""
        inside = [(t, n) for t, n in self.counts if t <= before]
        assert inside[0][0] < before - 3 * WINDOW, self.counts[:3]  # weights past 3 windows < 5%
        samples = seconds = 0.0
        for (t0, n0), (t1, n1) in itertools.pairwise(inside):
            weight = math.exp(-(before - t1) / WINDOW)
            samples += weight * (n1 - n0)
            seconds += weight * (t1 - t0)
        return samples / seconds

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def status_rates(addr: str) -> dict[str, tuple[float, float]]:
    """Each peer's published samples/s, and the wall-clock time it was published."""
    done = subprocess.run(
        [sys.executable, "-m", "moshpit", "status", "--initial-peers", addr, "--run-id",
         "rates", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    read_at = time.time()  # the read is the command's last step: close enough for 5 s windows
    report = json.loads(done.stdout)
    return {
        p["peer_id"]: (p["samples_per_second"], read_at - p["age_seconds"]) for p in report["peers"]
    }


def test_published_samples_per_second_matches_each_peers_own_count(tmp_path: Path) -> None:
    first = TrainPeer(tmp_path, "a")
    peers = [first]
    try:
        first.wait_joined()
        peers.append(TrainPeer(tmp_path, "b", "--initial-peers", first.addr))
        peers.append(TrainPeer(tmp_path, "c", "--initial-peers", first.addr, "--max-rate", "800"))
        for peer in peers:
            peer.wait_joined()
        for peer in peers:
            peer.wait_counting(3 * WINDOW)  # the published rates weigh ~5 s of steps most
        checked = []
        reads = 0
        for _ in range(3 * READS):  # a read on a loaded machine may miss a record: read again
            rates = status_rates(first.addr)
            if len(rates) < len(peers):
                continue
            reads += 1
            for peer in peers:
                published, at = rates[peer.peer_id]
                own = peer.own_rate(at)
                checked.append((peer.peer_id[-6:], round(published), round(own)))
                assert abs(published / own - 1) < TOLERANCE, checked
            if reads == READS:
                break
        assert reads == READS, f"only {reads} reads listed all {len(peers)} peers: {rates}"
        capped = [own for name, _, own in checked if name == peers[2].peer_id[-6:]]
        uncapped = [own for name, _, own in checked if name != peers[2].peer_id[-6:]]
        # the rates really differ: the cap holds, and the others train well past it (idle:
        # thousands a second; beside two busy processes 1,287-1,652, so not a fixed 2,000)
        assert max(capped) < 900 and min(uncapped) > 1.3 * max(capped), checked
    finally:
        for peer in peers:
            peer.stop()
