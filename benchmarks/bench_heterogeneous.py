"""Volunteers of unequal speed: utilisation, steps and loss per mode, against equal speeds.

N peer processes on loopback (default 4) train the demo's MLP on the 8x8 digits; each step is
padded to ``--step`` x its speed factor seconds (default factors 1 2 4 8: 0.05 / 0.1 / 0.2 /
0.4 s), as an H100, a T4 and two laptops would be. A peer "computes" while it runs its batch
and the padding; the time ``opt.step()`` spends beyond that (waiting for a round, loading
state) is overhead. Modes:

- ``local``: local Adam steps, parameters averaged in the background;
- ``sync``: one global step per ``--sync-target`` samples of the swarm (4096);
- ``diloco``: swarm-wide outer epochs, one outer step per ``--diloco-target`` samples of the
  swarm (default: about ``--outer-seconds`` (2) of the swarm's compute), Δ weighted by samples;
- ``diloco_lockstep``: every peer takes ``--inner-steps`` (20) inner steps, then an outer round
  that waits for all (the mode as it was before swarm-wide epochs).

Each mode runs twice in one invocation: with the speed factors, and with every peer at factor
1 (the baseline: the same run with equal speeds). One JSON line per run:

- ``utilisation``: time computing / wall time, over all peers;
- ``swarm_samples_per_s`` and ``solo_sum``: the swarm's samples per second, and the sum of the
  peers' solo rates (batch / padded step time): their ratio is what the swarm makes of the
  compute it was given;
- ``steps``, ``samples``: per peer; ``epochs``: each peer's epoch at the end;
  ``rounds_failed``: failed round attempts per peer;
- ``val_loss``: the validation loss of each peer's model at the end (its current parameters;
  for ``diloco`` the shared θ, what the swarm agreed on).

    python benchmarks/bench_heterogeneous.py [--seconds 90] [--modes local sync diloco]
    python benchmarks/bench_heterogeneous.py --speeds 1 2 4 8 --step 0.05 --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

MODES = ["local", "sync", "diloco", "diloco_lockstep"]
BATCH = 32
HIDDEN = 64
FAST = dict(min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=10.0)


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- worker side


def mode_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.mode == "local":
        return dict(mode="local")
    if args.mode == "sync":
        return dict(mode="sync", target_batch_size=args.sync_target)
    if args.mode == "diloco":
        return dict(mode="diloco", target_batch_size=args.diloco_target)
    return dict(mode="diloco", inner_steps=args.inner_steps)


def worker(args: argparse.Namespace) -> None:
    """One peer: join, wait for "go", train for ``--seconds`` with padded steps, report."""
    import torch

    import moshpit
    from moshpit.training.demo_task import evaluate, load_digits_split

    torch.set_num_threads(1)
    data = load_digits_split()
    torch.manual_seed(0)  # every peer starts from the same weights (diloco needs it)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10)
    )
    dht = moshpit.DHT(
        initial_peers=[args.bootstrap] if args.bootstrap else [],
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    _emit({"event": "dht", "maddr": str(dht.get_visible_maddrs()[0])})
    opt = moshpit.Optimizer(
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        dht=dht,
        run_id=f"hetero-{args.mode}-{args.tag}",
        batch_size_per_step=BATCH,
        target_group_size=args.world,
        averager_options=FAST,
        load_state_timeout=10.0,
        **mode_options(args),
    )
    _emit({"event": "ready"})
    while sys.stdin.readline().strip() not in ("go", ""):
        pass
    step_seconds = args.step * args.factor
    batches = data.batches(BATCH, seed=100 + args.rank)
    started = time.monotonic()
    computing = 0.0
    steps = 0
    while time.monotonic() - started < args.seconds:
        began = time.monotonic()
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        pad = step_seconds - (time.monotonic() - began)
        if pad > 0:
            time.sleep(pad)
        computing += time.monotonic() - began
        opt.step()
        steps += 1
    wall = time.monotonic() - started
    mode = opt.mode
    if args.mode.startswith("diloco"):  # the swarm's model is θ, not the inner loop's
        with torch.no_grad():
            for p, theta in zip(model.parameters(), mode.theta, strict=True):
                p.copy_(theta)
    _, val_loss = evaluate(model, data.x_test, data.y_test)
    _emit(
        {
            "event": "done",
            "rank": args.rank,
            "factor": args.factor,
            "wall": wall,
            "computing": computing,
            "steps": steps,
            "samples": steps * BATCH,
            "epoch": opt.epoch,
            "rounds_failed": int(getattr(mode, "rounds_failed", 0)),
            "val_loss": val_loss,
        }
    )
    opt.shutdown()
    dht.shutdown()


# ---------------------------------------------------------------------------- parent side


def run(args: argparse.Namespace, mode: str, factors: list[float], tag: str) -> dict[str, Any]:
    """Start the peers (the first one bootstraps the others), train, collect their reports."""
    procs: list[subprocess.Popen] = []
    reports: list[dict[str, Any]] = []
    lock = threading.Lock()
    bootstrap = ""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def read(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "done":
                with lock:
                    reports.append(event)

    try:
        for rank, factor in enumerate(factors):
            command = [
                sys.executable, __file__, "--worker", "--mode", mode, "--rank", str(rank),
                "--factor", str(factor), "--world", str(len(factors)), "--tag", tag,
                "--bootstrap", bootstrap, "--seconds", str(args.seconds), "--step",
                str(args.step), "--sync-target", str(args.sync_target), "--diloco-target",
                str(args.diloco_target), "--inner-steps", str(args.inner_steps),
            ]  # fmt: skip
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            procs.append(proc)
            assert proc.stdout is not None
            for line in proc.stdout:  # until it joined (the first one's address bootstraps)
                event = json.loads(line)
                if event.get("event") == "dht":
                    bootstrap = bootstrap or event["maddr"]
                if event.get("event") == "ready":
                    break
        readers = [threading.Thread(target=read, args=(p,), daemon=True) for p in procs]
        for reader in readers:
            reader.start()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in procs:
            proc.wait(timeout=args.seconds + 120)
        for reader in readers:
            reader.join(10)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    reports.sort(key=lambda r: r["rank"])
    if len(reports) != len(factors):
        return {"bench": "heterogeneous", "mode": mode, "tag": tag, "error": "a peer failed"}
    wall = max(r["wall"] for r in reports)
    solo_sum = sum(BATCH / (args.step * r["factor"]) for r in reports)
    return {
        "bench": "heterogeneous",
        "mode": mode,
        "speeds": tag,
        "factors": factors,
        "seconds": args.seconds,
        "utilisation": round(
            sum(r["computing"] for r in reports) / sum(r["wall"] for r in reports), 3
        ),
        "swarm_samples_per_s": round(sum(r["samples"] for r in reports) / wall, 1),
        "solo_sum": round(solo_sum, 1),
        "steps": [r["steps"] for r in reports],
        "samples": [r["samples"] for r in reports],
        "epochs": [r["epoch"] for r in reports],
        "rounds_failed": [r["rounds_failed"] for r in reports],
        "val_loss": [round(r["val_loss"], 4) for r in reports],
        "load_avg": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--speeds", nargs="+", type=float, default=[1, 2, 4, 8])
    parser.add_argument("--step", type=float, default=0.05, help="s per step at factor 1")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--sync-target", type=int, default=4096)
    parser.add_argument(
        "--outer-seconds", type=float, default=2.0,
        help="diloco: an outer step per this many seconds of the swarm's compute",
    )  # fmt: skip
    parser.add_argument("--diloco-target", type=int, default=0, help="0: from --outer-seconds")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--no-equal", action="store_true", help="skip the equal-speed runs")
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="local", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--factor", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs = [("speeds", args.speeds)]
    if not args.no_equal:
        runs.append(("equal", [1.0] * len(args.speeds)))
    for tag, factors in runs:
        rate = sum(BATCH / (args.step * f) for f in factors)
        run_args = argparse.Namespace(**vars(args))
        run_args.diloco_target = args.diloco_target or int(rate * args.outer_seconds)
        for mode in args.modes:
            _emit(run(run_args, mode, factors, tag))


if __name__ == "__main__":
    main()
