"""Newcomers joining a bootstrap node under a slowloris; one JSON object per result line.

  python benchmarks/bench_slowloris.py                       # 600 sockets from 150 addresses
  python benchmarks/bench_slowloris.py --connections 2000 --sources 500 --tries 10
  python benchmarks/bench_slowloris.py --sources 0 --speak-delay 0   # from the newcomers' address

Real processes and sockets: the victim is ``moshpit dht`` (a bootstrap node as users run it),
the attacker is ``tests/p2p/slowloris.py`` in its own process (idle sockets from 127.0.0.2..,
each reopened as soon as the node closes it), and every newcomer is a fresh ``DHTNode`` in this
process joining from 127.0.0.1 with the default bootstrap timeout; a second series makes each
newcomer slow to speak (``--speak-delay``: its first bytes reach the node 0.3 s after its TCP
connection, as from a busy process), which is what a flood churning through a few slots locks out. A try counts as joined when
``DHTNode.open`` returned (connected, pinged, looked up its own ID) within ``--limit`` seconds.
The baseline is the same joins with no attacker, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dht.kademlia.node import DHTNode  # noqa: E402
from dht.p2p.host import raise_open_file_limit  # noqa: E402
from dht.p2p.multiaddr import Multiaddr  # noqa: E402
from tests.p2p.slowloris import slow_to_speak_proxy  # noqa: E402

ADDRESS = re.compile(rb"(/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+)")


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": "slowloris", **fields}), flush=True)


def start_node(victim: str, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``moshpit dht`` (an idle bootstrap node) or ``moshpit train`` (a volunteer whose event
    loop shares its process with training)."""
    listen = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    extra = ["--checkpoint-dir", str(workdir / "ckpt")] if victim == "train" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "moshpit", victim, *listen, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        found = ADDRESS.search(line)
        if found:
            return proc, found.group(1).decode()
    proc.kill()
    raise RuntimeError("moshpit dht did not print its address")


def start_attackers(
    address: str, connections: int, sources: int, processes: int
) -> list[subprocess.Popen[bytes]]:
    """``processes`` slowloris processes sharing ``connections`` sockets and ``sources``
    addresses (an attacker with more than one core reopens evicted sockets faster)."""
    ip, port = address.split("/")[2], address.split("/")[4]
    # sources=0: the newcomers' own address, 127.0.0.1 (an attacker behind their NAT)
    addrs = [f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(sources)] or ["127.0.0.1"]
    procs = []
    for k in range(processes):
        mine = addrs[k::processes] or addrs  # fewer addresses than processes: share
        count = connections // processes + (k < connections % processes)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.p2p.slowloris", ip, port, str(count), *mine],
                stdout=subprocess.PIPE,
                cwd=REPO,
            )
        )
    for proc in procs:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            stop_attackers(procs)
            raise RuntimeError("an attacker did not get its connections open")
    return procs


def stop_attackers(procs: list[subprocess.Popen[bytes]]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        out, _ = proc.communicate(timeout=30)
        for k, v in re.findall(r"(\w+)=(\d+)", out.decode()):
            totals[k] = totals.get(k, 0) + int(v)
    return totals


async def join_once(address: str, limit: float, speak_delay: float) -> float | None:
    """Seconds until a fresh node joined through ``address``, or None if it did not. With
    ``speak_delay`` its first bytes reach the node that much after its TCP connection (a busy
    joiner), through a relay."""
    started = trio.current_time()
    with trio.move_on_after(limit):
        try:
            async with AsyncExitStack() as stack:
                target = address
                if speak_delay > 0:
                    relay = slow_to_speak_proxy(Multiaddr(address), speak_delay)
                    target = str(await stack.enter_async_context(relay))
                async with DHTNode.open(
                    initial_peers=[target], host_maddrs=["/ip4/127.0.0.1/tcp/0"]
                ):
                    return trio.current_time() - started
        except Exception:  # noqa: BLE001 - a failed join is a result here, not a crash
            return None
    return None


def join_tries(address: str, tries: int, limit: float, speak_delay: float) -> list[float | None]:
    return [trio.run(join_once, address, limit, speak_delay) for _ in range(tries)]


def summary(times: list[float | None], limit: float) -> dict[str, Any]:
    ok = [t for t in times if t is not None and t <= limit]
    return {
        "joined": len(ok),
        "tries": len(times),
        "median_s": round(statistics.median(ok), 3) if ok else None,
        "max_s": round(max(ok), 3) if ok else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=600)
    parser.add_argument(
        "--sources",
        type=int,
        default=150,
        help="attacker addresses (0: the newcomers' own, 127.0.0.1: one NAT shared with them)",
    )
    parser.add_argument("--tries", type=int, default=10)
    parser.add_argument("--limit", type=float, default=10.0, help="seconds a join may take")
    parser.add_argument(
        "--speak-delay",
        type=float,
        default=0.3,
        help="also measure newcomers whose first bytes arrive this many seconds after their "
        "TCP connection (0: only prompt ones)",
    )
    parser.add_argument("--attackers", type=int, default=1, help="attacker processes")
    parser.add_argument("--victim", choices=["dht", "train"], default="dht")
    parser.add_argument(
        "--load", type=int, default=0, help="busy-looping processes beside it (a loaded machine)"
    )
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of flood before joins")
    args = parser.parse_args()
    raise_open_file_limit()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)
    ]
    workdir = Path(tempfile.mkdtemp(prefix="bench-slowloris-"))
    node, address = start_node(args.victim, workdir)
    try:
        delays = [0.0, args.speak_delay] if args.speak_delay > 0 else [0.0]
        common = {"victim": args.victim, "load": args.load}
        baseline = {}
        for delay in delays:
            baseline[delay] = summary(
                join_tries(address, args.tries, args.limit, delay), args.limit
            )
            emit(case="baseline", speak_delay_s=delay, **common, **baseline[delay])
        attackers = start_attackers(address, args.connections, args.sources, args.attackers)
        try:
            time.sleep(args.warmup)
            attacked = {
                delay: summary(join_tries(address, args.tries, args.limit, delay), args.limit)
                for delay in delays
            }
        finally:
            stats = stop_attackers(attackers)
        for delay in delays:
            ours, base = attacked[delay], baseline[delay]
            emit(
                case="slowloris",
                speak_delay_s=delay,
                **common,
                connections=args.connections,
                sources=args.sources,
                attacker_processes=args.attackers,
                attacker=stats,
                **ours,
                median_vs_baseline=(
                    round(ours["median_s"] / base["median_s"], 2)
                    if ours["median_s"] and base["median_s"]
                    else None
                ),
            )
    finally:
        node.terminate()
        node.wait(timeout=30)
        for burner in burners:
            burner.kill()
            burner.wait()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
