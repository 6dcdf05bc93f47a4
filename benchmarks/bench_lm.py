"""Time to loss on a language model: 4 processes, DDP (gloo) against every moshpit mode.

Task (``lm_task.py``): a 2.2M-parameter character-level transformer (context 64) on the Python
standard library's source, AdamW, ``--batch`` windows per process and step. Every method starts
from the same weights and runs for ``--budget`` seconds of wall clock; the same run measures
DDP first, so every other row reads as a ratio to it.

Methods (``--methods``):

- ``ddp``: gloo process group + ``DistributedDataParallel``, one gradient all-reduce per step.
- ``sync`` / ``sync_8bit``: ``mode="sync"``, ``target_batch_size`` = peers x batch (DDP's
  global batch), gradients raw or ``Uniform8Bit``; the user loop just calls ``step()``.
  ``sync_delayed``: ``delay_averaging=True`` (each round overlaps the next batch; the update
  lands one step late).
- ``local``: local AdamW steps, parameters averaged in the background (adaptive period).
- ``diloco`` / ``diloco_8bit`` / ``diloco_4bit``: ``--inner-steps`` AdamW steps, then the outer
  Nesterov step on the averaged pseudo-gradient (raw, 8-bit, 4-bit with error feedback).
- ``streaming_4bit`` / ``streaming_sparse2bit``: streaming DiLoCo, ``--fragments`` fragments on
  staggered schedules, each fragment's round overlapped with ``--overlap-steps`` inner steps
  (``--fragments 1``: the whole model's round in the background), 4-bit or sparse outer
  gradients.
- ``streamingswarm_4bit`` / ``streamingswarm_sparse2bit``: streaming on the swarm's shared
  schedule: a fragment's round starts when the swarm's samples reach the fragment's share of
  ``target_batch_size`` (as ``dilocoswarm``), so every peer arrives at the same round.
- ``diloco_sparse2bit`` / ``dilocoswarm_sparse2bit``: the same with TopK2Bit both ways (the top
  ``--topk-density`` (1%) of every 4096 values, 2 bits each, error feedback); rows report bytes per peer per outer
  step and the ratio to a dense float32 all-reduce.
- ``dilocoswarm`` / ``dilocoswarm_4bit``: swarm-wide outer epochs (``target_batch_size`` =
  peers x batch x ``--inner-steps``, the samples of one lockstep outer step), rounds in the
  background, pseudo-gradients weighted by samples.

``--local-error-feedback`` and ``--outer-momentum M`` pass those options to every ``diloco``
method (the run rows record them). ``--state-link`` gives every moshpit peer the shaped rate as
its ``bandwidth`` (pacing, and the all-reduce's time allowance on slow links); the rows say
``stated_link``. ``BENCH_LOG=INFO`` in the environment prints the workers' logs on stderr (``BENCH_DEBUG`` =
comma-separated logger names: those at DEBUG).

``--speeds 1 2 4 8`` makes the peers unequal: worker ``i`` times its own forward and backward
pass before the race (the median of 3, no communication) and sleeps ``speeds[i] - 1`` times
that after every step, so its compute takes that many times as long (a race of an H100
against slower machines; DDP runs at the slowest one's pace).

Measured per method: worker 0's parameters are copied every ``--snapshot-every`` seconds during
the run (a memcpy, nothing else in the timed loop), and evaluated after it on a fixed
validation set (bits per byte). Per row: the code's own counters (optimizer steps, samples,
epochs, payload bytes sent; in a namespace also every byte eth0 sent), validation loss at the
budget, and the wall-clock time until the loss first reached DDP's loss at the budget
(linear between snapshots; ``null`` when it never did). One JSON line per method, then a
``summary`` line per link with the ratios against DDP, and with more than one link a ``race``
line: each link's losses against 4-bit DiLoCo on the fastest link run (does link speed still
matter?), with the model size that would see the same bytes-per-second ratio on a 45 Mbit/s
home uplink.

Links (``--links``): ``loopback``; ``1gbit``, ``100mbit`` and the home uplinks ``10mbit``,
``1mbit`` and ``200kbit`` (not run by default) put every process in its own
network namespace of ``wan_testbed.WanTestbed`` (tc tbf up and down; root needed, otherwise one
``skipped`` line). ``--plot out.png`` draws loss against wall clock and against megabytes
sent per peer, per link (matplotlib).

    python benchmarks/bench_lm.py                                   # all links, all methods
    python benchmarks/bench_lm.py --links loopback --methods ddp diloco --budget 30
    python benchmarks/bench_lm.py --links 100mbit 1mbit 200kbit \
        --methods diloco_4bit diloco_sparse2bit dilocoswarm_sparse2bit
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from bench_training import (  # noqa: E402
    GLOO_TIMEOUT_S,
    Peer,
    _emit,
    _eth0_tx_bytes,
    _free_port,
    add_worker_arguments,
    join_dht,
    join_gloo,
    kill_peers,
    spawn,
    start_peers,
)

METHODS = [
    "ddp",
    "sync",
    "sync_8bit",
    "sync_delayed",
    "local",
    "diloco",
    "diloco_8bit",
    "diloco_4bit",
    "diloco_sparse2bit",
    "streaming_4bit",
    "streaming_sparse2bit",
    "dilocoswarm",
    "dilocoswarm_4bit",
    "dilocoswarm_sparse2bit",
    "streamingswarm_4bit",
    "streamingswarm_sparse2bit",
]
# 1mbit with this 2.2M-parameter model is a 100M-parameter model's ratio on a 45 Mbit/s home
# uplink, 200kbit a 500M-parameter one's
LINKS = ["loopback", "1gbit", "100mbit", "10mbit", "1mbit", "200kbit"]
FAST = dict(
    min_matchmaking_time=1.0, request_timeout=2.0, allreduce_timeout=30.0, initial_group_bits=""
)
GLOO_PORT_WAN = 29533  # inside the namespaces only
CONTEXT = 64


# ---------------------------------------------------------------------------- worker side


def _build(args: argparse.Namespace, model: Any) -> tuple[Any, Any, Any, Any]:
    """(optimizer to step, module to call, moshpit.Optimizer or None, DHT or None)."""
    import torch

    method = args.method
    if method == "ddp":
        join_gloo(args)
        net = torch.nn.parallel.DistributedDataParallel(model)
        return torch.optim.AdamW(net.parameters(), lr=args.lr), net, None, None
    import moshpit

    dht = join_dht(args)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    base, _, codec = method.partition("_")  # e.g. dilocoswarm_sparse2bit
    options: dict[str, Any] = {}
    mode = base
    if base == "sync":
        options = dict(target_batch_size=args.batch * args.world, refresh_period=args.refresh)
        if codec == "8bit":
            from compression import Uniform8Bit

            options["compression"] = Uniform8Bit()
        elif codec == "delayed":  # the round of step e overlaps the batch of step e + 1
            options["delay_averaging"] = True
    elif base == "local":
        options = dict(average_every=args.average_every)
    elif base in ("dilocoswarm", "streamingswarm"):
        mode = "diloco"
        samples = args.batch * args.world * args.inner_steps  # one lockstep outer step's
        options = dict(target_batch_size=samples, refresh_period=max(0.1, args.refresh))
        if codec:
            options["compression"] = codec
        if codec == "sparse2bit":
            options["topk_density"] = args.topk_density
            options["reducer_density"] = args.reducer_density
        if base == "streamingswarm":
            options["fragments"] = args.fragments
    elif base in ("diloco", "streaming"):
        mode = "diloco"
        options = dict(inner_steps=args.inner_steps, refresh_period=max(0.1, args.refresh))
        if codec:
            options["compression"] = codec
        if codec == "sparse2bit":
            options["topk_density"] = args.topk_density
            options["reducer_density"] = args.reducer_density
        if base == "streaming":
            options["fragments"] = args.fragments
            options["overlap_steps"] = args.overlap_steps
    if mode == "diloco" and args.local_error_feedback:
        options["local_error_feedback"] = True
    if mode == "diloco" and args.outer_momentum is not None:
        options["outer_momentum"] = args.outer_momentum
    if mode == "diloco" and args.outer_lr is not None:
        options["outer_lr"] = args.outer_lr
    if mode == "diloco" and args.no_nesterov:
        options["nesterov"] = False
    if mode == "diloco" and args.error_feedback_decay is not None:
        options["error_feedback_decay"] = args.error_feedback_decay
    opt = moshpit.Optimizer(
        optimizer=inner,
        dht=dht,
        run_id=f"bench-lm-{method}",
        batch_size_per_step=args.batch,
        mode=mode,
        target_group_size=args.world,
        averager_options=FAST
        if args.link_bps is None
        else {**FAST, "bandwidth": args.link_bps / 8},
        load_state_timeout=20.0,
        **options,
    )
    opt.tracker.min_refresh_period = args.refresh
    return inner, model, opt, dht


def compute_seconds(model: Any, data: Any) -> float:
    """This process's forward and backward pass on one batch (median of 3), without any
    communication: the unit a slower peer's compute is a multiple of (``--speeds``)."""
    from lm_task import loss_of

    times = []
    for _ in range(3):
        x, y = next(data)
        began = time.perf_counter()
        loss_of(model, x, y).backward()
        times.append(time.perf_counter() - began)
        model.zero_grad(set_to_none=True)
    return sorted(times)[1]


