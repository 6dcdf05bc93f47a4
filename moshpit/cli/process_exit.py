"""How a ``moshpit`` command process ends: as Python's own exit, minus its module teardown.

Once torch is imported (and ``torch._dynamo``, which torch's optimizers import on first use),
the interpreter's teardown of its modules took 1.5 s on an idle 2-core VM and 4-5.5 s beside
two busy processes, all of it after a ``moshpit train`` peer had left the swarm, written its
checkpoint and said so. A preempted VM has a deadline, and ``moshpit demo`` restarts its
peers: neither gains anything from it. What Python's exit does before that teardown still
happens, in its order: non-daemon threads are joined (an executor's queued work included),
then the atexit handlers run; logs and standard streams are flushed; only the freeing of
memory that the kernel reclaims anyway is skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import NoReturn


def exit_without_teardown(status: int) -> NoReturn:
    """End the process with ``status`` (call from the main thread; see the module docstring).
    Where the interpreter lacks CPython's hooks for the first steps of its exit, a plain
    ``sys.exit``."""
    join_threads = getattr(threading, "_shutdown", None)
    run_atexit = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_atexit is None:
        sys.exit(status)
    try:
        join_threads()  # what CPython's exit does first: wait for every non-daemon thread
        run_atexit()  # then its atexit handlers (the DHT facade shuts its nodes down)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing left to say
                stream.flush()
        os._exit(status)
