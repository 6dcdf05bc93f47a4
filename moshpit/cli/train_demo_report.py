"""The end of ``moshpit demo`` (training): the single-process baselines, the verdict, the JSON
summary and the PNG plot.

Its own module because it is the demo's reporting, apart from driving the peer processes
(:mod:`moshpit.cli.train_demo`): it reads what the parent recorded during the run through
the small protocols below, so it imports nothing of the driver (no import cycle).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rich.console import Console

    from moshpit.training.demo_task import DigitsData

SYNC_TARGET_BATCH = 256  # mode sync: samples per global optimizer step
ACCURACY_TOLERANCE = 0.01  # 1 point, plus twice the baselines' spread
BASELINE_SEEDS = 5  # baselines trained (batch orders): ~1 s each on one core


class RunRecord(Protocol):
    """What the parent saw during the run (``train_demo.Record``)."""

    @property
    def points(self) -> list[tuple[int, float, int, float, float]]:
        """(slot, t, swarm samples, accuracy, test loss) of each progress line."""

    @property
    def marks(self) -> list[tuple[float, int, str, int]]:
        """(t, swarm samples, "SIGTERM" | "SIGKILL" | "restart", slot)."""

    @property
    def preemptions(self) -> dict[str, int]: ...

    @property
    def restarts(self) -> int: ...

    @property
    def swarm_samples(self) -> int: ...

    def elapsed(self) -> float: ...


class PeerEnd(Protocol):
    """How one peer slot ended (``train_demo.Slot``)."""

    @property
    def stuck(self) -> bool: ...

    @property
    def exit_codes(self) -> list[int]: ...


@dataclass
class SwarmResult:
    """The swarm's final model: the mean of the final peers' parameters."""

    accuracy: float
    loss: float
    peer_accuracies: dict[int, float]
    averaged: int  # peers whose parameters went into the mean


@dataclass
class Baselines:
    """The same model trained in one process on as many samples, with several batch orders."""

    accuracies: list[float]
    loss: float
    curve: list[tuple[int, float, float]]  # the first one's (samples, accuracy, loss)
    batch: int

    @property
    def accuracy(self) -> float:
        return statistics.fmean(self.accuracies)

    @property
    def spread(self) -> float:
        return statistics.stdev(self.accuracies)

    @property
    def margin(self) -> float:
        """How far below the baselines' mean the swarm may end and still pass."""
        return ACCURACY_TOLERANCE + 2 * self.spread


@dataclass
class Verdict:
    swarm: SwarmResult
    baselines: Baselines
    samples: int
    wall: float
    preemptions: int
    stuck: int
    unclean: int  # exits other than 0 or kill -9
    peers_at_end: int
    ok: bool

    @property
    def close(self) -> bool:
        return self.swarm.accuracy >= self.baselines.accuracy - self.baselines.margin


def conclude(
    args: argparse.Namespace,
    console: Console,
    data: DigitsData,
    peers: Sequence[PeerEnd],
    record: RunRecord,
    finals: Mapping[int, dict[str, Any]],
) -> int:
    """Judge the run, print the verdict (and the JSON summary with ``--json``), plot it: the
    exit status (0: OK)."""
    wall = record.elapsed()  # the footer's clock: both say the same number of seconds
    samples = record.swarm_samples
    swarm = _swarm_result(console, data, finals)
    baselines = _train_baselines(args, console, data, samples, finals)
    pre = record.preemptions
    preemptions = pre["SIGTERM"] + pre["SIGKILL"]
    stuck = sum(1 for s in peers if s.stuck)
    ok = (
        swarm.averaged > 0
        and swarm.accuracy >= baselines.accuracy - baselines.margin
        and stuck == 0
        and record.restarts == preemptions
        and args.peers == len(finals)
    )
    unclean = sum(1 for s in peers for code in s.exit_codes if code not in (0, -signal.SIGKILL))
    verdict = Verdict(swarm, baselines, samples, wall, preemptions, stuck, unclean, len(finals), ok)
    _print_verdict(args, console, record, verdict)
    plot_path = None
    if not args.no_plot:
        plot_path = plot(
            args,
            console,
            record,
            baselines.curve,
            swarm.accuracy,
            baselines.accuracy,
            samples,
            wall,
        )
    if args.json:
        sys.stdout.flush()
        console.file.flush()
        print(json.dumps(_summary(args, record, verdict, plot_path)), flush=True)
    return 0 if verdict.ok else 1


def _swarm_result(
    console: Console, data: DigitsData, finals: Mapping[int, dict[str, Any]]
) -> SwarmResult:
    """Test the mean of the final peers' parameters (each peer that trained since its last
    restart and sent usable ones)."""
    import torch

    from moshpit.training.demo_task import evaluate, load_flat_params, make_model, params_from_text

    model = make_model(0)
    peer_acc: dict[int, float] = {}
    flats = []
    for index, final in finals.items():
        if not final.get("steps"):
            # restarted so late that it never stepped: it holds its old checkpoint, not the
            # swarm's state, and would drag the average back
            console.print(f"peer {index} had not trained since its restart: left out of the mean")
            continue
        try:
            flat = params_from_text(model, final["params"])
        except (KeyError, ValueError) as e:
            console.print(f"[red]peer {index} sent unusable parameters: {e}[/red]")
            continue
        flats.append(flat)
        peer_acc[index] = float(final["accuracy"])
    if not flats:
        return SwarmResult(float("nan"), float("nan"), peer_acc, 0)
    load_flat_params(model, torch.stack(flats).mean(0))
    accuracy, loss = evaluate(model, data.x_test, data.y_test)
    return SwarmResult(accuracy, loss, peer_acc, len(flats))


