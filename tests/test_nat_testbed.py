"""benchmarks/nat_testbed.py: real NATs in network namespaces, and AutoNAT behind them.

The NAT checks need root, ``ip`` and ``nft``; where those are missing the tests skip and
say which one (``pytest -rs`` shows the reason).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from nat_testbed import NatTestbed, unavailable_reason  # noqa: E402

_REASON = unavailable_reason()


def _require_netns() -> None:
    if _REASON is not None:
        pytest.skip(f"NAT test bed unavailable: {_REASON}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# Reports the ip:port each connection came from, on two ports (two "destinations").
_MAPPING_SERVER = r"""
import selectors, socket, sys
sel = selectors.DefaultSelector()
for port in (5001, 5002):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], port))
    s.listen(8)
    sel.register(s, selectors.EVENT_READ)
print("listening", flush=True)
for _ in range(int(sys.argv[2])):
    events = sel.select(timeout=20)
    if not events:
        sys.exit("no connection within 20s")
    for key, _ in events[:1]:
        c, (ip, port) = key.fileobj.accept()
        c.sendall(f"{ip} {port}\n".encode())
        c.close()
"""
# From one local port to both server ports: which public ip:port did each leave from?
_MAPPING_CLIENT = r"""
import socket, sys
seen = []
socks = []
for port in (5001, 5002):
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    c.bind(("0.0.0.0", 40000))
    c.settimeout(10)
    c.connect((sys.argv[1], port))
    seen.append(c.makefile().readline().split())
    socks.append(c)
print(seen[0][0], seen[0][1], seen[1][1])
"""
_CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5)
except OSError as e:
    print("refused" if isinstance(e, ConnectionRefusedError) else f"failed {type(e).__name__}")
else:
    print("connected")
"""


