"""What `moshpit demo` shows, without starting a swarm: the live table in an 80-column terminal,
one clock for the table's footer and the verdict, one title after Ctrl-C, and a plot whose
preemption lines name the peer they hit.

The peers are fakes that feed `train_demo`'s own event handling (`_pump`, `_drive`), so the texts
checked here are the ones the demo really produces.
"""

from __future__ import annotations

import argparse
import io
import queue
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from moshpit.cli import train_demo, train_demo_report

TITLE = "moshpit demo: 4 peers train on the 8x8 digits"


def demo_args(**overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = dict(
        peers=4, group_size=4, seed=0, samples=150_000, preemptions=0, max_rate=800.0,
        mode="local", restart_delay=2.0, replace=False, stuck_after=20.0,
        plot="moshpit-demo.png", no_plot=True, json=False,
    )  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


class FakeProc:
    """A peer process that stays alive."""

    def poll(self) -> None:
        return None


class FakeSwarm:
    """`train_demo.Swarm` without processes: slots, an event queue, and the lines sent."""

    def __init__(self, args: argparse.Namespace, events: Any = None) -> None:
        self.args = args
        self.events = events if events is not None else queue.Queue()
        self.slots = [train_demo.Slot(i, f"peer{i}.key", f"peer{i}") for i in range(args.peers)]
        for slot in self.slots:
            slot.proc = FakeProc()  # type: ignore[assignment]
        self.sent: list[tuple[int, str]] = []

    def send(self, slot: train_demo.Slot, text: str) -> None:
        self.sent.append((slot.index, text))


def progress(samples: int, epoch: int = 123) -> dict[str, Any]:
    return {
        "event": "progress", "samples": samples, "epoch": epoch, "loss": 0.1234,
        "accuracy": 0.9667, "test_loss": 0.1122, "samples_per_s": 799.6, "peers": 4,
    }  # fmt: skip


def busy_swarm(record: train_demo.Record) -> FakeSwarm:
    """Four peers with the events a run shows: resumed, no checkpoint, left cleanly, kill -9."""
    swarm = FakeSwarm(demo_args())
    swarm.slots[1].incarnation = 1
    swarm.slots[2].state = "preempted"
    for index, incarnation, obj in [
        (0, 0, progress(37_512)),
        (0, 0, {"event": "started", "restored_epoch": 123}),
        (1, 1, progress(37_488)),
        (1, 1, {"event": "started", "restored_epoch": 0}),
        (2, 0, {"event": "preempted"}),
        (3, 0, progress(37_500)),
    ]:
        swarm.events.put((index, incarnation, obj))
    said: list[str] = []
    train_demo._pump(swarm, record, said.append, until=train_demo.time.monotonic() + 0.2)  # type: ignore[arg-type]
    swarm.slots[3].state = "preempted"
    swarm.slots[3].note = "kill -9"  # what _drive notes when it SIGKILLs a peer
    return swarm


# ------------------------------------------------------------------ 1. the table in 80 columns


def test_the_live_table_fits_80_columns_with_every_event_whole():
    record = train_demo.Record(started=train_demo.time.monotonic(), budget=150_000)
    swarm = busy_swarm(record)
    notes = [slot.note for slot in swarm.slots]
    assert "123" in notes[0]  # the epoch it resumed from is part of the event
    assert all(notes), notes
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(train_demo._table(swarm, record))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in out, out
    for note in notes:
        assert note in out, out
    for text in ("preempted", "training", "37512", "0.123", "0.967", "800", TITLE):
        assert text in out, out


# ------------------------------------------------------------------ 2. one clock


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_footer_and_the_verdict_give_the_same_time(monkeypatch: pytest.MonkeyPatch):
    clock = FakeClock(1000.0)
    monkeypatch.setattr(train_demo, "time", argparse.Namespace(monotonic=clock))
    record = train_demo.Record(started=clock(), budget=8000)
    args = demo_args(peers=2, samples=8000)
    swarm = FakeSwarm(args)
    for slot in swarm.slots:  # both reach the budget and send their final state
        swarm.events.put((slot.index, 0, progress(4000)))
        swarm.events.put((slot.index, 0, {"event": "final", "steps": 0, "accuracy": 0.9}))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    clock.now = 1062.0  # the swarm runs for 62 s
    outcome = train_demo._drive(args, console, swarm, record)  # type: ignore[arg-type]
    assert outcome is not None
    # stopping the peers and the bootstrap takes 8 s more before the verdict
    clock.now = 1070.0
    monkeypatch.setattr(
        "moshpit.training.demo_task.train_baseline",
        lambda data, samples, **kw: (0.95 + kw["seed"] / 1000, 0.2, [(samples, 0.95, 0.2)]),
    )
    train_demo._conclude(args, console, None, swarm, record, outcome)  # type: ignore[arg-type]
    out = console.file.getvalue()  # type: ignore[attr-defined]
    footer = re.findall(r"^\s*(\d+)s \| \d+/8000 samples", out, re.M)
    verdict = re.findall(r"^verdict: .* in (\d+)s", out, re.M)
    assert footer and verdict, out
    assert footer[-1] == verdict[-1] == "62", out


# ------------------------------------------------------------------ 3. Ctrl-C


class VirtualTerminal:
    """Just enough of a VT100 for rich's Live: text with auto-wrap at the last column, CR, LF,
    cursor up (CSI n A), erase line (CSI 2 K); other CSI sequences are ignored."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows: list[list[str]] = [[]]
        self.row = self.col = 0
        self.wrap_pending = False

    def _line_feed(self) -> None:
        self.row += 1
        if self.row == len(self.rows):
            self.rows.append([])

    def _put(self, ch: str) -> None:
        if self.wrap_pending:  # a character after the last column starts a new line
            self.col, self.wrap_pending = 0, False
            self._line_feed()
        line = self.rows[self.row]
        line.extend(" " * (self.col + 1 - len(line)))
        line[self.col] = ch
        if self.col == self.width - 1:
            self.wrap_pending = True
        else:
            self.col += 1

    def write(self, text: str) -> int:
        for match in re.finditer(r"\x1b\[([?0-9;]*)([A-Za-z])|(.)", text, re.S):
            params, final, ch = match.groups()
            if ch == "\n":  # the tty turns LF into CR LF
                self.col, self.wrap_pending = 0, False
                self._line_feed()
            elif ch == "\r":
                self.col, self.wrap_pending = 0, False
            elif ch is not None:
                self._put(ch)
            elif final == "A":
                self.row = max(0, self.row - int(params or 1))
                self.wrap_pending = False
            elif final == "K" and params == "2":
                self.rows[self.row] = []
        return len(text)

    def flush(self) -> None:
        pass

    def lines(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.rows]


class CtrlCEvents:
    """The swarm's event queue at the moment the user presses Ctrl-C: the terminal echoes "^C"
    where the cursor is, and the main thread gets KeyboardInterrupt (on the second wait)."""

    def __init__(self, terminal: VirtualTerminal) -> None:
        self.terminal = terminal
        self.calls = 0

    def get(self, timeout: float) -> Any:
        self.calls += 1
        if self.calls == 1:  # one round of the loop first: the table is up
            raise queue.Empty
        self.terminal.write("^C")
        raise KeyboardInterrupt


@pytest.mark.parametrize("width", [80, 60])
def test_ctrl_c_during_the_live_table_leaves_one_title(width: int):
    terminal = VirtualTerminal(width)
    console = Console(
        file=terminal,  # type: ignore[arg-type]
        width=width, height=40, force_terminal=True, color_system=None, legacy_windows=False,
    )  # fmt: skip
    record = train_demo.Record(started=train_demo.time.monotonic(), budget=150_000)
    swarm = busy_swarm(record)
    swarm.events = CtrlCEvents(terminal)
    with pytest.raises(KeyboardInterrupt):
        train_demo._drive(demo_args(), console, swarm, record)  # type: ignore[arg-type]
    assert record.live_used and record.table is not None
    screen = terminal.lines()
    assert sum(TITLE in line for line in screen) == 1, "\n".join(screen)
    train_demo._report_interrupt(console, record)
    screen = terminal.lines()
    assert sum(TITLE in line for line in screen) == 1, "\n".join(screen)
    assert sum(line.startswith("interrupted (Ctrl-C)") for line in screen) == 1, screen


# ------------------------------------------------------------------ 4. the plot


def test_each_preemption_line_in_the_plot_names_its_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    record = train_demo.Record(started=0.0, budget=40_000)
    record.points = [(i, t, 4000 * t, 0.9, 0.3) for t in range(1, 10) for i in range(3)]
    record.marks = [
        (3.0, 12_000, "SIGTERM", 2),
        (5.0, 20_000, "SIGKILL", 0),
        (6.5, 26_000, "restart", 2),
    ]
    record.preemptions = {"SIGTERM": 1, "SIGKILL": 1}
    figures: list[Any] = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at it
    args = demo_args(peers=3, no_plot=False, plot=str(tmp_path / "demo.png"))
    console = Console(file=io.StringIO(), width=200, color_system=None)
    path = train_demo_report.plot(
        args, console, record, [(40_000, 0.95, 0.2)], 0.94, 0.95, 40_000, 10.0
    )
    assert path == str(tmp_path / "demo.png")
    (fig,) = figures
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    for wanted in ("peer 2 SIGTERM", "peer 0 kill -9", "peer 2 restart"):
        # on both x axes: wall time and samples
        assert texts.count(wanted) == 2, texts
    real_close(fig)
