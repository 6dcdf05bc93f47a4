"""How a `moshpit` command process ends (moshpit/cli/process_exit.py): what Python's exit does
before its module teardown still happens (threads joined, an executor's queued work done,
atexit handlers, flushed output and logs, the status), and the teardown itself does not."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moshpit.cli import process_exit

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    from moshpit.cli.process_exit import exit_without_teardown

    out = Path(sys.argv[1])

    class TornDown:
        def __del__(self):  # runs in the interpreter's module teardown, if it happens
            (out / "torn-down").write_text("yes")

    kept = TornDown()

    def late_thread():
        time.sleep(0.3)
        (out / "thread").write_text("done")

    threading.Thread(target=late_thread).start()  # not a daemon: exit waits for it
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.3), (out / "queued").write_text("done")))
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.getLogger("x").info("the last log line")
    sys.stdout.write("x" * 300_000 + "\\nend\\n")  # buffered: flushed on the way out
    exit_without_teardown(3)
    """
)


def test_a_command_ends_with_its_status_after_threads_atexit_and_flushed_output(tmp_path: Path):
    script = tmp_path / "ends.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout.endswith("x\nend\n") and len(done.stdout) == 300_005
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "queued").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "the last log line" in (tmp_path / "log.txt").read_text()
    # the module teardown (which freed torch's modules for 1.5-5 s) did not run
    assert not (tmp_path / "torn-down").exists()


def test_without_cpythons_exit_hooks_it_is_a_plain_exit(monkeypatch):
    monkeypatch.delattr(process_exit.threading, "_shutdown")
    with pytest.raises(SystemExit) as exited:
        process_exit.exit_without_teardown(5)
    assert exited.value.code == 5


def test_python_m_moshpit_ends_through_it(tmp_path: Path):
    # the usage error path: no torch, no swarm; the status still comes through
    done = subprocess.run(
        [sys.executable, "-m", "moshpit", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "moshpit", "--version"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip()