@pytest.mark.slow
def test_nat_mappings_and_nothing_connects_in() -> None:
    _require_netns()
    with NatTestbed(public_hosts=1, nats=("eim", "symmetric"), inbound="drop") as tb:
        names = {tb.namespace(h) for h in tb.hosts} | {tb.net_ns}
        assert names <= _namespaces()
        assert "masquerade fully-random" in tb.ruleset(1)
        pub = tb.addr("pub0")
        server = tb.popen(
            "pub0", [sys.executable, "-c", _MAPPING_SERVER, pub, "4"], stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert server.stdout.readline().strip() == "listening"
        mapped = {}
        for j, home in enumerate(("home0", "home1")):
            out = tb.run(
                home, [sys.executable, "-c", _MAPPING_CLIENT, pub], capture_output=True,
                text=True, timeout=30, check=True,
            ).stdout.split()  # fmt: skip
            assert out[0] == tb.router_addr(j)  # the public side sees the router, not the host
            mapped[home] = (int(out[1]), int(out[2]))
        # endpoint-independent: one local port, the same public port for both destinations
        # (here even the local port itself: masquerade keeps a free port)
        assert mapped["home0"] == (40000, 40000)
        # symmetric: a new public port per destination
        assert mapped["home1"][0] != mapped["home1"][1], mapped
        server.wait(timeout=10)
        # a home host reaches the public network, nothing reaches a home host: its private
        # address has no route there, and its router drops unsolicited connections
        listener = tb.popen(
            "home0", [sys.executable, "-c",
                      "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',4001)); "
                      "s.listen(); print('up', flush=True); time.sleep(30)"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert listener.stdout.readline().strip() == "up"
        for target in (tb.router_addr(0), tb.addr("home0")):
            out = tb.run(
                "pub0", [sys.executable, "-c", _CONNECT, target, "4001"], capture_output=True,
                text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
            assert out.startswith("failed"), (target, out)
    assert not (names & _namespaces())


# Four public hosts in one process (the same IP, ports 4001-4004): serve AutoNAT, ask each
# other, print one JSON line per host; then serve until stdin closes.
_PUBLIC_PEERS = r"""
import json, sys, trio
from dht.p2p import Host
from dht.p2p.autonat import AutoNAT, AutoNATConfig

CFG = AutoNATConfig(dial_timeout=2.0, response_timeout=8.0)

async def main():
    async with trio.open_nursery() as nursery:
        hosts, nats = [], []
        for i in range(4):
            h = await nursery.start(run_host, 4001 + i)
            hosts.append(h)
            nat = AutoNAT(h, CFG)
            nat.serve()
            nats.append(nat)
        with trio.fail_after(20):
            for a in hosts:
                for b in hosts:
                    if a is not b:
                        await a.connect(b.listen_addrs)
        print("ready", flush=True)
        results = [None] * 4
        async def probe(i):
            others = [h.peer_id for h in hosts if h is not hosts[i]]  # not the home peers
            with trio.fail_after(20):
                await nats[i].probe(others)
            h = hosts[i]
            results[i] = {"status": h.reachability.status.value, "reason": h.reachability.reason,
                          "candidates": [str(a) for a in h.observed_addrs.candidates(h.listen_addrs)]}
        async with trio.open_nursery() as inner:
            for i in range(4):
                inner.start_soon(probe, i)
        print(json.dumps(results), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)
        nursery.cancel_scope.cancel()

async def run_host(port, task_status=trio.TASK_STATUS_IGNORED):
    async with Host.open() as h:
        await h.listen([f"/ip4/0.0.0.0/tcp/{port}"])
        task_status.started(h)
        await trio.sleep_forever()

trio.run(main)
"""
# A home peer: listen, connect to the public peers, ask them, print one JSON line.
_HOME_PEER = r"""
import json, sys, trio
from dht.p2p import Host
from dht.p2p.autonat import AutoNAT, AutoNATConfig

async def main(pub):
    async with Host.open() as h:
        await h.listen(["/ip4/0.0.0.0/tcp/4001"])
        with trio.fail_after(20):
            for port in range(4001, 4005):
                await h.connect([f"/ip4/{pub}/tcp/{port}"])
            while not all(c.identified.is_set() for g in h._conns.values() for c in g):
                await trio.sleep(0.05)
            await AutoNAT(h, AutoNATConfig(dial_timeout=2.0, response_timeout=8.0)).probe()
        print(json.dumps({
            "status": h.reachability.status.value, "reason": h.reachability.reason,
            "listen": [str(a.without_peer_id()) for a in h.listen_addrs],
            "candidates": [str(a) for a in h.observed_addrs.candidates(h.listen_addrs)],
            "observed": sorted({str(a) for a in h.observed_addrs.observed()}),
        }), flush=True)

trio.run(main, sys.argv[1])
"""


@pytest.mark.slow
def test_autonat_private_behind_nats_public_on_the_public_net_and_with_a_port_forward() -> None:
    _require_netns()
    with NatTestbed(public_hosts=1, nats=("eim", "symmetric", "eim"), inbound="drop") as tb:
        tb.forward_port(2, 4001)  # home2's user forwarded the port: reachable despite the NAT
        pub = tb.addr("pub0")
        public = tb.popen(
            "pub0", [sys.executable, "-c", _PUBLIC_PEERS], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert public.stdout.readline().strip() == "ready"
        homes = [
            tb.popen(
                home,
                [sys.executable, "-c", _HOME_PEER, pub],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for home in ("home0", "home1", "home2")
        ]
        results = json.loads(public.stdout.readline())
        for i, r in enumerate(results):
            assert r["status"] == "public", (i, r)
            assert "3 of 3 peers dialed this peer back" in r["reason"]
            assert f"/ip4/{pub}/tcp/{4001 + i}" in r["candidates"]
        for j, proc in enumerate(homes):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
            r = json.loads(out)
            if j == 2:
                assert r["status"] == "public", r
                assert (
                    f"4 of 4 peers dialed this peer back at /ip4/{tb.router_addr(2)}/tcp/4001"
                    in r["reason"]
                )
            else:
                assert r["status"] == "private", (j, r)
                assert "4 of 4 peers could not dial this peer back" in r["reason"]
            assert r["listen"][0] == f"/ip4/{tb.addr(f'home{j}')}/tcp/4001"
            # four public peers saw the router's address: the only trusted candidate IP
            assert r["candidates"] == [f"/ip4/{tb.router_addr(j)}/tcp/4001"], r
            assert {o.split("/")[2] for o in r["observed"]} == {tb.router_addr(j)}
        public.stdin.close()
        public.wait(timeout=10)


class _Lines:
    """A process' stdout lines, collected by a reader thread (so waits can time out)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, prefix: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line; output: {''.join(self.output)}"
                ) from None
            if line.startswith(prefix):
                return line[len(prefix) :].strip()


def _moshpit_dht(tb: NatTestbed, host: str, *args: str) -> _Lines:
    argv = [sys.executable, "-m", "moshpit", "dht", "--bootstrap-timeout", "20", *args]
    return _Lines(tb.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))


@pytest.mark.slow
def test_moshpit_dht_behind_nat_prints_private_and_why() -> None:
    _require_netns()
    with NatTestbed(public_hosts=1, nats=("eim",), inbound="reject") as tb:
        pub = tb.addr("pub0")
        boot = _moshpit_dht(tb, "pub0", "--host-maddrs", "/ip4/0.0.0.0/tcp/4001")
        joined = boot.wait_for("--initial-peers").split()
        assert joined and joined[0].startswith(f"/ip4/{pub}/tcp/4001/p2p/"), joined
        publics = [
            _moshpit_dht(tb, "pub0", "--host-maddrs", f"/ip4/0.0.0.0/tcp/{4002 + i}",
                         "--initial-peers", joined[0])
            for i in range(3)
        ]  # fmt: skip
        for p in publics:
            p.wait_for("Joined the swarm")
        home = _moshpit_dht(tb, "home0", "--initial-peers", joined[0])
        home.wait_for("Joined the swarm")
        line = home.wait_for("Reachability: private", timeout=30)
        assert "peers could not dial this peer back (behind NAT or a firewall)" in line, line
        # the bootstrap peer, asked by the public peers and the home peer, is public
        assert "peers dialed this peer back" in boot.wait_for("Reachability: public", timeout=30)
