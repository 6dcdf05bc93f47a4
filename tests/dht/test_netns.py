"""Two machines in one box: `moshpit dht` in two Linux network namespaces joined by a veth pair.

The first peer runs with the default listen address; the second joins using only the
``--initial-peers`` line the first printed. The 10.213.0.0/24 and 10.214.0.0/24 addresses exist only inside the
two namespaces this test creates (and deletes), so no traffic leaves them.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
FIRST_IP, SECOND_IP, DOWN_IP = "10.213.0.1", "10.213.0.2", "10.214.0.1"


def sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


class NamespacedPeer:
    """A `moshpit dht` process inside a network namespace; stdout lines arrive on a queue."""

    def __init__(self, netns: str, *args: str):
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, sys.executable, "-m", "moshpit", "dht", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line; output so far: {''.join(self.output)}"
                ) from None
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def wait_for_text(self, text: str, timeout: float = 30.0) -> None:
        """Until a line containing ``text`` is printed (log lines start with a timestamp)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.output):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r}; output so far: {''.join(self.output)}")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._reader.join(timeout=5)  # every line the process wrote is in self.output


@pytest.fixture
def two_namespaces():
    if sys.platform != "linux":
        pytest.skip("network namespaces are a Linux feature")
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    first, second = f"mpA{tag}", f"mpB{tag}"
    created: list[str] = []
    try:
        for ns in (first, second):
            done = sh("ip", "netns", "add", ns)
            if done.returncode != 0:
                pytest.skip(f"the OS refused `ip netns add`: {done.stderr.strip()}")
            created.append(ns)
        setup = [
            ("ip", "link", "add", "vA", "netns", first, "type", "veth", "peer", "name", "vB",
             "netns", second),
            ("ip", "-n", first, "addr", "add", f"{FIRST_IP}/24", "dev", "vA"),
            ("ip", "-n", second, "addr", "add", f"{SECOND_IP}/24", "dev", "vB"),
            ("ip", "-n", first, "link", "set", "vA", "up"),
            ("ip", "-n", second, "link", "set", "vB", "up"),
            ("ip", "-n", first, "link", "set", "lo", "up"),
            # an interface left down: its address must not be announced
            ("ip", "-n", first, "link", "add", "vC", "type", "veth", "peer", "name", "vD"),
            ("ip", "-n", first, "addr", "add", f"{DOWN_IP}/24", "dev", "vC"),
            ("ip", "-n", second, "link", "set", "lo", "up"),
        ]  # fmt: skip
        for cmd in setup:
            done = sh(*cmd)
            if done.returncode != 0:
                pytest.skip(f"the OS refused `{' '.join(cmd)}`: {done.stderr.strip()}")
        yield first, second
    finally:
        for ns in created:
            sh("ip", "netns", "del", ns)  # also destroys the veth pair


def test_a_peer_in_another_namespace_joins_with_only_the_printed_line(two_namespaces):
    first_ns, second_ns = two_namespaces
    peers: list[NamespacedPeer] = []
    try:
        first = NamespacedPeer(first_ns)  # default --host-maddrs: every interface
        peers.append(first)
        first_id = first.wait_for("PeerID:")
        printed = first.wait_for("--initial-peers").split()
        port = printed[0].split("/")[4]
        # the veth address (the one the other namespace can reach) first, loopback last, not
        # the address of the interface that is down
        assert printed == [
            f"/ip4/{FIRST_IP}/tcp/{port}/p2p/{first_id}",
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{first_id}",
        ]

        second = NamespacedPeer(second_ns, "--initial-peers", *printed)
        peers.append(second)
        second_id = second.wait_for("PeerID:")
        assert second.wait_for("--initial-peers").split()[0].startswith(f"/ip4/{SECOND_IP}/")
        joined = second.wait_for("Joined the swarm:")
        assert int(joined.split("sees ")[1].split()[0]) >= 1, joined
        # the first peer saw the connection that came in over the veth pair (it logs a peer
        # that stays connected for a second)
        first.wait_for_text(f"peer connected: {second_id}")
        assert [p.stop() for p in peers] == [0, 0]
    finally:
        for peer in peers:
            peer.stop()
