"""``moshpit demo averaging``: a local swarm of peer processes that average random tensors.

(``moshpit demo`` with no argument runs the training demo: ``moshpit/cli/train_demo.py``.)

The parent starts a bootstrap DHT peer (in-process, torch-free), launches N worker processes
(``python -m moshpit.cli.demo_cmd worker ...``) that know only the bootstrap multiaddr, and
reads one JSON line per round from each worker's stdout. From those it computes the global
mean and the spread (max |x_i - mean| over every peer and coordinate) per round and shows it
shrinking. ``--kill`` SIGKILLs one peer in the middle of a round to show the others carry on.

Ctrl-C stops every peer, prints the table so far and a one-line summary, and exits with
status 130 (the shell convention for SIGINT). Workers ignore SIGINT (a terminal's Ctrl-C reaches
the whole process group); the parent stops them with SIGTERM.

Workers get grid coordinates as their initial group bits (peer i -> bits of ``i``), so a full
swarm of ``group_size ** d`` peers reaches the exact mean in ``d`` rounds.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from moshpit.cli.signals import sigint_ignored

if TYPE_CHECKING:  # types only: `moshpit --help` must not wait for torch
    import torch
    from rich.console import Console
    from rich.table import Table

    from dht import DHT
    from moshpit.averaging.averager import Averager, StepResult

CODECS = ("none", "float16", "uint8", "blockwise8", "topk")
WORKER_STARTUP_TIMEOUT = 60.0


AVERAGING_DEFAULTS = {
    "peers": 8,
    "size": 10_000,
    "group_size": 2,
    "rounds": 5,
    "compression": "none",
    "min_matchmaking_time": 1.5,
}
TRAINING_DEFAULTS = {"peers": 4, "group_size": 4}
# options only the averaging demo has: giving one selects it (`moshpit demo --rounds 3`)
AVERAGING_ONLY = ("size", "rounds", "compression", "min_matchmaking_time")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    from moshpit.cli import train_demo

    parser.description = (
        "start a local swarm of peer processes. Default (train): they train a small MLP on the "
        "8x8 digits while peers are preempted (SIGTERM / kill -9) and restarted; ends with a "
        "verdict against a single-process baseline and a PNG plot. 'moshpit demo averaging' "
        "(or --averaging): the peers average random tensors until they agree."
    )
    parser.add_argument(
        "which",
        nargs="?",
        choices=("train", "averaging"),
        default=None,
        help="train (default) or averaging",
    )
    parser.add_argument(
        "--averaging", action="store_true", help="the averaging demo (same as 'demo averaging')"
    )
    parser.add_argument(
        "--peers", type=int, default=None, help="peer processes (default 4; averaging: 8)"
    )
    parser.add_argument(
        "--group-size", type=int, default=None, help="target group size (default 4; averaging: 2)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the demo's randomness (default: %(default)s)"
    )
    train_demo.configure_parser(parser)
    parser.add_argument(
        "--size", type=int, default=None, help="averaging: float32 values per peer (default 10000)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="averaging: rounds (default 5)")
    parser.add_argument(
        "--compression", choices=CODECS, default=None, help="averaging: codec for the all-reduce"
    )
    parser.add_argument(
        "--kill", action="store_true", help="averaging: SIGKILL one peer in the middle of round 2"
    )
    parser.add_argument(
        "--min-matchmaking-time", type=float, default=None, help="averaging: seconds (default 1.5)"
    )


def run(args: argparse.Namespace) -> int:
    """Dispatch to the training demo (default) or the averaging demo."""
    averaging = (
        args.which == "averaging"
        or args.averaging
        or args.kill
        or any(getattr(args, name) is not None for name in AVERAGING_ONLY)
    )
    if args.which == "train" and averaging and not args.averaging:
        print(
            "moshpit demo: --size/--rounds/--compression/--kill/--min-matchmaking-time belong "
            "to 'moshpit demo averaging'",
            file=sys.stderr,
        )
        return 2
    defaults = AVERAGING_DEFAULTS if averaging else TRAINING_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if averaging:
        return run_averaging(args)
    from moshpit.cli import train_demo

    return train_demo.run(args)


# ---------------------------------------------------------------------------------------------
# worker process


def make_codec(name: str) -> Any:
    import compression

    return {
        "none": None,
        "float16": compression.Float16(),
        "uint8": compression.Uniform8Bit(),
        "blockwise8": compression.Blockwise8Bit(),
        "topk": compression.TopK(density=0.1),
    }[name]


def encode_tensor(t: Any) -> str:
    return base64.b64encode(t.detach().float().contiguous().numpy().tobytes()).decode()


def decode_tensor(text: str) -> Any:
    import numpy as np
    import torch

    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype=np.float32).copy())


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moshpit-demo-worker")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--bits", default="")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compression", choices=CODECS, default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix", default="demo")
    p.add_argument("--min-matchmaking-time", type=float, default=1.5)
    p.add_argument("--allreduce-timeout", type=float, default=6.0)
    p.add_argument("--request-timeout", type=float, default=3.0)
    p.add_argument("--wait-go", action="store_true", help="start each round after a stdin line")
    p.add_argument("--die-at-round", type=int, default=-1, help="SIGKILL self mid-round (tests)")
    p.add_argument(
        "--sigterm-at-round", type=int, default=-1, help="SIGTERM self mid-round (tests)"
    )
    p.add_argument("--report-parts", action="store_true", help="report the part bounds (tests)")
    return p


def worker_main(argv: list[str]) -> int:
    args = _worker_parser().parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: the parent decides when peers stop
    # (it sends SIGTERM), so a peer must not die mid-round with a KeyboardInterrupt traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # many peers share a few cores: one OpenMP thread per torch op, in EVERY thread (the DHT's
    # trio thread runs torch ops too; torch.set_num_threads only affects the calling thread's
    # OpenMP team, and oversubscribed spinning OpenMP teams made rounds ~6x slower)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dht, averager, tensor = _start_worker_peer(args)

    def on_sigterm(signum: int, frame: Any) -> None:
        # leave cleanly: cancel the running round (groupmates finish via their timeouts)
        averager.shutdown()
        dht.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    _emit(
        {
            "event": "ready",
            "index": args.index,
            "peer": str(dht.peer_id),
            "tensor": encode_tensor(tensor),
        }
    )
    for r in range(args.rounds):
        if args.wait_go and not sys.stdin.readline():
            break  # the parent is gone
        _arm_test_faults(averager, r, args)
        res = averager.step(gather={"index": args.index})
        _emit(_round_report(args, r, res, averager))
    _emit({"event": "done", "index": args.index})
    averager.shutdown()
    dht.shutdown()
    return 0


def _start_worker_peer(args: argparse.Namespace) -> tuple[DHT, Averager, torch.Tensor]:
    """This peer's DHT node (joined through the bootstrap peer), averager and random tensor."""
    import logging

    import torch

    from dht import DHT

    if os.environ.get("MOSHPIT_DEMO_LOG"):
        logging.basicConfig(
            level=os.environ["MOSHPIT_DEMO_LOG"].upper(),
            format=f"%(relativeCreated)6d [{args.index}] %(name)s: %(message)s",
        )
    from moshpit.averaging.averager import Averager

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed * 100_003 + args.index)
    tensor = torch.randn(args.size, generator=gen) * 10 + args.index
    # the node retries its initial peer with backoff (a busy machine, N peers importing torch
    # at once, can be slow to answer)
    dht = DHT(
        initial_peers=[args.bootstrap], host_maddrs=["/ip4/127.0.0.1/tcp/0"], bootstrap_timeout=30
    )
    averager = Averager(
        [tensor],
        dht,
        prefix=args.prefix,
        target_group_size=args.group_size,
        min_matchmaking_time=args.min_matchmaking_time,
        request_timeout=args.request_timeout,
        allreduce_timeout=args.allreduce_timeout,
        compression=make_codec(args.compression),
        initial_group_bits=args.bits,
        matchmaking_timeout=args.min_matchmaking_time + 2.0,
    )
    return dht, averager, tensor