def worker(args: argparse.Namespace) -> None:
    """One process: train for the budget, then report (worker 0 also evaluates snapshots)."""
    import torch
    from lm_task import batches, bits_per_byte, loss_of, make_model, stdlib_corpus
    from lm_task import validation_windows as windows

    torch.set_num_threads(1)
    if os.environ.get("BENCH_LOG"):  # e.g. BENCH_LOG=INFO: the workers' logs on stderr
        import logging

        logging.basicConfig(
            level=os.environ["BENCH_LOG"],
            format=f"%(relativeCreated)7.0f w{args.rank} %(name)s %(levelname)s: %(message)s",
        )
        for name in filter(None, os.environ.get("BENCH_DEBUG", "").split(",")):
            logging.getLogger(name).setLevel(logging.DEBUG)  # e.g. moshpit.training.modes
    train, val = stdlib_corpus()
    model = make_model(context=CONTEXT)
    params = list(model.parameters())
    in_netns = args.host != "127.0.0.1"
    tx0 = _eth0_tx_bytes() if in_netns else None
    inner, forward, opt, dht = _build(args, model)
    pad = (args.speed - 1.0) * compute_seconds(model, batches(train, args.batch, CONTEXT, 7))
    _emit({"event": "ready"})
    while sys.stdin.readline().strip() not in ("go", ""):
        pass
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    profiler = None
    if args.profile and args.rank == 1:  # pyinstrument on one peer's training thread
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.005)
        profiler.start()
    data = batches(train, args.batch, CONTEXT, seed=1000 + args.rank)
    numel = sum(p.numel() for p in params)
    ring_bytes = 2 * (args.world - 1) / args.world * 4 * numel  # gloo's ring, per rank and step

    def sent_so_far() -> int:
        """Payload bytes this peer has sent so far (DDP: its ring all-reduce's share)."""
        if opt is None:
            return round(ring_bytes * steps)
        return int(getattr(opt.mode, "bytes_sent", 0))

    snapshots: list[tuple[float, int, list[Any]]] = []
    snapshot_at = 0.0
    started = time.perf_counter()
    steps = samples = 0
    ddp_flag = torch.zeros(1)
    while True:
        elapsed = time.perf_counter() - started
        if args.rank == 0 and elapsed >= snapshot_at:
            snapshots.append((elapsed, sent_so_far(), [p.detach().clone() for p in params]))
            snapshot_at += args.snapshot_every
        x, y = next(data)
        (opt or inner).zero_grad()
        loss = loss_of(forward, x, y)
        loss.backward()
        if opt is not None:
            opt.step(loss=loss)
        else:
            inner.step()
        steps += 1
        samples += len(x)
        if pad > 0:
            time.sleep(pad)
        done = stop.is_set() or time.perf_counter() - started >= args.budget
        if opt is None:  # DDP: every rank stops at the same step (a collective decides)
            import torch.distributed as dist

            ddp_flag.fill_(1.0 if done else 0.0)
            dist.all_reduce(ddp_flag)
            done = float(ddp_flag) > 0
        if done:
            break
    elapsed = time.perf_counter() - started
    if profiler is not None:
        profiler.stop()
        Path(args.profile).write_text(profiler.output_text(unicode=False, show_all=False))
    if args.rank == 0:
        snapshots.append((elapsed, sent_so_far(), [p.detach().clone() for p in params]))
    tx1 = _eth0_tx_bytes() if in_netns else None
    report: dict[str, Any] = {
        "event": "result",
        "rank": args.rank,
        "seconds": elapsed,
        "numel": numel,
        "wire_tx_bytes": None if tx0 is None or tx1 is None else tx1 - tx0,
    }
    if opt is None:
        report.update(steps=steps, samples=samples, epochs=steps)
        report["bytes_sent"] = sent_so_far()
    else:
        m = opt.mode
        report.update(
            steps=opt.local_steps,
            samples=opt.samples_processed,
            epochs=opt.epoch,
            bytes_sent=int(getattr(m, "bytes_sent", 0)),
            rounds_succeeded=getattr(m, "rounds_succeeded", None),
            rounds_failed=getattr(m, "rounds_failed", None),
            solo_steps=getattr(m, "solo_steps", None),
        )
        for name in ("round_seconds", "blocked_steps", "overlapped_steps"):
            if hasattr(m, name):
                value = getattr(m, name)
                report[name] = (
                    {k: round(v, 2) for k, v in value.items()} if isinstance(value, dict) else value
                )
        opt.shutdown()
    if dht is not None:
        dht.shutdown()
    if opt is None:
        import torch.distributed as dist

        dist.destroy_process_group()
    if args.rank == 0:  # evaluate after the clock stopped: the run paid only for copies
        torch.set_num_threads(args.eval_threads)
        held_out = windows(val, args.eval_windows, CONTEXT)
        curve, sent = [], []
        for at, sent_bytes, tensors in snapshots:
            with torch.no_grad():
                for p, saved in zip(params, tensors, strict=True):
                    p.copy_(saved)
            curve.append((round(at, 2), round(bits_per_byte(model, held_out), 4)))
            sent.append(sent_bytes)
        report["curve"] = curve
        report["curve_bytes_sent"] = sent
    _emit(report)


