"""`moshpit status` against a live local swarm of real processes (TCP on loopback).

Three peer processes (tests/training/status_swarm_peer.py) run a ``moshpit.DHT`` each with
ProgressTrackers; the third also announces a donor record under ``run.state``. The CLI runs as
its own process, joins as a DHT client and reads what they published.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moshpit.cli.status_cmd import Donor, Snapshot, health_verdict
from moshpit.training.progress import PeerProgress, aggregate

PEER_SCRIPT = Path(__file__).with_name("status_swarm_peer.py")
REPO = Path(__file__).resolve().parents[2]


class PeerProcess:
    def __init__(self, specs: list[str], initial_peers: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), *specs, "--", *initial_peers],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until ready (or EOF if it crashed)
        assert line.startswith("MADDRS "), f"peer failed to start: {line!r}"
        self.maddrs = line.split()[1:]
        self.peer_id = self.maddrs[0].rsplit("/p2p/", 1)[1]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def swarm():
    first = PeerProcess(["run:12", "lonely:3", "frozen:7:7:frozen", "sick:5:5", "ahead:4"], [])
    peers = [first]
    try:
        peers.append(PeerProcess(["run:12", "lonely:3", "sick:5:nan", "ahead:4"], first.maddrs))
        peers.append(PeerProcess(["run:12:12", "lonely:3:1", "ahead:5:5"], first.maddrs))
        yield peers
    finally:
        for peer in peers:
            peer.stop()


def status(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moshpit", "status", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status_json(peers, prefix: str, *extra: str) -> tuple[int, dict]:
    done = status("--initial-peers", peers[1].maddrs[0], "--prefix", prefix, "--json", *extra)
    assert done.stdout.count("\n") == 1, done.stdout + done.stderr
    return done.returncode, json.loads(done.stdout)


def wait_for_status(peers, prefix: str, predicate, *extra: str) -> tuple[int, dict]:
    """Poll until the swarm's records show up (the peers publish in the background)."""
    for _ in range(40):
        code, report = status_json(peers, prefix, *extra)
        if predicate(report):
            return code, report
        time.sleep(0.5)
    raise AssertionError(f"status never matched: {report}")


def test_status_json_shows_peers_epochs_donors_and_a_healthy_verdict(swarm):
    code, report = wait_for_status(
        swarm,
        "run",
        lambda r: r["num_peers"] == 3 and all(p["samples_per_second"] > 0 for p in r["peers"]),
    )
    assert code == 0 and report["healthy"] is True
    assert report["verdict"] == "healthy: 3 peers at epoch 12, median loss 0.5, 1 donors serve epoch 12"
    assert report["epoch"] == 12 and report["prefix"] == "run"
    assert {p["peer_id"] for p in report["peers"]} == {peer.peer_id for peer in swarm}
    donor_flags = {p["peer_id"]: (p["donor"], p["donor_epoch"]) for p in report["peers"]}
    assert donor_flags[swarm[2].peer_id] == (True, 12)
    assert donor_flags[swarm[0].peer_id] == (False, None)
    [donor] = report["donors"]
    assert donor["peer_id"] == swarm[2].peer_id and donor["epoch"] == 12 and donor["complete"]
    assert donor["bytes"] == 12345 and len(donor["root"]) == 64
    assert report["samples_accumulated"] > 0 and report["ignored"] == {}
    assert all(p["epoch"] == 12 and p["age_seconds"] >= 0 for p in report["peers"])


def test_status_table_ends_with_the_verdict_line(swarm):
    wait_for_status(swarm, "run", lambda r: r["num_peers"] == 3)
    done = status("--initial-peers", *swarm[0].maddrs, "--run-id", "run")  # --prefix's new name
    assert done.returncode == 0, done.stderr
    lines = done.stdout.rstrip("\n").splitlines()
    assert lines[-1] == "healthy: 3 peers at epoch 12, median loss 0.5, 1 donors serve epoch 12"
    assert "global epoch 12" in done.stdout
    for peer in swarm:
        assert peer.peer_id[-6:] in done.stdout
    assert "yes (12)" in done.stdout  # the donor column


