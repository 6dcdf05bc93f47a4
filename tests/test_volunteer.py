"""The volunteer program (`moshpit train`) with real processes:
it joins, trains, averages, checkpoints, leaves with exit 0 on SIGTERM and resumes as the same
peer from its checkpoint when restarted."""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.timing import stretch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
TIMEOUT = 120.0


class Volunteer:
    """A volunteer process whose JSON lines are collected on a thread."""

    def __init__(self, cmd: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=cwd,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                self.events.put(json.loads(line))
            except json.JSONDecodeError:
                self.events.put({"event": "text", "line": line})

    def _read_err(self) -> None:
        for line in self.proc.stderr:  # type: ignore[union-attr]
            self.stderr.append(line)

    def wait_for(self, predicate: Any, timeout: float = TIMEOUT) -> dict[str, Any]:
        while True:
            try:
                event = self.events.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no such event; stderr: {''.join(self.stderr)[-3000:]}"
                ) from None
            if predicate(event):
                return event

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def volunteer(tmp: Path, name: str, *extra: str) -> Volunteer:
    return Volunteer(
        [
            sys.executable,
            "-m",
            "moshpit",
            "train",
            "--json",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--identity",
            str(tmp / f"{name}.key"),
            "--checkpoint-dir",
            str(tmp / name),
            "--max-rate",
            "1000",
            "--report-every",
            "0.3",
            "--seed",
            str(len(name)),
            *extra,
        ],  # fmt: skip
        tmp,
    )


def test_volunteer_joins_trains_checkpoints_leaves_on_sigterm_and_resumes(tmp_path: Path):
    first = volunteer(tmp_path, "a")
    peers: list[Volunteer] = [first]
    try:
        addr = first.wait_for(lambda e: e["event"] == "joined")["addr"]
        # a stated uplink: its averaging rounds pace their connections (SO_MAX_PACING_RATE)
        second = volunteer(tmp_path, "bb", "--initial-peers", addr, "--uplink-mbit", "200")
        peers.append(second)
        joined = second.wait_for(lambda e: e["event"] == "joined")
        # it trains (samples go up, loss goes down) and averages with the first peer
        # (epoch = completed averaging rounds; peers = the progress tracker's view of the run)
        progress = second.wait_for(
            lambda e: e["event"] == "progress" and e["epoch"] >= 2 and e["peers"] == 2
        )
        assert progress["samples"] > 0 and progress["accuracy"] > 0.2
        # the preemption notice: it leaves cleanly and exits 0
        second.proc.send_signal(signal.SIGTERM)
        left = second.wait_for(lambda e: e["event"] == "preempted")
        assert second.proc.wait(timeout=60) == 0, "".join(second.stderr)
        assert left["epoch"] >= 2
        assert any((tmp_path / "bb").iterdir()), "no checkpoint was written"
        # restarted with the same identity and checkpoint dir (as `moshpit train`): same
        # PeerID, resumes from the checkpoint it wrote on its way out
        again = volunteer(tmp_path, "bb", "--initial-peers", addr)
        peers.append(again)
        assert again.wait_for(lambda e: e["event"] == "joined")["peer"] == joined["peer"]
        started = again.wait_for(lambda e: e["event"] == "started")
        assert started["restored_epoch"] == left["epoch"]
        resumed = again.wait_for(lambda e: e["event"] == "progress")
        assert resumed["epoch"] >= left["epoch"]
        for peer in (first, again):
            peer.proc.send_signal(signal.SIGTERM)
        for peer in (first, again):
            assert peer.proc.wait(timeout=60) == 0, "".join(peer.stderr)
    finally:
        for peer in peers:
            peer.kill()


def test_uncapped_volunteers_with_slow_rounds_never_go_nan(tmp_path: Path):
    """The README's volunteers, uncapped, with slow rounds (a stated 5 Mbit/s uplink), the
    second joining after the first trained alone: the first used to go NaN at its first
    round (Adam's second moments decayed below the round's correction), then serve NaN."""
    uncapped = ("--max-rate", "0", "--uplink-mbit", "5", "--report-every", "0.5")
    # the durations stretch with the machine's load: at load 12 on 2 cores the second peer's
    # 22 s went by in joining and loading, and neither peer ever averaged
    slow = stretch()
    first = volunteer(tmp_path, "a", *uncapped, "--duration", str(35 * slow))
    peers = [first]
    try:
        addr = first.wait_for(lambda e: e["event"] == "joined")["addr"]
        first.wait_for(lambda e: e["event"] == "progress" and e["elapsed"] > 8 * slow)
        second = volunteer(
            tmp_path, "bb", "--initial-peers", addr, *uncapped, "--duration", str(22 * slow)
        )
        peers.append(second)
        finals = []
        for peer in peers:
            assert peer.proc.wait(timeout=120 * slow) == 0, "".join(peer.stderr)[-3000:]
            rows = []
            while not peer.events.empty():
                rows.append(peer.events.get())
            progress = [r for r in rows if r.get("event") == "progress"]
            assert progress and all(math.isfinite(r["loss"]) for r in progress), progress[-3:]
            finals.append(next(r for r in rows if r.get("event") == "final"))
        assert all(f["accuracy"] > 0.8 for f in finals), finals
        assert all(f["epoch"] >= 2 for f in finals), finals  # they did average
        assert not any("non-finite" in line for p in peers for line in p.stderr)
    finally:
        for peer in peers:
            peer.kill()


def test_volunteer_stops_after_max_steps_with_a_final_report(tmp_path: Path):
    proc = volunteer(tmp_path, "c", "--max-steps", "40")
    try:
        final = proc.wait_for(lambda e: e["event"] == "final")
        assert proc.proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert final["steps"] == 40 and final["samples"] == 40 * 32
    assert any((tmp_path / "c").iterdir()), "no checkpoint was written at the end"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--uplink-mbit", "nan"], "--uplink-mbit must be a number of Mbit/s >= 0"),
        (["--uplink-mbit", "-100"], "--uplink-mbit must be a number of Mbit/s >= 0"),
        (["--name", "x" * 33], "--name: name must be 1..32 characters, got 33"),
        (
            ["--name", "ada\nlovelace"],
            "--name: name must be printable characters without leading/trailing spaces, "
            "got 'ada\\nlovelace'",
        ),
    ],
)
def test_volunteer_rejects_bad_arguments_in_one_line(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "moshpit", "train", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"moshpit train: {message}"


def test_volunteer_with_a_malformed_address_says_so_in_one_line(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "moshpit", "train", "--initial-peers", "not-an-address"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("moshpit train: bad address:")
    assert "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())  # the typo was reported before anything was created
