"""SIGTERM on real peer processes: leave within the deadline, checkpoint, withdraw, restart.

Peers are ``tests/training/preempt_peer.py`` processes (a tiny model, a TrainingStateAverager
with a checkpoint directory); they meet through a bootstrap DHT in this test process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dht import DHT
from moshpit.training.store import StateStore

pytestmark = pytest.mark.slow

PEER = Path(__file__).with_name("preempt_peer.py")
DEADLINE = 10.0


class Peer:
    """A peer process whose JSON events are collected by a reader thread."""

    def __init__(self, tmp: Path, name: str, bootstrap: str, prefix: str, *extra: str) -> None:
        self.dir = tmp / name
        self.dir.mkdir(exist_ok=True)
        command = [
            sys.executable, str(PEER), "--initial-peers", bootstrap,
            "--identity", str(self.dir / "peer.key"), "--checkpoint-dir", str(self.dir / "ckpt"),
            "--prefix", prefix, "--deadline", str(DEADLINE), *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.events: list[dict] = []
        self.stderr: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            event["t"] = time.monotonic()
            with self._cond:
                self.events.append(event)
                self._cond.notify_all()

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-200]

    def wait_for(self, predicate, timeout: float) -> dict:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                left = end - time.monotonic()
                assert left > 0, f"timed out; stderr tail:\n{''.join(self.stderr[-30:])}"
                self._cond.wait(left)

    def rounds(self, after: float = 0.0) -> list[dict]:
        with self._cond:
            return [e for e in self.events if e["event"] == "round" and e["t"] > after]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def bootstrap():
    dht = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        yield dht
    finally:
        dht.shutdown()


def _state_record(dht: DHT, prefix: str, peer: str):
    found = dht.get(f"{prefix}.state", latest=True)
    if found is None or not isinstance(found.value, dict):
        return None
    entry = found.value.get(f"[owner:{peer}]")
    return None if entry is None else entry.value


def test_sigterm_mid_round_leaves_cleanly_and_restart_continues(bootstrap, tmp_path):
    prefix = "sigterm"
    addr = str(bootstrap.get_visible_maddrs()[0])
    peers = [Peer(tmp_path, f"p{i}", addr, prefix) for i in range(3)]
    victim = peers[0]
    try:
        ready = victim.wait_for(lambda e: e["event"] == "ready", 120)
        for peer in peers:
            peer.wait_for(
                lambda e: e["event"] == "round" and e["succeeded"] and e["epoch"] >= 3, 120
            )
        # the victim serves its checkpoint: its state record is in the DHT
        assert _state_record(bootstrap, prefix, ready["peer"]) is not None
        last = victim.rounds()[-1]
        time.sleep(0.3)  # let it enter the next round (5 tiny local steps, then step())
        killed_at = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        code = victim.proc.wait(DEADLINE + 15)
        left_after = time.monotonic() - killed_at
        assert code == 0, "".join(victim.stderr[-30:])
        assert left_after <= DEADLINE + 5  # process start-up noise aside, within its deadline
        assert "Traceback" not in "".join(victim.stderr)
        # it wrote a checkpoint of the epoch it had reached, and withdrew its announcement
        epoch = max(e["epoch"] for e in victim.rounds())
        assert epoch >= last["epoch"]
        assert StateStore(victim.dir / "ckpt").latest().epoch == epoch
        assert _state_record(bootstrap, prefix, ready["peer"]) is None
        # survivors keep averaging with each other, never stalled by the leaver
        for peer in peers[1:]:
            peer.wait_for(
                lambda e: e["event"] == "round" and e["succeeded"] and e["t"] > killed_at + 1, 60
            )
        for peer in peers[1:]:
            after = peer.rounds(after=killed_at)
            assert after and max(r["seconds"] for r in after) <= 4.0, after
        # restart with the same identity: same PeerID, resumes from its checkpoint, catches up
        again = Peer(tmp_path, "p0", addr, prefix)
        peers.append(again)
        back = again.wait_for(lambda e: e["event"] == "ready", 120)
        assert back["peer"] == ready["peer"]
        assert back["epoch"] == epoch
        first = again.wait_for(lambda e: e["event"] == "round", 120)
        assert first["epoch"] > epoch  # caught up with the survivors, who went on training
    finally:
        for peer in peers:
            peer.stop()


def test_without_the_handler_sigterm_kills_and_the_swarm_goes_on(bootstrap, tmp_path):
    prefix = "sigterm-default"
    addr = str(bootstrap.get_visible_maddrs()[0])
    peers = [Peer(tmp_path, f"q{i}", addr, prefix, "--no-handler") for i in range(3)]
    try:
        for peer in peers:
            peer.wait_for(lambda e: e["event"] == "round" and e["succeeded"], 120)
        time.sleep(0.3)
        killed_at = time.monotonic()
        peers[0].proc.send_signal(signal.SIGTERM)
        assert peers[0].proc.wait(10) == -signal.SIGTERM
        for peer in peers[1:]:
            peer.wait_for(
                lambda e: e["event"] == "round" and e["succeeded"] and e["t"] > killed_at + 1, 60
            )
    finally:
        for peer in peers:
            peer.stop()


def _python(script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh interpreter with this checkout importable."""
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )


def test_a_leave_that_hangs_past_the_deadline_exits_3_saying_where_it_waited():
    """The watchdog ends a hung exit, and its stderr shows every thread's stack: a hang in the
    field then says where it waited instead of only that it did."""
    script = (
        "import os, signal, time\n"
        "import moshpit\n"
        "class Stuck:\n"
        "    def leave_swarm(self, deadline):\n"
        "        time.sleep(60)  # a component that never finishes leaving\n"
        "moshpit.handle_preemption(Stuck(), deadline=1.0)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(60)\n"
    )
    done = _python(script)
    assert done.returncode == 3, done.stderr
    assert "leaving took longer than 1 s" in done.stderr
    assert "in leave_swarm" in done.stderr and "Thread 0x" in done.stderr, done.stderr


def test_sigterm_while_the_training_thread_holds_the_progress_lock_still_leaves_cleanly():
    """The handler runs between two bytecodes of the main thread, which may be inside
    ``ProgressTracker.report`` (called by every ``step()``) holding the tracker's lock. Leaving
    needs that lock (``withdraw``): run in the handler there, it waited on its own thread until
    the watchdog's exit 3 (a tutorial volunteer did, about one SIGTERM in seven under load)."""
    script = (
        "import os, signal\n"
        "import moshpit\n"
        "from moshpit.training.progress import ProgressTracker\n"
        "dht = moshpit.DHT(host_maddrs=['/ip4/127.0.0.1/tcp/0'], start=True)\n"
        "tracker = ProgressTracker(dht, 'lock-test')\n"
        "tracker.report(0, 0)\n"
        "moshpit.handle_preemption(tracker, dht, deadline=5.0)\n"
        "with tracker._lock:  # where report() is between taking and releasing it\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    print('still inside', flush=True)\n"
        "print('never reached', flush=True)\n"
    )
    done = _python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left the swarm cleanly" in done.stderr, done.stderr[-3000:]
    assert "still inside" in done.stdout and "never reached" not in done.stdout, done.stdout


def test_sigterm_while_the_training_thread_holds_the_averagers_tensors_leaves_after_the_block():
    """Leaving writes a last checkpoint, which reads the averaged tensors under their lock;
    a SIGTERM inside the user's ``with averager.get_tensors():`` is handled after the block."""
    script = (
        "import os, signal, torch\n"
        "import moshpit\n"
        "dht = moshpit.DHT(host_maddrs=['/ip4/127.0.0.1/tcp/0'], start=True)\n"
        "averager = moshpit.Averager([torch.zeros(4)], dht, 'lock-test', 2, start=True)\n"
        "class LastCheckpoint:\n"
        "    def leave_swarm(self, deadline):\n"
        "        with averager.get_tensors() as tensors:\n"
        "            print('saved', tensors[0].tolist(), flush=True)\n"
        "        averager.shutdown()\n"
        "        dht.shutdown()\n"
        "moshpit.handle_preemption(LastCheckpoint(), deadline=5.0)\n"
        "with averager.get_tensors() as tensors:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    tensors[0] += 1  # the update the block was making is not cut in half\n"
        "print('never reached', flush=True)\n"
    )
    done = _python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved [1.0, 1.0, 1.0, 1.0]" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "never reached" not in done.stdout


def test_sigterm_while_the_training_thread_hands_work_to_the_dht_loop_still_leaves_cleanly():
    """Handing work to the DHT's loop (``run_coroutine``) holds trio's entry-queue lock for a
    moment; every other thread that hands work over needs it too. A SIGTERM landing there ran
    the leave in the handler, which waited for a checkpoint writer thread that waited for the
    lock: the tutorial's second volunteer exited 3 by the watchdog, its writer thread in
    ``run_sync_soon``. A profile hook raises the signal exactly there (inside the lock)."""
    script = (
        "import signal, sys, threading\n"
        "import moshpit\n"
        "dht = moshpit.DHT(host_maddrs=['/ip4/127.0.0.1/tcp/0'], start=True)\n"
        "async def noop(_dht, _node):\n"
        "    return 1\n"
        "class Writer:  # leaving waits for another thread that hands work to the loop\n"
        "    def leave_swarm(self, deadline):\n"
        "        out = []\n"
        "        t = threading.Thread(target=lambda: out.append(dht.run_coroutine(noop)))\n"
        "        t.start()\n"
        "        t.join(deadline)\n"
        "        print('writer done', out, flush=True)\n"
        "        dht.shutdown()\n"
        "moshpit.handle_preemption(Writer(), deadline=5.0)\n"
        "def hook(frame, event, arg):\n"
        "    if event == 'call' and frame.f_code.co_name == 'wakeup_thread_and_signal_safe':\n"
        "        sys.setprofile(None)\n"
        "        signal.raise_signal(signal.SIGTERM)  # trio's entry-queue lock is held here\n"
        "sys.setprofile(hook)\n"
        "dht.run_coroutine(noop)\n"
        "print('never reached', flush=True)\n"
    )
    done = _python(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "left the swarm cleanly" in done.stderr, done.stderr[-3000:]
    assert "writer done [1]" in done.stdout, (done.stdout, done.stderr[-3000:])
    assert "never reached" not in done.stdout
