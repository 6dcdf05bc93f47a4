"""The `moshpit` command as a user meets it: help, version, one-line errors, copyable
addresses in narrow or piped output, the join message, and Ctrl-C in `moshpit demo`."""

from __future__ import annotations

import importlib.metadata
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dht.p2p import Identity, Multiaddr

ROOT = Path(__file__).resolve().parents[1]
# COLUMNS=40: anything that wraps at the terminal width would break addresses here
ENV = {
    **os.environ,
    "COLUMNS": "40",
    "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
}
PEER_ID = str(Identity.generate().peer_id)


def moshpit(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moshpit", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=timeout,
    )


class Running:
    """A `moshpit ...` process with piped output collected line by line."""

    def __init__(self, *args: str, new_session: bool = False):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moshpit", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
            cwd=ROOT,
            start_new_session=new_session,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, prefix: str, timeout: float = 120.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line; output so far: {''.join(self.output)}"
                ) from None
            if line.startswith(prefix):
                return line.rstrip("\n")

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._reader.join(timeout=5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


# ------------------------------------------------------------------ help and version


def test_version_prints_the_installed_version():
    done = moshpit("--version")
    assert done.returncode == 0
    assert done.stdout == f"moshpit {importlib.metadata.version('moshpit-train')}\n"


def test_help_is_written_for_users():
    done = moshpit("--help")
    assert done.returncode == 0
    text = done.stdout
    assert "train one PyTorch model together on many machines" in text
    assert "--version" in text and "examples:" in text
    # the first peer is a `moshpit dht`; joining means training: `moshpit train`
    assert "moshpit dht --host-maddrs" in text and "--announce-maddrs" in text
    assert "moshpit train --initial-peers /ip4/" in text
    assert "moshpit dht --initial-peers" not in text
    assert "imported only when used" not in text and "configure_parser" not in text


# ------------------------------------------------------------------ one-line address errors


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (
            ["--initial-peers", "127.0.0.1:31337"],
            "bad --initial-peers: multiaddr '127.0.0.1:31337'",
        ),
        (["--initial-peers", f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID[:-5]}"], "invalid PeerID"),
        (
            ["--initial-peers", f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER_ID[:11]}"],
            f"bad --initial-peers: invalid PeerID '{PEER_ID[:11]}': it looks truncated: an "
            "Ed25519 PeerID is 52 characters (12D3KooW + 44 more), this one has 11; copy the "
            "whole PeerID (in '/ip4/127.0.0.1/tcp/31337/p2p/",
        ),
        (["--initial-peers", "/ip4/1.2.3.4/tcp/1", "/ip4/1.2.3.999/tcp/1"], "'1.2.3.999'"),
        (["--host-maddrs", "0.0.0.0:31337"], "bad --host-maddrs"),
        (["--announce-maddrs", "/ip4/0.0.0.0/tcp/31337"], "wildcard nobody can dial"),
    ],
    ids=[
        "host-port",
        "corrupt-peer-id",
        "truncated-peer-id",
        "bad-second-ip",
        "listen",
        "announce-wildcard",
    ],
)
def test_a_malformed_address_is_one_line_and_exit_status_2(args, wanted):
    done = moshpit("dht", *args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr  # no traceback, no exception group
    assert lines[0].startswith("moshpit dht: ") and wanted in lines[0]
    assert "expected e.g." in lines[0] or "e.g. /ip4/" in lines[0]


def test_an_address_this_machine_does_not_have_is_one_line_and_exit_status_1():
    # binding fails locally (EADDRNOTAVAIL); nothing is sent to the documentation address
    done = moshpit("dht", "--host-maddrs", "/ip4/203.0.113.7/tcp/0")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "moshpit dht: cannot listen on /ip4/203.0.113.7/tcp/0: Cannot assign requested address"
    ]


def test_a_port_in_use_says_another_process_holds_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = moshpit("dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"moshpit dht: cannot listen on /ip4/127.0.0.1/tcp/{port}: another process is using "
        "that port: stop it or pick another port"
    ]


