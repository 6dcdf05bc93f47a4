"""``mode="diloco"`` with 4 real peer processes, one 5x slower: every peer takes every outer
step in one group, so all reach the same outer epochs with the same θ (a race against DDP
found two of four peers at epoch 3 and two at epoch 1 after 160-178 inner steps: groups of
two formed among whoever finished its inner steps first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PEER = Path(__file__).with_name("diloco_peer.py")
REPO = Path(__file__).resolve().parents[2]
EPOCHS = 5


def start(tmp_path: Path, name: str, step_seconds: float, initial: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(PEER), str(tmp_path), name, str(step_seconds), str(EPOCHS), *initial],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_four_peers_take_every_outer_step_together(tmp_path):
    first = start(tmp_path, "p0", 0.02, [])
    procs = [first]
    try:
        line = first.stdout.readline()
        assert line.startswith("MADDR "), line + first.stderr.read()
        addr = line.split()[1]
        # the last one 5x slower: its inner steps end ~1.6 s after the others (longer than
        # min_matchmaking_time, so the others would form a group without it)
        for i, seconds in enumerate((0.02, 0.02, 0.1), start=1):
            procs.append(start(tmp_path, f"p{i}", seconds, [addr]))
        outputs = []
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-3000:]
            outputs.append([json.loads(x) for x in out.splitlines() if x.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    finals = [rows[-1] for rows in outputs]
    assert all(f["final"] and f["epoch"] == EPOCHS for f in finals), finals
    by_epoch: dict[int, set[str]] = {}
    for rows in outputs:
        epochs = [r["epoch"] for r in rows if "theta" in r]
        assert epochs == list(range(1, EPOCHS + 1)), epochs  # every outer step, in order
        for r in rows:
            if "theta" in r:
                by_epoch.setdefault(r["epoch"], set()).add(r["theta"])
                assert r["group"] == 4, rows  # each outer step averaged all four
                assert r["solo"] == 0 and r["loads"] == 0, rows
    # the same θ on every peer after every outer step
    assert all(len(thetas) == 1 for thetas in by_epoch.values()), by_epoch