def _arm_test_faults(averager: Averager, r: int, args: argparse.Namespace) -> None:
    """--die-at-round / --sigterm-at-round: this peer kills itself in the middle of round ``r``
    (after its group formed), as a preempted volunteer would."""
    if r == args.die_at_round:

        async def die(group: Any) -> None:
            import trio

            await trio.sleep(0.3)  # let the leader's group message reach everyone first
            os.kill(os.getpid(), signal.SIGKILL)

        averager._before_allreduce = die
    if r == args.sigterm_at_round:

        async def terminate(group: Any) -> None:
            import trio

            await trio.sleep(0.3)
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs on the main thread
            await trio.sleep_forever()  # until shutdown() cancels this round

        averager._before_allreduce = terminate


def _round_report(
    args: argparse.Namespace, r: int, res: StepResult, averager: Averager
) -> dict[str, Any]:
    """The JSON line of round ``r`` for the parent: the group, the timings, the tensor after."""
    with averager.get_tensors() as ts:
        out = encode_tensor(ts[0])
    report: dict[str, Any] = {
        "event": "round",
        "index": args.index,
        "round": r,
        "ok": res.succeeded,
        "reason": res.reason,
        "group_id": res.group_id.hex() if res.group_id else None,
        "members": [str(m) for m in res.members],
        "group_indices": sorted(v["index"] for v in res.gathered.values()),
        "failed": sorted(str(f) for f in res.failed),
        "matchmaking_s": res.matchmaking_seconds,
        "allreduce_s": res.allreduce_seconds,
        "tensor": out,
    }
    if args.report_parts and res.group_id:
        from moshpit.averaging.group_info import GroupInfo
        from moshpit.averaging.partition import part_bounds

        group = GroupInfo(res.group_id, res.members, res.modes, (None,) * len(res.members))
        report["parts"] = part_bounds(group, args.size)
    return report