@pytest.mark.parametrize("command", ["status", "train"])
def test_a_port_where_nothing_listens_is_an_error_in_seconds(command, tmp_path):
    """A mistyped port is refused at once: the command ends in seconds (it waited 20-36 s)
    with one line that names the address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}"
    extra = ["--run-id", "x"] if command == "status" else ["--checkpoint-dir", str(tmp_path)]
    # the refusal path's own message proves it did not wait out the 30 s bootstrap timeout
    # (that one says "none of the initial peers answered within 30s"); the generous limit
    # only keeps a hang from lasting forever on a loaded machine (torch's import alone)
    done = moshpit(command, "--initial-peers", dead, *extra, timeout=120)
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"moshpit {command}: ") and f"nothing listens at {dead}" in line
    assert "Check the port in the address" in line


def test_a_second_volunteer_in_a_used_checkpoint_directory_is_one_line_and_exit_status_1(
    tmp_path,
):
    """Two `moshpit train` in one folder shared ./moshpit-checkpoint and printed 51 warnings."""
    first = Running(
        "train", "--json", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--duration", "60",
    )  # fmt: skip
    try:
        first.wait_for('{"event": "joined"')
        done = moshpit(
            "train", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--duration", "5",
        )  # fmt: skip
        assert done.returncode == 1, done.stdout + done.stderr
        assert done.stderr.splitlines() == [
            f"moshpit train: checkpoint directory {tmp_path / 'ckpt'} is in use by another "
            f"running process (pid {first.proc.pid}): stop it, or give this peer a directory "
            "of its own (--checkpoint-dir / checkpoint_dir): two peers in one directory "
            "overwrite each other's state"
        ]
    finally:
        first.kill()


# ------------------------------------------------------------------ copyable output, join message


def test_printed_addresses_are_whole_lines_and_the_joiner_says_how_many_peers_it_sees():
    first = Running("dht")  # default: all interfaces, several addresses on one long line
    peers = [first]
    try:
        line = first.wait_for("--initial-peers ")
        printed = line.split()[1:]
        assert len(line) > 40 and printed  # longer than the 40 columns it must not wrap at
        for text in printed:
            assert Multiaddr(text).peer_id is not None  # whole, with its PeerID
        second = Running(
            "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", *printed
        )
        peers.append(second)
        joined = second.wait_for("Joined the swarm:")
        assert joined == "Joined the swarm: this peer sees 1 other peer(s)"
        third = Running(
            "dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--initial-peers", printed[-1]
        )
        peers.append(third)
        assert third.wait_for("Joined the swarm:").endswith("sees 2 other peer(s)")
    finally:
        for peer in peers:
            peer.kill()


# ------------------------------------------------------------------ Ctrl-C in the demo


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_ctrl_c_in_the_demo_stops_cleanly_with_the_table_so_far_and_a_summary():
    demo = Running(
        "demo", "--peers", "2", "--rounds", "50", "--size", "100",
        "--min-matchmaking-time", "0.5", new_session=True,
    )  # fmt: skip
    try:
        bootstrap = demo.wait_for("bootstrap peer: ")
        # copyable at 40 columns and piped: the whole multiaddr on its line
        assert Multiaddr(bootstrap.split(": ", 1)[1]).peer_id is not None
        demo.wait_for("round 1:")
        workers = _children(demo.proc.pid)
        assert len(workers) == 2
        # a terminal's Ctrl-C: SIGINT to the whole process group (the parent and its peers)
        os.killpg(demo.proc.pid, signal.SIGINT)
        status = demo.finish()
    finally:
        demo.kill()
    output = "".join(demo.output)
    assert status == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    summaries = [line for line in output.splitlines() if line.startswith("interrupted (Ctrl-C)")]
    assert len(summaries) == 1, output
    assert " of 50 rounds: spread " in summaries[0] and "all peers stopped" in summaries[0]
    assert "Moshpit averaging: 2 peers" in output  # the table so far
    # the parent waits for its peers before exiting, so none may be left
    assert not any(_running(pid) for pid in workers), "a peer process was left running"


def test_ctrl_c_while_joining_stops_at_once_without_waiting_for_the_bootstrap():
    # an "initial peer" that accepts TCP connections but never says a word: joining hangs
    # until the 10 s bootstrap timeout unless the signal is handled during the join
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        port = silent.getsockname()[1]
        peer = Running(
            "dht",
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--initial-peers",
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER_ID}",
        )
        try:
            conn, _ = silent.accept()  # the peer is now dialing us, inside the join
            peer.proc.send_signal(signal.SIGINT)
            status = peer.finish()
            conn.close()
        finally:
            peer.kill()
    output = "".join(peer.output)
    assert status == 0, output
    assert "could not join" not in output and "Traceback" not in output


@pytest.mark.parametrize(
    ("args", "wanted"),
    [
        (["--relay-circuit-data", "-1"], "--relay-circuit-data must be >= 0 MiB"),
        (["--relay-circuit-duration", "-5"], "circuit_duration must be >= 0"),
    ],
    ids=["data", "duration"],
)
def test_bad_relay_limits_are_one_line_and_exit_status_2(args, wanted):
    done = moshpit("dht", *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moshpit dht: ") and wanted in lines[0]