# ---------------------------------------------------------------------------- parent side


def run_method(args: argparse.Namespace, method: str, link: str, tb: Any | None) -> dict:
    n = args.peers
    gloo_port = GLOO_PORT_WAN if tb is not None else _free_port()

    def start(rank: int, bootstrap: str | None) -> Peer:
        host = tb.addr(rank) if tb is not None else "127.0.0.1"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--method", method,
                "--rank", str(rank), "--world", str(n), "--host", host,
                "--gloo-addr", tb.addr(0) if tb is not None else "127.0.0.1",
                "--gloo-port", str(gloo_port), "--batch", str(args.batch), "--lr", str(args.lr),
                "--budget", str(args.budget), "--snapshot-every", str(args.snapshot_every),
                "--inner-steps", str(args.inner_steps), "--fragments", str(args.fragments),
                "--topk-density", str(args.topk_density),
                "--overlap-steps", str(args.overlap_steps),
                "--average-every", str(args.average_every), "--refresh", str(args.refresh),
                "--eval-windows", str(args.eval_windows),
                "--speed", str(args.speeds[rank % len(args.speeds)])]  # fmt: skip
        if args.profile:
            argv += ["--profile", f"{args.profile}.{link}.{method}.txt"]
        if args.local_error_feedback:
            argv.append("--local-error-feedback")
        if args.outer_momentum is not None:
            argv += ["--outer-momentum", str(args.outer_momentum)]
        if args.reducer_density is not None:
            argv += ["--reducer-density", str(args.reducer_density)]
        if args.outer_lr is not None:
            argv += ["--outer-lr", str(args.outer_lr)]
        if args.no_nesterov:
            argv.append("--no-nesterov")
        if args.error_feedback_decay is not None:
            argv += ["--error-feedback-decay", str(args.error_feedback_decay)]
        rate = link_bits_per_second(link)
        if args.state_link and rate is not None:
            argv += ["--link-bps", str(rate)]
        return spawn(argv, rank, bootstrap, tb)

    peers = start_peers(n, start)
    try:
        load_start = os.getloadavg()
        for p in peers:
            p.send("go")
        time.sleep(args.budget)
        for p in peers:
            p.send("stop")
        results = [p.wait_for("result", 300) for p in peers]
        for p in peers:
            p.p.wait(timeout=60)
    finally:
        kill_peers(peers)
    first = results[0]
    row: dict[str, Any] = {
        "kind": "run",
        "link": link,
        "method": method,
        "peers": n,
        "numel": first["numel"],
        "batch_per_peer": args.batch,
        "budget_s": args.budget,
        "speeds": args.speeds,
        "local_error_feedback": args.local_error_feedback,
        "outer_momentum": args.outer_momentum,
        "reducer_density": args.reducer_density,
        "outer_lr": args.outer_lr,
        "nesterov": not args.no_nesterov,
        "error_feedback_decay": args.error_feedback_decay,
        "stated_link": args.state_link,
        "local_steps_all": [r["steps"] for r in results],
        "optimizer_steps_worker0": first["epochs"],
        "local_steps_worker0": first["steps"],
        "samples_all": sum(r["samples"] for r in results),
        "payload_bytes_sent_per_peer": round(sum(r["bytes_sent"] for r in results) / n),
        "final_bpb_worker0": first["curve"][-1][1],
        "curve_worker0": first["curve"],
        "curve_bytes_sent_worker0": first["curve_bytes_sent"],
        "max_loss_rise_bpb": max_rise(first["curve"]),
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    }
    for name in ("rounds_failed", "solo_steps"):  # every peer's: a failed round anywhere counts
        counts = [r.get(name) for r in results]
        if all(isinstance(c, int) for c in counts):
            row[f"{name}_all"] = sum(counts)
    wire = [r["wire_tx_bytes"] for r in results]
    if all(w is not None for w in wire):
        row["wire_bytes_sent_per_peer"] = round(sum(wire) / n)
    for name in ("rounds_succeeded", "rounds_failed", "round_seconds", "blocked_steps",
                 "overlapped_steps"):  # fmt: skip
        if name in first:
            row[f"{name}_worker0"] = first[name]
    if method.startswith(("diloco", "streaming")):
        row["inner_steps"] = args.inner_steps
        if method.endswith("sparse2bit"):
            row["topk_density"] = args.topk_density
        outer = first["epochs"]  # outer steps taken (streaming: fragment rounds)
        if method.startswith("streaming"):  # a whole outer step is one round per fragment
            outer /= args.fragments
        if outer:  # what a home uplink has to carry per outer step, against dense float32
            per_step = row["payload_bytes_sent_per_peer"] / outer
            dense = 2 * (n - 1) / n * 4 * row["numel"]  # butterfly all-reduce of float32
            row["bytes_per_outer_step_per_peer"] = round(per_step)
            row["compression_vs_float32"] = round(dense / max(per_step, 1.0), 1)
    if method.startswith(("dilocoswarm", "streamingswarm")):
        row["target_batch_size"] = args.batch * n * args.inner_steps
    if method.startswith("streaming"):
        row["fragments"] = args.fragments
    if method.startswith("streaming_"):
        row["overlap_steps"] = args.overlap_steps
    return row