# ---------------------------------------------------------------------------------------------
# parent


class Worker:
    """One peer process and a thread that collects its JSON lines."""

    def __init__(self, index: int, cmd: list[str]):
        self.index = index
        # MOSHPIT_DEMO_LOGDIR=dir keeps each worker's stderr (with MOSHPIT_DEMO_LOG=debug: logs)
        log_dir = os.environ.get("MOSHPIT_DEMO_LOGDIR")
        self._err_file = open(os.path.join(log_dir, f"peer{index}.log"), "w") if log_dir else None  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err_file or subprocess.PIPE,
            text=True,
        )
        self.lines: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.stderr_tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        if self._err_file is None:
            threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            with self.cond:
                self.lines.append(obj)
                self.cond.notify_all()
        with self.cond:
            self.lines.append({"event": "exit"})
            self.cond.notify_all()

    def _read_err(self) -> None:
        for line in self.proc.stderr or ():
            self.stderr_tail = (self.stderr_tail + [line])[-20:]

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for obj in self.lines:
                    if predicate(obj):
                        return obj
                if any(o["event"] == "exit" for o in self.lines):
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.cond.wait(remaining)

    def send_go(self) -> None:
        if self.proc.stdin is None:
            return  # never: Popen(stdin=PIPE)
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def terminate(self) -> None:
        """Ask the peer to leave (its SIGTERM handler shuts the averager and DHT down)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the exit after :meth:`terminate`, then SIGKILL."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._err_file is not None:
            self._err_file.close()

    def stop(self) -> None:
        self.terminate()
        self.finish(5.0)


def worker_command(
    index: int, bootstrap: str, bits: str, args: argparse.Namespace, extra: Sequence[str] = ()
) -> list[str]:
    return [
        sys.executable, "-m", "moshpit.cli.demo_cmd", "worker",
        "--bootstrap", bootstrap, "--index", str(index), "--size", str(args.size),
        "--group-size", str(args.group_size), "--bits", bits, "--rounds", str(args.rounds),
        "--compression", args.compression, "--seed", str(args.seed),
        "--min-matchmaking-time", str(args.min_matchmaking_time), "--wait-go", *extra,
    ]  # fmt: skip


def grid_bits(index: int, num_peers: int, group_size: int) -> str:
    """Initial key bits for peer ``index``: its grid coordinates (see module docstring)."""
    from moshpit.averaging.group_keys import default_num_bits

    nbits = default_num_bits(group_size, num_peers)
    return format(index % (1 << nbits), f"0{nbits}b") if nbits else ""


class _Progress:
    """What the parent has shown so far, for the summary after Ctrl-C."""

    def __init__(self) -> None:
        self.table: Table | None = None
        self.live_used = False
        self.spreads: list[float] = []
        self.alive: set[int] = set()
        self.killed: int | None = None  # the peer --kill stopped


def run_averaging(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.peers < 2 or args.group_size < 2 or args.rounds < 1 or args.size < 1:
        console.print("[red]need --peers >= 2, --group-size >= 2, --rounds >= 1, --size >= 1")
        return 2
    progress = _Progress()
    try:
        return _run(args, console, progress)
    except KeyboardInterrupt:
        # Ctrl-C: the peers are already stopped (see _run's finally); show what we have
        if progress.table is not None and not progress.live_used:
            console.print(progress.table)
        if len(progress.spreads) > 1:
            done = len(progress.spreads) - 1
            summary = (
                f"interrupted (Ctrl-C) after {done} of {args.rounds} rounds: spread "
                f"{progress.spreads[0]:.4g} -> {progress.spreads[-1]:.4g} with "
                f"{len(progress.alive)}/{args.peers} peers; all peers stopped"
            )
        elif progress.spreads:
            summary = f"interrupted (Ctrl-C) before round 1 of {args.rounds}; all peers stopped"
        else:
            summary = "interrupted (Ctrl-C) while starting the peers; all peers stopped"
        console.print(f"[bold]{summary}[/bold]", soft_wrap=True, highlight=False)
        return 130


def _run(args: argparse.Namespace, console: Console, progress: _Progress) -> int:
    from dht import DHT

    started = time.monotonic()
    bootstrap: DHT | None = None
    workers: list[Worker] = []
    try:
        bootstrap = DHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddr = str(bootstrap.get_visible_maddrs()[0])
        # an address the user may copy: one unwrapped line, whatever the terminal width
        console.print(f"bootstrap peer: [bold]{maddr}[/bold]", soft_wrap=True, highlight=False)
        initial = _start_workers(args, console, maddr, workers)
        if initial is None:
            return 1
        console.print(
            f"{args.peers} peers up after {time.monotonic() - started:.1f}s; averaging..."
        )
        progress.spreads.append(_spread(initial))
        table = progress.table = _round_table(args, progress.spreads[0])
        if not _average(args, console, workers, progress, table):
            return 1
        return _verdict(args, console, progress, started)
    finally:
        # a second Ctrl-C must not leave peers running: finish the clean-up first
        with sigint_ignored():
            _stop_workers(workers)
            if bootstrap is not None:
                bootstrap.shutdown()


def _start_workers(
    args: argparse.Namespace, console: Console, maddr: str, workers: list[Worker]
) -> list[torch.Tensor] | None:
    """Launch the peers into ``workers`` and wait until each is ready: their initial tensors,
    or None (after saying why) when one failed to start."""
    for i in range(args.peers):
        workers.append(
            Worker(i, worker_command(i, maddr, grid_bits(i, args.peers, args.group_size), args))
        )
    initial = []
    with console.status(f"starting {args.peers} peers..."):
        for w in workers:
            ready = w.wait_for(lambda o: o["event"] == "ready", WORKER_STARTUP_TIMEOUT)
            if ready is None:
                console.print(
                    f"[red]peer {w.index} failed to start:[/red]\n{''.join(w.stderr_tail)}"
                )
                return None
            initial.append(decode_tensor(ready["tensor"]))
    return initial


def _round_table(args: argparse.Namespace, spread: float) -> Table:
    """The table of rounds, with its first row: the spread before any averaging."""
    from rich.table import Table

    table = Table(title=f"Moshpit averaging: {args.peers} peers, groups of {args.group_size}")
    for col in (
        "round",
        "peers",
        "groups",
        "spread (max |x - mean|)",
        "matchmaking s",
        "all-reduce s",
    ):
        table.add_column(col, justify="right")
    table.add_row("start", str(args.peers), "-", f"{spread:.3g}", "-", "-")
    return table


def _average(
    args: argparse.Namespace,
    console: Console,
    workers: list[Worker],
    progress: _Progress,
    table: Table,
) -> bool:
    """Play the rounds, a row of ``table`` each; False when no peer reported a round."""
    from rich.live import Live

    from moshpit.cli.render import SpareColumns  # room for the "^C" echo: one title

    # a terminal gets a live table; pipes/logs get one line per round and the table at the end
    live = (
        Live(SpareColumns(table), console=console, refresh_per_second=8)
        if console.is_terminal
        else None
    )
    progress.live_used = live is not None
    if live is None:
        console.print(f"round start: spread {progress.spreads[0]:.4g}")
    alive = progress.alive
    alive.update(range(args.peers))
    with live or contextlib.nullcontext():
        for r in range(args.rounds):
            # rounds are aligned by the parent (a "go" line per round) so each row of the
            # table compares every peer after the same number of rounds
            for i in alive:
                workers[i].send_go()
            if args.kill and r == min(1, args.rounds - 1) and progress.killed is None:
                progress.killed = _kill_one(args, console, workers, alive, r)
            reports = _collect_round(console, workers, alive, r)
            if not reports:
                console.print("[red]no peer reported; giving up")
                return False
            _add_round(console, table, progress.spreads, reports, r, live is None)
    if live is None:
        console.print(table)
    return True


def _kill_one(
    args: argparse.Namespace, console: Console, workers: list[Worker], alive: set[int], r: int
) -> int:
    """SIGKILL the last peer in the middle of round ``r``: the others must carry on."""
    killed: int = args.peers - 1
    time.sleep(0.3)  # mid-round: groups are forming / averaging
    workers[killed].proc.kill()
    alive.discard(killed)
    console.print(f"[yellow]killed peer {killed} (SIGKILL) during round {r + 1}[/yellow]")
    return killed


def _collect_round(
    console: Console, workers: list[Worker], alive: set[int], r: int
) -> list[dict[str, Any]]:
    """Each live peer's report of round ``r``; a peer that stays silent leaves ``alive``."""
    reports = []
    for i in sorted(alive):
        rep = workers[i].wait_for(lambda o: o["event"] == "round" and o["round"] == r, 60.0)
        if rep is None:
            alive.discard(i)
            console.print(f"[yellow]peer {i} stopped reporting[/yellow]")
            continue
        reports.append(rep)
    return reports


