"""Roles follow reachability, end to end: peers behind NATs started without any flag decide
they are private, reserve relay slots on the public peers and are reached through them.

The in-process test (loopback TCP) checks the averaging rule: a peer reachable only through
a relay reduces only when its tensors fit the relay's per-connection limit. The test-bed test
(``slow``) runs real processes behind real NATs (``benchmarks/nat_testbed.py``); it needs
root, ``ip`` and ``nft`` and skips saying which is missing (``pytest -rs``).
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from dht.p2p.relay import RelayLimits
from tests.dht.test_roles import Swarm, wait_until
from tests.timing import patience

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from nat_testbed import NatTestbed, unavailable_reason  # noqa: E402

_REASON = unavailable_reason()

AVERAGING = dict(
    target_group_size=2,
    min_group_size=2,
    initial_group_bits="",
    min_matchmaking_time=0.5,
    request_timeout=2.0,
    allreduce_timeout=10.0,
)


async def _average(averagers: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(averagers)

    async def one(i: int) -> None:
        results[i] = await averagers[i].astep(timeout=20)

    async with trio.open_nursery() as nursery:
        for i in range(len(averagers)):
            nursery.start_soon(one, i)
    return results


async def test_relayed_peer_reduces_only_what_its_relay_carries() -> None:
    torch = pytest.importorskip("torch")
    from moshpit.averaging.averager import RELAY_CONTROL_HEADROOM, Averager

    limit = 128 * 1024
    async with trio.open_nursery() as nursery:
        swarm = Swarm(nursery)
        r, s = await swarm.public_pair(relay=RelayLimits(circuit_data=limit))
        await wait_until(lambda: r.relay_service is not None and s.relay_service is not None)
        boot = r
        a = await swarm.private(boot)
        c = await swarm.private(boot)
        for node in (a, c):
            await wait_until(lambda node=node: node.role is not None and node.role.circuit_addrs)
            assert node.relay_limit.data == limit and not node.client_mode

        # two peers nobody can dial: they average through a relay, both reducing (16 values
        # fit the relay's 128 KiB per connection, even counted over both directions)
        pair = [
            Averager([torch.full((16,), float(v))], node, "small", **AVERAGING)
            for v, node in ((1, a), (3, c))
        ]
        results = await _average(pair)
        assert all(res.succeeded for res in results), [res.reason for res in results]
        assert sorted(results[0].modes) == ["node", "node"]
        for averager in pair:
            assert torch.equal(averager._tensors[0], torch.full((16,), 2.0))
        assert a.network.relayed_only(c.peer_id) and c.network.relayed_only(a.peer_id)

        # tensors too big for the relay: the relayed peer averages as a client (the public
        # peer reduces everything; the private one reaches it directly)
        numel = (limit // 2 - RELAY_CONTROL_HEADROOM) // 4 + 1  # both directions in one budget
        big = [
            Averager([torch.full((numel,), float(v))], node, "big", **AVERAGING)
            for v, node in ((1, a), (3, r))
        ]
        results = await _average(big)
        assert all(res.succeeded for res in results), [res.reason for res in results]
        modes = dict(zip(results[0].members, results[0].modes, strict=True))
        assert modes == {a.peer_id: "client", r.peer_id: "node"}
        for averager in big:
            assert torch.equal(averager._tensors[0], torch.full((numel,), 2.0))
        for averager in pair + big:
            averager.shutdown()
        nursery.cancel_scope.cancel()


# -- real NATs ----------------------------------------------------------------------------------

# Four public DHT peers in one process (ports 4001-4004), default options: they check each
# other with AutoNAT, find they are public and serve relays. Prints "ready <bootstrap addr>",
# then serves until stdin closes.
_PUBLIC = r"""
import sys, trio
from contextlib import AsyncExitStack
from dht import DHTNode

async def main(pub):
    async with AsyncExitStack() as stack:
        nodes = [await stack.enter_async_context(
            DHTNode.open(host_maddrs=["/ip4/0.0.0.0/tcp/4001"]))]
        boot = [str(a) for a in nodes[0].get_visible_maddrs() if f"/ip4/{pub}/" in str(a)]
        for port in (4002, 4003, 4004):
            nodes.append(await stack.enter_async_context(
                DHTNode.open(initial_peers=boot, host_maddrs=[f"/ip4/0.0.0.0/tcp/{port}"])))
        with trio.fail_after(30):
            while not all(n.role is not None and n.role.serving_relay for n in nodes):
                await trio.sleep(0.05)
        print("ready", boot[0], flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)

trio.run(main, sys.argv[1])
"""

# A peer behind a NAT, started like any volunteer: DHTNode.open with its initial peer and
# nothing else. Prints its role once AutoNAT decided and a relay took it, then runs commands
# from stdin, one JSON line per answer.
_HOME = r"""
import json, sys, trio
from dht import DHTNode
from dht.kademlia.clock import get_dht_time
from dht.kademlia.ids import node_id_of
from dht.p2p import PeerID

def say(**fields):
    print(json.dumps(fields), flush=True)

# how we reach a peer: only through a relay, or (hole punching, where it works between the
# two NATs) also over a punched direct connection
def path(node, peer):
    if node.network.relayed_only(peer):
        return "relayed"
    live = [c for c in node.host._conns.get(peer, ()) if c.alive]
    if any(getattr(c, "hole_punched", False) for c in live):
        return "hole-punched"
    return "direct" if live else "none"

