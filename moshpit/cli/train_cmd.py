"""``moshpit train``: a volunteer peer, the script a user runs on each (preemptible) VM.

It joins the swarm through ``--initial-peers`` (or starts one when none is given), restores its
own checkpoint from ``--checkpoint-dir`` if there is one, catches up with the swarm if the swarm
is ahead (``moshpit.Optimizer`` loads the newest state from the donors), trains the demo task
(8x8 digits, a small MLP: ``moshpit/training/demo_task.py``), checkpoints every
``--checkpoint-every`` seconds, and leaves cleanly on SIGTERM (the notice a preemptible VM gets)
or Ctrl-C: finish or abandon the running averaging round, write a checkpoint, withdraw from the
DHT, exit 0 (``moshpit.handle_preemption``). Restarted with the same ``--identity`` and
``--checkpoint-dir`` it is the same peer again and resumes where it was.

Torch gets all cores but one, in every thread (``--threads``), and the pace is uncapped unless
``--max-rate`` caps the samples/s (then torch's idle threads sleep: ``prepare_process``).

Progress goes to the terminal (a live row: epoch, loss, test accuracy, samples/s, peers), or,
with ``--json``, one JSON object per line on stdout (what ``moshpit demo`` reads from its peers).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from dht.facade import DHT
    from moshpit.training.optimizer import Optimizer

logger = logging.getLogger(__name__)

# What run() imports, and torch._dynamo, which torch's optimizers import on their first step:
# the console script imports them with the garbage collector paused (process_start.py).
STARTUP_IMPORTS = ("torch", "torch._dynamo", "moshpit.training.optimizer", "dht.facade")

DEFAULT_RUN_ID = "digits"
DEFAULT_CHECKPOINT_DIR = "moshpit-checkpoint"
# the demo task's defaults (moshpit/training/demo_task.py; a test checks that they agree), not
# imported from there: that module imports torch, and torch must not be loaded before --threads
# is known (see limit_threads)
DEFAULT_BATCH = 32
DEFAULT_LR = 0.003
# samples of the whole swarm per global step (sync) or outer step (diloco): about one or two
# seconds of four demo peers (800 samples/s each)
DEFAULT_TARGET = {"sync": 256, "diloco": 4096}


def prepare_process(argv: list[str], environ: MutableMapping[str, str] | None = None) -> None:
    """With a ``--max-rate`` cap, torch's idle threads sleep instead of spinning.

    A capped peer pauses between steps, and OpenMP's default lets each idle thread of torch's
    teams spin on its core for a while first: on 2 cores with ``--threads 2``, 15 s at 2,000
    samples/s cost 18.4 s of CPU with the default and 8.5 s with ``OMP_WAIT_POLICY=PASSIVE``
    (the same samples, start-up included), so the cap left the machine no freer. OpenMP
    reads the variable once, when torch loads: the console script calls this before its
    startup imports (``process_start.py``). A value the user exported wins; uncapped peers
    keep the default (PASSIVE cost 9% of their samples there).
    """
    env = os.environ if environ is None else environ
    scan = argparse.ArgumentParser(add_help=False)
    scan.add_argument("--max-rate", nargs="?", default="0")  # "?": never an error here
    known, _ = scan.parse_known_args(argv)
    try:
        capped = float(known.max_rate) > 0
    except (TypeError, ValueError):  # the real parser says what is wrong with it
        capped = False
    if capped and "OMP_WAIT_POLICY" not in env:
        env["OMP_WAIT_POLICY"] = "PASSIVE"


def default_threads(cpu_count: int | None) -> int:
    """All cores but one (at least one): a volunteer leaves its machine usable to its owner."""
    return max(1, (cpu_count or 1) - 1)


def available_cpus() -> int | None:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def torch_threads(
    requested: int | None, cpu_count: int | None, env: Mapping[str, str]
) -> int | None:
    """The torch thread count to set, or None to leave torch's default.

    ``requested`` is ``--threads``: N sets N, 0 leaves torch's default (every core); not given,
    an OMP_NUM_THREADS the user exported wins, else all cores but one.
    """
    if requested is None:
        return None if env.get("OMP_NUM_THREADS") else default_threads(cpu_count)
    return requested or None


def limit_threads(threads: int | None) -> None:
    """Give torch ``threads`` threads in every thread of this process, not only this one.

    torch.set_num_threads sizes only the calling thread's OpenMP team; the DHT's and the
    averager's threads run torch ops too and size theirs from OMP_NUM_THREADS, which OpenMP reads
    once, when torch is loaded: so it is set first (if torch is loaded already, only this
    thread's team changes).
    """
    if threads is None:
        return
    if "torch" in sys.modules:
        logger.debug("torch was loaded already: only this thread gets %d torch threads", threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    logger.info("torch threads: %d", threads)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The options of ``moshpit train``, in groups as ``--help`` lists them."""
    _add_swarm_options(parser.add_argument_group("the swarm"))
    _add_training_options(parser.add_argument_group("training"))
    _add_run_options(parser.add_argument_group("how long, checkpoints and output"))
    from moshpit.cli.dht_cmd import add_metrics_arguments

    add_metrics_arguments(parser)
    # used by `moshpit demo` for its peer processes
    parser.add_argument("--stdin-control", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ignore-sigint", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--send-params", action="store_true", help=argparse.SUPPRESS)


def _add_swarm_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MADDR",
        help="multiaddr(s) of peers already in the swarm (default: none, start a new swarm)",
    )
    parser.add_argument(
        "--host-maddrs",
        nargs="*",
        default=["/ip4/0.0.0.0/tcp/0"],
        metavar="MADDR",
        help="where to listen (default: /ip4/0.0.0.0/tcp/0, every interface, a free port)",
    )
    parser.add_argument(
        "--identity",
        default=None,
        metavar="PATH",
        help="key file that keeps this peer's PeerID across restarts (created if missing; "
        "default: none, a new PeerID each start)",
    )
    parser.add_argument(
        "--run-id", default=DEFAULT_RUN_ID, help="the run's name (default: %(default)s)"
    )
    parser.add_argument(
        "--group-size", type=int, default=4, help="averaging group size (default: %(default)s)"
    )
    parser.add_argument(
        "--uplink-mbit",
        type=float,
        default=0.0,
        metavar="MBIT_PER_S",
        help="this peer's uplink; averaging rounds pace their connections to it "
        "(default: %(default)s = unknown, TCP shares the link)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="your display name on the run's dashboard (moshpit dashboard): up to 32 printable "
        "characters (default: none, the dashboard shows the PeerID)",
    )


