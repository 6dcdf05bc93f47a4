"""DHT benchmarks; one JSON object per result line.

  python benchmarks/bench_dht.py --network tcp --peers 64          # real TCP on loopback, one process
  python benchmarks/bench_dht.py --network tcp --peers 64 --processes 4   # 4 processes x 16 peers
  python benchmarks/bench_dht.py --network loopback --peers 1024   # virtual clock, loopback fabric
  python benchmarks/bench_dht.py --network memory --peers 64       # virtual clock, real hosts on MemoryNetwork
  python benchmarks/bench_dht.py --network loopback --peers 1024 --churn 0.3

TCP: the baseline is one unary ``host.call`` round trip between two connected hosts in the
same process, so DHT latencies read as multiples of one RPC. Simulations: lookups are
compared with brute force, and messages/hops are counted per lookup.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dht.kademlia.clock import dht_clock, get_dht_time, trio_clock  # noqa: E402
from dht.kademlia.node import DHTNode  # noqa: E402
from dht.kademlia.simulation import open_swarm  # noqa: E402

TARGET_MS = {"store": 10, "get": 5}


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": "dht", **fields}), flush=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def rpc_baseline(rounds: int = 300) -> float:
    """Median seconds of one unary host.call round trip on loopback TCP (connection reused)."""
    from dht.p2p import Host

    async def echo(peer: Any, request: Any) -> Any:
        return request

    async with Host.open() as server, Host.open() as client:
        addrs = await server.listen(["/ip4/127.0.0.1/tcp/0"])
        server.set_rpc_handler("/bench/echo/1.0.0", echo)
        await client.connect(addrs)
        samples = []
        for i in range(rounds):
            started = time.perf_counter()
            await client.call(
                server.peer_id, "/bench/echo/1.0.0", {"i": i, "pad": b"x" * 64}, timeout=5
            )
            samples.append(time.perf_counter() - started)
        return statistics.median(samples)


async def bench_tcp(args: argparse.Namespace) -> None:
    baseline = await rpc_baseline()
    emit(
        network="tcp",
        metric="rpc_roundtrip_median_ms",
        value=round(baseline * 1e3, 3),
        note="baseline",
    )
    rng = random.Random(args.seed)
    async with trio.open_nursery() as nursery:
        nodes: list[DHTNode] = []
        startup: list[float] = []

        async def run_node(initial: list[Any], task_status=trio.TASK_STATUS_IGNORED) -> None:
            started = time.perf_counter()
            async with DHTNode.open(
                initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
            ) as node:
                startup.append(time.perf_counter() - started)
                task_status.started(node)
                await trio.sleep_forever()

        local_peers = args.peers // args.processes
        for _ in range(local_peers):
            initial = [rng.choice(nodes).get_visible_maddrs()[0]] if nodes else []
            nodes.append(await nursery.start(run_node, initial))
        workers = []
        for _ in range(args.processes - 1):  # the other peers live in worker processes
            workers.append(
                await trio.lowlevel.open_process(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        "--peers",
                        str(local_peers),
                        "--join",
                        str(rng.choice(nodes).get_visible_maddrs()[0]),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                )
            )
        for worker in workers:  # each prints one line once all its nodes joined
            with trio.fail_after(300):
                assert b"ready" in await worker.stdout.receive_some(100)
        for node in nodes:  # learn about the workers' peers as a long-running swarm would
            await node.find_nearest_peers(node.node_id, 20)
        rng = random.Random(args.seed + 1)  # same sequence of (node, key) pairs in each phase
        emit(
            network="tcp",
            peers=args.peers,
            processes=args.processes,
            metric="startup_per_peer_ms",
            value=round(statistics.median(startup[1:]) * 1e3, 2),
            p95=round(percentile(startup[1:], 0.95) * 1e3, 2),
            target_ms=100,
            met=statistics.median(startup[1:]) <= 0.1,
        )
        for phase, op in (("cold", "store"), ("cold", "get"), ("warm", "store"), ("warm", "get")):
            # cold: first contact between most pairs (Noise handshakes on the critical path);
            # warm: the same nodes again once connections exist, as in a long-running swarm
            samples, cpu, ok = [], [], 0
            for node in nodes:
                node.lookup_stats.clear()
            if phase == "warm" and op == "store":
                rng = random.Random(args.seed + 1)
            for i in range(args.ops):
                node = rng.choice(nodes)
                started, cpu_started = time.perf_counter(), time.process_time()
                if op == "store":
                    success = await node.store(f"bench{i}", {"i": i}, get_dht_time() + 600)
                else:
                    found = await node.get(f"bench{i}")
                    success = found is not None and found.value == {"i": i}
                samples.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
                ok += bool(success)
            median = statistics.median(samples)
            finds = [s.messages for n in nodes for s in n.lookup_stats]
            emit(
                network="tcp",
                peers=args.peers,
                processes=args.processes,
                metric=f"{op}_latency_ms_{phase}",
                median=round(median * 1e3, 3),
                p95=round(percentile(samples, 0.95) * 1e3, 3),
                ratio_vs_rpc=round(median / baseline, 2),
                # all 64 peers share this process's CPU: wall ~= CPU means CPU-bound here
                process_cpu_median_ms=round(statistics.median(cpu) * 1e3, 3),
                success_rate=ok / args.ops,
                find_rpcs_per_lookup_mean=round(statistics.mean(finds), 2) if finds else None,
                # background work since start (0 on code without republish/hand-over)
                republished_records=sum(
                    getattr(n, "maintenance", None) and n.maintenance.republished_records or 0
                    for n in nodes
                ),
                handover_rpcs=sum(
                    getattr(n, "maintenance", None) and n.maintenance.handover_rpcs or 0
                    for n in nodes
                ),
                target_ms=TARGET_MS[op],  # issue 11: store <= 10 ms, get <= 5 ms
                met=median <= TARGET_MS[op] / 1e3 and ok == args.ops,
            )
        for worker in workers:
            await worker.stdin.aclose()
            with trio.move_on_after(30):
                await worker.wait()
            if worker.returncode is None:
                worker.kill()
                await worker.wait()
        nursery.cancel_scope.cancel()


async def run_worker(args: argparse.Namespace) -> None:
    """--processes helper: run --peers nodes joined through --join until stdin closes."""
    async with trio.open_nursery() as nursery:

        async def run_node(initial: list[Any], task_status=trio.TASK_STATUS_IGNORED) -> None:
            async with DHTNode.open(
                initial_peers=initial, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
            ) as node:
                task_status.started(node)
                await trio.sleep_forever()

        nodes = []
        for _ in range(args.peers):
            initial = [args.join] if not nodes else [random.choice(nodes).get_visible_maddrs()[0]]
            nodes.append(await nursery.start(run_node, initial))
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        while await stdin.receive_some(100):
            pass
        nursery.cancel_scope.cancel()


async def bench_simulated(args: argparse.Namespace) -> None:
    from dht.p2p import MemoryNetwork

    rng = random.Random(args.seed)
    memory = MemoryNetwork(latency=args.latency) if args.network == "memory" else None
    wall = time.perf_counter()
    with dht_clock(trio_clock):
        async with open_swarm(
            args.peers, latency=args.latency, memory_network=memory, seed=args.seed
        ) as swarm:
            nodes = swarm.nodes
            emit(
                network=args.network,
                peers=args.peers,
                metric="swarm_start_wall_s",
                value=round(time.perf_counter() - wall, 1),
            )
            for node in nodes:
                node.lookup_stats.clear()
            expiration = get_dht_time() + 100_000
            stored = 0
            keys = [f"sim{i}" for i in range(args.ops)]
            for key in keys:
                stored += await rng.choice(nodes).store(key, key, expiration)
            store_stats = [s for n in nodes for s in n.lookup_stats]
            for node in nodes:
                node.lookup_stats.clear()
            found = 0
            for key in keys:
                value = await rng.choice(nodes).get(key, latest=True)
                found += value is not None and value.value == key
            get_stats = [s for n in nodes for s in n.lookup_stats]
            exact = 0
            for _ in range(50):
                node, target = rng.choice(nodes), rng.getrandbits(256)
                got = [c.peer_id for c in await node.find_nearest_peers(target, 20)]
                truth = [
                    n.peer_id
                    for n in sorted(nodes, key=lambda n: n.node_id ^ target)
                    if n is not node
                ][:20]
                exact += got == truth
            for name, stats, ok in (("store", store_stats, stored), ("get", get_stats, found)):
                hops = [s.hops for s in stats]
                emit(
                    network=args.network,
                    peers=args.peers,
                    metric=f"{name}_lookups",
                    success_rate=ok / len(keys),
                    hops_median=statistics.median(hops),
                    rounds_median=statistics.median(s.rounds for s in stats),
                    messages_per_lookup_median=statistics.median(s.messages for s in stats),
                    messages_per_lookup_mean=round(statistics.mean(s.messages for s in stats), 2),
                    baseline_log2_peers=round(__import__("math").log2(args.peers), 1),
                    target="success>=0.999, hops median<=4",
                    met=ok / len(keys) >= 0.999 and statistics.median(hops) <= 4,
                )
            emit(
                network=args.network,
                peers=args.peers,
                metric="k_nearest_exact_vs_brute_force",
                value=exact / 50,
            )
            if args.churn:
                victims = rng.sample(nodes, int(args.churn * len(nodes)))
                for victim in victims:
                    swarm.kill(victim)
                alive = swarm.alive()
                ok = 0
                for key in keys:
                    value = await rng.choice(alive).get(key)
                    ok += value is not None and value.value == key
                late = [await swarm.add() for _ in range(10)]
                late_ok = 0
                for key in keys[:200]:
                    value = await rng.choice(late).get(key)
                    late_ok += value is not None and value.value == key
                emit(
                    network=args.network,
                    peers=args.peers,
                    metric="churn_get_success",
                    killed_fraction=args.churn,
                    success_rate=ok / len(keys),
                    newcomer_success_rate=late_ok / 200,
                    baseline_all_replicas_dead_expected=round(1 - args.churn**5, 4),
                    target=0.99,
                    met=ok / len(keys) >= 0.99,
                )
            emit(
                network=args.network,
                peers=args.peers,
                metric="total_wall_s",
                value=round(time.perf_counter() - wall, 1),
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--network", choices=["tcp", "memory", "loopback"], default="loopback")
    parser.add_argument("--peers", type=int, default=64)
    parser.add_argument("--ops", type=int, default=1000, help="keys stored and read")
    parser.add_argument(
        "--churn", type=float, default=0.0, help="fraction of peers killed after storing"
    )
    parser.add_argument(
        "--latency", type=float, default=0.005, help="per-hop latency in simulations (s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--processes", type=int, default=1, help="tcp: split the peers over N processes"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--join", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        trio.run(run_worker, args)
    elif args.network == "tcp":
        trio.run(bench_tcp, args)
    else:
        trio.run(bench_simulated, args, clock=trio.testing.MockClock(autojump_threshold=0))


if __name__ == "__main__":
    main()
