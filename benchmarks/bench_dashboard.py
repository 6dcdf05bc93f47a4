"""``moshpit dashboard`` under a large run: its memory and CPU, the JSON's size and latency,
and the page's time to first full render in chromium. One JSON object per line.

The run: ``--peers`` simulated peers (200), each with an identity of its own, republishing a
signed progress record every ``--publish-period`` seconds (the tracker's wire format: epoch,
samples, samples/s, time, loss, name, role; the record lives 10 s, as ``moshpit train``'s),
one in ten a donor record too. They live on ``--nodes`` real DHT nodes (20) on loopback TCP in
one helper process (``bench_dashboard.py peers``; 200 full nodes in one Python process
saturate it: handshakes time out), each node signing for the peers it hosts, so the DHT
holds ``--peers`` distinct signed records, as from that many machines.
The dashboard is ``moshpit dashboard`` as a user runs it, in its own process, reading every
``--interval`` seconds; its CPU (user + system, /proc) and memory (RSS, peak RSS) are measured
over ``--measure`` seconds, first with no page open, then with one chromium page polling it.

    PYTHONPATH=. python benchmarks/bench_dashboard.py [--peers 200] [--measure 60]
        [--interval 2] [--publish-period 3] [--no-browser]

Also: ``RunHistory.update`` + the JSON for that many peers with a full history, in-process
(``section: history``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RUN = "bench-dashboard"
RECORD_TTL = 10.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def emit(**fields: Any) -> None:
    print(json.dumps({"bench": "dashboard", **fields}), flush=True)


# ---------------------------------------------------------------------- the simulated peers


def peers_main(count: int, period: float, nodes: int) -> None:
    """The helper process: ``count`` simulated peers on ``nodes`` DHT nodes, publishing until
    stdin closes. Each simulated peer has an identity of its own and its record carries that
    identity's signature (its node signs for the peers it hosts), so the DHT and the dashboard
    see ``count`` distinct signed peers, as from ``count`` machines."""
    import trio

    from dht import DHTNode, OwnerSignatureValidator, get_dht_time
    from dht.p2p import Identity
    from moshpit.training.progress import owner_subkey, progress_key

    identities = [Identity.generate() for _ in range(count)]
    hosted = [identities[i::nodes] for i in range(nodes)]

    def record(index: int, peer_id: Any, t: float, rng: random.Random, state: dict) -> list:
        now = time.monotonic()
        state["samples"] += int(state["sps"] * (now - state["last"]))
        state["last"] = now
        epoch = int(t // 30)
        value = {
            "epoch": epoch,
            "samples": state["samples"],
            "sps": state["sps"],
            "time": t,
            "ok": True,
            "loss": 2.0 * 0.999 ** (t % 3000) + rng.uniform(0, 0.2),
            "name": f"sim-{index}",
            "client": index % 4 == 0,
        }
        items = [(progress_key(RUN), owner_subkey(peer_id), value, t + RECORD_TTL)]
        if index % 10 == 0:
            donor = {"root": bytes(32), "epoch": epoch, "bytes": 1 << 20, "complete": True}
            items.append((f"{RUN}.state", owner_subkey(peer_id), donor, t + RECORD_TTL))
        return items

    async def node_task(
        n: int, initial: list[Any], started: Any, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        rng = random.Random(n)
        mine = hosted[n]
        async with DHTNode.open(
            initial_peers=initial,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            client_mode=False,
            bootstrap_timeout=60,
            validators=[OwnerSignatureValidator(identity) for identity in mine],
            # no AutoNAT dial-backs nor relays among them (on loopback all are reachable)
            autonat=False,
            relay=False,
        ) as node:
            task_status.started(node.get_visible_maddrs()[0])
            await started.wait()
            states = [
                {"sps": rng.uniform(200, 800), "samples": 0, "last": time.monotonic()} for _ in mine
            ]
            await trio.sleep(rng.uniform(0, period))
            while True:
                began = trio.current_time()
                t = get_dht_time()
                items = []
                for identity, state in zip(mine, states, strict=True):
                    index = identities.index(identity)
                    items += record(index, identity.peer_id, t, rng, state)
                with trio.move_on_after(period):
                    await node.store_many(items)
                await trio.sleep_until(began + period)

    async def main() -> None:
        started = trio.Event()
        async with trio.open_nursery() as nursery:
            addrs = [await nursery.start(node_task, 0, [], started)]
            for n in range(1, nodes):
                addrs.append(await nursery.start(node_task, n, [addrs[0]], started))
            started.set()
            print("MADDR", addrs[0], flush=True)
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()

    trio.run(main)


# ---------------------------------------------------------------------- measuring


class Lines:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.queue.put(line)

    def wait(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.queue.get(timeout=max(0.01, deadline - time.monotonic()))
            if needle in line:
                return line


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def memory_mib(pid: int) -> dict[str, float]:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            status[key] = int(value.split()[0]) / 1024
    return {"rss_mib": round(status["VmRSS"], 1), "peak_rss_mib": round(status["VmHWM"], 1)}


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def measure(pid: int, seconds: float) -> dict[str, float]:
    wall0, cpu0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(seconds)
    wall, cpu = time.monotonic() - wall0, cpu_seconds(pid) - cpu0
    return {
        "seconds": round(wall, 1),
        "cpu_s": round(cpu, 2),
        "cpu_pct": round(100 * cpu / wall, 1),
    }


def bench_history(peers: int, points: int) -> None:
    """RunHistory.update and the JSON for ``peers`` records with ``points`` of history."""
    from moshpit.dashboard.history import RunHistory
    from moshpit.training.progress import PeerProgress
    from moshpit.training.run_records import RunRecords

    history = RunHistory(RUN, history=points)
    rng = random.Random(0)
    ids = [f"12D3KooW{i:044d}" for i in range(peers)]
    rates = [rng.uniform(200, 800) for _ in ids]
    t0 = 1.7e9
    updates = []
    for step in range(points):
        t = t0 + 2 * step
        records = [
            PeerProgress(p, step // 15, int(r * 2 * (step % 15)), r, t - 0.5, 1.0, name=f"n{i}")
            for i, (p, r) in enumerate(zip(ids, rates, strict=True))
        ]
        run = RunRecords(RUN, t, records)
        began = time.perf_counter()
        history.update(run)
        updates.append(time.perf_counter() - began)
    began = time.perf_counter()
    full = history.json_bytes()
    full_s = time.perf_counter() - began
    began = time.perf_counter()
    since = history.json_bytes(since=t0 + 2 * (points - 2))
    since_s = time.perf_counter() - began
    emit(
        section="history",
        peers=peers,
        points=points,
        update_ms_median=round(1000 * statistics.median(updates), 2),
        json_full_ms=round(1000 * full_s, 2),
        json_full_kib=round(len(full) / 1024, 1),
        json_since_ms=round(1000 * since_s, 2),
        json_since_kib=round(len(since) / 1024, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=200)
    parser.add_argument("--publish-period", type=float, default=3.0)
    parser.add_argument("--nodes", type=int, default=20, help="DHT nodes hosting the peers")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--measure", type=float, default=60.0)
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()

    bench_history(args.peers, 1800)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    started = time.monotonic()
    peers = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "peers",
            str(args.peers),
            str(args.publish_period),
            str(args.nodes),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    dashboard = None
    try:
        maddr = Lines(peers).wait("MADDR", timeout=600).split()[1]
        emit(section="swarm", peers=args.peers, start_s=round(time.monotonic() - started, 1))
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "moshpit", "dashboard", "--initial-peers", maddr,
             "--run-id", RUN, "--port", "0", "--interval", str(args.interval)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        url = Lines(dashboard).wait("http://", timeout=60).split(": ", 1)[1].split()[0]
        began = time.monotonic()
        while True:
            doc = json.loads(get(url + "api/run.json"))
            if doc["num_peers"] >= args.peers:
                break
            if time.monotonic() - began > 120:
                break
            time.sleep(0.5)
        emit(
            section="join",
            peers_seen=doc["num_peers"],
            all_seen_after_s=round(time.monotonic() - began, 1),
            **memory_mib(dashboard.pid),
        )
        idle = measure(dashboard.pid, args.measure)
        doc = json.loads(get(url + "api/run.json"))
        emit(
            section="dashboard",
            page_open=False,
            peers_seen=doc["num_peers"],
            reads=doc["reads"],
            failed_reads=doc["failed_reads"],
            interval_s=args.interval,
            **idle,
            **memory_mib(dashboard.pid),
            swarm_process_cpu_pct=round(
                100 * cpu_seconds(peers.pid) / (time.monotonic() - started), 1
            ),
        )
        latency = []
        for _ in range(20):
            began = time.perf_counter()
            body = get(url + "api/run.json")
            latency.append(time.perf_counter() - began)
        since = doc["history"]["t"][-1] if doc["history"]["t"] else 0
        small = []
        for _ in range(20):
            began = time.perf_counter()
            get(url + f"api/run.json?since={since}")
            small.append(time.perf_counter() - began)
        emit(
            section="json",
            peers=doc["num_peers"],
            history_points=len(doc["history"]["t"]),
            full_kib=round(len(body) / 1024, 1),
            full_ms_median=round(1000 * statistics.median(latency), 1),
            since_ms_median=round(1000 * statistics.median(small), 1),
        )
        if not args.no_browser:
            bench_browser(url, dashboard.pid, args)
    finally:
        if dashboard is not None:
            dashboard.terminate()
            dashboard.wait(timeout=20)
        peers.stdin.close()  # type: ignore[union-attr]
        try:
            peers.wait(timeout=30)
        except subprocess.TimeoutExpired:
            peers.kill()


def bench_browser(url: str, pid: int, args: argparse.Namespace) -> None:
    from tests.chromium import Chromium, find_chromium

    executable = find_chromium()
    if executable is None:
        emit(section="page", skipped="no chromium")
        return
    loads = []
    for _ in range(3):
        with Chromium(executable) as browser:
            began = time.monotonic()
            browser.navigate(url)
            browser.wait_for("Number(document.body.dataset.renders) >= 1", timeout=60)
            wall = time.monotonic() - began
            first = float(browser.evaluate("document.body.dataset.firstRenderMs"))
            rows = browser.evaluate("document.querySelectorAll('#peers tbody tr').length")
            loads.append((first, wall, rows))
    emit(
        section="page",
        peers_in_table=loads[-1][2],
        first_render_ms=[round(x[0]) for x in loads],
        first_render_ms_median=round(statistics.median(x[0] for x in loads)),
        navigate_to_render_s_median=round(statistics.median(x[1] for x in loads), 2),
    )
    with Chromium(executable) as browser:
        browser.navigate(url)
        browser.wait_for("Number(document.body.dataset.renders) >= 1", timeout=60)
        renders0 = int(browser.evaluate("document.body.dataset.renders"))
        used = measure(pid, args.measure)
        renders = int(browser.evaluate("document.body.dataset.renders")) - renders0
        emit(
            section="dashboard",
            page_open=True,
            page_renders=renders,
            **used,
            **memory_mib(pid),
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peers":
        peers_main(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
