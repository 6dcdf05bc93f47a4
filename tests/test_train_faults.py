"""Faults that must not stop a `moshpit train` peer, made for real on disk: a damaged newest
checkpoint (a flipped byte in a pack, a truncated or garbled LATEST, a truncated manifest)
falls back to the older one; a read-only or full checkpoint disk, a taken port and an
unwritable key path are one line each, never a traceback.

Read-only and full disks are real mounts (tmpfs, remounted read-only) when running as root,
as CI does; otherwise the read-only case uses permission bits and the full-disk case is
skipped with that reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
IS_ROOT = os.geteuid() == 0


def train(ckpt: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable, "-m", "moshpit", "train", "--json",
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-dir", str(ckpt),
            "--identity", str(ckpt.parent / "peer.key"), "--threads", "1", *extra,
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=timeout,
    )


def events(done: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def no_traceback(done: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr


# sync mode alone takes one optimizer step per batch (target = one batch): the epoch counts
# steps, and a checkpoint is committed after every epoch (the last two are kept)
SOLO_SYNC = ("--mode", "sync", "--batch-size", "32", "--target-batch-size", "32")


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A checkpoint directory whose LATEST names the state of epoch 5 (newest, written on
    the way out) and an older one (a per-epoch checkpoint: which one depends on timing)."""
    from moshpit.training.store import StateStore

    ckpt = tmp_path_factory.mktemp("made") / "ckpt"
    done = train(ckpt, *SOLO_SYNC, "--max-steps", "5")
    assert done.returncode == 0, done.stderr
    assert events(done)[-1]["epoch"] == 5
    store = StateStore(ckpt)
    epochs = [store.load_manifest(root).epoch for root in store.committed_roots()]
    assert len(epochs) == 2 and epochs[0] == 5 and epochs[1] < 5, epochs
    return ckpt


def older_epoch(ckpt: Path) -> int:
    from moshpit.training.store import StateStore

    store = StateStore(ckpt)
    return store.load_manifest(store.committed_roots()[1]).epoch


def copy_of(source: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def newest_manifest(ckpt: Path) -> Path:
    first_root = (ckpt / "LATEST").read_text().splitlines()[1]
    return ckpt / "manifests" / first_root


def flip_newest_pack(ckpt: Path) -> None:
    from moshpit.training.store import StateStore

    manifest = StateStore(ckpt).latest()
    packs = sorted((ckpt / "packs").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    newest = packs[-1]
    data = bytearray(newest.read_bytes())
    data[-5] ^= 0x20  # inside its last chunk, which belongs to the newest state
    newest.write_bytes(bytes(data))
    assert manifest.epoch == 5


DAMAGE = {
    "pack-byte": flip_newest_pack,
    "latest-truncated": lambda c: (c / "LATEST").write_bytes((c / "LATEST").read_bytes()[:30]),
    "latest-garbled": lambda c: (c / "LATEST").write_bytes(b"\xff\x00 not a pointer"),
    "manifest-truncated": lambda c: newest_manifest(c).write_bytes(
        newest_manifest(c).read_bytes()[:-9]
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_falls_back_and_the_peer_trains_on(two_checkpoints, tmp_path, damage):
    ckpt = copy_of(two_checkpoints, tmp_path)
    older = older_epoch(ckpt)
    DAMAGE[damage](ckpt)
    done = train(ckpt, *SOLO_SYNC, "--max-steps", "3")
    assert done.returncode == 0, done.stderr
    no_traceback(done)
    started = next(e for e in events(done) if e["event"] == "started")
    final = events(done)[-1]
    if damage.startswith("latest"):
        # LATEST is only a pointer: manifests/ still holds both intact states; the log says
        # the newest one was restored (it said "the older checkpoint of epoch 5 instead of
        # newer ones", though 5 is the newest)
        assert started["restored_epoch"] == 5
        assert "restored the newest intact checkpoint, of epoch 5" in done.stderr, done.stderr
        assert "older" not in done.stderr
    else:
        assert started["restored_epoch"] == older
        assert f"restored the older checkpoint of epoch {older}" in done.stderr, done.stderr
        assert done.stderr.count(" WARNING moshpit.training.state_averager") == 1, done.stderr
    assert final["event"] == "final" and final["epoch"] == started["restored_epoch"] + 3
    if damage == "pack-byte":
        assert "does not match its digest" in done.stderr


def test_nothing_usable_on_disk_starts_over_with_one_warning(two_checkpoints, tmp_path):
    ckpt = copy_of(two_checkpoints, tmp_path)
    for manifest in (ckpt / "manifests").iterdir():
        manifest.write_bytes(manifest.read_bytes()[:-1])
    (ckpt / "LATEST").unlink()
    done = train(ckpt, *SOLO_SYNC, "--max-steps", "2")
    assert done.returncode == 0, done.stderr
    no_traceback(done)
    assert "no usable checkpoint" in done.stderr and "loading the swarm's state" in done.stderr
    assert events(done)[-1]["epoch"] == 2  # from scratch: nobody else serves a state


@contextlib.contextmanager
def read_only_dir(path: Path):
    """``path`` on a read-only filesystem (root: a tmpfs remounted read-only), or without
    write permission (others; root ignores permission bits)."""
    path.mkdir(parents=True, exist_ok=True)
    if IS_ROOT:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], check=True)
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], check=False)
    else:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)


