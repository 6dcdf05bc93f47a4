"""The root of the averaging layer's errors.

A script that averages catches :class:`AveragingError` (exported as ``moshpit.AveragingError``)
to handle anything the averaging layer raises on purpose, and lets bugs through. Each error
keeps its more specific base too (``ValueError`` for a malformed group, ``RuntimeError`` for a
lock misuse), so code written against those still works.
"""

from __future__ import annotations

__all__ = ["AveragingError"]


class AveragingError(Exception):
    """Something the averaging layer refuses or cannot do (see the subclasses)."""
