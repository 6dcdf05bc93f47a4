"""Time to a target accuracy: 4 peer processes in each ``moshpit.Optimizer`` mode vs DDP (gloo).

Task: the demo's 8x8 digits (``moshpit.training.demo_task``: fixed 1258/539 split), an MLP
64-``--hidden``-10 from the same seed everywhere, Adam (``--lr``), ``--batch`` samples per process
and step, so the global batch is ``peers x batch`` for every run. Every worker is its own process
with one torch thread.

- ``ddp``: a gloo process group + ``DistributedDataParallel``; one gradient all-reduce per step.
- ``sync``: ``moshpit.Optimizer(mode="sync", target_batch_size=peers x batch)``; each peer
  contributes one batch per global step and then ``poll()``s (every global batch is exactly the
  DDP batch).
- ``sync_8bit``: the same with ``compression=Uniform8Bit()``.
- ``local``: local Adam steps, parameters averaged in the background (adaptive period).
- ``diloco`` / ``diloco_8bit``: ``--inner-steps`` inner Adam steps per outer step.

Measured: the wall time from the first training step until **worker 0's own model** (its
current parameters) first reaches ``--target`` test accuracy, evaluated every ``--eval-every``
local steps (the evaluation is inside the timed loop for every mode alike), capped at
``--cap`` seconds; bytes sent per peer per data epoch (1258 samples of the swarm): the modes'
``bytes_sent`` counters (payload of the averaging rounds) and, for DDP, ``4 x parameters`` per
step (the gradient; gloo's ring all-reduce puts ``2 (N-1)/N`` times that on the wire). With
``--net wan`` each peer also reports the bytes its namespace's ``eth0`` transmitted (everything:
DHT, matchmaking, averaging, gloo), from ``/proc/net/dev``.

``--net loopback``: 127.0.0.1. ``--net wan --rate 100mbit``: every peer in its own network
namespace of ``wan_testbed.WanTestbed`` (links shaped with tc tbf); skipped with the testbed's
reason where namespaces are not permitted. One JSON line per (net, mode) with the load average,
the DDP line comes from the same run, then a ``summary`` line per net with ratios to DDP.

    python benchmarks/bench_training.py                    # loopback, then wan 100mbit
    python benchmarks/bench_training.py --quick            # fewer modes, shorter cap
    python benchmarks/bench_training.py --net wan --rate 100mbit --modes ddp diloco_8bit
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

MODES = ["ddp", "alone", "sync", "sync_8bit", "local", "diloco", "diloco_8bit"]
QUICK_MODES = ["ddp", "alone", "sync_8bit", "local", "diloco_8bit"]
FAST = dict(
    min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0, initial_group_bits=""
)
GLOO_PORT_WAN = 29531  # inside the namespaces only


# ---------------------------------------------------------------------------- worker side


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _eth0_tx_bytes() -> int | None:
    """Bytes transmitted by this network namespace's eth0 (None outside the testbed)."""
    try:
        for line in Path("/proc/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    except OSError:
        return None
    return None


def _make_model(hidden: int, seed: int = 0) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10)
    )


GLOO_TIMEOUT_S = 120.0  # DDP's process group: every collective, the start's broadcast too


def join_gloo(args: argparse.Namespace) -> None:
    """DDP's process group over the worker's link (reports "dht" so the parent goes on)."""
    import datetime

    import torch.distributed as dist

    _emit({"event": "dht", "maddr": ""})
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.gloo_addr}:{args.gloo_port}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S),
    )


def join_dht(args: argparse.Namespace) -> Any:
    """The worker's moshpit.DHT; its address goes to the parent, which bootstraps the rest."""
    import moshpit

    dht = moshpit.DHT(
        initial_peers=[args.bootstrap] if args.bootstrap else [],
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        startup_timeout=120,
    )
    _emit({"event": "dht", "maddr": str(dht.get_visible_maddrs()[0])})
    return dht


