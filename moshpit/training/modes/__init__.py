"""The training modes of ``moshpit.Optimizer``; each module holds one (see docs/training.md)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from moshpit.training.modes.base import TrainingMode

__all__ = ["TrainingMode", "make_mode"]


def make_mode(name: str, optimizer: Any, **options: Any) -> TrainingMode:
    """Build mode ``name``; an option it does not know is a TypeError listing the ones it does."""
    mode_class = importlib.import_module(f"moshpit.training.modes.{name}").MODE
    known = [
        p.name
        for p in inspect.signature(mode_class.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"unknown option(s) for mode={name!r}: {', '.join(unknown)}; "
            f"it takes: {', '.join(known) or 'none'}"
        )
    return mode_class(optimizer, **options)
