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


def peer_main(argv: list[str]) -> None:
    import trio

    parser = argparse.ArgumentParser(prog="bench_nat.py peer")
    parser.add_argument("role", choices=("relay", "target", "dialer"))
    parser.add_argument("--listen", default=LISTEN)
    parser.add_argument("--relay", help="the relay's address (target)")
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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=32, help="MB per transfer (default 32)")
    parser.add_argument("--no-symmetric", action="store_true", help="skip the symmetric NAT")
    args = parser.parse_args()
    bench(args.mb, not args.no_symmetric)


if __name__ == "__main__":
    main()
