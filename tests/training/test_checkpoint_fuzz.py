"""kill -9 a real checkpoint writer at random moments: every restore is the old or the new state.

The writer (checkpoint_writer.py, a fork server so torch is imported once) saves states A, B,
A, ... into one directory with keep=1, so the kills land in chunk writes, manifest and LATEST
commits, garbage collection and rewrites of collected chunks. After each SIGKILL a fresh
StateStore must restore exactly A or B, every chunk verified; NoCheckpointError only while
nothing was ever committed.
"""

from __future__ import annotations

import os
import pathlib
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from moshpit.training.errors import NoCheckpointError
from moshpit.training.manifest import build_manifest
from moshpit.training.store import StateStore, save_state
from tests.training.checkpoint_writer import EPOCHS, make_states
from tests.training.test_store import packs, stored

WRITER = pathlib.Path(__file__).with_name("checkpoint_writer.py")
MIN_KILLS = 50
MIN_MID_WRITE_KILLS = 10  # kills after which a tmp file was left: the writer died mid-write
MAX_KILLS = 300
# A kill lands within this many save times of the child's start: a save of the ~12 MiB states
# takes some tens of ms on an idle machine and several times that beside other work, so the
# save time is measured (not assumed) before the kills and again every CALIBRATE_EVERY kills.
DELAY_IN_SAVES = 1.5
CALIBRATE_EVERY = 50


class Writer:
    """The fork server: each ``start()`` forks a fresh writer child and returns its pid."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next_line() == "ready"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().strip())
        self.lines.put("EOF")

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=120)
        except queue.Empty:
            pytest.fail("the checkpoint writer stopped answering")
        if line == "EOF":
            self.proc.wait(timeout=10)
            assert self.proc.stderr is not None
            pytest.fail(f"the checkpoint writer exited: {self.proc.stderr.read().decode()}")
        return line

    def seconds_per_save(self) -> float:
        """Fork a child, time four saves, kill it: the longest save, in seconds. The first
        counts from the fork, as a killed child's does (its start-up is part of its save)."""
        stamps = [time.monotonic()]
        pid = self.start()
        while len(stamps) < 5:
            line = self.next_line()
            if line.startswith("commit "):
                stamps.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)
        self.wait_exit(pid)
        return max(b - a for a, b in zip(stamps, stamps[1:], strict=False))

    def start(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"fork\n")
        self.proc.stdin.flush()
        kind, pid = self.next_line().split()
        assert kind == "pid"
        return int(pid)

    def wait_exit(self, pid: int) -> tuple[int, list[str]]:
        """The child's wait status and the states it reported committed."""
        commits = []
        while True:
            line = self.next_line()
            if line.startswith("commit "):
                commits.append(line.split()[1])
            elif line.startswith(f"exited {pid} "):
                return int(line.split()[2]), commits

    def errors(self) -> str:
        """What the writer printed on stderr so far (the reason a child failed)."""
        self.close()
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode(errors="replace")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def tmp_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in directory.rglob(".tmp-*")]


@pytest.mark.slow
def test_kill_9_at_random_moments_restores_old_or_new_state(tmp_path: pathlib.Path) -> None:
    directory = tmp_path / "checkpoints"
    states = make_states()
    roots = {
        label: build_manifest(named, EPOCHS[label], {"state": label})[0].root
        for label, named in states.items()
    }
    rng = random.Random()
    writer = Writer(directory)
    kills = mid_write = 0
    ever_committed = False
    restored = {"A": 0, "B": 0}
    max_delay = 0.0
    streak = 0  # kills in a row that restored the same state
    last = None
    try:
        while kills < MIN_KILLS or mid_write < MIN_MID_WRITE_KILLS or 0 in restored.values():
            assert kills < MAX_KILLS, (
                f"after {kills} kills: {mid_write} mid-write, restored {restored}; the kills "
                f"do not reach the interesting moments (kills within {max_delay:.3f} s)"
            )
            if kills % CALIBRATE_EVERY == 0 or streak >= CALIBRATE_EVERY // 2:
                # also when the machine slowed down: every kill then lands before the child's
                # first commit, and the same state is restored again and again
                streak = 0
                max_delay = DELAY_IN_SAVES * writer.seconds_per_save()
                ever_committed = True  # the timed saves committed
            pid = writer.start()
            threading.Event().wait(rng.uniform(0, max_delay))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it died on its own: wait_exit says how
                pass
            status, commits = writer.wait_exit(pid)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"the writer child died on its own (status {status}) before the kill: "
                f"{writer.errors()}"
            )
            kills += 1
            ever_committed = ever_committed or bool(commits)
            if tmp_files(directory):
                mid_write += 1

            store = StateStore(directory)
            try:
                manifest = store.latest()
            except NoCheckpointError:
                assert not ever_committed, "a committed checkpoint vanished after a kill"
                continue
            ever_committed = True
            label = manifest.metadata["state"]
            assert manifest.root == roots[label]
            tensors = store.load_tensors(manifest)
            for (name, want), got in zip(states[label], tensors, strict=True):
                assert got.dtype == want.dtype and torch.equal(got, want), name
            restored[label] += 1
            streak = streak + 1 if label == last else 0
            last = label
    finally:
        writer.close()
    print(f"{kills} kills, {mid_write} mid-write, restored {restored}")

    # A save by the next process collects what the killed writers left behind.
    store = StateStore(directory, keep=1)
    manifest = save_state(store, states["A"], EPOCHS["A"], {"state": "A"})
    assert tmp_files(directory) == []
    assert sorted(p.name for p in (directory / "manifests").iterdir()) == [manifest.root.hex()]
    live = manifest.chunk_refs()
    assert stored(directory) == set(live)
    for entries in packs(directory).values():  # no pack left mostly garbage
        assert 2 * sum(size for digest, _, size in entries if digest in live) >= sum(
            size for _, _, size in entries
        )