def worker(args: argparse.Namespace) -> None:
    """One peer: train until told to stop (stdin ``stop``) or until the cap; report on stdout."""
    import torch

    from moshpit.training.demo_task import evaluate, load_digits_split

    torch.set_num_threads(1)
    data = load_digits_split()
    model = _make_model(args.hidden)
    numel = sum(p.numel() for p in model.parameters())
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
                return
        stop.set()

    in_netns = args.host != "127.0.0.1"  # the testbed: this namespace's eth0 is our link
    tx0 = _eth0_tx_bytes() if in_netns else None
    mode = args.mode
    dht = opt = None
    if mode == "alone":  # one process, no communication: what a single peer achieves by itself
        _emit({"event": "dht", "maddr": ""})
        inner = torch.optim.Adam(model.parameters(), lr=args.lr)
        forward: Callable = model
    elif mode == "ddp":
        import torch.distributed as dist

        join_gloo(args)
        net = torch.nn.parallel.DistributedDataParallel(model)
        inner = torch.optim.Adam(net.parameters(), lr=args.lr)
        forward = net
    else:
        import moshpit
        from compression import Uniform8Bit

        dht = join_dht(args)
        inner = torch.optim.Adam(model.parameters(), lr=args.lr)
        base = mode.split("_")[0]
        options: dict[str, Any] = {}
        if base == "sync":
            options = dict(target_batch_size=args.batch * args.world, refresh_period=0.05)
            if mode.endswith("8bit"):
                options["compression"] = Uniform8Bit()
        elif base == "local":
            options = dict(average_every=args.average_every)
        elif base == "diloco":
            options = dict(inner_steps=args.inner_steps, refresh_period=0.1)
            if mode.endswith("8bit"):
                options["compression"] = "8bit"
        opt = moshpit.Optimizer(
            optimizer=inner,
            dht=dht,
            run_id=f"bench-training-{mode}",
            batch_size_per_step=args.batch,
            mode=base,
            target_group_size=args.world,
            averager_options=FAST,
            load_state_timeout=10.0,
            **options,
        )
        opt.tracker.min_refresh_period = 0.05
        forward = model
    _emit({"event": "ready"})
    # all peers start together: the parent says "go" once every peer is ready
    while sys.stdin.readline().strip() not in ("go", ""):
        pass
    threading.Thread(target=read_stdin, daemon=True).start()
    batches = data.batches(args.batch, seed=100 + args.rank)
    started = time.perf_counter()
    steps = samples = 0
    reached_s: float | None = None
    curve: list[tuple[float, float]] = []
    ddp_stop = torch.zeros(1)
    while True:
        x, y = next(batches)
        if opt is not None:
            opt.zero_grad()
        else:
            inner.zero_grad()
        loss = torch.nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        if opt is not None:
            epoch = opt.epoch
            opt.step(batch_size=len(y))
            if mode.startswith("sync"):  # one batch per peer and global step, like DDP
                deadline = time.monotonic() + 30
                while opt.epoch == epoch and time.monotonic() < deadline and not stop.is_set():
                    if opt.mode.poll():
                        break
                    time.sleep(0.01)
        else:
            inner.step()
        steps += 1
        samples += len(y)
        elapsed = time.perf_counter() - started
        if steps % args.eval_every == 0:
            acc, _ = evaluate(model, data.x_test, data.y_test)
            curve.append((round(elapsed, 2), round(acc, 4)))
            if reached_s is None and acc >= args.target:
                reached_s = elapsed
                _emit({"event": "reached", "seconds": elapsed, "steps": steps})
            if mode == "ddp":  # everyone stops at the same step (a collective decides)
                import torch.distributed as dist

                ddp_stop.fill_(1.0 if (stop.is_set() or elapsed > args.cap) else 0.0)
                dist.all_reduce(ddp_stop)
                if float(ddp_stop) > 0:
                    break
        if mode != "ddp" and (stop.is_set() or elapsed > args.cap):
            break
    elapsed = time.perf_counter() - started
    tx1 = _eth0_tx_bytes() if in_netns else None
    acc, _ = evaluate(model, data.x_test, data.y_test)
    report: dict[str, Any] = {
        "event": "result",
        "rank": args.rank,
        "steps": steps,
        "samples": samples,
        "seconds": elapsed,
        "reached_s": reached_s,
        "final_accuracy": acc,
        "numel": numel,
        "curve": curve[-40:],
        "wire_tx_bytes": None if tx0 is None or tx1 is None else tx1 - tx0,
    }
    if opt is not None:
        m = opt.mode
        report["bytes_sent"] = int(getattr(m, "bytes_sent", 0))
        report["rounds_succeeded"] = getattr(m, "rounds_succeeded", None)
        report["rounds_failed"] = getattr(m, "rounds_failed", None)
        report["epoch"] = opt.epoch
    else:  # what gloo's ring all-reduce sends per peer and step: 2 (N-1)/N x the gradient
        report["bytes_sent"] = round(2 * (args.world - 1) / args.world * 4 * numel * steps)
    _emit(report)
    if opt is not None:
        opt.shutdown()
    if dht is not None:
        dht.shutdown()
    if mode == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()