def _add_training_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--mode",
        choices=("local", "sync", "diloco"),
        default="local",
        help="local: local steps + background averaging; sync: one global batch; diloco: "
        "local steps, and an outer step (8-bit pseudo-gradients) whenever the swarm processed "
        "--target-batch-size samples, peers of any speed (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH,
        help="samples per step (default: %(default)s)",
    )
    parser.add_argument(
        "--target-batch-size",
        type=int,
        default=None,
        help="samples the whole swarm processes per global step (sync) or outer step "
        f"(diloco) (default: {DEFAULT_TARGET['sync']} in sync, {DEFAULT_TARGET['diloco']} in "
        "diloco)",
    )
    parser.add_argument(
        "--lr", type=float, default=DEFAULT_LR, help="Adam learning rate (default: %(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of this peer's batch order (default: random)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads, in every thread of this peer (default: all cores but one, here "
        f"{default_threads(available_cpus())}, so the machine stays usable; an exported "
        "OMP_NUM_THREADS is used instead when --threads is not given; 0: torch's default, "
        "every core)",
    )
    parser.add_argument(
        "--max-rate",
        type=float,
        default=0.0,
        metavar="SAMPLES_PER_S",
        help="train at most this many samples/s (default: %(default)s = no cap, as fast as the "
        "cores allow). Use it when this peer shares the machine: to keep it responsive or cool, "
        "or to keep several peers on one machine at the same pace (moshpit demo gives each of "
        "its peers 800). --threads bounds the cores a step may use, --max-rate how often steps "
        "run; with a cap, torch's idle threads sleep between steps instead of spinning "
        "(OMP_WAIT_POLICY=PASSIVE unless exported)",
    )


