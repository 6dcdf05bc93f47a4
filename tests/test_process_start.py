"""A ``moshpit`` command process imports torch with the garbage collector paused, then
freezes what it imported (``moshpit/cli/process_start.py``); ``main`` called in someone
else's process leaves their collector alone."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moshpit.cli import main

ROOT = Path(__file__).resolve().parents[1]

# Counts the collector's passes that start while torch is (being) imported and nothing is
# frozen yet: the start-up window. Prints what the process looked like at its exit.
WATCH = """
import atexit, gc, json, sys
passes = []
def watch(phase, info):
    if phase == "start" and gc.get_freeze_count() == 0 and "torch" in sys.modules:
        passes.append(info["generation"])
gc.callbacks.append(watch)
atexit.register(lambda: print(json.dumps({
    "passes_while_importing": len(passes),
    "frozen": gc.get_freeze_count(),
    "enabled": gc.isenabled(),
    "dynamo": "torch._dynamo" in sys.modules,
})))
"""


def run_python(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_train_command_imports_torch_and_dynamo_without_collecting_then_freezes():
    # `--help` ends inside argparse, after the console imported the command
    seen = run_python(WATCH + "from moshpit.cli import console\nconsole(['train', '--help'])")
    assert seen["dynamo"]  # what torch's optimizers import on their first step
    assert seen["passes_while_importing"] == 0
    assert seen["frozen"] > 10_000  # torch's modules, out of the collector's later passes
    assert seen["enabled"]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_pause_restores_the_collector_as_it_was(enabled_before):
    code = WATCH + textwrap.dedent(f"""
        if not {enabled_before}:
            gc.disable()
        from moshpit.cli.process_start import import_paused
        import_paused(["torch", "no_such_module_here"])  # a failed import is the caller's
    """)
    seen = run_python(code)
    assert seen["passes_while_importing"] == 0 and seen["frozen"] > 10_000
    assert seen["enabled"] is enabled_before


def test_main_in_someone_elses_process_leaves_their_collector_alone():
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert gc.get_freeze_count() == frozen
    assert gc.isenabled()