def max_rise(curve: list[list[float]]) -> float:
    """The largest jump of the loss above its best value so far (a spike, e.g. when a failed
    round's fragment is applied alone): 0 for a curve that only falls."""
    best, rise = float("inf"), 0.0
    for _, loss in curve:
        rise = max(rise, loss - best)
        best = min(best, loss)
    return round(rise, 4)


def ddp_step_too_slow(args: argparse.Namespace, link: str) -> str | None:
    """Why DDP cannot run on ``link`` (None if it can): one step's ring all-reduce of the
    float32 gradient would take longer than the whole budget (and gloo's start, a broadcast
    of the weights to every rank, longer than its 120-s timeout)."""
    rate = link_bits_per_second(link)
    if rate is None:
        return None
    from lm_task import make_model

    numel = sum(p.numel() for p in make_model(context=CONTEXT).parameters())
    seconds = 2 * (args.peers - 1) / args.peers * 4 * numel * 8 / rate
    if seconds > args.budget:
        return (
            f"one DDP step would take {seconds:.0f} s on {link} (ring all-reduce of "
            f"{4 * numel / 1e6:.1f} MB), more than the {args.budget:.0f}-s budget"
        )
    # DDP's start: rank 0 sends the weights to every other rank over its own uplink
    start = (args.peers - 1) * 4 * numel * 8 / rate
    if start > GLOO_TIMEOUT_S:
        return (
            f"DDP's start would take {start:.0f} s on {link} (rank 0 sends the "
            f"{4 * numel / 1e6:.1f}-MB weights to {args.peers - 1} ranks), more than gloo's "
            f"{GLOO_TIMEOUT_S:.0f}-s timeout"
        )
    return None


