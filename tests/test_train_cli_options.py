"""The options of `moshpit train` and the examples
of `moshpit --help`, checked on the parsers themselves: no swarm, no training."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from moshpit.cli import SUBCOMMANDS, build_parser, train_cmd, train_demo

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser([name])
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def run_python(code: str, unset: str) -> str:
    """What ``python -c code`` printed, in an environment without the variable ``unset``."""
    env = {k: v for k, v in ENV.items() if k != unset}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def train_args(*argv: str) -> argparse.Namespace:
    return build_parser(["train"]).parse_args(["train", *argv])


# ------------------------------------------------------------------ --help


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_states_the_default_of_every_option(command: str):
    parser = subparser(command)
    text = parser.format_help()
    missing = []
    for action in parser._actions:
        default = action.default
        if (
            not action.option_strings
            or action.help in (None, argparse.SUPPRESS)
            or default is None
            or default is False
            or default == []
            or default == argparse.SUPPRESS
        ):
            continue  # flags, and options whose absence the help explains
        helped = parser._get_formatter()._expand_help(action)
        if "default" not in helped:
            missing.append(action.option_strings[0])
    assert not missing, f"no default in the help of {missing}"
    if command == "train":
        for wanted in (
            "samples per step (default: 32)",
            "Adam learning rate (default: 0.003)",
            "averaging group size (default: 4)",
            "seconds between reports (default: 1.0)",
            "(default: 0.0 = no",
        ):
            assert wanted in " ".join(text.split()), text


def test_max_rate_and_threads_say_when_to_use_them():
    text = " ".join(subparser("train").format_help().split())
    assert "--max-rate SAMPLES_PER_S" in text and "no cap" in text and "shares the machine" in text
    here = train_cmd.default_threads(train_cmd.available_cpus())
    assert f"all cores but one, here {here}" in text and "OMP_NUM_THREADS" in text


def test_the_join_example_trains_with_the_swarm():
    text = build_parser([]).format_help()
    join = text.index("moshpit train --initial-peers /ip4/")
    assert "moshpit dht --host-maddrs" in text[:join]  # the first peer: a bootstrap node
    assert "moshpit dht --initial-peers" not in text


def test_the_parser_defaults_are_the_demo_tasks():
    from moshpit.training import demo_task

    args = train_args()
    assert args.batch_size == demo_task.DEFAULT_BATCH
    assert args.lr == demo_task.DEFAULT_LR


# ------------------------------------------------------------------ --threads


@pytest.mark.parametrize(("cpus", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15), (None, 1)])
def test_by_default_a_volunteer_leaves_one_core_to_the_user(cpus: int | None, threads: int):
    assert train_cmd.default_threads(cpus) == threads


def test_the_target_batch_defaults_to_the_modes_own():
    """sync's global step and diloco's outer step each have their own scale of samples."""
    for mode, target in (("sync", 256), ("diloco", 4096)):
        args = train_args("--mode", mode)
        assert train_cmd.check_args(args) is None and args.target_batch_size == target
    args = train_args("--mode", "diloco", "--target-batch-size", "1024")
    assert train_cmd.check_args(args) is None and args.target_batch_size == 1024
    assert train_cmd.check_args(train_args("--mode", "diloco", "--target-batch-size", "8")) == (
        "--target-batch-size must be >= --batch-size"
    )


def test_threads_is_parsed_and_checked():
    assert train_args().threads is None
    assert train_args("--threads", "3").threads == 3
    assert train_cmd.check_args(train_args("--threads", "0")) is None
    assert train_cmd.check_args(train_args("--threads", "-1")) == "--threads must be >= 0"


def test_which_thread_count_is_set():
    pick = train_cmd.torch_threads
    assert pick(None, 8, {}) == 7  # not told: all cores but one
    assert pick(None, 8, {"OMP_NUM_THREADS": "2"}) is None  # the user's OMP_NUM_THREADS
    assert pick(3, 8, {"OMP_NUM_THREADS": "2"}) == 3  # --threads wins
    assert pick(0, 8, {}) is None  # 0: torch's own default


def test_the_thread_limit_reaches_every_thread_of_the_peer():
    # parsing the options must not load torch: OpenMP reads OMP_NUM_THREADS once, at load, for
    # every thread but the one that calls torch.set_num_threads (the DHT's, the averager's)
    code = (
        "import sys, threading\n"
        "from moshpit.cli import build_parser\n"
        "from moshpit.cli.train_cmd import limit_threads\n"
        "args = build_parser(['train']).parse_args(['train', '--threads', '7'])\n"
        "assert 'torch' not in sys.modules, 'the train parser loaded torch'\n"
        "limit_threads(args.threads)\n"
        "import torch\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))\n"
        "t.start(); t.join()\n"
        "print(torch.get_num_threads(), seen[0])\n"
    )
    out = run_python(code, unset="OMP_NUM_THREADS")
    assert out.split() == ["7", "7"], out


# ------------------------------------------------------------------ --max-rate and OpenMP


@pytest.mark.parametrize(
    ("argv", "exported", "policy"),
    [
        (["--max-rate", "100"], None, "PASSIVE"),
        (["--max-rate=50"], None, "PASSIVE"),
        (["--threads", "2", "--max-rate", "0.5", "--duration", "3"], None, "PASSIVE"),
        ([], None, None),  # uncapped: OpenMP's default
        (["--max-rate", "0"], None, None),
        (["--max-steps", "100"], None, None),
        (["--max-rate", "oops"], None, None),  # left to the parser's own error
        (["--max-rate"], None, None),
        (["--max-rate", "100"], "ACTIVE", "ACTIVE"),  # what the user exported wins
    ],
)
def test_a_rate_cap_lets_idle_torch_threads_sleep(argv, exported, policy):
    env = {} if exported is None else {"OMP_WAIT_POLICY": exported}
    train_cmd.prepare_process(["train", *argv], env)
    assert env.get("OMP_WAIT_POLICY") == policy


def test_the_console_sets_the_wait_policy_before_torch_loads():
    # OpenMP reads OMP_WAIT_POLICY once, when torch loads it: set later, it changes nothing
    code = (
        "import os, sys\n"
        "from moshpit.cli import console, train_cmd\n"
        "real = train_cmd.prepare_process\n"
        "def spy(argv, environ=None):\n"
        "    real(argv, environ)\n"
        "    print('torch' in sys.modules, os.environ.get('OMP_WAIT_POLICY'), flush=True)\n"
        "train_cmd.prepare_process = spy\n"
        "console(['train', '--max-rate', '100', '--help'])\n"
    )
    out = run_python(code, unset="OMP_WAIT_POLICY")
    assert out.splitlines()[0] == "False PASSIVE", out[:300]


class FakePopen:
    """A peer process that exits at once with nothing to say."""

    def __init__(self, cmd: list[str], **kwargs: Any) -> None:
        self.cmd = cmd
        self.env = kwargs.get("env") or {}
        self.stdin = io.StringIO()
        self.stdout = io.StringIO("")
        self.stderr = io.StringIO("")
        self.returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def poll(self) -> int:
        return 0


def test_demo_peers_keep_one_thread_and_their_rate_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    started: list[FakePopen] = []

    def popen(cmd: list[str], **kwargs: Any) -> FakePopen:
        started.append(FakePopen(cmd, **kwargs))
        return started[-1]

    monkeypatch.setattr(train_demo.subprocess, "Popen", popen)
    monkeypatch.delenv("MOSHPIT_DEMO_LOGDIR", raising=False)
    demo = build_parser(["demo"]).parse_args(["demo"])
    demo.peers, demo.group_size = 4, 4
    swarm = train_demo.Swarm(demo, "/ip4/127.0.0.1/tcp/1/p2p/x", str(tmp_path))
    swarm.spawn(swarm.slots[0])
    (proc,) = started
    # the console's own start (process_start.py) and exit (process_exit.py)
    assert proc.cmd[:4] == [sys.executable, "-m", "moshpit", "train"]
    peer = build_parser(["train"]).parse_args(proc.cmd[3:])
    # 4 peers on a laptop: one torch thread each (in every thread: OMP_NUM_THREADS), 800/s
    assert peer.threads == 1 and proc.env["OMP_NUM_THREADS"] == "1"
    assert peer.max_rate == 800.0


def test_the_first_plain_progress_line_shows_even_just_after_boot(monkeypatch):
    """``time.monotonic()`` starts near 0 at boot: a reporter that started its 5-s timer at
    0.0 skipped the first line on a machine up for less than 5 s (a fresh CI VM)."""
    monkeypatch.setattr(train_cmd.time, "monotonic", lambda: 2.0)
    reporter = train_cmd._Reporter(json_lines=False)
    reporter.console.file = out = io.StringIO()
    row = dict(epoch=1, samples=32, loss=2.5, accuracy=0.1, samples_per_s=100.0, peers=1)
    reporter._progress(row)
    reporter._progress({**row, "epoch": 2})  # within 5 s of the first: not shown
    assert out.getvalue().count("epoch ") == 1 and "epoch 1 " in out.getvalue()
