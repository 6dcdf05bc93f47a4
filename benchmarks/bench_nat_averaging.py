"""Averaging with peers behind NATs: what a hole-punched path buys over a relay and over
today's client mode.

Runs in the NAT test bed (``nat_testbed.py``: network namespaces, nftables masquerade; needs
root, ``ip`` and ``nft``). A group of four ``moshpit.Averager`` peers, one DHT node each: two
on the public network (AutoNAT servers and relays, with the relay's per-connection data and
time limits lifted so that a round fits), two behind endpoint-independent NATs. Every peer
holds one float32 tensor of ``--mb`` MB with integer values, so the exact mean is known and
checked on every peer after every round. Three configurations, one after the other in the
same run (fresh processes, other ports):

* ``punched``: the NAT'ed peers left to themselves (``client_mode=None``): they find they are
  private, reserve relay slots, and DCUtR punches a direct connection between them during a
  warm-up round; all four reduce;
* ``relayed``: the same without hole punching (``Host.open(hole_punching=False)``): the two
  NAT'ed peers reach each other through a relay; all four reduce;
* ``client``: the NAT'ed peers forced to ``client_mode=True`` (what volunteers behind NAT
  ran before relays): they send their tensors to the public peers and reduce nothing.

One JSON object per configuration: round seconds (the slowest peer's ``astep`` per round; the
round starts on all four at once and a full group proceeds without waiting) as mean, median,
min and max over ``--rounds`` rounds after one warm-up round; the bytes the relays forwarded
during those rounds; each peer's averaging mode; and how each NAT'ed peer reached the others.

    sudo python benchmarks/bench_nat_averaging.py [--mb 4] [--rounds 5] [--rate 100mbit]

``--rate`` shapes every host's access link (public hosts and home routers, both directions)
with ``tc tbf``, so that the links, not the CPU, limit a round: a relay then carries the
relayed bytes on its own link besides its share of the round.

The peer program is this file too (``bench_nat_averaging.py peer ...``): JSON events on
stdout, log lines on stderr, commands on stdin.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_nat import PeerProcess, _commands, _emit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("punched", "relayed", "client")
GROUP = 4
PREFIX = "natavg"


# ---------------------------------------------------------------------------------------------
# the peer program (runs inside a namespace)


def _values(numel: int, index: int) -> Any:
    """Peer ``index``'s tensor: small integers, so every sum and the mean are exact."""
    import torch

    return (torch.arange(numel, dtype=torch.float32) % 1024) + 8 * index


def _expected(numel: int) -> Any:
    """The mean of peers 0..3's tensors: the pattern + 8 * 1.5."""
    import torch

    return (torch.arange(numel, dtype=torch.float32) % 1024) + 12


def _path(node: Any, peer: Any) -> str:
    """How ``node`` reaches ``peer`` now: "relayed", "hole-punched", "direct" or "none"."""
    if node.network.relayed_only(peer):
        return "relayed"
    live = [c for c in node.host._conns.get(peer, ()) if c.alive]
    if any(c.hole_punched for c in live if not c.relayed):
        return "hole-punched"
    return "direct" if live else "none"


