"""The training modes of ``moshpit.Optimizer``; each module holds one (see docs/training.md),
and ``options.py`` their knobs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moshpit.training.modes.base import TrainingMode
from moshpit.training.modes.options import (
    DiLoCoOptions,
    LocalOptions,
    ModeOptions,
    SyncOptions,
    options_for,
)

if TYPE_CHECKING:
    from moshpit.training.optimizer import Optimizer

__all__ = [
    "DiLoCoOptions",
    "LocalOptions",
    "ModeOptions",
    "SyncOptions",
    "TrainingMode",
    "make_mode",
    "options_for",
]


def make_mode(options: ModeOptions, optimizer: Optimizer) -> TrainingMode:
    """The mode that ``options`` configure (``options_for`` builds and checks them)."""
    mode_class = importlib.import_module(f"moshpit.training.modes.{options.mode}").MODE
    mode: TrainingMode = mode_class(optimizer, options)
    return mode