def _train_baselines(
    args: argparse.Namespace,
    console: Console,
    data: DigitsData,
    samples: int,
    finals: Mapping[int, dict[str, Any]],
) -> Baselines:
    import torch

    from moshpit.training.demo_task import DEFAULT_BATCH, train_baseline

    # one thread: the model is tiny, and spinning OpenMP teams on a busy machine are ~10x slower
    torch.set_num_threads(1)
    with console.status("training the single-process baselines on the same number of samples..."):
        # sync takes one optimizer step per global batch (>= SYNC_TARGET_BATCH: peers keep
        # accumulating while a round forms), so its one-process equivalent takes as many steps
        # on as many samples; local mode is compared with the peers' batches of 32
        batch = DEFAULT_BATCH
        if args.mode == "sync":
            epochs = max((int(f.get("epoch", 0)) for f in finals.values()), default=0)
            batch = max(SYNC_TARGET_BATCH, samples // max(1, epochs))
        # several seeds (batch orders): one baseline's accuracy moves by ~0.8 points from
        # seed to seed on this 539-image test set, so the swarm is held to their mean, with
        # a margin that grows with their measured spread
        runs = [
            train_baseline(data, samples, batch_size=batch, seed=args.seed + k)
            for k in range(BASELINE_SEEDS)
        ]
    return Baselines(
        [acc for acc, _, _ in runs],
        statistics.fmean(loss for _, loss, _ in runs),
        runs[0][2],
        batch,
    )


def _print_verdict(
    args: argparse.Namespace, console: Console, record: RunRecord, verdict: Verdict
) -> None:
    swarm, base, pre = verdict.swarm, verdict.baselines, record.preemptions
    gap = (swarm.accuracy - base.accuracy) * 100
    console.print(
        f"[bold]verdict: {'OK' if verdict.ok else 'NOT OK'}[/bold] — swarm {swarm.accuracy:.3f} "
        f"vs baseline {base.accuracy:.3f} ± {base.spread:.3f} ({gap:+.1f} points; "
        f"{'within' if verdict.close else 'more than'} the {100 * base.margin:.1f}-point "
        f"margin), {verdict.preemptions} preemptions survived ({pre['SIGTERM']} SIGTERM, "
        f"{pre['SIGKILL']} kill -9), {record.restarts} restarts, {verdict.stuck} stuck peers, "
        f"{verdict.peers_at_end}/{args.peers} peers at the end, {verdict.samples} samples in "
        f"{verdict.wall:.0f}s",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        "swarm accuracy = test accuracy of the mean of the final peers' parameters "
        f"(each peer alone: {', '.join(f'{a:.3f}' for a in swarm.peer_accuracies.values()) or '-'}); "
        "baseline = the same MLP and Adam in one process on the same number of samples"
        + (f" and as many optimizer steps (batches of {base.batch})" if args.mode == "sync" else "")
        + f", mean of {BASELINE_SEEDS} batch orders "
        f"({', '.join(f'{a:.3f}' for a in base.accuracies)}); "
        f"margin = 1 point + 2 x their standard deviation",
        soft_wrap=True,
        highlight=False,
    )


def _summary(
    args: argparse.Namespace, record: RunRecord, verdict: Verdict, plot_path: str | None
) -> dict[str, Any]:
    """The ``--json`` line."""
    swarm, base, pre = verdict.swarm, verdict.baselines, record.preemptions
    return {
        "final_accuracy": round(swarm.accuracy, 4),
        "final_loss": round(swarm.loss, 4),
        "baseline_accuracy": round(base.accuracy, 4),
        "baseline_loss": round(base.loss, 4),
        "baseline_accuracies": [round(a, 4) for a in base.accuracies],
        "margin": round(base.margin, 4),
        "peer_accuracies": [round(a, 4) for a in swarm.peer_accuracies.values()],
        "preemptions": verdict.preemptions,
        "sigterm": pre["SIGTERM"],
        "kill9": pre["SIGKILL"],
        "restarts": record.restarts,
        "stuck_peers": verdict.stuck,
        "unclean_exits": verdict.unclean,
        "peers": args.peers,
        "peers_at_end": verdict.peers_at_end,
        "peers_averaged": swarm.averaged,
        "samples": verdict.samples,
        "mode": args.mode,
        "wall_s": round(verdict.wall, 1),
        "verdict": "OK" if verdict.ok else "NOT OK",
        "plot": plot_path,
    }


# ---------------------------------------------------------------------------------------------
# the plot

MARK_STYLE = {
    "SIGTERM": ("tab:orange", "-"),
    "SIGKILL": ("tab:red", "-"),
    "restart": ("tab:green", ":"),
}
MARK_LABEL = {"SIGTERM": "SIGTERM", "SIGKILL": "kill -9", "restart": "restart"}


def plot(
    args: argparse.Namespace,
    console: Console,
    record: RunRecord,
    base_curve: list[tuple[int, float, float]],
    final_acc: float,
    base_acc: float,
    samples: int,
    wall: float,
) -> str | None:
    """Accuracy and loss of every peer against wall time and swarm samples, with the baseline,
    the swarm's final accuracy and the preemptions: the PNG's path (None: none written)."""
    plt = _pyplot(console)
    if plt is None:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    _plot_peers(plt, axes, args.peers, record)
    if base_curve:
        bn = [c[0] for c in base_curve]
        axes[0][1].plot(bn, [c[1] for c in base_curve], "k--", lw=1.5, label="baseline (1 process)")
        axes[1][1].plot(bn, [c[2] for c in base_curve], "k--", lw=1.5, label="baseline (1 process)")
    axes[0][1].plot([samples], [final_acc], "r*", ms=12, label="swarm (mean of peers)")
    end = max((p[1] for p in record.points), default=wall)
    axes[0][0].plot([end], [final_acc], "r*", ms=12, label="swarm (mean of peers)")
    _plot_marks(axes, record)
    _label_axes(axes)
    pre = record.preemptions
    fig.suptitle(
        f"moshpit demo: {args.peers} peers ({args.mode}), {pre['SIGTERM']} SIGTERM + "
        f"{pre['SIGKILL']} kill -9 — swarm {final_acc:.3f} vs baseline {base_acc:.3f}"
    )
    fig.tight_layout()
    path: str = os.path.abspath(args.plot)
    try:
        fig.savefig(path, dpi=90)
    except OSError as e:
        console.print(f"[red]could not write the plot to {path}: {e}[/red]")
        return None
    finally:
        plt.close(fig)
    console.print(f"plot: {path}", soft_wrap=True, highlight=False)
    return path


def _pyplot(console: Console) -> Any:
    """``matplotlib.pyplot`` (drawing off-screen), or None after saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from moshpit.training.demo_task import DEMO_INSTALL_HINT

        console.print(
            f"no plot: matplotlib is not installed ({DEMO_INSTALL_HINT})",
            soft_wrap=True,
            highlight=False,
            markup=False,
        )
        return None
    return plt


def _plot_peers(plt: Any, axes: Any, peers: int, record: RunRecord) -> None:
    """Each peer's test accuracy and loss (rows) against time and swarm samples (columns)."""
    colors = plt.get_cmap("tab10")
    for index in range(peers):
        pts = [p for p in record.points if p[0] == index]
        if not pts:
            continue
        t = [p[1] for p in pts]
        n = [p[2] for p in pts]
        kw = dict(color=colors(index % 10), lw=1.0, alpha=0.8, label=f"peer {index}")
        axes[0][0].plot(t, [p[3] for p in pts], ".", ms=2, **kw)
        axes[1][0].plot(t, [p[4] for p in pts], ".", ms=2, **kw)
        axes[0][1].plot(n, [p[3] for p in pts], ".", ms=2, **kw)
        axes[1][1].plot(n, [p[4] for p in pts], ".", ms=2, **kw)


def _plot_marks(axes: Any, record: RunRecord) -> None:
    """A vertical line at each preemption and restart, labelled with the peer it hit."""
    seen: set[str] = set()
    for t, n, kind, slot in record.marks:
        color, ls = MARK_STYLE[kind]
        label = MARK_LABEL[kind]
        for row in (0, 1):
            axes[row][0].axvline(
                t, color=color, ls=ls, lw=1.2, label=None if label in seen or row else label
            )
            axes[row][1].axvline(n, color=color, ls=ls, lw=1.2)
        seen.add(label)
        # which peer was hit (or came back): along the line, near the bottom of the accuracy
        # plots (x in data, y in axes coordinates); preemptions left of their line, restarts right
        for col, x in ((0, t), (1, n)):
            ax = axes[0][col]
            ax.text(
                x, 0.03, f"peer {slot} {label}", transform=ax.get_xaxis_transform(),
                rotation=90, ha="left" if kind == "restart" else "right", va="bottom",
                fontsize=7, color=color,
            )  # fmt: skip


def _label_axes(axes: Any) -> None:
    for row, name in ((0, "test accuracy"), (1, "test loss")):
        for col in (0, 1):
            axes[row][col].set_ylabel(name)
            axes[row][col].grid(alpha=0.3)
    axes[0][0].set_ylim(0.8, 1.0)  # the interesting part; the first seconds are below
    axes[0][1].set_ylim(0.8, 1.0)
    axes[1][0].set_yscale("log")
    axes[1][1].set_yscale("log")
    axes[1][0].set_xlabel("wall time (s)")
    axes[1][1].set_xlabel("samples processed by the whole swarm")
    axes[0][0].legend(loc="lower right", fontsize=8)
    axes[0][1].legend(loc="lower right", fontsize=8)
