"""A NAT test bed on one Linux box: a "public" network and home LANs behind real NATs.

Layout (every address exists only inside the namespaces created here)::

    ns <tag>-pub0  eth0 10.215.0.1 ─┐
    ns <tag>-pub1  eth0 10.215.0.2 ─┤
                                    ├ br0 in ns <tag>-net: the "Internet", 10.215.0.0/24
    ns <tag>-r0    wan0 10.215.0.101┤   router 0: nftables masquerade (NAT behaviour 0)
    ns <tag>-r1    wan0 10.215.0.102┘   router 1: ...
         r0 lan0 192.168.1.1/24 (a bridge) ── ns <tag>-home0-0  eth0 192.168.1.2, via .1
         r1 lan0 192.168.2.1/24 (a bridge) ── ns <tag>-home1-0  eth0 192.168.2.2, via .1

Hosts in a home LAN reach the public network through their router, which rewrites their
source address to its own WAN address (``masquerade``); nothing can connect in: the public
network has no route to the LANs, and the router's WAN side drops (or rejects) every new
inbound connection. The NAT behaviour of each router is one of:

* ``"eim"`` (endpoint-independent mapping): plain ``masquerade``, which keeps the source port
  where it is free, so one local ``ip:port`` maps to the same public port whatever the
  destination; the common home router. Its filtering is still address-dependent (no
  conntrack entry, no way in), so hole punching would work but unsolicited dials do not.
* ``"symmetric"``: ``masquerade fully-random``, a new random public port for every
  connection (per destination), like carrier-grade or enterprise NATs.

:meth:`NatTestbed.forward_port` opens one port of a router to one of its hosts (DNAT), like a
user-configured port forward: that host is then reachable at ``router_addr(j):port``.

The "public" network uses a private range (10.215.0.0/24) by default because it must not
collide with real addresses; code under test must not treat private ranges as "behind NAT" by
themselves. ``public_subnet="203.0.113"`` (TEST-NET-3, a documentation range no NAT hands
out) puts it on addresses that count as globally routable (``reachability.globally_routable``),
as a VM on the Internet has: what a lone bootstrap node needs to find it is public.

Usage (root or CAP_NET_ADMIN, ``ip`` and ``nft``; :func:`unavailable_reason` says why not)::

    with NatTestbed(public_hosts=1, nats=("eim", "symmetric")) as tb:
        server = tb.popen("pub0", [sys.executable, "server.py", tb.addr("pub0")])
        tb.run("home0-0", [sys.executable, "client.py", tb.addr("pub0")])

Namespaces are removed in ``__exit__`` even when the body raises (deleting a namespace
deletes its veth ends, bridges and nftables rules); processes started with :meth:`popen` are
killed first.
"""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Sequence
from typing import Any

from netns import NamespaceTestbed, run_command
from netns import unavailable_reason as namespaces_unavailable

__all__ = ["GLOBAL_SUBNET", "NAT_BEHAVIOURS", "NatTestbed", "NatTestbedError", "unavailable_reason"]

logger = logging.getLogger(__name__)

PUBLIC_SUBNET = "10.215.0"  # /24; public hosts .1 .., routers' WAN side .101 ..
GLOBAL_SUBNET = "203.0.113"  # TEST-NET-3: routable-looking, never on a real home LAN
NAT_BEHAVIOURS = {"eim": "masquerade", "symmetric": "masquerade fully-random"}
INBOUND_POLICIES = ("drop", "reject")


class NatTestbedError(RuntimeError):
    """Setting up or running the NAT test bed failed (the message names the command)."""


def _run(
    argv: Sequence[str], check: bool = True, input_text: str | None = None
) -> subprocess.CompletedProcess:
    return run_command(argv, NatTestbedError, check, input_text)


def _router_ruleset(wan: str, lan: str, lan_net: str, nat: str, inbound: str) -> str:
    """nftables rules of one home router: NAT out, established traffic back, nothing in
    (but what :meth:`NatTestbed.forward_port` adds to ``prerouting``)."""
    refuse = "drop" if inbound == "drop" else "reject with tcp reset"
    return f"""
table ip nat {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "{wan}" ip saddr {lan_net} {NAT_BEHAVIOURS[nat]}
    }}
}}
table inet filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "{lan}" oifname "{wan}" accept
        ct status dnat accept
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "{wan}" ct state established,related accept
        iifname "{wan}" meta l4proto tcp {refuse}
        iifname "{wan}" drop
    }}
}}
"""