async def main(boot):
    async with DHTNode.open(initial_peers=[boot], bootstrap_timeout=20) as node:
        with trio.fail_after(30):
            while node.role is None or not node.role.circuit_addrs:
                await trio.sleep(0.05)
        role = node.role
        say(peer=str(node.peer_id), line=role.describe(), client_mode=node.client_mode,
            status=role.reachability.status.value, relays=[str(a) for a in role.circuit_addrs],
            visible=[str(a) for a in node.get_visible_maddrs()])
        stdin = trio.wrap_file(sys.stdin)
        while line := (await stdin.readline()).split():
            cmd, args = line[0], line[1:]
            if cmd == "ping":  # find the peer through the DHT, then a DHT RPC to it
                peer = PeerID.from_base58(args[0])
                found = await node.find_nearest_peers(node_id_of(peer), 8)
                addrs = [c.addrs for c in found if c.peer_id == peer]
                ok = await node.ping(peer)
                say(ok=ok, path=path(node, peer), found=bool(addrs))
            elif cmd == "put":  # a record stored on that very peer, over the relay
                peer = PeerID.from_base58(args[0])
                _, record = node._make_record(args[1], None, args[2], get_dht_time() + 120)
                (accepted, reason), = await node._store_rpc(peer, [record])
                say(accepted=accepted, reason=reason)
            elif cmd == "store":
                say(ok=await node.store(args[0], args[1], get_dht_time() + 120))
            elif cmd == "get":
                found = await node.get(args[0], latest=True)
                say(value=None if found is None else found.value)
            elif cmd == "has":
                from dht.kademlia.ids import id_from_bytes, serialize
                stored = node.storage.get(id_from_bytes(serialize(args[0])), get_dht_time())
                say(has=stored is not None)
            elif cmd == "average":
                import torch
                from moshpit import Averager
                peer = PeerID.from_base58(args[1])
                avg = Averager([torch.full((16,), float(args[0]))], node, "nat",
                               target_group_size=2, min_group_size=2, initial_group_bits="",
                               min_matchmaking_time=1.0, request_timeout=3.0,
                               allreduce_timeout=10.0)
                result = await avg.astep(timeout=20)
                say(ok=result.succeeded, reason=result.reason, modes=list(result.modes),
                    values=avg._tensors[0].tolist(), path=path(node, peer))
                avg.shutdown()

trio.run(main, sys.argv[1])
"""


class _Lines:
    """A process' stdout lines, read by a thread (so that waits time out)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)

    def next(self, prefix: str = "{", timeout: float = 30.0) -> str:
        deadline = time.monotonic() + patience(timeout)  # stretched by load: tests/timing.py
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no {prefix!r} line; output: {''.join(self.output)[-4000:]}"
                ) from None
            if line.startswith(prefix):
                return line

    def ask(self, command: str, timeout: float = 30.0) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.next("{", timeout))


def _start(tb: NatTestbed, host: str, script: str, *args: str) -> _Lines:
    proc = tb.popen(
        host,
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return _Lines(proc)


@pytest.mark.slow
def test_peers_behind_two_nats_are_reached_through_a_relay_without_any_flag() -> None:
    if _REASON is not None:
        pytest.skip(f"NAT test bed unavailable: {_REASON}")
    with NatTestbed(public_hosts=1, nats=("eim", "symmetric"), inbound="reject") as tb:
        pub = tb.addr("pub0")
        public = _start(tb, "pub0", _PUBLIC, pub)
        boot = public.next("ready").split()[1]
        assert boot.startswith(f"/ip4/{pub}/tcp/4001/p2p/"), boot
        homes = [_start(tb, home, _HOME, boot) for home in ("home0", "home1")]
        roles = [json.loads(home.next("{", timeout=40)) for home in homes]
        for role in roles:
            # private, a slot on the public peers' relays, announced instead of the LAN address
            assert role["status"] == "private" and not role["client_mode"], role
            assert role["line"].startswith("Reachability: private ("), role
            assert "could not dial this peer back (behind NAT or a firewall)" in role["line"]
            assert f"reachable via relay /ip4/{pub}/tcp/400" in role["line"], role
            assert role["line"].endswith("acting as a DHT server reached through the relay")
            assert role["visible"] and all("/p2p-circuit/p2p/" in a for a in role["visible"])
        peers = [role["peer"] for role in roles]
        for me, other in ((0, 1), (1, 0)):
            # found through the DHT, and answered through a relay (no other way in). The
            # other peer announces its relayed addresses after its verdict: on a loaded
            # machine the first lookup may come before that record is stored: look again
            deadline = time.monotonic() + patience(15)
            answer = homes[me].ask(f"ping {peers[other]}")
            while not answer["found"] and time.monotonic() < deadline:
                time.sleep(0.5)
                answer = homes[me].ask(f"ping {peers[other]}")
            assert answer["ok"] and answer["found"], answer
            assert answer["path"] in ("relayed", "hole-punched"), answer
            # a record stored on the other NATed peer, and read back through the DHT
            key = f"from-home{me}"
            assert homes[me].ask(f"put {peers[other]} {key} v{me}")["accepted"]
            assert homes[other].ask(f"has {key}")["has"]
            assert homes[me].ask(f"store {key}-stored w{me}")["ok"]
            assert homes[other].ask(f"get {key}-stored")["value"] == f"w{me}"
        # two averagers behind the two NATs: the exact mean, through the relay
        for i, home in enumerate(homes):
            home.proc.stdin.write(f"average {2 * i + 1} {peers[1 - i]}\n")
            home.proc.stdin.flush()
        for home in homes:
            result = json.loads(home.next("{", timeout=40))
            assert result["ok"], result
            assert sorted(result["modes"]) == ["node", "node"], result
            assert result["values"] == [2.0] * 16, result
            assert result["path"] in ("relayed", "hole-punched"), result
        for proc in [public.proc] + [home.proc for home in homes]:
            proc.stdin.close()
        for proc in [public.proc] + [home.proc for home in homes]:
            proc.wait(timeout=20)
