"""A WAN testbed on one Linux box: N peers in network namespaces behind shaped links.

Layout (all addresses private and present only inside the namespaces created here)::

    ns <tag>-p0  eth0 10.214.0.1/24 --veth-- <tag>s0 ┐
    ns <tag>-p1  eth0 10.214.0.2/24 --veth-- <tag>s1 ├ br0 in ns <tag>-sw (the "switch")
    ...                                              ┘

Every peer's link is shaped in both directions with ``tc ... tbf`` (the peer's ``eth0`` egress
is its uplink, the switch-side veth's egress its downlink), optionally with a ``netem`` delay in
front, so each peer sees a ``rate`` up and down like a host on a WAN access link. Loopback
benchmarks hide the question the issue asks (does compression pay for itself when the link,
not the CPU, is the limit?); this answers it without a second machine.

Usage (root or CAP_NET_ADMIN; :func:`unavailable_reason` says why not otherwise)::

    with WanTestbed(4, rate="100mbit") as tb:
        procs = [tb.popen(i, [sys.executable, "worker.py", "--host", tb.addr(i)]) for i in range(4)]

Namespaces, veths and the bridge are removed in ``__exit__`` even when the body raises;
deleting a namespace deletes the veth ends inside it. Processes started with :meth:`popen` are
killed first, so nothing keeps a namespace alive.
"""

from __future__ import annotations

import logging
import re
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

from netns import NamespaceTestbed, run_command
from netns import unavailable_reason as namespaces_unavailable

__all__ = ["WanTestbed", "WanTestbedError", "parse_rate", "unavailable_reason"]

logger = logging.getLogger(__name__)

DEFAULT_SUBNET = "10.214.0"  # /24, exists only inside the testbed's namespaces
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class WanTestbedError(RuntimeError):
    """Setting up or running the namespace testbed failed (the message names the command)."""


def parse_rate(rate: str) -> int:
    """``"100mbit"`` -> bits per second (tc's decimal units)."""
    m = _RATE_RE.match(rate.strip())
    if not m:
        raise ValueError(f"rate must look like '100mbit' or '1gbit', got {rate!r}")
    return int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return run_command(argv, WanTestbedError, check)


def unavailable_reason() -> str | None:
    """``None`` if network namespaces, veths, bridges and tbf can be used here, else why not."""

    def tbf(name: str) -> str | None:
        proc = _run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
             "rate", "1mbit", "burst", "32kb", "latency", "50ms"],
            check=False,
        )  # fmt: skip
        return f"the tbf qdisc is not available: {proc.stderr.strip()}" if proc.returncode else None

    return namespaces_unavailable({"tc": "iproute2"}, tbf)


class WanTestbed(NamespaceTestbed):
    """Context manager: ``num_peers`` namespaces on a bridge, each link shaped to ``rate``.

    :param rate: per-peer link rate in each direction, tc syntax (``"100mbit"``, ``"1gbit"``).
    :param delay_ms: optional one-way delay added on every peer's uplink and downlink (netem),
      so the round-trip time between two peers is ``4 * delay_ms``.
    :param subnet: first three octets of a private /24 used only inside the namespaces.
    :param latency_ms: tbf queue size expressed as time at ``rate`` (packets queued longer are
      dropped, as on a real bottleneck with a finite buffer).
    """

    def __init__(
        self,
        num_peers: int,
        rate: str = "100mbit",
        *,
        delay_ms: float = 0.0,
        subnet: str = DEFAULT_SUBNET,
        latency_ms: float = 50.0,
    ):
        if not 1 <= num_peers <= 200:
            raise ValueError(f"num_peers must be in 1..200, got {num_peers}")
        if not re.match(r"^10\.\d{1,3}\.\d{1,3}$", subnet):
            raise ValueError(f"subnet must be the first three octets of a 10/8 net, got {subnet!r}")
        self.num_peers = num_peers
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.delay_ms = float(delay_ms)
        self.subnet = subnet
        self.latency_ms = float(latency_ms)
        # unique per testbed so concurrent runs (other engineers, parallel tests) never collide;
        # interface names must stay <= 15 characters
        self.tag = "mw" + uuid.uuid4().hex[:6]
        self.switch_ns = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-p{i}" for i in range(num_peers)]
        self.error = WanTestbedError
        super().__init__()

    # -- addresses and processes ---------------------------------------------------------------

    def addr(self, i: int) -> str:
        """IPv4 address of peer ``i`` (reachable from every other peer's namespace)."""
        return f"{self.subnet}.{i + 1}"

    def ns_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside peer ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in peer ``i``'s namespace; killed on exit if still running."""
        return self._spawn(self.namespaces[i], argv, **kwargs)

    def run(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion in peer ``i``'s namespace."""
        return self._run_in(self.namespaces[i], argv, **kwargs)

    # -- setup / teardown ----------------------------------------------------------------------

    def _shape(self, ns: str, dev: str) -> None:
        rate_bytes = self.rate_bps // 8
        # the bucket must hold at least one timer tick of traffic (HZ is 100..1000) and a
        # jumbo GSO segment, or tbf caps the rate below `rate`
        burst = max(64 * 1024, rate_bytes // 100)
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", f"{self.latency_ms}ms"]
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        if self.delay_ms > 0:
            try:
                _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms}ms"])
            except WanTestbedError as e:
                raise WanTestbedError(
                    f"delay_ms needs the netem qdisc (kernel module sch_netem): {e}"
                ) from e
            _run([*tc, "parent", "1:", "handle", "2:", *tbf])
        else:
            _run([*tc, "root", *tbf])

    name = "WAN testbed"

    def _unavailable(self) -> str | None:
        return unavailable_reason()

    def _describe(self) -> str:
        return (
            f"WAN testbed {self.tag}: {self.num_peers} peers at {self.rate} "
            f"(delay {self.delay_ms:.1f} ms)"
        )

    def _setup(self) -> None:
        sw = self.switch_ns
        _run(["ip", "netns", "add", sw])
        self._created.append(sw)
        _run(["ip", "-n", sw, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", sw, "link", "set", "br0", "up"])
        _run(["ip", "-n", sw, "link", "set", "lo", "up"])
        for i, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            outer = f"{self.tag}s{i}"
            # create the pair inside the switch namespace (never in the root namespace), then
            # move the peer end into the peer's namespace
            _run(["ip", "-n", sw, "link", "add", outer, "type", "veth", "peer", "name", "eth0"])
            _run(["ip", "-n", sw, "link", "set", "eth0", "netns", ns])
            _run(["ip", "-n", sw, "link", "set", outer, "master", "br0"])
            _run(["ip", "-n", sw, "link", "set", outer, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._shape(ns, "eth0")  # uplink
            self._shape(sw, outer)  # downlink

    # -- introspection (tests, reports) --------------------------------------------------------

    def qdiscs(self, i: int) -> str:
        """``tc qdisc show`` of peer ``i``'s uplink (for reports and tests)."""
        ns = self.namespaces[i]
        return _run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0"]).stdout

    def describe(self) -> dict[str, Any]:
        return {
            "peers": self.num_peers,
            "rate": self.rate,
            "rate_bps": self.rate_bps,
            "delay_ms": self.delay_ms,
            "tbf_latency_ms": self.latency_ms,
        }