def unavailable_reason() -> str | None:
    """``None`` if namespaces, veths, bridges and nftables NAT can be used here, else why not."""

    def bridge_and_nat(name: str) -> str | None:
        proc = _run(["ip", "-n", name, "link", "add", "b0", "type", "bridge"], check=False)
        if proc.returncode != 0:
            return f"bridges are not available: {proc.stderr.strip()}"
        rules = _router_ruleset("p0", "p1", "192.168.1.0/24", "symmetric", "reject")
        proc = _run(["ip", "netns", "exec", name, "nft", "-f", "-"], check=False, input_text=rules)
        if proc.returncode != 0:
            return f"nftables NAT (masquerade) is not available: {proc.stderr.strip()}"
        return None

    tools = {"nft": "nftables: apt-get install nftables", "sysctl": "procps"}
    return namespaces_unavailable(tools, bridge_and_nat)


class NatTestbed(NamespaceTestbed):
    """Context manager: ``public_hosts`` namespaces on the "Internet" and one home LAN per
    entry of ``nats`` (its router's NAT behaviour: ``"eim"`` or ``"symmetric"``), each with
    ``hosts_per_home`` hosts.

    Host names: ``"pub<i>"`` and ``"home<j>-<k>"`` (``"home<j>"`` is ``"home<j>-0"``).
    :param inbound: what a router does with a new connection arriving at its WAN address:
      ``"drop"`` (silently, like most home routers: a dial times out) or ``"reject"`` (TCP
      reset: a dial fails at once).
    :param public_subnet: the first three octets of the "Internet" /24 (default
      ``10.215.0``; :data:`GLOBAL_SUBNET` for addresses that look globally routable).
    """

    def __init__(
        self,
        public_hosts: int = 1,
        nats: Sequence[str] = ("eim", "symmetric"),
        *,
        hosts_per_home: int = 1,
        inbound: str = "drop",
        public_subnet: str = PUBLIC_SUBNET,
    ):
        if not 1 <= public_hosts <= 50:
            raise ValueError(f"public_hosts must be in 1..50, got {public_hosts}")
        if not 0 <= len(nats) <= 50:
            raise ValueError(f"at most 50 home LANs, got {len(nats)}")
        unknown = [n for n in nats if n not in NAT_BEHAVIOURS]
        if unknown:
            raise ValueError(f"unknown NAT behaviour {unknown[0]!r}; one of {list(NAT_BEHAVIOURS)}")
        if not 1 <= hosts_per_home <= 50:
            raise ValueError(f"hosts_per_home must be in 1..50, got {hosts_per_home}")
        if inbound not in INBOUND_POLICIES:
            raise ValueError(f"inbound must be one of {INBOUND_POLICIES}, got {inbound!r}")
        octets = public_subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and 0 <= int(o) <= 255 for o in octets):
            raise ValueError(
                f"public_subnet must be three octets like '10.215.0', got {public_subnet!r}"
            )
        if public_subnet.startswith("192.168."):
            raise ValueError("public_subnet must not be in 192.168.0.0/16 (the home LANs)")
        self.public_subnet = public_subnet
        self.public_hosts = public_hosts
        self.nats = tuple(nats)
        self.hosts_per_home = hosts_per_home
        self.inbound = inbound
        # unique per test bed so concurrent runs never collide; interface names <= 15 chars
        self.tag = "nt" + uuid.uuid4().hex[:6]
        self.net_ns = f"{self.tag}-net"
        self._addrs: dict[str, str] = {}
        self._namespaces: dict[str, str] = {}
        for i in range(public_hosts):
            self._addrs[f"pub{i}"] = f"{public_subnet}.{i + 1}"
            self._namespaces[f"pub{i}"] = f"{self.tag}-pub{i}"
        for j in range(len(self.nats)):
            for k in range(hosts_per_home):
                self._addrs[f"home{j}-{k}"] = f"{self._lan_prefix(j)}.{k + 2}"
                self._namespaces[f"home{j}-{k}"] = f"{self.tag}-home{j}-{k}"
        super().__init__()
        self.error = NatTestbedError

    # -- names and addresses ---------------------------------------------------------------------

    @staticmethod
    def _lan_prefix(j: int) -> str:
        return f"192.168.{j + 1}"

    def _name(self, host: str) -> str:
        if host.startswith("home") and "-" not in host:
            host = f"{host}-0"
        if host not in self._namespaces:
            raise KeyError(f"no host {host!r} in this test bed; hosts: {self.hosts}")
        return host

    @property
    def hosts(self) -> list[str]:
        return list(self._namespaces)

    def namespace(self, host: str) -> str:
        return self._namespaces[self._name(host)]

    def addr(self, host: str) -> str:
        """The host's own IPv4 address (a home host's is private to its LAN)."""
        return self._addrs[self._name(host)]

    def router_addr(self, home: int) -> str:
        """The public (WAN) address of home LAN ``home``'s router: what the public network
        sees as the source of that LAN's connections."""
        if not 0 <= home < len(self.nats):
            raise KeyError(f"no home LAN {home}")
        return f"{self.public_subnet}.{101 + home}"

    def router_namespace(self, home: int) -> str:
        return f"{self.tag}-r{home}"

    # -- processes -------------------------------------------------------------------------------

    def ns_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace; killed on exit if still running."""
        return self._spawn(self.namespace(host), argv, **kwargs)

    def run(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` to completion in ``host``'s namespace."""
        return self._run_in(self.namespace(host), argv, **kwargs)

    # -- setup / teardown ------------------------------------------------------------------------

    name = "NAT test bed"

    def _unavailable(self) -> str | None:
        return unavailable_reason()

    def _describe(self) -> str:
        return (
            f"NAT test bed {self.tag}: {self.public_hosts} public host(s), home LANs behind "
            f"{', '.join(self.nats) or 'none'}"
        )

    def _plug(self, switch_ns: str, bridge: str, outer: str, ns: str, inner: str) -> None:
        """A veth from ``bridge`` in ``switch_ns`` to interface ``inner`` in ``ns`` (created in
        the switch namespace, never in the root namespace, then moved)."""
        _run(["ip", "-n", switch_ns, "link", "add", outer, "type", "veth", "peer", "name", inner])
        _run(["ip", "-n", switch_ns, "link", "set", inner, "netns", ns])
        _run(["ip", "-n", switch_ns, "link", "set", outer, "master", bridge])
        _run(["ip", "-n", switch_ns, "link", "set", outer, "up"])
        _run(["ip", "-n", ns, "link", "set", inner, "up"])

    def _setup(self) -> None:
        net = self.net_ns
        self._add_namespace(net)
        _run(["ip", "-n", net, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", net, "link", "set", "br0", "up"])
        for i in range(self.public_hosts):
            name = f"pub{i}"
            ns = self._namespaces[name]
            self._add_namespace(ns)
            self._plug(net, "br0", f"{self.tag}p{i}", ns, "eth0")
            _run(["ip", "-n", ns, "addr", "add", f"{self._addrs[name]}/24", "dev", "eth0"])
        for j, nat in enumerate(self.nats):
            router = self.router_namespace(j)
            self._add_namespace(router)
            self._plug(net, "br0", f"{self.tag}r{j}", router, "wan0")
            _run(["ip", "-n", router, "addr", "add", f"{self.router_addr(j)}/24", "dev", "wan0"])
            _run(["ip", "-n", router, "link", "add", "lan0", "type", "bridge"])
            _run(["ip", "-n", router, "link", "set", "lan0", "up"])
            lan = self._lan_prefix(j)
            _run(["ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan0"])
            _run(["ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
            rules = _router_ruleset("wan0", "lan0", f"{lan}.0/24", nat, self.inbound)
            _run(["ip", "netns", "exec", router, "nft", "-f", "-"], input_text=rules)
            for k in range(self.hosts_per_home):
                name = f"home{j}-{k}"
                ns = self._namespaces[name]
                self._add_namespace(ns)
                self._plug(router, "lan0", f"h{k}", ns, "eth0")
                _run(["ip", "-n", ns, "addr", "add", f"{self._addrs[name]}/24", "dev", "eth0"])
                _run(["ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1"])

    def forward_port(self, home: int, port: int, host: int = 0) -> None:
        """Forward TCP ``port`` of home LAN ``home``'s public address to the same port of
        its host ``host`` (what a user configures on a home router, or UPnP does)."""
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        target = self.addr(f"home{home}-{host}")
        _run(
            ["ip", "netns", "exec", self.router_namespace(home), "nft", "add", "rule", "ip", "nat",
             "prerouting", "iifname", "wan0", "tcp", "dport", str(port), "dnat", "to",
             f"{target}:{port}"]
        )  # fmt: skip

    # -- introspection (tests, reports) ----------------------------------------------------------

    def ruleset(self, home: int) -> str:
        """``nft list ruleset`` of home LAN ``home``'s router."""
        return _run(
            ["ip", "netns", "exec", self.router_namespace(home), "nft", "list", "ruleset"]
        ).stdout

    def describe(self) -> dict[str, Any]:
        return {
            "public_hosts": self.public_hosts,
            "nats": list(self.nats),
            "hosts_per_home": self.hosts_per_home,
            "inbound": self.inbound,
            "public_subnet": self.public_subnet,
        }
