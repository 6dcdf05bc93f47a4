"""How a ``moshpit`` command process starts: its heavy imports with the cyclic collector paused.

``moshpit train`` imports torch, and torch's optimizers import ``torch._dynamo`` on their
first step. While those modules load, CPython's cyclic garbage collector makes hundreds of
passes over a heap that only grows (nothing an import creates is garbage yet): 678 of them
on a 2-core VM. The console script therefore imports the command's module, and the modules
it names in ``STARTUP_IMPORTS``, with the collector paused, and then freezes what is there
(``gc.freeze``): the collector's later full passes in the training loop skip those objects
instead of walking all of them again each time. A ``moshpit train`` peer's CPU up to its
fifth step went from 4.96 s to 4.39 s.

Only the console script does this, in a process of its own (``moshpit.cli.console``):
``moshpit.cli.main`` called from someone else's process leaves their collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterable, Iterator
from types import ModuleType


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside; afterwards everything alive is frozen (never scanned
    again) and the collector runs as before (or stays off if it was off)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def import_command(module_name: str, argv: list[str]) -> ModuleType:
    """Import a command's module and what it names in ``STARTUP_IMPORTS``, with the
    collector paused.

    In between, the module's ``prepare_process(argv)`` (if it has one) sets what libraries
    read once when they load, such as OpenMP's environment variables, which torch loads.
    """
    with collector_paused():
        module = importlib.import_module(module_name)
        prepare = getattr(module, "prepare_process", None)
        if prepare is not None:
            prepare(argv)
        _import_each(getattr(module, "STARTUP_IMPORTS", ()))
    return module


def import_paused(names: Iterable[str]) -> None:
    """Import ``names`` with the collector paused (a process that is not the console's)."""
    with collector_paused():
        _import_each(names)


def _import_each(names: Iterable[str]) -> None:
    """A startup import that fails is left for the command to report when it imports the
    module itself, with its own message."""
    for name in names:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