def remount_read_only(path: Path) -> None:
    if IS_ROOT:
        subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    else:
        path.chmod(0o555)


@pytest.mark.parametrize("holding", [False, True], ids=["empty", "holding-a-checkpoint"])
def test_a_read_only_checkpoint_dir_is_one_line_and_exit_2(two_checkpoints, tmp_path, holding):
    with read_only_dir(tmp_path / "ro") as ro:
        if IS_ROOT:
            subprocess.run(["mount", "-o", "remount,rw", str(ro)], check=True)
        else:
            ro.chmod(0o755)
        if holding:
            copy_of(two_checkpoints, ro)
        remount_read_only(ro)
        ckpt = ro / "ckpt"
        done = subprocess.run(
            [sys.executable, "-m", "moshpit", "train", "--checkpoint-dir", str(ckpt)],
            capture_output=True,
            text=True,
            env=ENV,
            cwd=ROOT,
            timeout=60,
        )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("moshpit train: ")
    assert "--checkpoint-dir" in lines[0] and str(ckpt) in lines[0]


def test_a_taken_port_and_an_unwritable_key_path_are_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "moshpit", "train", "--checkpoint-dir", str(tmp_path / "c"),
             "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],  # fmt: skip
            capture_output=True,
            text=True,
            env=ENV,
            cwd=ROOT,
            timeout=60,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"moshpit train: cannot listen on /ip4/127.0.0.1/tcp/{port}: another process is using "
        "that port: stop it or pick another port"
    ]
    done = subprocess.run(
        [sys.executable, "-m", "moshpit", "train", "--checkpoint-dir", str(tmp_path / "c"),
         "--identity", "/proc/moshpit-nope/peer.key"],  # fmt: skip
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moshpit train: cannot create --identity")


@pytest.mark.skipif(not IS_ROOT, reason="a full disk needs a small tmpfs mount (root)")
def test_a_full_disk_is_reported_and_sigterm_still_leaves(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], check=True)
    try:
        ckpt = disk / "ckpt"
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "moshpit", "train", "--json", "--checkpoint-dir", str(ckpt),
                "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--checkpoint-every", "0.5",
                "--max-rate", "2000", "--report-every", "0.5",
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # training: the first checkpoints went through
                if '"event": "progress"' in line and json.loads(line)["steps"] > 50:
                    break
            # now the disk fills up (opening the filler may already fail: the peer's own
            # checkpoints can fill 3 MiB first)
            with contextlib.suppress(OSError), open(disk / "filler", "wb") as filler:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            time.sleep(3.0)  # several background checkpoints fail meanwhile
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        subprocess.run(["umount", str(disk)], check=False)
    assert "Traceback" not in err, err
    failures = [line for line in err.splitlines() if "background checkpoint failed" in line]
    assert len(failures) == 1, err  # at once, then rate-limited (one line per minute)
    assert "No space left on device" in failures[0] and "MiB free" in failures[0]
    assert proc.returncode == 1, err
    # the failure once (it was printed three times), no promise of exit 0 on the way
    assert err.count("could not write the last checkpoint into") == 1, err
    assert "exit 0" not in err, err
    [preempted] = [json.loads(line) for line in out.splitlines() if '"preempted"' in line]
    assert preempted["clean"] is False and preempted["steps"] > 50
    assert preempted["failures"][0].startswith("could not write the last checkpoint into")
    assert "left the swarm in" not in out  # (logged, not printed)
    assert "withdraw" not in err.lower() or "could not withdraw" not in err.lower()


def test_a_run_of_another_model_is_one_line_and_exit_1(tmp_path: Path):
    """A newcomer whose run id names another model's run (its donors serve a state that does
    not fit the demo's MLP) stops with the mismatch in one line, not a traceback."""
    import torch

    import moshpit
    from moshpit.training.state_averager import TrainingStateAverager

    dht = moshpit.DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        model = torch.nn.Linear(64, 10)  # not the demo's 64-H-10 MLP
        state = TrainingStateAverager(
            dht=dht,
            optimizer=torch.optim.Adam(model.parameters()),
            prefix="digits",
            target_group_size=4,
            checkpoint_dir=tmp_path / "other-model",
            sync_on_start=False,
        )
        try:
            state.epoch = 7
            state.save_checkpoint()
            address = str(dht.get_visible_maddrs()[0])
            done = train(tmp_path / "ckpt", "--initial-peers", address, "--duration", "30")
        finally:
            state.shutdown()
    finally:
        dht.shutdown()
    no_traceback(done)
    assert done.returncode == 1, (done.stdout, done.stderr)
    [line] = [s for s in done.stderr.splitlines() if s.startswith("moshpit train:")]
    assert "trains another model" in line and "'params.0' has shape [10, 64]" in line, line