# ---------------------------------------------------------------------------- parent side


class Peer:
    """A worker process speaking JSON lines on stdout (read by a thread), commands on stdin."""

    def __init__(self, argv: list[str], popen: Callable[..., subprocess.Popen], ifname: str):
        # gloo must use the shaped link (eth0 in a namespace), not what the hostname resolves to
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname)
        self.p = popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.queue: queue.Queue[dict | None] = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            try:
                self.queue.put(json.loads(line))
            except json.JSONDecodeError:
                continue  # a stray line (a library printing): not ours
        self.queue.put(None)

    def send(self, line: str) -> None:
        try:
            assert self.p.stdin is not None
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def poll_event(self, timeout: float) -> dict | None:
        try:
            event = self.queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is None:
            raise RuntimeError(f"worker exited (rc={self.p.poll()}) before reporting")
        self.seen.append(event)
        return event

    def wait_for(self, kind: str, timeout: float) -> dict:
        for e in self.seen:
            if e.get("event") == kind:
                return e
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            e = self.poll_event(min(1.0, max(0.01, deadline - time.monotonic())))
            if e is not None and e.get("event") == kind:
                return e
        raise TimeoutError(f"no {kind!r} from worker within {timeout:.0f}s")


def spawn(argv: list[str], rank: int, bootstrap: str | None, tb: Any | None) -> Peer:
    """Worker ``rank`` on loopback, or in its own namespace of the testbed ``tb``."""
    if bootstrap:
        argv = [*argv, "--bootstrap", bootstrap]
    popen = (lambda a, **kw: tb.popen(rank, a, **kw)) if tb is not None else subprocess.Popen
    return Peer(argv, popen, "eth0" if tb is not None else "lo")


def start_peers(n: int, start: Callable[[int, str | None], Peer]) -> list[Peer]:
    """Rank 0 first (its DHT address bootstraps the others), then ranks 1..n-1; returns once
    every worker is ready. Workers started so far are killed if that fails."""
    peers = [start(0, None)]
    try:
        maddr = peers[0].wait_for("dht", 120)["maddr"]
        peers += [start(r, maddr or None) for r in range(1, n)]
        for p in peers:
            p.wait_for("ready", 180)
    except BaseException:
        kill_peers(peers)
        raise
    return peers


def kill_peers(peers: list[Peer]) -> None:
    """Kill the workers still running (after a run, or when it failed)."""
    for p in peers:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mode(args: argparse.Namespace, mode: str, tb: Any | None) -> dict:
    """Start ``args.peers`` workers in ``mode``, wait for worker 0 to reach the target or the cap."""
    gloo_port = GLOO_PORT_WAN if tb is not None else _free_port()
    n = 1 if mode == "alone" else args.peers

    def start(rank: int, bootstrap: str | None) -> Peer:
        host = tb.addr(rank) if tb is not None else "127.0.0.1"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--mode", mode,
                "--rank", str(rank), "--world", str(n), "--host", host,
                "--gloo-addr", tb.addr(0) if tb is not None else "127.0.0.1",
                "--gloo-port", str(gloo_port), "--hidden", str(args.hidden),
                "--batch", str(args.batch), "--lr", str(args.lr), "--target", str(args.target),
                "--cap", str(args.cap), "--eval-every", str(args.eval_every),
                "--inner-steps", str(args.inner_steps),
                "--average-every", str(args.average_every)]  # fmt: skip
        return spawn(argv, rank, bootstrap, tb)

    peers = start_peers(n, start)
    try:
        load_start = os.getloadavg()
        for p in peers:
            p.send("go")
        reached = None
        deadline = time.monotonic() + args.cap + 60
        while time.monotonic() < deadline:
            e = peers[0].poll_event(1.0)
            if e is not None and e.get("event") in ("reached", "result"):
                reached = e if e["event"] == "reached" else None
                break
        for p in peers:
            p.send("stop")
        results = [p.wait_for("result", 120) for p in peers]
        for p in peers:
            p.p.wait(timeout=60)
    finally:
        kill_peers(peers)
    total_samples = sum(r["samples"] for r in results)
    data_epochs = total_samples / 1258
    sent = [r["bytes_sent"] for r in results]
    line: dict[str, Any] = {
        "kind": "run",
        "net": args.net_now,
        "mode": mode,
        "peers": n,
        "hidden": args.hidden,
        "numel": results[0]["numel"],
        "batch_per_peer": args.batch,
        "global_batch": args.batch * n,
        "target": args.target,
        "reached": reached is not None,
        "time_to_target_s": round(reached["seconds"], 2) if reached else None,
        "cap_s": args.cap,
        "worker0_steps": results[0]["steps"],
        "final_accuracy_worker0": round(results[0]["final_accuracy"], 4),
        "data_epochs": round(data_epochs, 2),
        "bytes_sent_per_peer_per_epoch": round(sum(sent) / len(sent) / max(data_epochs, 1e-9)),
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    }
    if mode == "alone":
        line["note"] = "one process with the per-peer batch, no communication (reference)"
    elif mode == "ddp":
        line["bytes_note"] = "ring all-reduce: 2 (N-1)/N x 4 x params per step"
    else:
        line["rounds_succeeded_worker0"] = results[0].get("rounds_succeeded")
        line["rounds_failed_worker0"] = results[0].get("rounds_failed")
        line["epoch_worker0"] = results[0].get("epoch")
    wire = [r["wire_tx_bytes"] for r in results]
    if all(w is not None for w in wire):
        line["wire_tx_bytes_per_peer_per_epoch"] = round(sum(wire) / len(wire) / data_epochs)
    line["curve_worker0"] = results[0]["curve"][-10:]
    if args.rate_now:
        line["rate"] = args.rate_now
    return line


