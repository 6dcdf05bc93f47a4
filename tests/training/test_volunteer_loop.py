"""The volunteer loop's own rules, without a swarm: limits, a failed download, a stop mid-pause."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from moshpit.training.errors import NoDonorError
from moshpit.training.volunteer import LoopLimits, LoopProgress, RateCap, run_volunteer_loop


class CountingOptimizer:
    """Stands in for moshpit.Optimizer: steps a real SGD, and fails the steps it is told to."""

    def __init__(self, model: torch.nn.Module, fail_at: set[int]) -> None:
        self.inner = torch.optim.SGD(model.parameters(), lr=0.1)
        self.fail_at, self.steps = fail_at, 0

    def step(self, loss: float | None = None) -> None:
        self.steps += 1
        self.inner.step()
        if self.steps in self.fail_at:
            raise NoDonorError("no peer of the swarm serves its state")

    def zero_grad(self) -> None:
        self.inner.zero_grad()


def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    for _ in itertools.count():
        x = torch.randn(8, 4, generator=generator)
        yield x, (x.sum(dim=1) > 0).long()


def test_a_failed_download_is_a_warning_and_training_goes_on_to_the_step_limit() -> None:
    model = torch.nn.Linear(4, 2)
    opt = CountingOptimizer(model, fail_at={2, 5})
    warnings: list[str] = []
    reports: list[int] = []
    done = run_volunteer_loop(
        opt, model, batches(), 8, LoopLimits(max_steps=10, report_every=3600),
        report=lambda p: reports.append(p.steps), warn=warnings.append,
    )  # fmt: skip
    assert (done.steps, done.samples, opt.steps) == (10, 80, 10)
    assert len(warnings) == 2 and all("will retry" in w for w in warnings)
    assert reports == [1, 10]  # the first step reports (nothing reported yet), then the end
    assert done.loss is not None and done.loss > 0


def test_a_stop_cuts_a_rate_limited_pause_short_and_progress_survives_for_the_caller() -> None:
    model = torch.nn.Linear(4, 2)
    stop = threading.Event()
    progress = LoopProgress()
    # 1 sample/s: after the first step of 8 samples the loop would pause ~8 s
    limits = LoopLimits(max_rate=1.0, report_every=3600)
    worker = threading.Thread(
        target=run_volunteer_loop,
        args=(CountingOptimizer(model, set()), model, batches(), 8, limits),
        kwargs={"report": lambda p: None, "warn": lambda w: None, "stop": stop,
                "progress": progress},
    )  # fmt: skip
    worker.start()
    while progress.steps < 1:
        time.sleep(0.01)
    time.sleep(0.1)  # inside the pause, whose slices last up to 1 s
    stopped = time.monotonic()
    stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive(), "the stop did not end the pause"
    assert progress.steps == 1
    assert time.monotonic() - stopped < 0.7, "the loop slept through the stop"


def test_duration_ends_the_loop() -> None:
    limits = LoopLimits(duration=0.2, report_every=3600)
    model = torch.nn.Linear(4, 2)
    done = run_volunteer_loop(
        CountingOptimizer(model, set()), model, batches(), 8, limits,
        report=lambda p: None, warn=lambda w: None,
    )  # fmt: skip
    assert done.steps > 1 and time.monotonic() - done.started >= 0.2


def test_a_capped_loop_does_not_make_up_a_stall_at_full_speed() -> None:
    # 800 samples/s in steps of 8 (10 ms each), then a 2-s stall (an averaging round). Paced
    # against the start alone, the next 1600 samples went through with no pause at all
    now = [0.0]
    cap = RateCap(800.0, slack=0.1, clock=lambda: now[0])
    samples = 0
    for _ in range(100):  # 1 s at the cap: each step waits out its 10 ms
        samples += 8
        now[0] += cap.pause(samples)
    assert abs(now[0] - 1.0) < 1e-9
    now[0] += 2.0  # the stall
    burst = 0
    while (wait := cap.pause(samples + 8 * (burst + 1))) == 0.0:
        burst += 1
    assert burst * 8 <= 0.1 * 800 + 8  # the slack's worth without a pause (a step at the edge)
    samples += 8 * (burst + 1)
    now[0] += wait
    start = now[0]
    for _ in range(100):  # and the cap holds after it
        samples += 8
        now[0] += cap.pause(samples)
    assert abs((now[0] - start) - 1.0) < 1e-9
    with pytest.raises(ValueError, match="rate must be > 0"):
        RateCap(0.0)
