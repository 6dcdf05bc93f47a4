"""``moshpit demo`` (the default): a local swarm trains a real model while peers are preempted.

The parent starts a bootstrap DHT peer in-process (torch-free), then N peer processes, each
running the volunteer logic of ``moshpit train`` (``moshpit/cli/train_cmd.py``: a
``moshpit.Optimizer`` with a checkpoint directory, an identity file and
``moshpit.handle_preemption``) on the 8x8 digits with a small MLP. Each peer trains at most
``--max-rate`` samples/s with one torch thread (``--threads 1``; the peers share the machine's
cores; a cap keeps the swarm's pace steady so preemptions land mid-training) and reports one
JSON line per half second.

While the swarm has processed between 15% and 70% of ``--samples``, the parent preempts
``--preemptions`` peers chosen at random (SIGTERM and SIGKILL alternately, distinct peers while
there are enough) and restarts each one ``--restart-delay`` seconds after it is gone, with the
same identity and checkpoint directory (``--replace``: a fresh peer with an empty one). A peer is
*stuck* when it is alive but its sample count has not moved for ``--stuck-after`` seconds.

When the swarm has processed ``--samples`` samples the parent tells every peer to stop; each
sends its final parameters. The swarm's final accuracy is the test accuracy of the average of
the surviving peers' parameters (what one more averaging round would give everyone); the
baseline is the same model and optimizer trained in one process on as many samples as the
whole swarm processed, with 5 batch orders (one baseline alone moves by ~0.8 points from seed
to seed on the 539 test images). Verdict OK: the swarm is at most 1 point plus twice the
baselines' standard deviation below their mean (or better), no peer was stuck, and every
preempted peer came back.

With the ``dashboard`` extra installed, the parent also serves ``moshpit dashboard``'s page of
the run (on a thread, from the bootstrap peer's DHT) and prints its address; ``--no-dashboard``
turns it off.

Ctrl-C stops every peer, prints the table so far and a one-line summary, exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moshpit.cli.render import SpareColumns
from moshpit.cli.signals import sigint_ignored
from moshpit.cli.train_demo_report import SYNC_TARGET_BATCH, conclude

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from moshpit.dashboard.server import DashboardThread
    from moshpit.training.demo_task import DigitsData

Say = Callable[[str], None]  # prints one line above the live table (or to the pipe)

STARTUP_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0
RUN_ID = "demo-digits"
DASHBOARD_PORT = 8080


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of the training demo (``demo_cmd`` adds them next to the averaging demo's)."""
    parser.add_argument(
        "--samples",
        type=int,
        default=150_000,
        help="training: samples the whole swarm processes before it stops (default 150000)",
    )
    parser.add_argument(
        "--preemptions",
        type=int,
        default=3,
        help="training: peers preempted (SIGTERM / kill -9 alternately) and restarted (default 3)",
    )
    parser.add_argument(
        "--max-rate",
        type=float,
        default=800.0,
        help="training: samples/s cap of each peer (default 800)",
    )
    parser.add_argument(
        "--mode",
        choices=("local", "sync"),
        default="local",
        help="training: moshpit.Optimizer mode (default: %(default)s)",
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=2.0,
        help="training: seconds between a peer's exit and its restart (default 2)",
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="training: replace preempted peers by fresh ones (new identity, no checkpoint)",
    )
    parser.add_argument(
        "--stuck-after",
        type=float,
        default=20.0,
        help="training: a live peer whose samples do not move for this long is stuck (default 20)",
    )
    parser.add_argument(
        "--plot",
        default="moshpit-demo.png",
        metavar="PATH",
        help="training: where the PNG plot goes (default ./moshpit-demo.png)",
    )
    parser.add_argument("--no-plot", action="store_true", help="training: write no plot")
    parser.add_argument(
        "--json", action="store_true", help="training: print a JSON summary as the last line"
    )
    parser.add_argument(
        "--dashboard-port",
        type=int,
        default=DASHBOARD_PORT,
        metavar="PORT",
        help="training: port of the run's live web page on 127.0.0.1 (default: %(default)s; "
        "any free port when it is taken; needs the 'dashboard' extra)",
    )
    parser.add_argument(
        "--no-dashboard", action="store_true", help="training: serve no live web page"
    )