async def _run_peer(args: argparse.Namespace) -> None:
    import torch
    import trio

    from dht import DHTNode
    from dht.p2p import Host
    from dht.p2p.autonat import AutoNATConfig
    from dht.p2p.relay import RelayLimits
    from moshpit import Averager

    # quick AutoNAT verdicts: one peer decides, short dial-backs (the routers drop inbound
    # connections, so a dial-back to a NAT'ed peer runs into its timeout)
    autonat = AutoNATConfig(
        threshold=1, dial_timeout=2.0, response_timeout=5.0, request_timeout=5.0
    )
    relay = RelayLimits(circuit_data=0, circuit_duration=0)  # a round must fit: no caps
    client_mode = True if args.client_mode else None
    async with Host.open(hole_punching=False if args.no_punch else None) as host:
        await host.listen([f"/ip4/0.0.0.0/tcp/{args.port}"])
        async with DHTNode.open(
            initial_peers=args.boot,
            host=host,
            client_mode=client_mode,
            autonat=autonat,
            relay=relay,
            bootstrap_timeout=20,
            relay_check_interval=1.0,
        ) as node:
            addrs = [str(a) for a in node.get_visible_maddrs()]
            _emit(
                "up",
                peer=str(node.peer_id),
                addr=next((a for a in addrs if f"/ip4/{args.ip}/" in a), None),
            )
            with trio.fail_after(60):
                while True:
                    role = node.role
                    if args.client_mode and node.client_mode:
                        break
                    if role is not None and args.public and role.serving_relay:
                        break
                    if role is not None and not args.public and role.circuit_addrs:
                        break
                    await trio.sleep(0.05)
            _emit(
                "ready",
                peer=str(node.peer_id),
                line=role.describe() if role is not None else "client mode (explicit)",
            )
            tensor = _values(args.numel, args.index)
            expected = _expected(args.numel)
            averager = Averager(
                [tensor],
                node,
                PREFIX,
                target_group_size=GROUP,
                min_group_size=GROUP,
                initial_group_bits="",
                min_matchmaking_time=2.0,
                request_timeout=3.0,
                allreduce_timeout=60.0,
                matchmaking_timeout=20.0,
            )

            async def handle(cmd: list[str]) -> None:
                if cmd[0] == "average":
                    tensor.copy_(_values(args.numel, args.index))
                    start = time.monotonic()
                    result = await averager.astep(timeout=90)
                    seconds = time.monotonic() - start
                    others = [p for p in result.members if p != node.peer_id]
                    _emit(
                        "averaged",
                        peer=str(node.peer_id),
                        round=int(cmd[1]),
                        ok=result.succeeded,
                        reason=result.reason,
                        seconds=seconds,
                        exact=bool(torch.equal(tensor, expected)),
                        modes=dict(zip(map(str, result.members), result.modes, strict=True)),
                        paths={str(p): _path(node, p) for p in others},
                    )
                elif cmd[0] == "stats":
                    service = node.relay_service
                    _emit(
                        "stats",
                        bytes_forwarded=service.stats.bytes_forwarded if service else 0,
                        circuits_opened=service.stats.circuits_opened if service else 0,
                    )

            await _commands(handle)
            averager.shutdown()


def peer_main(argv: list[str]) -> None:
    import trio

    parser = argparse.ArgumentParser(prog="bench_nat_averaging.py peer")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ip", required=True, help="this host's address (to pick the addr)")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--boot", nargs="*", default=[])
    parser.add_argument("--public", action="store_true")
    parser.add_argument("--client-mode", action="store_true")
    parser.add_argument("--no-punch", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"peer{args.index} %(name)s: %(message)s",
    )
    trio.run(_run_peer, args)


# ---------------------------------------------------------------------------------------------
# the controller (the root namespace)


class AveragingPeer(PeerProcess):
    """A peer program of this file (PeerProcess' event reading, commands and stop)."""

    def __init__(self, tb: Any, host: str, *args: str) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "peer", *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env["OMP_NUM_THREADS"] = "1"
        self.name = f"peer@{host}"
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