def test_status_without_a_donor_for_the_current_epoch_is_unhealthy(swarm):
    code, report = wait_for_status(swarm, "lonely", lambda r: r["num_peers"] == 3)
    assert code == 1 and report["healthy"] is False
    assert report["verdict"] == (
        "unhealthy: no donor serves epoch 3 (or 2): joiners cannot load the current state "
        "(newest donor epoch: 1)"
    )


def test_status_counts_a_donor_one_epoch_ahead(swarm):
    """Peers at 4 and 5 (global epoch 4), the only donor at 5: joiners load epoch 5, which is
    fine (the verdict used to flap to 'no donor serves the current epoch' here)."""
    for _ in range(3):
        code, report = wait_for_status(swarm, "ahead", lambda r: r["num_peers"] == 3)
        assert code == 0, report["verdict"]
        assert report["verdict"].startswith("healthy: 2 peers at epoch 4, 1 ahead")


def test_status_names_a_peer_whose_loss_is_nan_and_exits_1(swarm):
    code, report = wait_for_status(
        swarm, "sick", lambda r: r["num_peers"] == 2 and not all(p["finite"] for p in r["peers"])
    )
    assert code == 1 and report["healthy"] is False
    sick = [p for p in report["peers"] if not p["finite"]]
    assert [p["peer_id"] for p in sick] == [swarm[1].peer_id]
    assert report["verdict"] == (
        f"unhealthy: 1 unhealthy peer(s): {swarm[1].peer_id[-6:]} (its loss or state is NaN/Inf)"
    )
    well = [p for p in report["peers"] if p["finite"]]
    assert well[0]["loss"] == 0.5 and well[0]["problem"] is None
    table = status("--initial-peers", swarm[0].maddrs[0], "--prefix", "sick")
    assert table.returncode == 1
    assert "its loss or state is NaN/Inf" in table.stdout


def test_status_of_a_stalled_run(swarm):
    code, report = wait_for_status(
        swarm, "frozen", lambda r: r["verdict"].startswith("stalled"), "--stall-after", "1"
    )
    assert code == 1 and report["num_peers"] == 1 and report["epoch"] == 7
    assert report["peers"][0]["age_seconds"] > 1


def test_status_of_an_unknown_prefix(swarm):
    code, report = status_json(swarm, "nobody")
    assert code == 1 and report["num_peers"] == 0
    assert report["verdict"].startswith(
        "no peers report progress under run id 'nobody': check the run id"
    )