# ---------------------------------------------------------------------------------------------
# peer processes


@dataclass
class Slot:
    """One peer of the swarm across its restarts (same identity and checkpoint dir)."""

    index: int
    identity: str
    checkpoint_dir: str
    proc: subprocess.Popen[str] | None = None
    incarnation: int = 0
    state: str = "starting"
    spawned_at: float = 0.0
    last_advance: float = 0.0  # when its samples last moved (or it was spawned)
    samples: int = 0  # of the current incarnation
    samples_before: int = 0  # of earlier incarnations
    row: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] | None = None
    note: str = ""
    restart_at: float | None = None
    stuck: bool = False
    exit_codes: list[int] = field(default_factory=list)
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def total_samples(self) -> int:
        return self.samples_before + self.samples


class Swarm:
    """Starts, preempts and restarts the peer processes; their JSON lines go to one queue."""

    def __init__(self, args: argparse.Namespace, bootstrap: str, workdir: str) -> None:
        self.args = args
        self.bootstrap = bootstrap
        self.workdir = workdir
        self.events: queue.Queue[tuple[int, int, dict[str, Any]]] = queue.Queue()
        self.slots = [self._new_slot(i, 0) for i in range(args.peers)]

    def _new_slot(self, index: int, generation: int) -> Slot:
        name = f"peer{index}" + (f"-{generation}" if generation else "")
        return Slot(
            index,
            os.path.join(self.workdir, f"{name}.key"),
            os.path.join(self.workdir, name),
        )

    def spawn(self, slot: Slot) -> None:
        args = self.args
        cmd = [
            sys.executable, "-m", "moshpit", "train",
            "--initial-peers", self.bootstrap, "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
            "--identity", slot.identity, "--checkpoint-dir", slot.checkpoint_dir,
            "--checkpoint-every", "3", "--run-id", RUN_ID, "--mode", args.mode,
            "--target-batch-size", str(SYNC_TARGET_BATCH),
            "--group-size", str(args.group_size), "--max-rate", str(args.max_rate),
            "--seed", str(args.seed * 100_003 + slot.index * 101 + slot.incarnation),
            "--report-every", "0.5", "--deadline", "10", "--threads", "1",
            "--json", "--stdin-control", "--ignore-sigint", "--send-params",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        log_dir = os.environ.get("MOSHPIT_DEMO_LOGDIR")
        err = (
            open(os.path.join(log_dir, f"peer{slot.index}.{slot.incarnation}.log"), "w")  # noqa: SIM115
            if log_dir
            else subprocess.PIPE
        )
        slot.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,  # the parent alone decides when peers stop (Ctrl-C)
        )
        if not isinstance(err, int):
            err.close()
        now = time.monotonic()
        slot.spawned_at = slot.last_advance = now
        slot.samples = 0
        slot.state = "starting"
        slot.row = {}
        slot.final = None
        threading.Thread(
            target=self._read, args=(slot, slot.incarnation, slot.proc), daemon=True
        ).start()
        if not log_dir:
            threading.Thread(target=self._read_err, args=(slot, slot.proc), daemon=True).start()

    def _read(self, slot: Slot, incarnation: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("event"), str):
                self.events.put((slot.index, incarnation, obj))
        proc.wait()
        self.events.put((slot.index, incarnation, {"event": "exit", "code": proc.returncode}))

    def _read_err(self, slot: Slot, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            slot.stderr_tail = (slot.stderr_tail + [line])[-20:]

    def send(self, slot: Slot, text: str) -> None:
        try:
            assert slot.proc is not None and slot.proc.stdin is not None
            slot.proc.stdin.write(text + "\n")
            slot.proc.stdin.flush()
        except (BrokenPipeError, OSError, AssertionError):
            pass

    def stop_all(self, grace: float = 12.0) -> None:
        """SIGTERM every live peer, give them ``grace`` seconds together, then SIGKILL."""
        live = [s.proc for s in self.slots if s.proc is not None and s.alive]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------------
# the run


@dataclass
class Record:
    """What the parent saw, for the table, the plot, the summary and Ctrl-C."""

    started: float
    budget: int
    points: list[tuple[int, float, int, float, float]] = field(default_factory=list)
    # (slot, t, swarm samples, accuracy, test loss)
    marks: list[tuple[float, int, str, int]] = field(default_factory=list)
    # (t, swarm samples, "SIGTERM" | "SIGKILL" | "restart", slot)
    preemptions: dict[str, int] = field(default_factory=lambda: {"SIGTERM": 0, "SIGKILL": 0})
    restarts: int = 0
    table: Table | None = None
    live_used: bool = False
    swarm_samples: int = 0
    ended: float | None = None  # when the swarm had stopped training (finals in)

    def elapsed(self) -> float:
        """Seconds the swarm has run: the one clock of the table's footer, the status lines, the
        verdict and the JSON ``wall_s`` (frozen once the run is over, so that the stopping of the
        peers and the baselines' training after it count in none of them)."""
        end = self.ended if self.ended is not None else time.monotonic()
        return end - self.started


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    record = Record(started=time.monotonic(), budget=args.samples)
    console = Console()
    if args.peers < 2 or args.group_size < 2 or args.samples < 1 or args.preemptions < 0:
        console.print(
            "[red]need --peers >= 2, --group-size >= 2, --samples >= 1, --preemptions >= 0"
        )
        return 2
    if not args.max_rate > 0 or args.restart_delay < 0 or not args.stuck_after > 0:
        console.print("[red]need --max-rate > 0, --restart-delay >= 0, --stuck-after > 0")
        return 2
    try:
        from moshpit.training.demo_task import MissingDemoDependency, load_digits_split

        data = load_digits_split()
    except MissingDemoDependency as e:
        console.print(f"moshpit demo: {e}", soft_wrap=True, highlight=False, markup=False)
        return 2
    try:
        return _run(args, console, data, record)
    except KeyboardInterrupt:
        _report_interrupt(console, record)
        return 130


def _report_interrupt(console: Console, record: Record) -> None:
    """After Ctrl-C (the peers are stopped): the table so far, once, and a one-line summary."""
    if record.table is not None and not record.live_used:  # a live table is on screen already
        console.print(record.table)
    pre = record.preemptions
    console.print(
        f"[bold]interrupted (Ctrl-C) after {record.elapsed():.0f}s: "
        f"{record.swarm_samples}/{record.budget} samples, "
        f"{pre['SIGTERM'] + pre['SIGKILL']} preemptions, {record.restarts} restarts; "
        "all peers stopped[/bold]",
        soft_wrap=True,
        highlight=False,
    )


def _run(args: argparse.Namespace, console: Console, data: DigitsData, record: Record) -> int:
    from dht import DHT

    bootstrap: DHT | None = None
    swarm: Swarm | None = None
    dashboard: DashboardThread | None = None
    with tempfile.TemporaryDirectory(prefix="moshpit-demo-") as workdir:
        try:
            bootstrap = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            maddr = str(bootstrap.get_visible_maddrs()[0])
            console.print(f"bootstrap peer: [bold]{maddr}[/bold]", soft_wrap=True, highlight=False)
            if not getattr(args, "no_dashboard", False):
                dashboard = _start_dashboard(args, console, maddr)
            console.print(
                f"{args.peers} peers train a 64-64-10 MLP on the 8x8 digits (mode {args.mode}, "
                f"<= {args.max_rate:.0f} samples/s each) until the swarm has seen "
                f"{args.samples} samples; {args.preemptions} of them get preempted and restart",
                soft_wrap=True,
                highlight=False,
            )
            swarm = Swarm(args, maddr, workdir)
            for slot in swarm.slots:
                swarm.spawn(slot)
            outcome = _drive(args, console, swarm, record)
        finally:
            # a second Ctrl-C must not leave peers running: finish the clean-up first
            with sigint_ignored():
                if dashboard is not None:
                    dashboard.stop()
                if swarm is not None:
                    swarm.stop_all()
                if bootstrap is not None:
                    bootstrap.shutdown()
    if outcome is None:
        return 1
    return _conclude(args, console, data, swarm, record, outcome)


def _start_dashboard(
    args: argparse.Namespace, console: Console, bootstrap: str
) -> DashboardThread | None:
    """Serve the run's live page on a thread (``moshpit dashboard``); print its address, or
    one line on why there is none. Returns the running dashboard or None."""
    from moshpit.dashboard.server import (
        INSTALL_HINT,
        DashboardThread,
        MissingDashboardDependency,
        bind_socket,
        require_hypercorn,
    )

    def say(text: str) -> None:
        console.print(text, soft_wrap=True, highlight=False, markup=False)

    try:
        require_hypercorn()
    except MissingDashboardDependency:
        say(f"dashboard: not installed ({INSTALL_HINT} to watch the run in a browser)")
        return None
    port = getattr(args, "dashboard_port", DASHBOARD_PORT)
    try:
        sock = bind_socket("127.0.0.1", port)
    except OSError:
        try:  # taken (another demo?): any free port
            sock = bind_socket("127.0.0.1", 0)
        except OSError as e:
            say(f"dashboard: none ({e})")
            return None
    dashboard = DashboardThread([bootstrap], RUN_ID, sock, interval=1.0)
    try:
        url = dashboard.start(timeout=30.0)
    except Exception as e:  # noqa: BLE001 - the demo runs without its page
        say(f"dashboard: could not start ({e})")
        return None
    say(f"dashboard: {url} (the run live in a browser, while the demo runs)")
    return dashboard


def _plan(args: argparse.Namespace, rng: random.Random) -> list[tuple[float, str]]:
    """(fraction of the sample budget, signal name) for each preemption."""
    n = args.preemptions
    if n == 0:
        return []
    lo, hi = 0.1, 0.6  # a restart takes ~10-20 s on a busy 2-core machine: leave it time
    width = (hi - lo) / n
    return [
        (lo + width * (k + rng.uniform(0.2, 0.8)), "SIGTERM" if k % 2 == 0 else "SIGKILL")
        for k in range(n)
    ]


def _drive(
    args: argparse.Namespace, console: Console, swarm: Swarm, record: Record
) -> dict[str, Any] | None:
    """Run until the budget is reached; returns the stop outcome (None: the swarm failed)."""
    from rich.live import Live

    preemptions = _Preemptions(args)
    live = (
        Live(SpareColumns(_table(swarm, record)), console=console, refresh_per_second=4)
        if console.is_terminal
        else None
    )
    record.live_used = live is not None
    last_line = -math.inf  # the first line at once, even just after boot

    def say(text: str) -> None:
        (live.console if live else console).print(text, soft_wrap=True, highlight=False)

    with live or contextlib.nullcontext():
        while True:
            now = time.monotonic()
            _pump(swarm, record, say, until=now + 0.25)
            now = time.monotonic()
            record.swarm_samples = sum(s.total_samples for s in swarm.slots)
            _restart_due(args, swarm, record, say, now)
            _mark_stuck(args, swarm, say, now)
            preemptions.preempt_due(swarm, record, say, now)
            record.table = _table(swarm, record)  # also what Ctrl-C prints
            if live is not None:
                live.update(SpareColumns(record.table))
            elif now - last_line >= 5.0:
                last_line = now
                say(_status_line(swarm, record))
            if record.swarm_samples >= args.samples:
                break
            if not any(s.alive or s.restart_at is not None for s in swarm.slots):
                say("[red]every peer is gone; giving up[/red]")
                for s in swarm.slots:
                    if s.stderr_tail:
                        say(f"peer {s.index} stderr:\n{''.join(s.stderr_tail[-8:])}")
                return None
        _stop_training(swarm, record, say, live)
    if live is None:
        console.print(record.table)
    return {"finals": {s.index: s.final for s in swarm.slots if s.final is not None}}


def _restart_due(
    args: argparse.Namespace, swarm: Swarm, record: Record, say: Say, now: float
) -> None:
    """Restart the preempted peers whose ``--restart-delay`` is over (``--replace``: as fresh
    peers, with a new identity and an empty checkpoint dir)."""
    for slot in swarm.slots:
        if slot.restart_at is None or now < slot.restart_at:
            continue
        slot.restart_at = None
        if args.replace:
            fresh = swarm._new_slot(slot.index, slot.incarnation + 1)
            slot.identity, slot.checkpoint_dir = fresh.identity, fresh.checkpoint_dir
        slot.samples_before += slot.samples
        slot.incarnation += 1
        swarm.spawn(slot)
        record.restarts += 1
        record.marks.append((now - record.started, record.swarm_samples, "restart", slot.index))
        kind = "replaced by a fresh peer" if args.replace else "restarted"
        slot.note = "replaced" if args.replace else "restarted"
        say(
            f"peer {slot.index} {kind} (same identity and checkpoint dir)"
            if not args.replace
            else f"peer {slot.index} {kind}"
        )


def _mark_stuck(args: argparse.Namespace, swarm: Swarm, say: Say, now: float) -> None:
    """Stuck peers: alive, but their samples did not move for ``--stuck-after`` seconds."""
    for slot in swarm.slots:
        limit = STARTUP_TIMEOUT if slot.state == "starting" else args.stuck_after
        if (
            slot.alive
            and slot.state in ("starting", "training")
            and now - slot.last_advance > limit
            and not slot.stuck
        ):
            slot.stuck = True
            say(
                f"[red]peer {slot.index} is stuck: no progress for {now - slot.last_advance:.0f}s[/red]"
            )


class _Preemptions:
    """The preemptions still to come (see :func:`_plan`), and the peers already hit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.plan = _plan(args, self.rng)
        self.hit: set[int] = set()

    def preempt_due(self, swarm: Swarm, record: Record, say: Say, now: float) -> None:
        """Preempt a training peer (one not hit yet, if any) once the swarm's samples reach
        the next planned fraction of the budget; never the last peer training."""
        if not self.plan or record.swarm_samples < self.plan[0][0] * self.args.samples:
            return
        training = [s for s in swarm.slots if s.alive and s.state == "training"]
        if len(training) < 2:
            return
        fresh_victims = [s for s in training if s.index not in self.hit]
        victim = self.rng.choice(fresh_victims or training)
        _, signame = self.plan.pop(0)
        self.hit.add(victim.index)
        victim.state = "preempted"
        victim.note = "SIGTERM" if signame == "SIGTERM" else "kill -9"
        record.preemptions[signame] += 1
        record.marks.append((now - record.started, record.swarm_samples, signame, victim.index))
        if victim.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                victim.proc.send_signal(getattr(signal, signame))
        say(
            f"[yellow]preempted peer {victim.index} with "
            f"{'SIGTERM' if signame == 'SIGTERM' else 'kill -9'} at "
            f"{record.swarm_samples} samples[/yellow]"
        )


def _stop_training(swarm: Swarm, record: Record, say: Say, live: Live | None) -> None:
    """The budget is reached: every training peer sends its final state and leaves (for at
    most ``STOP_TIMEOUT`` seconds); the run's clock stops."""
    for slot in swarm.slots:
        if slot.alive:
            swarm.send(slot, "stop")
    deadline = time.monotonic() + STOP_TIMEOUT
    while time.monotonic() < deadline and any(
        s.alive and s.state in ("training", "starting", "stopping") and s.final is None
        for s in swarm.slots
    ):
        for s in swarm.slots:
            if s.alive and s.state == "training":
                s.state = "stopping"
        _pump(swarm, record, say, until=time.monotonic() + 0.25)
        if live is not None:
            live.update(SpareColumns(_table(swarm, record)))
    record.ended = time.monotonic()  # the run is over: the clock stops here
    record.table = _table(swarm, record)
    if live is not None:
        live.update(SpareColumns(record.table))


def _pump(swarm: Swarm, record: Record, say: Say, until: float) -> None:
    """Apply the peers' JSON lines that arrive before ``until``."""
    while True:
        remaining = until - time.monotonic()
        if remaining <= 0:
            return
        try:
            index, incarnation, obj = swarm.events.get(timeout=remaining)
        except queue.Empty:
            return
        slot = swarm.slots[index]
        if incarnation != slot.incarnation:
            continue  # a line from a previous life (already gone)
        kind = obj["event"]
        now = time.monotonic()
        if kind == "progress":
            samples = int(obj.get("samples", 0))
            if samples > slot.samples:
                slot.last_advance = now
            slot.samples = samples
            slot.row = obj
            if slot.state == "starting":
                slot.state = "training"
            swarm_samples = sum(s.total_samples for s in swarm.slots)
            record.swarm_samples = swarm_samples
            record.points.append(
                (
                    index,
                    now - record.started,
                    swarm_samples,
                    float(obj["accuracy"]),
                    float(obj["test_loss"]),
                )
            )
        elif kind == "started":
            slot.last_advance = now
            if obj.get("restored_epoch"):
                slot.note = f"resumed ep {obj['restored_epoch']}"  # short: fits 80 columns
                say(f"peer {index} resumed from its checkpoint of epoch {obj['restored_epoch']}")
            elif slot.incarnation:
                slot.note = "no checkpoint"
                say(f"peer {index} came back without a checkpoint; it loads the swarm's state")
        elif kind == "final":
            slot.final = obj
            slot.state = "done"
        elif kind == "preempted":
            slot.note = "left cleanly"
        elif kind == "exit":
            code = int(obj.get("code", 0))
            slot.exit_codes.append(code)
            if slot.state == "preempted":
                slot.restart_at = now + swarm.args.restart_delay
                slot.state = "down"
            elif slot.state != "done":
                slot.state = "failed"
                say(f"[red]peer {index} exited with status {code}[/red]")
                if slot.stderr_tail:
                    say("".join(slot.stderr_tail[-8:]))


def _status_line(swarm: Swarm, record: Record) -> str:
    accs = [s.row["accuracy"] for s in swarm.slots if s.row and s.alive]
    acc = f"{sum(accs) / len(accs):.3f}" if accs else "-"
    pre = record.preemptions
    return (
        f"{record.elapsed():5.0f}s  samples {record.swarm_samples}/{record.budget}  "
        f"peers training {sum(1 for s in swarm.slots if s.alive and s.state == 'training')}  "
        f"mean test acc {acc}  preemptions {pre['SIGTERM'] + pre['SIGKILL']}  "
        f"restarts {record.restarts}"
    )


def _table(swarm: Swarm, record: Record) -> Table:
    from rich import box
    from rich.table import Table

    pre = record.preemptions
    # no vertical rules and one padding between columns: all nine columns, the events whole,
    # fit an 80-column terminal (less SpareColumns' two)
    table = Table(
        title=f"moshpit demo: {len(swarm.slots)} peers train on the 8x8 digits",
        caption=(  # short enough not to wrap under the (narrow) table
            f"{record.elapsed():.0f}s | {record.swarm_samples}/{record.budget} samples | "
            f"{pre['SIGTERM']} SIGTERM + {pre['SIGKILL']} kill -9 | {record.restarts} restarts"
        ),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in ("peer", "state", "epoch", "samples", "loss", "acc", "rate/s", "peers", "events"):
        table.add_column(
            col, justify="left" if col in ("state", "events") else "right", no_wrap=True
        )
    for s in swarm.slots:
        r = s.row
        table.add_row(
            str(s.index),
            s.state,
            str(r.get("epoch", "-")),
            str(s.total_samples),
            f"{r['loss']:.3f}" if r else "-",
            f"{r['accuracy']:.3f}" if r else "-",
            f"{r['samples_per_s']:.0f}" if r else "-",
            str(r.get("peers", "-")),
            s.note,
        )
    return table


def _conclude(
    args: argparse.Namespace,
    console: Console,
    data: DigitsData,
    swarm: Swarm,
    record: Record,
    outcome: dict[str, Any],
) -> int:
    """The baselines, the verdict, the summary and the plot (``train_demo_report``)."""
    return conclude(args, console, data, swarm.slots, record, outcome["finals"])
