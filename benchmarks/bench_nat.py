"""Hole punching (DCUtR) through real NATs: how long it takes and what the direct path buys.

Runs in the NAT test bed (``nat_testbed.py``: network namespaces, nftables masquerade; needs
root, ``ip`` and ``nft``): a relay on the "public" network, peer B behind an
endpoint-independent NAT holding a reservation on it, peer A behind another one dialing B's
circuit address. Prints one JSON object per result:

* ``reservation``: seconds from B's start (its Host opening) to "reachable via the relay"
  (the reservation granted);
* ``relayed_connect``: seconds for A to connect to B through the relay;
* ``hole_punch``: seconds from that relayed connection to the punched direct connection
  (as A sees it registered), and how many attempts B needed;
* ``transfer``, once per path (``relayed``, ``direct``): the same payload over the relayed
  connection and over the direct one in the same run (the relay's data limit is lifted for
  this), with throughput and CPU seconds per MB of the sender, the receiver and the relay;
* ``hole_punch_failure`` (unless ``--no-symmetric``): a third peer behind a *symmetric* NAT,
  where punching cannot work: seconds until B gives up (all its attempts), the relayed
  connection still in use.

    sudo python benchmarks/bench_nat.py [--mb 32] [--no-symmetric]

``--one-bootstrap`` measures the swarm people actually start instead: ONE public peer
running ``moshpit dht`` (no flag but its port, on an address that looks globally routable)
and ``--volunteers`` peers, each behind its own home router (``--nat``: port-preserving
``eim`` routers, ``symmetric`` ones, or ``mixed``), each a plain ``DHTNode.open`` with the
bootstrap address and a ``moshpit.Averager(target_group_size=--group)`` of ``--numel``
float32 values. Two ``one_bootstrap`` objects: the baseline (the same volunteers on public
addresses, ``"nats": ["none"]``) and the NAT'ed swarm, each with the seconds from the
bootstrap's start to the first averaged round (every volunteer holding its group's exact
mean), how the volunteers reached each other, and the bytes the bootstrap relayed while they
averaged against the bytes they averaged.

    sudo python benchmarks/bench_nat.py --one-bootstrap [--volunteers 2] [--nat eim]

The same file holds the peer programs (``bench_nat.py peer relay|target|dialer ...``) that
``tests/test_nat_dcutr.py`` starts in the test bed: JSON events on stdout (log lines on
stderr), commands on stdin.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SINK_PROTOCOL = "/moshpit-bench/sink/1.0.0"
LISTEN = "/ip4/0.0.0.0/tcp/4001"
MAX_SINK_BYTES = 1 << 32  # what a sink accepts in one transfer
BLOCK = 1 << 20


# ---------------------------------------------------------------------------------------------
# peer programs (run inside the namespaces)


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _result_fields(result: Any) -> dict[str, Any]:
    return {
        "peer": str(result.peer),
        "initiated": result.initiated,
        "success": result.success,
        "attempts": result.attempts,
        "seconds": result.seconds,
        "addr": result.addr,
        "reason": result.reason,
    }


def _conn_fields(conn: Any) -> dict[str, Any]:
    return {
        "relayed": conn.relayed,
        "outbound": conn.outbound,
        "hole_punched": conn.hole_punched,
        "remote": conn.remote_addr,
        "alive": conn.alive,
    }


def _punch_setting(args: argparse.Namespace) -> Any:
    from dht.p2p.dcutr import HolePunchConfig

    if args.no_punch:
        return False
    return HolePunchConfig(punch_timeout=args.punch_timeout)


async def _commands(handle: Any) -> None:
    """Read stdin lines and pass each, split, to ``handle`` until EOF or ``quit``."""
    import trio

    while True:
        line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        if not line or line.strip() == "quit":
            return
        if line.split():
            await handle(line.split())


async def _sink(stream: Any) -> None:
    header = await stream.receive_msg()
    size = int(header["size"]) if isinstance(header, dict) else -1
    if not 0 <= size <= MAX_SINK_BYTES:
        stream.reset()
        return
    cpu = time.process_time()
    digest = hashlib.sha256()
    got = 0
    while got < size:
        data = await stream.receive_some(BLOCK)
        if not data:
            break
        digest.update(data)
        got += len(data)
    await stream.send_msg(
        {"sha256": digest.hexdigest(), "bytes": got, "cpu": time.process_time() - cpu}
    )


async def _open_on(host: Any, conn: Any, protocol: str) -> Any:
    """A stream on that very connection (the Host would pick the best one)."""
    from dht.p2p import multistream
    from dht.p2p.host import P2PStream

    ystream = await conn.session.open_stream()
    _, inner = await multistream.negotiate_outbound(ystream, [protocol], 10.0)
    return P2PStream(inner, ystream, conn.peer_id, protocol, host.limits.max_message_size)


async def _send(host: Any, peer: Any, mode: str, size: int) -> dict[str, Any]:
    live = [c for c in host._conns.get(peer, ()) if c.alive]
    if mode == "relayed":
        conn = next((c for c in live if c.relayed), None)
    elif mode == "direct":
        conn = next((c for c in live if not c.relayed), None)
    else:
        conn = host._best_connection(peer)
    if conn is None:
        return {"ok": False, "error": f"no {mode} connection"}
    block = os.urandom(BLOCK)
    expected = hashlib.sha256()
    left = size
    while left:
        expected.update(block[: min(BLOCK, left)])
        left -= min(BLOCK, left)
    cpu, start = time.process_time(), time.monotonic()
    stream = await _open_on(host, conn, SINK_PROTOCOL)
    await stream.send_msg({"size": size})
    left = size
    while left:
        n = min(BLOCK, left)
        await stream.send_all(block[:n])
        left -= n
    await stream.send_eof()
    reply = await stream.receive_msg()
    seconds, cpu = time.monotonic() - start, time.process_time() - cpu
    await stream.aclose()
    return {
        "ok": reply.get("sha256") == expected.hexdigest() and reply.get("bytes") == size,
        "over": "relayed" if conn.relayed else "direct",
        "bytes": size,
        "seconds": seconds,
        "cpu": cpu,
        "peer_cpu": reply.get("cpu"),
    }


async def _peer_commands(host: Any, cmd: list[str], nursery: Any) -> None:
    """Commands both home peers answer: conns, send, dial."""
    import trio

    from dht.p2p import PeerID
    from dht.p2p.errors import P2PError

    if cmd[0] == "conns":
        peer = PeerID.from_base58(cmd[1])
        _emit("conns", peer=cmd[1], conns=[_conn_fields(c) for c in host._conns.get(peer, ())])
    elif cmd[0] == "send":
        peer = PeerID.from_base58(cmd[1])
        try:
            with trio.fail_after(120):
                result = await _send(host, peer, cmd[2], int(cmd[3]))
        except (P2PError, trio.BrokenResourceError, trio.TooSlowError) as e:
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _emit("sent", peer=cmd[1], mode=cmd[2], **result)
    elif cmd[0] == "dial":

        async def dial(addr: str) -> None:
            start = time.monotonic()
            try:
                peer = await host.connect([addr], timeout=30)
            except P2PError as e:
                _emit("connected", addr=addr, ok=False, error=str(e))
                return
            conn = host._best_connection(peer)
            _emit(
                "connected",
                addr=addr,
                ok=True,
                peer=str(peer),
                relayed=bool(conn is not None and conn.relayed),
                seconds=time.monotonic() - start,
                at=time.monotonic(),
            )

        nursery.start_soon(dial, cmd[1])
    else:
        _emit("error", error=f"unknown command {cmd!r}")


async def _run_relay(args: argparse.Namespace) -> None:
    from dht.p2p import Host
    from dht.p2p.relay import RelayLimits, enable_relay_service

    async with Host.open(hole_punching=False) as host:
        await host.listen([args.listen])
        limits = RelayLimits(circuit_data=args.circuit_data, circuit_duration=300)
        service = enable_relay_service(host, limits)
        addr = next(a for a in host.listen_addrs if not str(a).startswith("/ip4/127."))
        _emit("ready", addr=str(addr), peer=str(host.peer_id))

        async def handle(cmd: list[str]) -> None:
            if cmd[0] == "stats":
                _emit(
                    "stats",
                    bytes_forwarded=service.stats.bytes_forwarded,
                    circuits=len(service.circuits),
                    circuits_opened=service.stats.circuits_opened,
                    cpu=time.process_time(),
                )

        await _commands(handle)


async def _run_home(args: argparse.Namespace, target: bool) -> None:
    import trio

    from dht.p2p import Host, Multiaddr
    from dht.p2p.relay import relay_client

    started = time.monotonic()
    async with Host.open(hole_punching=_punch_setting(args)) as host:
        await host.listen([args.listen])
        host.set_stream_handler(SINK_PROTOCOL, _sink)
        if host.hole_puncher is not None:
            host.hole_puncher.add_observer(
                lambda r: _emit("holepunch", at=time.monotonic(), **_result_fields(r))
            )
        async with trio.open_nursery() as nursery:
            if target:
                relay = Multiaddr(args.relay)
                client = relay_client(host)
                rsvp = await nursery.start(client.keep_reservation, relay.peer_id, [relay])
                _emit(
                    "ready",
                    peer=str(host.peer_id),
                    circuit=str(rsvp.circuit_addrs[0]),
                    seconds=time.monotonic() - started,
                )
            else:
                _emit("ready", peer=str(host.peer_id))

            async def handle(cmd: list[str]) -> None:
                await _peer_commands(host, cmd, nursery)

            await _commands(handle)
            nursery.cancel_scope.cancel()


def _reached(node: Any, peer: Any) -> str:
    """How ``node`` reaches ``peer`` now: "relayed", "hole-punched", "direct" or "none"."""
    live = node.host.connections(peer)
    if live and all(c.relayed for c in live):
        return "relayed"
    if any(c.hole_punched for c in live if not c.relayed):
        return "hole-punched"
    return "direct" if live else "none"


VALUE_STEP = 24  # volunteer i adds 24 * i: the mean of any 2, 3 or 4 of them is an integer


def _volunteer_values(numel: int, index: int) -> Any:
    """Volunteer ``index``'s tensor: small integers, so that every group's mean is exact in
    float32, and the offset from the shared base says which volunteers were averaged."""
    import torch

    return (torch.arange(numel, dtype=torch.float32) % 1024) + VALUE_STEP * index


def _offset(tensor: Any, numel: int) -> float | None:
    """The averaged tensor's offset from the shared base when every element has the same one
    (what an exact mean of volunteers' values looks like), else None."""
    diff = tensor - _volunteer_values(numel, 0)
    first = float(diff[0])
    return first if bool((diff == first).all()) else None


def exact_mean_offset(indices: list[int]) -> float:
    """The offset an exact mean over the volunteers ``indices`` leaves."""
    return VALUE_STEP * sum(indices) / len(indices)


async def _run_volunteer(args: argparse.Namespace) -> None:
    """A volunteer as people start one: its bootstrap address and nothing about NATs; it
    averages round after round and reports each (JSON on stdout) until told to quit."""
    import torch
    import trio

    from dht import DHTNode
    from moshpit import Averager

    started = time.monotonic()
    async with DHTNode.open(initial_peers=[args.boot], bootstrap_timeout=30) as node:
        node.add_role_observer(
            lambda d: _emit(
                "role",
                at=time.monotonic(),
                status=d.reachability.status.value,
                line=d.describe(),
                relays=[str(a) for a in d.circuit_addrs],
                client_mode=d.client_mode,
            )
        )
        _emit(
            "joined",
            peer=str(node.peer_id),
            at=time.monotonic(),
            since_start=time.monotonic() - started,
        )
        tensor = _volunteer_values(args.numel, args.index)
        averager = Averager(
            [tensor], node, "onebootstrap", target_group_size=args.group, min_group_size=2
        )
        me = str(node.peer_id)

        async def average() -> None:
            """Round after round; after ``--rounds`` good ones it goes on, so that no other
            volunteer lacks a partner, until stdin says ``quit``."""
            done = 0
            while True:
                begun = time.monotonic()
                result = await averager.astep(timeout=60)
                _emit(
                    "round",
                    ok=result.succeeded,
                    offset=_offset(tensor, args.numel),  # averaged in place
                    reason=result.reason,
                    begun=begun,
                    at=time.monotonic(),
                    since_start=time.monotonic() - started,
                    modes=list(result.modes),
                    members=[str(m) for m in result.members],
                    paths={str(m): _reached(node, m) for m in result.members if str(m) != me},
                    bytes_sent=result.bytes_sent,
                    bytes_received=result.bytes_received,
                )
                done += result.succeeded
                if result.succeeded and done == args.rounds:
                    _emit("done", at=time.monotonic())
                with torch.no_grad():  # every round starts from the volunteers' own values
                    tensor.copy_(_volunteer_values(args.numel, args.index))

        async def ignore(cmd: list[str]) -> None:
            return None

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(average)
                await _commands(ignore)
                nursery.cancel_scope.cancel()
        finally:
            averager.shutdown()


def peer_main(argv: list[str]) -> None:
    import trio

    parser = argparse.ArgumentParser(prog="bench_nat.py peer")
    parser.add_argument("role", choices=("relay", "target", "dialer", "volunteer"))
    parser.add_argument("--listen", default=LISTEN)
    parser.add_argument("--relay", help="the relay's address (target)")
    parser.add_argument("--boot", help="the bootstrap node's address (volunteer)")
    parser.add_argument("--index", type=int, default=0, help="volunteer: which values it holds")
    parser.add_argument("--group", type=int, default=2, help="volunteer: target group size")
    parser.add_argument("--numel", type=int, default=4096, help="volunteer: float32 values")
    parser.add_argument("--rounds", type=int, default=3, help="volunteer: rounds to average")
    parser.add_argument("--circuit-data", type=int, default=128 * 1024, help="relay: 0 = no cap")
    parser.add_argument("--punch-timeout", type=float, default=5.0)
    parser.add_argument("--no-punch", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format=f"{args.role} %(name)s: %(message)s"
    )
    for name in ("dht.p2p.dcutr", "dht.p2p.relay"):
        logging.getLogger(name).setLevel(logging.INFO)
    if args.role == "relay":
        trio.run(_run_relay, args)
    elif args.role == "volunteer":
        for name in ("dht.p2p.autonat", "dht.kademlia.roles"):
            logging.getLogger(name).setLevel(logging.INFO)
        trio.run(_run_volunteer, args)
    else:
        trio.run(_run_home, args, args.role == "target")


# ---------------------------------------------------------------------------------------------
# the controller side (the test bed's root namespace)


class PeerProcess:
    """A peer program in a namespace: its JSON events, its log lines, commands to it."""

    def __init__(self, tb: Any, host: str, role: str, *args: str) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "peer", role, *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.name = f"{role}@{host}"
        self.proc = tb.popen(
            host,
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.logs: list[str] = []
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=self._read_logs, daemon=True).start()

    def _read_events(self) -> None:
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.logs.append(line)
                continue
            self.events.put(event)

    def _read_logs(self) -> None:
        for line in self.proc.stderr:
            self.logs.append(line)

    def send(self, *cmd: str) -> None:
        self.proc.stdin.write(" ".join(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, event: str, timeout: float = 30.0, **match: Any) -> dict[str, Any]:
        """The next event named ``event`` whose fields equal ``match`` (earlier ones that did
        not match stay in ``seen``)."""
        for old in self.seen:
            if old["event"] == event and all(old.get(k) == v for k, v in match.items()):
                self.seen.remove(old)
                return old
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                got = self.events.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {event} event {match} within {timeout:.0f}s; "
                    f"exit code {self.proc.poll()}; log:\n{''.join(self.logs[-40:])}"
                ) from None
            if got["event"] == event and all(got.get(k) == v for k, v in match.items()):
                return got
            self.seen.append(got)

    def collect(self, until: Any, timeout: float = 30.0) -> None:
        """Move arrived events into ``seen`` until one matching ``until`` is there (an
        AssertionError after ``timeout``); nothing is taken out of ``seen``."""
        deadline = time.monotonic() + timeout
        while not any(until(e) for e in self.seen):
            try:
                self.seen.append(self.events.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no such event within {timeout:.0f}s; log:\n"
                    f"{''.join(self.logs[-40:])}"
                ) from None

    def request(self, event: str, *cmd: str, timeout: float = 30.0) -> dict[str, Any]:
        self.send(*cmd)
        return self.wait(event, timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


def start_relay(tb: Any, *args: str) -> tuple[PeerProcess, str]:
    relay = PeerProcess(tb, "pub0", "relay", *args)
    return relay, relay.wait("ready")["addr"]


def _transfer(
    relay: PeerProcess, dialer: PeerProcess, target: str, mode: str, size: int
) -> dict[str, Any]:
    before = relay.request("stats", "stats")
    sent = dialer.request("sent", "send", target, mode, str(size), timeout=180)
    after = relay.request("stats", "stats")
    if not sent.get("ok"):
        raise RuntimeError(f"{mode} transfer failed: {sent}")
    mb = size / 1e6
    relay_cpu = after["cpu"] - before["cpu"]
    return {
        "metric": "transfer",
        "path": sent["over"],
        "mb": mb,
        "seconds": round(sent["seconds"], 3),
        "mb_per_s": round(mb / sent["seconds"], 1),
        "cpu_s_per_mb": {
            "sender": round(sent["cpu"] / mb, 5),
            "receiver": round(sent["peer_cpu"] / mb, 5),
            "relay": round(relay_cpu / mb, 5),
            "total": round((sent["cpu"] + sent["peer_cpu"] + relay_cpu) / mb, 5),
        },
        "relay_bytes": after["bytes_forwarded"] - before["bytes_forwarded"],
    }


def bench(mb: int, symmetric: bool) -> list[dict[str, Any]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nat_testbed import NatTestbed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"NAT test bed unavailable: {reason}")
    nats = ("eim", "eim", "symmetric") if symmetric else ("eim", "eim")
    results: list[dict[str, Any]] = []
    procs: list[PeerProcess] = []

    def out(result: dict[str, Any]) -> None:
        results.append(result)
        print(json.dumps(result), flush=True)

    with NatTestbed(public_hosts=1, nats=nats, inbound="drop") as tb:
        try:
            relay, relay_addr = start_relay(tb, "--circuit-data", "0")
            procs.append(relay)
            homes = {"target": [], "dialer": None}
            spawned = time.monotonic()
            for j in range(1, len(nats)):
                proc = PeerProcess(tb, f"home{j}", "target", "--relay", relay_addr)
                procs.append(proc)
                homes["target"].append(proc)
            dialer = PeerProcess(tb, "home0", "dialer")
            procs.append(dialer)
            a = dialer.wait("ready")["peer"]
            ready = [t.wait("ready") for t in homes["target"]]
            out(
                {
                    "metric": "reservation",
                    "nat": "eim",
                    "seconds": round(ready[0]["seconds"], 3),  # from B's Host opening
                    "seconds_from_spawn": round(time.monotonic() - spawned, 3),  # + start-up
                }
            )
            for r in ready:
                dialer.send("dial", r["circuit"])
            b = ready[0]["peer"]
            connected = dialer.wait("connected", peer=b)
            out({"metric": "relayed_connect", "seconds": round(connected["seconds"], 3)})
            punched = dialer.wait("holepunch", peer=b, success=True, timeout=30)
            attempts = homes["target"][0].wait("holepunch", peer=a, timeout=30)
            out(
                {
                    "metric": "hole_punch",
                    "nat": "eim",
                    "seconds": round(punched["at"] - connected["at"], 3),
                    "attempts": attempts["attempts"],
                    "addr": punched["addr"],
                }
            )
            size = mb * 1_000_000
            for mode in ("relayed", "direct"):
                out(_transfer(relay, dialer, b, mode, size))
            if symmetric:
                c = ready[1]["peer"]
                dialer.wait("connected", peer=c)
                failed = homes["target"][1].wait("holepunch", success=False, timeout=60)
                out(
                    {
                        "metric": "hole_punch_failure",
                        "nat": "symmetric",
                        "seconds": round(failed["seconds"], 3),
                        "attempts": failed["attempts"],
                        "reason": failed["reason"],
                    }
                )
        finally:
            for proc in procs:
                proc.stop()
    return results


class Bootstrap:
    """``moshpit dht`` on the public host, as a researcher starts it (a fixed port, nothing
    else but a short status period): its lines, and the relay bytes its status lines report."""

    RELAY_BYTES = re.compile(r"(\d+) bytes forwarded")

    def __init__(self, tb: Any, port: int = 4001) -> None:
        argv = [sys.executable, "-m", "moshpit", "dht", "--host-maddrs",
                f"/ip4/0.0.0.0/tcp/{port}", "--status-period", "0.5"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = tb.popen(
            "pub0", argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self._new: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for("--initial-peers ")
        self.addr = next(a for a in line.split()[1:] if f"/ip4/{tb.addr('pub0')}/" in a)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            self._new.put(line)

    def wait_for(self, needle: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"bootstrap: no {needle!r} line; output:\n{self.output()[-3000:]}"
                ) from None
            if needle in line:
                return line.strip()

    def relay_bytes(self, at: float, after: bool, timeout: float = 10.0) -> int:
        """Bytes forwarded as of the last status line before ``at`` (0 before any), or with
        ``after`` the first one after it (waiting up to ``timeout`` for it to be printed)."""
        deadline = time.monotonic() + timeout
        while True:
            found = 0
            for when, line in list(self.lines):
                match = self.RELAY_BYTES.search(line)
                if match is None:
                    continue
                if when <= at:
                    found = int(match.group(1))
                elif after:
                    return int(match.group(1))
                else:
                    return found
            if not after or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def output(self) -> str:
        return "".join(line for _, line in self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


NAT_MIXES = {
    "eim": lambda n: ("eim",) * n,
    "symmetric": lambda n: ("symmetric",) * n,
    "mixed": lambda n: tuple("eim" if i % 2 == 0 else "symmetric" for i in range(n)),
}


def _volunteer_hosts(volunteers: int, behind_nat: bool) -> list[str]:
    return [f"home{i}" if behind_nat else f"pub{i + 1}" for i in range(volunteers)]


def one_bootstrap(
    volunteers: int = 2, nat: str = "eim", group: int = 2, numel: int = 16384, rounds: int = 3,
    inbound: str = "drop", timeout: float = 120.0,
) -> dict[str, Any]:  # fmt: skip
    """One ``moshpit dht`` on the public network and ``volunteers`` averaging peers behind
    NATs (``nat="none"``: on the public network themselves, the baseline); returns the
    ``one_bootstrap`` result object (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nat_testbed import GLOBAL_SUBNET, NatTestbed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"NAT test bed unavailable: {reason}")
    behind_nat = nat != "none"
    nats = NAT_MIXES[nat](volunteers) if behind_nat else ()
    public_hosts = 1 if behind_nat else 1 + volunteers
    with NatTestbed(
        public_hosts=public_hosts, nats=nats, inbound=inbound, public_subnet=GLOBAL_SUBNET
    ) as tb:
        started = time.monotonic()
        deadline = started + timeout
        boot = Bootstrap(tb)
        peers: list[PeerProcess] = []
        try:
            for i, host in enumerate(_volunteer_hosts(volunteers, behind_nat)):
                peers.append(
                    PeerProcess(
                        tb,
                        host,
                        "volunteer",
                        "--boot",
                        boot.addr,
                        "--index",
                        str(i),
                        "--group",
                        str(group),
                        "--numel",
                        str(numel),
                        "--rounds",
                        str(rounds),
                    )  # fmt: skip
                )
            joined = [p.wait("joined", timeout=max(1.0, deadline - time.monotonic()))
                      for p in peers]  # fmt: skip
            ids = [e["peer"] for e in joined]
            index_of = {peer: i for i, peer in enumerate(ids)}

            def exact(r: dict[str, Any]) -> bool:
                indices = [index_of[m] for m in r["members"]]
                return r["offset"] is not None and r["offset"] == exact_mean_offset(indices)

            seen: dict[int, list[dict[str, Any]]] = {i: [] for i in range(volunteers)}
            for i, p in enumerate(peers):
                while len([r for r in seen[i] if r["ok"]]) < rounds:
                    left = max(1.0, deadline - time.monotonic())
                    seen[i].append(p.wait("round", timeout=left))
            good = {i: [r for r in rs if r["ok"]] for i, rs in seen.items()}
            first_done = max(rs[0]["at"] for rs in good.values())
            averaging_begun = min(rs[0]["begun"] for rs in good.values())
            last_done = max(rs[-1]["at"] for rs in good.values())
            relayed_before = boot.relay_bytes(averaging_begun, after=False)
            relayed_total = boot.relay_bytes(last_done, after=True)
            averaging = sum(r["bytes_sent"] for rs in good.values() for r in rs)
            # a pair's first round may start over the relay while its hole punch is still
            # under way: the rounds after every first one show where averaging settles
            relayed_by_first = boot.relay_bytes(first_done, after=False)
            averaging_later = sum(r["bytes_sent"] for rs in good.values() for r in rs[1:])
            for p in peers if behind_nat else ():  # it may average before it decided
                p.collect(
                    lambda e: e["event"] == "role" and e["status"] == "private",
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            roles = {}
            for i, p in enumerate(peers):
                lines = [e for e in p.seen if e["event"] == "role"]
                roles[ids[i]] = lines[-1]["line"] if lines else None
            first_private = [
                min((e["at"] for e in p.seen if e["event"] == "role" and e["status"] == "private"
                     and e["relays"]), default=None)
                for p in peers
            ]  # fmt: skip
            result = {
                "metric": "one_bootstrap",
                "volunteers": volunteers,
                "group": group,
                "nats": list(nats) or ["none"],
                "inbound": inbound,
                "numel": numel,
                "rounds": rounds,
                "first_averaged_round_s": round(first_done - started, 2),
                "joined_s": round(max(e["at"] for e in joined) - started, 2),
                "relay_slot_s": round(max(first_private) - started, 2)
                if first_private and None not in first_private else None,
                "failed_rounds_before": [len(rs) - len(good[i]) for i, rs in seen.items()],
                "failure_reasons": sorted({r["reason"] for rs in seen.values() for r in rs
                                           if not r["ok"]}),
                "inexact_rounds": sum(1 for rs in good.values() for r in rs if not exact(r)),
                "group_sizes": sorted({len(r["members"]) for rs in good.values() for r in rs}),
                "paths": sorted({path for rs in good.values() for r in rs
                                 for path in r["paths"].values()}),
                "modes": sorted({m for rs in good.values() for r in rs for m in r["modes"]}),
                "averaging_bytes": averaging,
                "relayed_bytes_while_averaging": relayed_total - relayed_before,
                "relayed_share": round((relayed_total - relayed_before) / averaging, 4)
                if averaging else None,
                "relayed_bytes_total": relayed_total,
                "averaging_bytes_after_first_round": averaging_later,
                "relayed_bytes_after_first_round": relayed_total - relayed_by_first,
                "joined_in_process_s": [round(e["since_start"], 2) for e in joined],
                "role_timeline": [
                    [[round(e["at"] - started, 1), e["status"], len(e["relays"])]
                     for e in p.seen if e["event"] == "role"]
                    for p in peers
                ],  # fmt: skip
                "timeline": [
                    [[round(r["at"] - started, 1), r["ok"], len(r["members"])] for r in rs]
                    for rs in seen.values()
                ],
                "roles": roles,
            }  # fmt: skip
        except BaseException:
            print(boot.output()[-4000:], file=sys.stderr)
            for p in peers:
                print(f"--- {p.name}\n{''.join(p.logs[-60:])}", file=sys.stderr)
            raise
        finally:
            for p in peers:
                p.stop()
            boot.stop()
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=32, help="MB per transfer (default 32)")
    parser.add_argument("--no-symmetric", action="store_true", help="skip the symmetric NAT")
    parser.add_argument(
        "--one-bootstrap", action="store_true",
        help="one `moshpit dht` and volunteers behind NATs: time to the first averaged round",
    )  # fmt: skip
    parser.add_argument("--volunteers", type=int, default=2)
    parser.add_argument("--nat", choices=[*sorted(NAT_MIXES), "none"], default="eim")
    parser.add_argument("--group", type=int, default=2, help="target_group_size (default 2)")
    parser.add_argument("--numel", type=int, default=16384, help="float32 values per volunteer")
    parser.add_argument("--rounds", type=int, default=3, help="averaged rounds to measure")
    parser.add_argument("--inbound", choices=("drop", "reject"), default="drop")
    args = parser.parse_args()
    if args.one_bootstrap:
        for nat in ("none", args.nat):  # the baseline first: the same swarm without NATs
            result = one_bootstrap(
                args.volunteers, nat, args.group, args.numel, args.rounds, args.inbound
            )
            print(json.dumps(result), flush=True)
        return
    bench(args.mb, not args.no_symmetric)


if __name__ == "__main__":
    main()
