"""Smoke test of benchmarks/wan_testbed.py: namespaces, shaped links, reachability, teardown."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from wan_testbed import WanTestbed, parse_rate, unavailable_reason  # noqa: E402

_REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"WAN testbed: {_REASON}")

_SERVER = r"""
import hashlib, socket, sys
s = socket.socket()
s.bind((sys.argv[1], 5001))
s.listen(1)
print("listening", flush=True)
s.settimeout(60)
c, _ = s.accept()
c.settimeout(60)
h, n = hashlib.sha256(), 0
while chunk := c.recv(1 << 16):
    h.update(chunk)
    n += len(chunk)
print(n, h.hexdigest(), flush=True)
"""
_CLIENT = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], 5001), timeout=60)
c.sendall(bytes(range(256)) * 4096)
c.close()
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_parse_rate() -> None:
    assert parse_rate("100mbit") == 100_000_000
    assert parse_rate("1gbit") == 1_000_000_000
    assert parse_rate("2.5Mbit") == 2_500_000
    with pytest.raises(ValueError, match="100mbit"):
        parse_rate("100 MB/s")


@needs_netns
def test_shaped_links_carry_tcp_between_namespaces_and_are_removed() -> None:
    with WanTestbed(3, "100mbit") as tb:
        names = set(tb.namespaces) | {tb.switch_ns}
        assert names <= _namespaces()
        qdisc = tb.qdiscs(0)
        assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        # peer 2 -> peer 1 through the bridge, over the shaped links
        server = tb.popen(
            1, [sys.executable, "-c", _SERVER, tb.addr(1)], stdout=subprocess.PIPE, text=True
        )
        assert server.stdout.readline().strip() == "listening"
        tb.run(2, [sys.executable, "-c", _CLIENT, tb.addr(1)], check=True, timeout=60)
        size, digest = server.stdout.readline().split()
        payload = bytes(range(256)) * 4096
        assert int(size) == len(payload)
        assert digest == hashlib.sha256(payload).hexdigest()
        server.wait(timeout=30)
        # the testbed's addresses do not exist outside its namespaces
        host_addrs = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout
        assert tb.addr(1) + "/" not in host_addrs
    assert not (names & _namespaces())


@needs_netns
def test_teardown_on_error_kills_processes_and_removes_namespaces() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with WanTestbed(2, "1gbit") as tb:
            names = set(tb.namespaces) | {tb.switch_ns}
            proc = tb.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert not (names & _namespaces())


def test_uplink_report_measures_use_between_the_first_and_last_busy_interval() -> None:
    from bench_wan import UplinkSampler

    sampler = UplinkSampler([1, 2])
    capacity = 1_000_000 / 8  # 1 Mbit/s in bytes per second
    # 10 ms intervals: idle, then peer 0 at full rate for 4 intervals while peer 1 sends at
    # full rate, stops for two intervals, then sends half, then all is idle again
    rates = [(0, 0), (1, 1), (1, 0), (1, 0), (1, 0.5), (0, 0), (0, 0)]
    t, sent = 0.0, [0, 0]
    sampler.samples.append((t, list(sent)))
    for r0, r1 in rates:
        t += 0.01
        sent = [sent[0] + int(r0 * capacity * 0.01), sent[1] + int(r1 * capacity * 0.01)]
        sampler.samples.append((t, list(sent)))
    report = sampler.report(1_000_000)
    assert report["span_s"] == pytest.approx(0.04)
    assert report["utilization"] == pytest.approx([1.0, 0.375], abs=0.01)
    assert report["idle_share"] == [0.0, 0.5]
    assert UplinkSampler([1]).report(1_000_000) == {
        "span_s": 0.0,
        "utilization": [],
        "idle_share": [],
    }