def time_to(curve: list[list[float]], target: float) -> float | None:
    """The first wall-clock time the curve reaches ``target`` (linear between points)."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            if l0 <= target or l0 == l1:
                return t1 if l0 > target else t0
            return round(t0 + (t1 - t0) * (l0 - target) / (l0 - l1), 2)
    return None


def summarize(rows: list[dict]) -> dict:
    """Per link: every method's final loss and bytes; with DDP in the run (it cannot run on
    the slowest links), also the time to DDP's final loss and the bytes, as ratios to DDP."""
    ddp = next((r for r in rows if r["method"] == "ddp"), None)
    out: dict[str, Any] = {"kind": "summary", "link": rows[0]["link"]}
    target = ddp_time = None
    if ddp is not None:
        target = ddp["final_bpb_worker0"]
        ddp_time = time_to(ddp["curve_worker0"], target) or ddp["budget_s"]
        out.update(ddp_final_bpb=target, ddp_time_to_final_s=ddp_time)
    for r in rows:
        entry: dict[str, Any] = {"final_bpb": r["final_bpb_worker0"]}
        if ddp is not None and target is not None and ddp_time:
            took = time_to(r["curve_worker0"], target)
            entry.update(
                time_to_ddp_loss_s=took,
                time_to_ddp_loss_vs_ddp=None if took is None else round(took / ddp_time, 2),
                bytes_vs_ddp=round(
                    r["payload_bytes_sent_per_peer"] / max(1, ddp["payload_bytes_sent_per_peer"]),
                    4,
                ),
            )
        for name in ("bytes_per_outer_step_per_peer", "compression_vs_float32",
                     "rounds_failed_all", "max_loss_rise_bpb"):  # fmt: skip
            if name in r:
                entry[name] = r[name]
        out[r["method"]] = entry
    lockstep = next((r for r in rows if r["method"] == "diloco"), None)
    if lockstep is not None:  # swarm-wide epochs against lockstep: time to its final loss
        goal = lockstep["final_bpb_worker0"]
        for r in rows:
            if r["method"].startswith("dilocoswarm"):
                took = time_to(r["curve_worker0"], goal)
                out[r["method"]]["time_to_lockstep_diloco_loss_s"] = took
                out[r["method"]]["time_vs_lockstep_diloco"] = (
                    None if took is None else round(took / lockstep["budget_s"], 2)
                )
    return out


