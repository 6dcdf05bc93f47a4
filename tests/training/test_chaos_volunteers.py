"""Chaos in CI: `moshpit train` volunteers SIGKILLed, SIGTERMed and SIGSTOPped at random
(`benchmarks/chaos_volunteers.py`, real processes on loopback); the swarm's epoch must keep
moving and every live peer must have caught up by the end of a quiet spell.

This is the run that once stalled for good (three peers at epoch 278 waiting for three at 277
that waited for a donor of 278, `moshpit status` saying healthy): what it checks is liveness,
not speed, so its numbers are generous and its seed fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.timing import patience

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _log_tails(log_dir: Path, peers: list[str], lines: int = 60) -> str:
    """The end of each named peer's log: what it was doing when the run ended."""
    tails = []
    for peer in peers:
        path = log_dir / f"peer{peer}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        tails.append(f"--- peer {peer} ({len(text)} log lines) ---\n" + "\n".join(text[-lines:]))
    return "\n".join(tails)


def test_a_swarm_under_random_kills_and_pauses_keeps_moving_and_every_peer_catches_up(
    tmp_path: Path,
) -> None:
    log_dir = tmp_path / "logs"
    # 55 s of chaos, then a quiet spell for the restarted peers to start (torch's import
    # alone took 10+ s beside two busy processes) and catch up: it stretches with the load
    settle = patience(25.0)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "chaos_volunteers.py"), "--peers", "4",
         "--seconds", f"{55.0 + settle:.1f}", "--seed", "3", "--target-batch-size", "2048",
         "--every", "10", "--pause", "12", "--settle", f"{settle:.1f}", "--stall-after", "45",
         "--max-behind", "2", "--log-dir", str(log_dir), "--verbose"],
        cwd=ROOT, capture_output=True, text=True, timeout=400 + 8 * 25,
    )  # fmt: skip
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    faults = [e["event"] for e in lines if e.get("event") in ("SIGTERM", "SIGKILL", "SIGSTOP")]
    summary = next((e for e in lines if e.get("summary") == "chaos"), None)
    assert summary is not None, done.stdout[-2000:] + done.stderr[-3000:]
    assert len(faults) >= 3 and "SIGSTOP" in faults, faults  # the chaos really happened
    assert not summary["stalled"], summary
    live = {p: s for p, s in summary["peers"].items() if s["live"]}
    assert len(live) == 4, summary["peers"]  # every killed peer was restarted and rejoined
    behind = [p for p in live if summary["behind"][p] > 2]
    # a failure says where each late peer stood (its log, at INFO), not just how far behind
    assert not behind, f"{summary}\n{_log_tails(log_dir, behind)}"
    assert summary["epochs_reached"] >= 10, summary  # epochs moved through the faults
    assert done.returncode == 0, done.stderr[-3000:]
