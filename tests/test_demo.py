"""`moshpit demo` end to end: a small swarm of real peer processes converges (and survives --kill)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moshpit", "demo", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_demo_converges_exactly_on_a_full_grid():
    # 4 peers, groups of 2: a 2x2 grid, exact after 2 rounds
    proc = run_demo("--peers", "4", "--rounds", "2", "--size", "2000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: CONVERGED" in proc.stdout
    assert "4/4 peers alive" in proc.stdout


def test_demo_survives_a_killed_peer():
    proc = run_demo("--peers", "4", "--rounds", "4", "--size", "500", "--kill")
    assert "killed peer 3" in proc.stdout, proc.stdout + proc.stderr
    assert "3/4 peers alive" in proc.stdout
    assert "verdict:" in proc.stdout  # a verdict line, whatever the luck of the grid