def summarize(rows: list[dict]) -> dict:
    ddp = next((r for r in rows if r["mode"] == "ddp"), None)
    out: dict[str, Any] = {"kind": "summary", "net": rows[0]["net"], "target": rows[0]["target"]}
    if rows[0].get("rate"):
        out["rate"] = rows[0]["rate"]
    for r in rows:
        out[f"{r['mode']}_s"] = r["time_to_target_s"]
        if ddp is not None and r is not ddp:
            if r["time_to_target_s"] is not None and ddp["time_to_target_s"] is not None:
                out[f"{r['mode']}_time_vs_ddp"] = round(
                    r["time_to_target_s"] / ddp["time_to_target_s"], 2
                )
                out[f"{r['mode']}_beats_ddp"] = r["time_to_target_s"] < ddp["time_to_target_s"]
            out[f"{r['mode']}_bytes_vs_ddp"] = round(
                r["bytes_sent_per_peer_per_epoch"] / max(1, ddp["bytes_sent_per_peer_per_epoch"]),
                4,
            )
    out["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    return out


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden options the parent passes to each worker process."""
    hidden = argparse.SUPPRESS
    parser.add_argument("--rank", type=int, default=0, help=hidden)
    parser.add_argument("--world", type=int, default=4, help=hidden)
    parser.add_argument("--host", default="127.0.0.1", help=hidden)
    parser.add_argument("--bootstrap", default=None, help=hidden)
    parser.add_argument("--gloo-addr", default="127.0.0.1", help=hidden)
    parser.add_argument("--gloo-port", type=int, default=0, help=hidden)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="ddp", choices=MODES, help=argparse.SUPPRESS)
    add_worker_arguments(parser)
    parser.add_argument("--net", nargs="+", choices=["loopback", "wan"], default=None)
    parser.add_argument("--rate", default="100mbit", help="per-peer link rate for --net wan")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=None)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=32, help="samples per process and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--cap", type=float, default=60.0, help="seconds per run at most")
    parser.add_argument("--eval-every", type=int, default=5, help="local steps between evals")
    parser.add_argument("--inner-steps", type=int, default=20, help="DiLoCo H")
    parser.add_argument("--average-every", type=int, default=4, help="local: initial period")
    parser.add_argument("--quick", action="store_true", help="4 modes, 30 s cap")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    modes = args.modes or (QUICK_MODES if args.quick else MODES)
    if args.quick:
        args.cap = min(args.cap, 30.0)
    if "ddp" in modes:  # the baseline first, in the same run
        modes = ["ddp"] + [m for m in modes if m != "ddp"]
    for net in args.net or ["loopback", "wan"]:
        args.net_now, args.rate_now = net, (args.rate if net == "wan" else None)
        rows: list[dict] = []
        if net == "wan":
            from wan_testbed import WanTestbed, unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                _emit({"kind": "skipped", "net": "wan", "reason": reason})
                continue
            for mode in modes:  # a fresh testbed per mode: no leftover state between runs
                with WanTestbed(args.peers, args.rate) as tb:
                    rows.append(run_mode(args, mode, tb))
                _emit(rows[-1])
        else:
            for mode in modes:
                rows.append(run_mode(args, mode, None))
                _emit(rows[-1])
        _emit(summarize(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