def _add_round(
    console: Console,
    table: Table,
    spreads: list[float],
    reports: list[dict[str, Any]],
    r: int,
    plain: bool,
) -> None:
    """Record round ``r``'s spread, add its row (and print a line for a pipe: ``plain``)."""
    spread = _spread([decode_tensor(rep["tensor"]) for rep in reports])
    spreads.append(spread)
    groups = len({rep["group_id"] for rep in reports if rep["group_id"]})
    mm = max(rep["matchmaking_s"] for rep in reports)
    ar = max(rep["allreduce_s"] for rep in reports)
    table.add_row(
        str(r + 1),
        str(len(reports)),
        str(groups),
        f"{spread:.3g}",
        f"{mm:.2f}",
        f"{ar:.2f}",
    )
    if plain:
        console.print(
            f"round {r + 1}: {len(reports)} peers in {groups} groups, spread {spread:.4g}"
        )


def _verdict(
    args: argparse.Namespace,
    console: Console,
    progress: _Progress,
    started: float,
) -> int:
    """Say whether the spread shrank enough: 0 if it did, 1 if not."""
    spreads = progress.spreads
    ratio = spreads[-1] / spreads[0] if spreads[0] > 0 else 0.0
    # a full grid reaches the exact mean; with a peer killed the grid has a hole, so we
    # only ask for a clear geometric decrease
    converged = ratio < 1e-3 if progress.killed is None else ratio < 0.25
    elapsed = time.monotonic() - started
    verdict = "CONVERGED" if converged else "DID NOT CONVERGE"
    console.print(
        f"[bold]verdict: {verdict}[/bold]: spread {spreads[0]:.4g} -> {spreads[-1]:.4g} "
        f"(x{ratio:.2g}) in {args.rounds} rounds, {len(progress.alive)}/{args.peers} peers "
        f"alive, {elapsed:.1f}s",
        soft_wrap=True,
    )
    return 0 if converged else 1


def _stop_workers(workers: list[Worker], grace: float = 5.0) -> None:
    """SIGTERM every peer at once, give them ``grace`` seconds together, then SIGKILL."""
    for w in workers:
        w.terminate()
    deadline = time.monotonic() + grace
    for w in workers:
        w.finish(max(0.0, deadline - time.monotonic()))


def _spread(tensors: list[Any]) -> float:
    import torch

    if not tensors:
        return math.nan
    xs = torch.stack(tensors)
    return float((xs - xs.mean(0)).abs().max())


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        from moshpit.cli.process_exit import exit_without_teardown
        from moshpit.cli.process_start import import_paused

        import_paused(("torch", "moshpit.averaging.averager", "dht.facade"))
        exit_without_teardown(worker_main(sys.argv[2:]))
    sys.exit("usage: python -m moshpit.cli.demo_cmd worker ... (or run `moshpit demo`)")