def _add_run_options(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--checkpoint-dir",
        default=DEFAULT_CHECKPOINT_DIR,
        metavar="DIR",
        help="checkpoints of this peer, restored on restart (default: ./%(default)s)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between checkpoints; one more is written on SIGTERM (default: %(default)s)",
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="stop after this many steps (default: %(default)s = never)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="stop after this many seconds (default: %(default)s = never)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=25.0,
        metavar="S",
        help="seconds allowed for leaving after SIGTERM (default: %(default)s)",
    )
    parser.add_argument(
        "--report-every",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between reports (default: %(default)s)",
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per line on stdout instead of a table"
    )


def check_args(args: argparse.Namespace) -> str | None:
    """A message for the first invalid argument, or None."""
    if args.target_batch_size is None:
        args.target_batch_size = DEFAULT_TARGET.get(args.mode, DEFAULT_TARGET["sync"])
    for name in ("batch_size", "target_batch_size", "group_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    for name in ("max_steps", "duration", "max_rate", "checkpoint_every"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0"
    if not 0 <= args.uplink_mbit < float("inf"):
        return "--uplink-mbit must be a number of Mbit/s >= 0"
    if args.threads is not None and args.threads < 0:
        return "--threads must be >= 0"
    if not args.lr > 0 or not args.report_every > 0 or not args.deadline > 0:
        return "--lr, --report-every and --deadline must be > 0"
    if args.mode != "local" and args.target_batch_size < args.batch_size:
        return "--target-batch-size must be >= --batch-size"
    if args.name is not None:
        from moshpit.training.progress import check_name

        try:
            check_name(args.name)
        except ValueError as e:
            return f"--name: {e}"
    return None


class _Reporter:
    """Shows progress: JSON lines, a live row in a terminal, or a plain line per report."""

    def __init__(self, json_lines: bool) -> None:
        from rich.console import Console

        self.json_lines = json_lines
        self.console = Console()
        self.live: Any = None
        self.last_plain = -math.inf  # the first line at once, even just after boot
        # events also come from the DHT's thread (the reachability line): one line at a time
        self._lock = threading.Lock()

    def event(self, kind: str, text: str, **fields: Any) -> None:
        with self._lock:
            if self.json_lines:
                _emit({"event": kind, **fields})
            else:
                self.console.print(text, soft_wrap=True, highlight=False)

    def start_live(self) -> None:
        if self.json_lines or not self.console.is_terminal:
            return
        from rich.live import Live

        from moshpit.cli.render import SpareColumns

        self.live = Live(
            SpareColumns(self._table(None)), console=self.console, refresh_per_second=4
        )
        self.live.start()

    def progress(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._progress(row)

    def _progress(self, row: dict[str, Any]) -> None:
        if self.json_lines:
            _emit({"event": "progress", **row})
        elif self.live is not None:
            from moshpit.cli.render import SpareColumns

            self.live.update(SpareColumns(self._table(row)))
        elif time.monotonic() - self.last_plain >= 5.0:
            self.last_plain = time.monotonic()
            self.console.print(
                f"epoch {row['epoch']} | {row['samples']} samples | loss {row['loss']:.3f} | "
                f"test acc {row['accuracy']:.3f} | {row['samples_per_s']:.0f}/s | "
                f"peers {row['peers']}",
                soft_wrap=True,
                highlight=False,
            )

    def _table(self, row: dict[str, Any] | None) -> Any:
        from rich.table import Table

        table = Table(title="moshpit train (Ctrl-C or SIGTERM: checkpoint and leave)")
        for col in ("time s", "epoch", "samples", "loss", "test acc", "samples/s", "peers"):
            table.add_column(col, justify="right")
        if row is not None:
            table.add_row(
                f"{row['elapsed']:.0f}",
                str(row["epoch"]),
                str(row["samples"]),
                f"{row['loss']:.3f}",
                f"{row['accuracy']:.3f}",
                f"{row['samples_per_s']:.0f}",
                str(row["peers"]),
            )
        return table

    def stop_live(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _watch_stdin(stop: threading.Event) -> None:
    """`moshpit demo` writes 'stop' (or closes stdin) when the run is over."""
    for line in sys.stdin:
        if line.strip() == "stop":
            break
    stop.set()


def _join(args: argparse.Namespace) -> Any:
    from dht import DHT

    # the node retries its initial peers with backoff for bootstrap_timeout (a busy machine,
    # many peers importing torch at once, or a bootstrap node under a flood can be slow)
    return DHT(
        initial_peers=args.initial_peers,
        host_maddrs=args.host_maddrs,
        identity_path=args.identity,
        bootstrap_timeout=30,
    )


def _report_role(reporter: _Reporter, decision: Any) -> None:
    """One line once AutoNAT has decided (and on each change): what, why, and the role."""
    reach = decision.reachability
    reporter.event(
        "reachability",
        decision.describe(),
        line=decision.describe(),
        status=reach.status.value,
        reason=reach.reason,
        client_mode=decision.client_mode,
        relay_addrs=[str(a) for a in decision.circuit_addrs],
        serving_relay=decision.serving_relay,
    )


def _make_optimizer(
    args: argparse.Namespace, dht: DHT, inner: torch.optim.Optimizer, mode_options: dict[str, Any]
) -> Any:
    import moshpit

    return moshpit.Optimizer(
        optimizer=inner,
        dht=dht,
        run_id=args.run_id,
        batch_size_per_step=args.batch_size,
        target_batch_size=args.target_batch_size if args.mode != "local" else None,
        mode=args.mode,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every_seconds=args.checkpoint_every or None,
        target_group_size=args.group_size,
        averager_options=dict(
            min_matchmaking_time=1.0,
            request_timeout=2.0,
            allreduce_timeout=10.0,
            bandwidth=args.uplink_mbit * 1e6 / 8 if args.uplink_mbit > 0 else None,
        ),
        load_state_timeout=10.0,
        progress_ttl=10.0,
        name=args.name,
        **mode_options,
    )


def run(args: argparse.Namespace) -> int:
    problem = check_args(args)
    if problem is not None:
        print(f"moshpit train: {problem}", file=sys.stderr)
        return 2
    if args.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    # before anything loads torch (demo_task does)
    limit_threads(torch_threads(args.threads, available_cpus(), os.environ))
    try:
        from moshpit.training.demo_task import MissingDemoDependency, load_digits_split

        data = load_digits_split()
    except MissingDemoDependency as e:
        print(f"moshpit train: {e}", file=sys.stderr)
        return 2
    from dht.kademlia.node import check_address_args
    from dht.p2p import MultiaddrError
    from moshpit.cli.preflight import (
        PreflightError,
        check_identity_path,
        check_ports_free,
        check_writable_dir,
    )

    try:  # a typo in an address fails before anything touches the disk
        check_address_args(args.initial_peers or [], args.host_maddrs, None)
    except MultiaddrError as e:
        print(f"moshpit train: bad address: {e}", file=sys.stderr)
        return 2
    try:  # before joining: a path or port that cannot work is one line, not a traceback
        check_writable_dir(args.checkpoint_dir, "--checkpoint-dir")
        check_identity_path(args.identity)
        check_ports_free(args.host_maddrs)
    except PreflightError as e:
        print(f"moshpit train: {e}", file=sys.stderr)
        return 2
    from moshpit.training.dirlock import CheckpointDirLock
    from moshpit.training.errors import CheckpointError

    try:  # another running peer in this directory: say so before joining (the peer locks it)
        with CheckpointDirLock(args.checkpoint_dir):
            pass
    except CheckpointError as e:
        print(f"moshpit train: {e}", file=sys.stderr)
        return 1
    from moshpit.cli.dht_cmd import start_metrics

    metrics, status = start_metrics(args, "moshpit train")
    if status is not None:
        return status
    reporter = _Reporter(args.json)
    if metrics is not None:
        reporter.event("metrics", f"Prometheus metrics: {metrics.url}", url=metrics.url)
    try:
        return _train(args, data, reporter)
    finally:
        reporter.stop_live()
        if metrics is not None:
            metrics.close()


def _train(args: argparse.Namespace, data: Any, reporter: _Reporter) -> int:
    """Join, train until done or preempted, leave; every way out has its exit status."""
    import moshpit
    from moshpit.cli.exit_codes import JOIN_FAILURES
    from moshpit.training.demo_task import make_model, make_optimizer
    from moshpit.training.errors import StateError

    started = time.monotonic()
    dht = opt = None
    try:
        dht = _join(args)
        _report_joined(args, dht, reporter, started)
        model = make_model(seed=0)  # every peer starts from the same weights
        opt = _make_optimizer(args, dht, make_optimizer(model, args.lr), _mode_options(args))
    except JOIN_FAILURES as e:
        if dht is not None:
            dht.shutdown()
        return _fail(e, args)
    from moshpit.training.volunteer import LoopProgress

    _start(args, opt, dht, reporter)
    reporter.start_live()
    progress = LoopProgress()
    try:
        _loop(args, opt, model, data, reporter, started, progress)
    except moshpit.Preempted as e:
        reporter.stop_live()
        return _preempted(args, opt, reporter, e, progress)
    except StateError as e:  # diverged with nothing good to go back to, or another model's
        reporter.stop_live()
        return _abandon(args, opt, dht, e)
    finally:
        reporter.stop_live()
    return _finish(args, opt, dht, model, data, reporter, progress, started)


def _fail(error: BaseException, args: argparse.Namespace) -> int:
    """One line on stderr and the exit status the table gives (moshpit/cli/exit_codes.py)."""
    from moshpit.cli.exit_codes import failure_of

    failure = failure_of(
        error,
        initial_peers=args.initial_peers or [],
        host_maddrs=args.host_maddrs or [],
        run_id=args.run_id,
    )
    if failure is None:
        raise error
    print(f"moshpit train: {failure.line}", file=sys.stderr)
    return failure.status


def _mode_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"compression": "8bit"} if args.mode == "diloco" else {}


def _report_joined(args: argparse.Namespace, dht: DHT, reporter: _Reporter, started: float) -> None:
    addrs = [str(a) for a in dht.get_visible_maddrs()]
    reporter.event(
        "joined",
        f"peer {dht.peer_id} is up; others join with --initial-peers {addrs[0]}",
        peer=str(dht.peer_id),
        addr=addrs[0],
        startup_s=round(time.monotonic() - started, 2),
    )
    dht.add_role_observer(lambda decision: _report_role(reporter, decision))


def _start(args: argparse.Namespace, opt: Optimizer, dht: DHT, reporter: _Reporter) -> None:
    """Leave cleanly on SIGTERM (and Ctrl-C) within the deadline; say what runs."""
    import moshpit

    signals = (signal.SIGTERM,) if args.ignore_sigint else (signal.SIGTERM, signal.SIGINT)
    moshpit.handle_preemption(opt, dht, deadline=args.deadline, signals=signals)
    restored = opt.epoch
    reporter.event(
        "started",
        f"training run {args.run_id!r} in mode {args.mode}"
        + (f", resumed from the checkpoint of epoch {restored}" if restored else "")
        + f"; checkpoints in {args.checkpoint_dir}",
        restored_epoch=restored,
    )


def _loop(
    args: argparse.Namespace,
    opt: Optimizer,
    model: Any,
    data: Any,
    reporter: _Reporter,
    started: float,
    progress: Any,
) -> Any:
    """The training layer's volunteer loop, reporting the demo task's test accuracy."""
    from moshpit.training.demo_task import evaluate
    from moshpit.training.volunteer import LoopLimits, run_volunteer_loop

    stop = threading.Event()
    if args.stdin_control:
        threading.Thread(target=_watch_stdin, args=(stop,), daemon=True).start()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")

    def report(progress: Any) -> None:
        now = time.monotonic()
        accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
        reporter.progress(
            dict(
                elapsed=round(now - started, 2),
                epoch=opt.epoch,
                steps=progress.steps,
                samples=progress.samples,
                loss=round(progress.loss, 4),
                test_loss=round(test_loss, 4),
                accuracy=round(accuracy, 4),
                samples_per_s=round(progress.samples_per_second(now), 1),
                peers=max(1, opt.tracker.global_progress.num_peers),
            )
        )

    def warn(line: str) -> None:
        reporter.event("warning", line, message=line)

    limits = LoopLimits(args.max_steps, args.duration, args.max_rate, args.report_every)
    batches = data.batches(args.batch_size, seed=seed)
    return run_volunteer_loop(
        opt, model, batches, args.batch_size, limits, report=report, warn=warn, stop=stop,
        progress=progress,
    )  # fmt: skip


def _preempted(
    args: argparse.Namespace, opt: Optimizer, reporter: _Reporter, e: Any, progress: Any
) -> int:
    """SIGTERM or Ctrl-C: the peer left (see moshpit.handle_preemption); 1 if not cleanly."""
    signame = signal.Signals(e.signum).name
    steps = progress.steps
    counts = dict(epoch=opt.epoch, steps=steps, samples=progress.samples)
    if e.failures:  # left, withdrew and shut down, but e.g. the last save failed
        # the failures were logged once (stderr) as they happened: not repeated here
        reporter.event(
            "preempted",
            f"{signame}: left the swarm at epoch {opt.epoch} after {steps} steps, but not "
            "cleanly (the error above); exit status 1",
            clean=False,
            failures=list(e.failures),
            **counts,
        )
        return 1
    reporter.event(
        "preempted",
        f"{signame}: left the swarm cleanly at epoch {opt.epoch} after {steps} steps; "
        f"checkpoint in {args.checkpoint_dir}; restart with the same --identity and "
        "--checkpoint-dir to resume",
        clean=True,
        **counts,
    )
    return 0


def _abandon(args: argparse.Namespace, opt: Optimizer, dht: DHT, error: BaseException) -> int:
    """Nothing this peer can train on: say why, leave, exit 1."""
    from moshpit.training.preemption import critical_section

    status = _fail(error, args)
    with critical_section():
        opt.leave_swarm(args.deadline)
        dht.shutdown()
    return status


def _finish(
    args: argparse.Namespace,
    opt: Optimizer,
    dht: DHT,
    model: Any,
    data: Any,
    reporter: _Reporter,
    progress: Any,
    started: float,
) -> int:
    """A normal end (steps or duration reached, or the demo said stop): report, leave."""
    from moshpit.training.demo_task import evaluate, params_to_text
    from moshpit.training.errors import CheckpointError
    from moshpit.training.preemption import critical_section

    accuracy, test_loss = evaluate(model, data.x_test, data.y_test)
    final: dict[str, Any] = dict(
        epoch=opt.epoch,
        steps=progress.steps,
        samples=progress.samples,
        accuracy=round(accuracy, 4),
        test_loss=round(test_loss, 4),
        elapsed=round(time.monotonic() - started, 2),
    )
    if args.send_params:
        final["params"] = params_to_text(model)
    reporter.event(
        "final",
        f"done: {progress.steps} steps, {progress.samples} samples, epoch {opt.epoch}, test "
        f"accuracy {accuracy:.3f}; checkpoint in {args.checkpoint_dir}",
        **final,
    )
    with critical_section():  # a SIGTERM now waits for the clean exit below
        try:
            opt.leave_swarm(args.deadline)
        except CheckpointError as e:  # left and withdrew, but the last save failed
            return _fail(e, args)
        finally:
            dht.shutdown()
    return 0


if __name__ == "__main__":
    from moshpit.cli import console

    console(["train", *sys.argv[1:]])
