"""One key file, one live peer: ``Identity.locked`` refuses a second user while the first runs.

Two processes with one key file would share one PeerID and break each other's routing. The
lock is an flock on the key file, which the kernel drops when its holder exits however it
dies, so a SIGKILLed peer never blocks its own restart. Holders here are real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dht.p2p import Identity, IdentityError, IdentityInUseError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX-only")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}

# Holds the key until its stdin closes (then exits cleanly); prints its PeerID once it holds it.
HOLDER = textwrap.dedent(
    """
    import os, sys
    from dht.p2p import Identity
    with Identity.locked(sys.argv[1]) as identity:
        print(identity.peer_id, flush=True)
        if sys.argv[2:] == ["fork"]:  # a forked child outlives us; it must not keep the lock
            if os.fork() == 0:  # past the fork hooks once Python code runs here
                print(os.getpid(), flush=True)
                sys.stdin.read()
                os._exit(0)
            os._exit(0)  # like a crash: no cleanup at all
        sys.stdin.read()
    """
)


def in_use_message(key: Path, pid: int) -> str:
    return (
        f"identity file {key} is in use by another running process (pid {pid}): two peers "
        "must not share one PeerID; stop that process or use a different key file "
        "(--identity / identity_path)"
    )


class Holder:
    """A real process holding ``key`` (see HOLDER)."""

    def __init__(self, key: Path, *extra: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(key), *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        line = self.proc.stdout.readline()
        assert line, self.proc.communicate(timeout=30)[1]
        self.peer_id = line.strip()

    def close(self, timeout: float = 30) -> int:
        """Close stdin (a clean exit, or the orphan's cue) and reap the process."""
        try:
            _, err = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert not err, err
        return self.proc.returncode


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def try_lock_in_a_new_process(key: Path) -> subprocess.CompletedProcess:
    code = (
        "import sys\nfrom dht.p2p import Identity, IdentityInUseError\n"
        "try:\n    Identity.locked(sys.argv[1]).__enter__()\n"
        "except IdentityInUseError as e:\n    sys.exit(str(e))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(key)],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=60,
    )


def test_a_second_user_in_this_process_is_refused_until_the_first_lets_go(tmp_path):
    key = tmp_path / "peer.key"
    fds = open_fds() if os.path.isdir("/proc/self/fd") else None
    with Identity.locked(key) as first:
        assert key.with_name("peer.key.pid").read_text() == f"{os.getpid()}\n"
        with pytest.raises(IdentityInUseError) as info:
            with Identity.locked(key):
                pass
        assert isinstance(info.value, IdentityError)  # callers catching IdentityError see it
        assert str(info.value) == (
            f"identity file {key} is already in use by a peer in this process (pid "
            f"{os.getpid()}): two peers must not share one PeerID; shut that peer down first "
            "or use a different key file (--identity / identity_path)"
        )
        assert info.value.path == key and info.value.pid == os.getpid()
    # released on exit: the same identity again, no pid file, no descriptor left open
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer.key"]
    with Identity.locked(key) as again:
        assert again.peer_id == first.peer_id
    if fds is not None:
        assert open_fds() == fds


def test_a_second_process_is_refused_and_a_clean_exit_lets_it_start(tmp_path):
    key = tmp_path / "peer.key"
    holder = Holder(key)
    try:
        done = try_lock_in_a_new_process(key)
        assert done.returncode == 1
        assert done.stderr.strip() == in_use_message(key, holder.proc.pid)
        with pytest.raises(IdentityInUseError) as info:
            Identity.locked(key).__enter__()
        assert str(info.value) == in_use_message(key, holder.proc.pid)
    finally:
        assert holder.close() == 0
    with Identity.locked(key) as identity:
        assert str(identity.peer_id) == holder.peer_id


def test_a_sigkilled_holder_does_not_block_the_restart(tmp_path):
    key = tmp_path / "peer.key"
    holder = Holder(key)
    holder.proc.send_signal(signal.SIGKILL)
    assert holder.proc.wait(timeout=30) == -signal.SIGKILL
    holder.proc.stdout.close()
    holder.proc.stdin.close()
    holder.proc.stderr.close()
    pid_file = key.with_name("peer.key.pid")
    assert pid_file.read_text() == f"{holder.proc.pid}\n"  # stale, and harmless
    restarted = Holder(key)
    try:
        assert restarted.peer_id == holder.peer_id  # same key file, same PeerID
        assert pid_file.read_text() == f"{restarted.proc.pid}\n"
    finally:
        assert restarted.close() == 0
    assert not pid_file.exists()


def test_a_forked_child_does_not_keep_the_lock_after_its_parent_died(tmp_path):
    key = tmp_path / "peer.key"
    holder = Holder(key, "fork")
    child = int(holder.proc.stdout.readline())
    try:
        assert holder.proc.wait(timeout=30) == 0  # died without releasing anything
        os.kill(child, 0)  # the child still runs, with the parent's descriptors minus the lock
        with Identity.locked(key) as identity:
            assert str(identity.peer_id) == holder.peer_id
    finally:
        holder.close()  # closing the pipe lets the orphan exit


def test_a_key_file_that_cannot_be_read_is_still_an_identity_error(tmp_path):
    with pytest.raises(IdentityError, match="is a directory|cannot read identity file"):
        with Identity.locked(tmp_path):
            pass
