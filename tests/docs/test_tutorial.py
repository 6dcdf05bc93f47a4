"""Runs every code block of docs/tutorial.md, in order, as a reader would.

``python`` blocks that start with ``# file: NAME`` are written to a scratch directory; ``bash``
blocks are run there (``python`` is this interpreter, ``moshpit`` this checkout's CLI);
``text`` blocks are sample output and are not run. HTML comments ``<!-- test: ... -->`` (not
shown by a renderer) say how: ``background NAME`` starts the next block as process NAME and
``wait-for "REGEX"`` waits until NAME prints a matching line; ``run`` runs it to the end;
``expect-exit N`` checks an exit status (negative: killed by that signal); ``sigterm NAME``,
``sigint NAME`` (Ctrl-C) and ``wait NAME`` end a background process; ``expect-output "REGEX"`` checks what the process printed. A bash block without a
directive runs to the end and must exit 0.

Two substitutions make one machine stand in for several: the placeholder address
``/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW...`` becomes the loopback address the newest
``first`` process printed, and port 31337 becomes a free port. The environment is the test's
own: the scripts choose their torch threads as the text says (no ``OMP_NUM_THREADS`` here).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorial.md"
PLACEHOLDER = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
DIRECTIVE = re.compile(r"<!-- test: (.*?) -->")
TOKEN = re.compile(f"{DIRECTIVE.pattern}|{BLOCK.pattern}", re.M | re.S)
ACTION = re.compile(r'\s*([a-z-]+)(?:\s+("[^"]*"|\S+))?\s*')

WAIT_FOR_SECONDS = 90.0
RUN_SECONDS = 120.0

pytestmark = pytest.mark.slow


@dataclass
class Process:
    """A background block: its process and everything it printed so far."""

    name: str
    command: str
    popen: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    def start_reading(self) -> None:
        def read() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                self.lines.append(line)

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def output(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            pytest.fail(f"{self.name!r} did not exit within {timeout:.0f} s:\n{self.output()}")
        assert self.reader is not None
        self.reader.join(10)
        return code


def parse_actions(text: str) -> list[tuple[str, str | None]]:
    actions = []
    for part in text.split(";"):
        match = ACTION.fullmatch(part)
        assert match, f"unreadable tutorial test directive {part!r}"
        name, arg = match.groups()
        actions.append((name, arg.strip('"') if arg else None))
    return actions


def tutorial_steps() -> list[tuple[str, str, str]]:
    """(kind, info, body) in document order: ("directive", actions, ""), ("block", lang, code)."""
    steps = []
    for match in TOKEN.finditer(TUTORIAL.read_text()):
        if match.group(1) is not None:
            steps.append(("directive", match.group(1), ""))
        else:
            steps.append(("block", match.group(2), match.group(3)))
    return steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_bin(directory: Path) -> Path:
    """``python`` and ``moshpit`` commands that run this interpreter and this checkout."""
    directory.mkdir()
    # Scripts, not symlinks: an interpreter started through a symlink in another directory
    # does not find the virtual environment it belongs to (no pyvenv.cfg beside the link).
    for name, command in (("python", ""), ("moshpit", " -m moshpit")):
        script = directory / name
        script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{command} "$@"\n')
        script.chmod(0o755)
    return directory


class Tutorial:
    """Plays the tutorial's steps in a scratch directory."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.address: str | None = None
        self.processes: dict[str, Process] = {}
        self.finished: list[Process] = []
        self.pending: list[tuple[str, str | None]] = []
        bin_dir = make_bin(workdir / ".bin")
        self.env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.pop("OMP_NUM_THREADS", None)  # the text as written decides the threads

    # ------------------------------------------------------------------ substitutions
    def substitute(self, command: str) -> str:
        if PLACEHOLDER in command:
            assert self.address, "the tutorial joins a peer before any 'first' peer printed one"
            command = command.replace(PLACEHOLDER, self.address)
        return command.replace("31337", str(self.port))

    def note_address(self, process: Process) -> None:
        if process.name != "first":
            return
        for line in process.lines:
            if "--initial-peers" in line:
                addresses = line.split("--initial-peers", 1)[1].split()
                loopback = [a for a in addresses if a.startswith("/ip4/127.0.0.1/")]
                self.address = (loopback or addresses)[0]

    # ------------------------------------------------------------------ steps
    def block(self, lang: str, code: str) -> None:
        if lang == "python":
            first_line, _, rest = code.partition("\n")
            match = re.fullmatch(r"# file: (\S+)", first_line.strip())
            assert match, f"a python block must start with '# file: NAME':\n{code}"
            path = self.workdir / match.group(1)
            path.write_text(code.replace("31337", str(self.port)))
            return
        if lang == "text":
            return
        assert lang == "bash", f"tutorial block of unknown kind {lang!r}"
        command = self.substitute(code.replace("\\\n", " ").strip())
        actions, self.pending = self.pending or [("run", None)], []
        names = [name for name, _ in actions]
        if "background" in names:
            self.background(dict(actions)["background"], command, actions)
        else:
            self.run(command, actions)

    def spawn(self, name: str, command: str) -> Process:
        popen = subprocess.Popen(
            ["bash", "-c", f"exec {command}"],  # the signals reach the program itself
            cwd=self.workdir,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        process = Process(name, command, popen)
        process.start_reading()
        return process

    def background(self, name: str | None, command: str, actions: list) -> None:
        assert name, "background needs a name"
        assert name not in self.processes, f"{name!r} is already running"
        process = self.spawn(name, command)
        self.processes[name] = process
        for action, arg in actions:
            if action == "wait-for":
                self.wait_for(process, arg or "")
        self.note_address(process)

    def wait_for(self, process: Process, pattern: str) -> None:
        deadline = time.monotonic() + WAIT_FOR_SECONDS
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            if any(regex.search(line) for line in list(process.lines)):
                return
            if process.popen.poll() is not None and process.reader is not None:
                process.reader.join(5)
                if any(regex.search(line) for line in list(process.lines)):
                    return
                pytest.fail(
                    f"{process.name!r} exited ({process.popen.returncode}) before printing "
                    f"{pattern!r}:\n{process.output()}{self.others(process)}"
                )
            time.sleep(0.1)
        pytest.fail(
            f"{process.name!r} printed no {pattern!r} in {WAIT_FOR_SECONDS:.0f} s:\n"
            f"{process.output()}{self.others(process)}"
        )

    def run(self, command: str, actions: list) -> None:
        process = self.spawn("run", command)
        code = process.finish(RUN_SECONDS)
        self.check(process, code, actions)

    def check(self, process: Process, code: int, actions: list) -> None:
        expected = 0
        for action, arg in actions:
            if action == "expect-exit":
                expected = int(arg or 0)
        assert code == expected, (
            f"`{process.command}` exited {code}, expected {expected}:\n{process.output()}"
            f"{self.others(process)}"
        )
        for action, arg in actions:
            if action == "expect-output":
                assert re.search(arg or "", process.output()), (
                    f"`{process.command}` printed no {arg!r}:\n{process.output()}"
                )
        self.finished.append(process)

    def others(self, process: Process) -> str:
        """What every other process printed: a failure often starts in another peer."""
        text = ""
        for other in [*self.processes.values(), *self.finished[-3:]]:
            if other is not process:
                state = "running" if other.popen.poll() is None else f"exit {other.popen.poll()}"
                text += f"\n--- {other.name} ({state}): {other.command}\n{other.output()[-3000:]}"
        return text

    def directive(self, text: str) -> None:
        actions = parse_actions(text)
        if actions[0][0] in ("background", "run"):
            self.pending = actions  # applies to the next bash block
            return
        groups: list[list] = []
        for action, arg in actions:  # "sigterm a; expect-exit 0; wait b" -> two groups
            if action in ("sigterm", "sigint", "wait"):
                groups.append([(action, arg)])
            else:
                groups[-1].append((action, arg))
        for group in groups:
            (verb, name), rest = group[0], group[1:]
            process = self.processes.pop(name or "")
            if verb in ("sigterm", "sigint"):
                process.popen.send_signal(signal.SIGTERM if verb == "sigterm" else signal.SIGINT)
            code = process.finish(RUN_SECONDS)
            self.check(process, code, rest)

    def close(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.popen.pid, signal.SIGKILL)
            process.popen.wait()


def test_every_tutorial_block_is_run_and_does_what_the_text_says(tmp_path: Path) -> None:
    steps = tutorial_steps()
    blocks = [info for kind, info, _ in steps if kind == "block"]
    assert blocks.count("bash") >= 8 and blocks.count("python") >= 4, blocks
    tutorial = Tutorial(tmp_path)
    try:
        for kind, info, body in steps:
            if kind == "directive":
                tutorial.directive(info)
            else:
                tutorial.block(info, body)
        leftover = sorted(tutorial.processes)
        assert not leftover, f"the tutorial leaves {leftover} running"
        assert not tutorial.pending, "a test directive is not followed by a bash block"
    finally:
        tutorial.close()


def test_the_python_shim_runs_this_interpreter_in_its_environment(tmp_path: Path) -> None:
    """In a venv, ``python`` in the scratch directory must see the venv's packages."""
    shim = make_bin(tmp_path / "bin") / "python"
    done = subprocess.run([str(shim), "-c", "import sys; print(sys.prefix)"], capture_output=True)
    assert done.stdout.decode().strip() == sys.prefix, done


def test_directives_parse() -> None:
    assert parse_actions('background first; wait-for "--initial-peers"') == [
        ("background", "first"),
        ("wait-for", "--initial-peers"),
    ]
    assert parse_actions("sigterm second; expect-exit 0") == [
        ("sigterm", "second"),
        ("expect-exit", "0"),
    ]
    with pytest.raises(AssertionError):
        parse_actions("background first wait-for x")