def test_status_does_not_import_torch(swarm):
    code = (
        "import sys; from moshpit.cli import main; "
        f"rc = main(['status', '--initial-peers', {swarm[0].maddrs[0]!r}, '--prefix', 'run', "
        "'--json']); print('torch' in sys.modules, rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines()[-1].split()[0] == "False", done.stdout + done.stderr


@pytest.mark.parametrize(
    "address", ["/ip4/nope/tcp/1", "not-an-address", "/ip4/127.0.0.1/tcp/99999"]
)
def test_bad_address_exits_2_with_one_line(address):
    done = status("--initial-peers", address, "--prefix", "run")
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "--initial-peers" in done.stderr


def test_unreachable_peer_exits_1_with_one_line(swarm):
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{swarm[0].peer_id}"  # nothing listens on the discard port
    done = status("--initial-peers", dead, "--prefix", "run", "--timeout", "2")
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("moshpit status: ")


# ---------------------------------------------------------------------------- verdict rule


def snapshot(peers, donors=(), now=100.0):
    return Snapshot("p", now, aggregate(peers, now=now), list(donors))


def test_verdicts():
    fresh = [PeerProgress(n, 4, 10, 1.0, 95.0) for n in "ab"]
    serving = Donor("c", 4, 1, True, "00" * 32)
    healthy, verdict = health_verdict(snapshot([]), 60)
    assert not healthy and verdict.startswith("no peers report progress under run id 'p': ")
    assert "run ids are matched whole, not as a prefix" in verdict
    healthy, line = health_verdict(snapshot(fresh, [serving]), 60)
    assert healthy and line == "healthy: 2 peers at epoch 4, 1 donors serve epoch 4"
    healthy, line = health_verdict(snapshot(fresh, [serving], now=200.0), 60)
    assert not healthy and line.startswith("stalled: no progress for 105 s")
    partial = Donor("c", 4, 1, False, "00" * 32)
    healthy, line = health_verdict(snapshot(fresh, [partial]), 60)
    assert not healthy and line.endswith("cannot load the current state (no donors at all)")
    mixed = [*fresh, PeerProgress("y", 2, 0, 1.0, 99.0), PeerProgress("z", 9, 0, 1.0, 99.0)]
    assert health_verdict(snapshot(mixed, [serving]), 60)[1] == (
        "healthy: 2 peers at epoch 4, 1 behind, 1 ahead, 1 donors serve epoch 4"
    )
    # donors one behind (just stepped, checkpoint on its way) and one ahead both count
    trailing = Donor("d", 3, 1, True, "00" * 32)
    leading = Donor("e", 5, 1, True, "00" * 32)
    assert health_verdict(snapshot(fresh, [trailing, leading]), 60) == (
        True,
        "healthy: 2 peers at epoch 4, 2 donors serve epoch 3-5",
    )
    assert not health_verdict(snapshot(fresh, [Donor("f", 2, 1, True, "00" * 32)]), 60)[0]
    # health fields: a NaN state or failing checkpoints make the run unhealthy, a loss shows
    sick = [
        PeerProgress("a", 4, 10, 1.0, 95.0, 0.25),
        PeerProgress("b", 4, 10, 1.0, 95.0, None, False),
    ]
    assert health_verdict(snapshot(sick, [serving]), 60) == (
        False,
        "unhealthy: 1 unhealthy peer(s): b (its loss or state is NaN/Inf)",
    )
    full = [
        PeerProgress("a", 4, 10, 1.0, 95.0, 0.25),
        PeerProgress("b", 4, 10, 1.0, 95.0, 0.5, True, 3),
    ]
    assert health_verdict(snapshot(full, [serving]), 60)[1] == (
        "unhealthy: 1 unhealthy peer(s): b (its last 3 checkpoint(s) failed)"
    )
    well = [PeerProgress("a", 4, 10, 1.0, 95.0, 0.25), PeerProgress("b", 4, 10, 1.0, 95.0, 0.5)]
    assert health_verdict(snapshot(well, [serving]), 60)[1] == (
        "healthy: 2 peers at epoch 4, median loss 0.5, 1 donors serve epoch 4"
    )


def test_peers_that_keep_stepping_while_their_epoch_stands_still_are_stalled():
    """A chaos run once sat for 90 s: three peers at epoch 278 stepping every ~3 s, three at
    277 stepping 10 times a second, all reporting, and status said "healthy". Epochs had
    taken ~4 s; one that lasts 5x the usual (and at least --stall-after) is a stall."""
    serving = Donor("c", 278, 1, True, "00" * 32)

    def peer(name: str, epoch: int, since: float, per_epoch: float | None = 4.0):
        return PeerProgress(name, epoch, 100, 30.0, 199.0, epoch_since=since,
                            epoch_seconds=per_epoch)  # fmt: skip

    stuck = [peer(n, 278, 110.0) for n in "abc"] + [peer(n, 277, 105.0) for n in "def"]
    healthy, line = health_verdict(snapshot(stuck, [serving], now=200.0), 60)
    assert not healthy and line.startswith("stalled: epoch 278 began 90 s ago and epochs took "
                                           "4.0 s before, while 6 peers keep reporting")  # fmt: skip
    moving = [peer(n, 278, 190.0) for n in "abc"] + [peer(n, 277, 186.0) for n in "def"]
    assert health_verdict(snapshot(moving, [serving], now=200.0), 60)[0]
    # slow epochs are not a stall: 90 s into an epoch when epochs take 60 s
    slow = [peer(n, 278, 110.0, 60.0) for n in "abcdef"]
    assert health_verdict(snapshot(slow, [serving], now=200.0), 60)[0]
    # one peer claiming an ancient epoch start cannot make the swarm look stalled
    liar = [peer(n, 278, 190.0) for n in "abc"] + [peer("x", 278, -1e9, 0.001)]
    assert health_verdict(snapshot(liar, [serving], now=200.0), 60)[0]
    # older peers that publish no timing: no verdict from timing
    quiet = [PeerProgress(n, 278, 100, 30.0, 199.0) for n in "abc"]
    assert health_verdict(snapshot(quiet, [serving], now=200.0), 60)[0]