def _configuration(tb: Any, config: str, port: int, numel: int, rounds: int) -> dict[str, Any]:
    """Start the four peers of ``config``, run a warm-up round and ``rounds`` measured ones."""
    hosts = ["pub0", "pub1", "home0", "home1"]
    peers: list[AveragingPeer] = []
    names: dict[str, str] = {}  # PeerID -> host

    def start(i: int, boot: list[str]) -> str:
        host = hosts[i]
        args = ["--index", str(i), "--port", str(port), "--ip", tb.addr(host)]
        args += ["--numel", str(numel)]
        if boot:
            args += ["--boot", *boot]
        if host.startswith("pub"):
            args.append("--public")
        elif config == "client":
            args.append("--client-mode")
        elif config == "relayed":
            args.append("--no-punch")
        peer = AveragingPeer(tb, host, *args)
        peers.append(peer)
        up = peer.wait("up", timeout=60)
        names[up["peer"]] = host
        return up["addr"]

    def average(round_no: int) -> list[dict[str, Any]]:
        for peer in peers:
            peer.send("average", str(round_no))
        done = [peer.wait("averaged", timeout=120, round=round_no) for peer in peers]
        for host, event in zip(hosts, done, strict=True):
            if not (event["ok"] and event["exact"]):
                raise RuntimeError(f"{config}: round {round_no} failed on {host}: {event}")
        return done

    def relay_bytes() -> int:
        return sum(peer.request("stats", "stats")["bytes_forwarded"] for peer in peers[:2])

    try:
        boot = [start(0, [])]
        boot.append(start(1, boot))
        for i in (2, 3):
            start(i, boot)
        ready = [peer.wait("ready", timeout=90) for peer in peers]
        average(0)  # warm-up: connections, relay circuits, hole punching
        before = relay_bytes()
        seconds = []
        last: list[dict[str, Any]] = []
        for r in range(1, rounds + 1):
            last = average(r)
            seconds.append(max(e["seconds"] for e in last))
        forwarded = relay_bytes() - before
        # the numbers are labelled by path: make sure that is the path the rounds took
        want = {"punched": "hole-punched", "relayed": "relayed"}.get(config)
        between = [last[i]["paths"].get(last[5 - i]["peer"]) for i in (2, 3)]
        if want is not None and between != [want, want]:
            raise RuntimeError(f"{config}: the NAT'ed peers reached each other {between}")
    finally:
        for peer in peers:
            peer.stop()
    return {
        "config": config,
        "group": GROUP,
        "nat_peers": 2,
        "mb": round(numel * 4 / 1e6, 2),
        "rounds": rounds,
        "round_s": {
            "mean": round(statistics.mean(seconds), 3),
            "median": round(statistics.median(seconds), 3),
            "min": round(min(seconds), 3),
            "max": round(max(seconds), 3),
        },
        "relay_bytes": forwarded,
        "relay_bytes_per_round": forwarded // rounds,
        "exact_mean": True,  # checked on every peer, every round
        "modes": {names[p]: m for p, m in last[0]["modes"].items()},
        "paths": {
            hosts[i]: {names[p]: path for p, path in last[i]["paths"].items()} for i in (2, 3)
        },
        "roles": {hosts[i]: ready[i]["line"] for i in (2, 3)},
    }


def _shape(tb: Any, rate: str) -> None:
    """Every host's access link at ``rate`` each way (``tc ... tbf`` on both ends' egress):
    the public hosts' and the routers' WAN links, so a home's uplink and downlink and the
    relay's own link are all ``rate``."""
    from wan_testbed import parse_rate

    burst = str(max(64 * 1024, parse_rate(rate) // 8 // 100))
    tbf = ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]
    links = [(tb.namespace(f"pub{i}"), "eth0", f"{tb.tag}p{i}") for i in range(tb.public_hosts)]
    links += [(tb.router_namespace(j), "wan0", f"{tb.tag}r{j}") for j in range(len(tb.nats))]
    for ns, uplink, downlink in links:
        for where, dev in ((ns, uplink), (tb.net_ns, downlink)):
            subprocess.run(
                ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", *tbf],
                check=True,
                capture_output=True,
            )


def bench(
    mb: float, rounds: int, configs: list[str], rate: str | None = None
) -> list[dict[str, Any]]:
    from nat_testbed import NatTestbed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"NAT test bed unavailable: {reason}")
    numel = int(mb * 1e6) // 4
    results = []
    with NatTestbed(public_hosts=2, nats=("eim", "eim"), inbound="drop") as tb:
        if rate is not None:
            _shape(tb, rate)
        for n, config in enumerate(configs):
            result = _configuration(tb, config, 4101 + 100 * n, numel, rounds)
            result["link_rate"] = rate or "unshaped"
            results.append(result)
            print(json.dumps(result), flush=True)
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0, help="MB per peer's tensor (default 4)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    parser.add_argument(
        "--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS), help="default: all"
    )
    parser.add_argument(
        "--rate",
        default=None,
        help="shape every host's access link to this rate each way, tc syntax (e.g. 100mbit; "
        "default: unshaped, the CPU is the limit)",
    )
    args = parser.parse_args()
    bench(args.mb, args.rounds, args.configs, args.rate)


if __name__ == "__main__":
    main()