def link_bits_per_second(link: str) -> float | None:
    """``"200kbit"`` -> 2e5; None for loopback."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if link.endswith(unit):
            return float(link[: -len(unit)]) * scale
    return None


def summarize_race(rows: list[dict]) -> dict:
    """Across links: does link speed still matter? Every link's best final loss and each
    method's, against 4-bit DiLoCo (and the best method) on the fastest link run, and the model
    size whose outer gradient would weigh as much on a 45 Mbit/s home uplink as this model's on
    the link (parameters scale with the link's slowness)."""
    links = sorted({r["link"] for r in rows}, key=LINKS.index)
    final = {(r["link"], r["method"]): r["final_bpb_worker0"] for r in rows}
    reference_link = links[0]
    reference = final.get((reference_link, "diloco_4bit"))
    best_reference = min(v for (link, _), v in final.items() if link == reference_link)
    out: dict[str, Any] = {
        "kind": "race",
        "reference_link": reference_link,
        "reference_diloco_4bit_bpb": reference,
        "reference_best_bpb": best_reference,
    }
    numel = rows[0]["numel"]
    for link in links:
        here = {m: v for (lk, m), v in final.items() if lk == link}
        best = min(here, key=here.__getitem__)
        rate = link_bits_per_second(link)
        entry: dict[str, Any] = {
            "best_method": best,
            "best_bpb": here[best],
            "best_vs_reference_best": round(here[best] - best_reference, 4),
            "equivalent_params_on_45mbit_uplink": (
                None if rate is None else round(numel * 45e6 / rate)
            ),
        }
        if reference is not None:
            entry["vs_reference_diloco_4bit"] = {
                m: round(v - reference, 4) for m, v in here.items()
            }
        out[link] = entry
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in rows}, key=LINKS.index)
    fig, axes = plt.subplots(2, len(links), figsize=(5.5 * len(links), 8.4), squeeze=False)
    palette = plt.get_cmap("tab10").colors
    present = [m for m in METHODS if any(r["method"] == m for r in rows)]
    colour = {m: palette[i % len(palette)] for i, m in enumerate(present)}  # same on every link
    for column, link in enumerate(links):
        by_time, by_bytes = axes[0][column], axes[1][column]
        for r in (r for r in rows if r["link"] == link):
            t, loss = zip(*r["curve_worker0"], strict=True)
            width = 2.2 if r["method"] == "ddp" else 1.4
            style = dict(label=r["method"], lw=width, color=colour[r["method"]])
            by_time.plot(t, loss, **style)
            sent = [(b / 1e6, v) for b, v in zip(r["curve_bytes_sent_worker0"], loss, strict=True)]
            if any(b > 0 for b, _ in sent):  # log scale: from the first byte on
                by_bytes.plot(*zip(*[(b, v) for b, v in sent if b > 0], strict=True), **style)
        by_time.set(title=link, xlabel="wall clock (s)", ylabel="validation bits per byte")
        by_bytes.set(xlabel="MB sent per peer (log)", ylabel="validation bits per byte")
        by_bytes.set_xscale("log")
        for ax in (by_time, by_bytes):
            ax.set_ylim(top=5.0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ddp", choices=METHODS, help=argparse.SUPPRESS)
    add_worker_arguments(parser)
    parser.add_argument("--eval-threads", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--links", nargs="+", choices=LINKS, default=LINKS[:3])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="windows per process and step")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of training")
    parser.add_argument("--snapshot-every", type=float, default=3.0, help="seconds")
    parser.add_argument("--eval-windows", type=int, default=128, help="validation windows")
    parser.add_argument("--inner-steps", type=int, default=25, help="DiLoCo H")
    parser.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo fragments")
    parser.add_argument(
        "--outer-momentum", type=float, default=None, help="diloco methods (default 0.9)"
    )
    parser.add_argument("--outer-lr", type=float, default=None, help="diloco (default 0.7)")
    parser.add_argument("--no-nesterov", action="store_true", help="diloco: plain momentum")
    parser.add_argument(
        "--error-feedback-decay", type=float, default=None,
        help="diloco: each member's residual x this a round (SparseLoCo's beta; default 1)",
    )  # fmt: skip
    parser.add_argument(
        "--local-error-feedback",
        action="store_true",
        help="diloco methods: restart the inner loop from θ minus the unsent residual",
    )
    parser.add_argument(
        "--topk-density", type=float, default=0.01, help="sparse2bit: share of values sent"
    )
    parser.add_argument(
        "--reducer-density", type=float, default=None,
        help="sparse2bit: share of the summed part a reducer sends back (default: --topk-density)",
    )  # fmt: skip
    parser.add_argument(
        "--state-link", action="store_true",
        help="moshpit peers state the shaped link's rate as their bandwidth (as a volunteer "
        "does with `moshpit train --uplink-mbit`): it paces their uplink and sizes the "
        "all-reduce's time budget",
    )  # fmt: skip
    parser.add_argument("--link-bps", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--overlap-steps", type=int, default=5, help="streaming: inner steps")
    parser.add_argument("--average-every", type=int, default=4, help="local: initial period")
    parser.add_argument("--refresh", type=float, default=0.05, help="s between progress reads")
    parser.add_argument(
        "--speeds", nargs="+", type=float, default=[1.0],
        help="each peer's step takes this many times its compute (e.g. 1 2 4 8; default: 1)",
    )  # fmt: skip
    parser.add_argument("--speed", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--plot", default=None, help="PNG of loss vs wall clock and vs bytes, per link"
    )
    parser.add_argument(
        "--profile", default=None, help="pyinstrument text of worker 1 to this file"
    )
    parser.add_argument(
        "--replot", nargs="+", default=None, metavar="JSONL",
        help="no runs: read the rows of earlier runs' output, print the race line, draw --plot",
    )  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.replot:
        import json

        rows = [
            row
            for path in args.replot
            for row in map(json.loads, Path(path).read_text().splitlines())
            if row.get("kind") == "run"
        ]
        _emit(summarize_race(rows))
        if args.plot:
            plot(rows, args.plot)
        return 0
    methods = ["ddp"] + [m for m in args.methods if m != "ddp"]  # the baseline, same run
    _emit({"kind": "machine", "date": datetime.date.today().isoformat(),
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "torch": __import__("torch").__version__, "processor": platform.processor(),
           "loadavg": [round(v, 2) for v in os.getloadavg()]})  # fmt: skip
    all_rows: list[dict] = []
    for link in args.links:
        rows: list[dict] = []
        for method in methods:
            too_slow = method == "ddp" and ddp_step_too_slow(args, link)
            if too_slow:
                _emit({"kind": "skipped", "link": link, "method": method, "reason": too_slow})
                continue
            try:
                if link == "loopback":
                    rows.append(run_method(args, method, link, None))
                else:
                    from wan_testbed import WanTestbed, unavailable_reason

                    reason = unavailable_reason()
                    if reason is not None:
                        _emit({"kind": "skipped", "link": link, "reason": reason})
                        break
                    with WanTestbed(args.peers, link) as tb:  # fresh per method: no leftovers
                        rows.append(run_method(args, method, link, tb))
            except Exception as e:  # noqa: BLE001 - one method's crash must not end the race
                _emit({"kind": "failed", "link": link, "method": method, "error": repr(e)})
                continue
            _emit(rows[-1])
        if rows:
            _emit(summarize(rows))
            all_rows += rows
    if len({r["link"] for r in all_rows}) > 1:
        _emit(summarize_race(all_rows))
    if args.plot and all_rows:
        plot(all_rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
