"""Falling back to an older checkpoint when the newest is damaged, refused or unreadable.

Kept apart from the commit protocol (``store.py``) because it is a policy over what the
directory holds, not a way of writing it: walk the states ``LATEST`` names, newest first, then
any other manifest in manifests/ that verifies (a damaged or lost ``LATEST`` must not lose the
states it named), and say what was passed over and why. ``StateStore`` uses
:func:`intact_manifests` too, so that a commit after a damaged ``LATEST`` keeps those states.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    NoCheckpointError,
)
from moshpit.training.manifest import DIGEST_BYTES, Manifest
from moshpit.training.store_format import CheckpointLayout, read_manifest

if TYPE_CHECKING:
    from moshpit.training.store import StateStore

__all__ = ["RestoredState", "intact_manifests", "load_newest_intact"]


def intact_manifests(
    layout: CheckpointLayout, exclude: Iterable[bytes] = (), problems: list[str] | None = None
) -> list[bytes]:
    """Roots of the manifests in manifests/ that verify, newest epoch first (then newest
    file): what LATEST would name, for a directory whose LATEST is gone or damaged. Why
    the others do not verify is added to ``problems``."""
    skip = set(exclude)
    found: list[tuple[int, int, bytes]] = []
    try:
        entries = list(os.scandir(layout.manifests))
    except OSError:
        return []
    for entry in entries:
        try:
            root = bytes.fromhex(entry.name)
        except ValueError:
            continue  # tmp files, not ours
        if len(root) != DIGEST_BYTES or root in skip:
            continue
        try:
            manifest = read_manifest(layout, root)
            mtime = entry.stat().st_mtime_ns
        except (CheckpointError, OSError) as e:
            if problems is not None:
                problems.append(str(e))
            continue
        found.append((manifest.epoch, mtime, root))
    found.sort(reverse=True)
    return [root for _, _, root in found]


@dataclass
class RestoredState:
    """What :func:`load_newest_intact` loaded, and what it had to pass over to get there."""

    manifest: Manifest
    tensors: list[torch.Tensor]
    passed_over: list[str]  # one line per damaged or refused state that is newer
    # what else was damaged, though no newer state was lost to it: a damaged LATEST (the
    # newest manifest was found by scanning manifests/), or a manifest that does not parse
    notes: list[str] = field(default_factory=list)


def load_newest_intact(
    store: StateStore,
    accept: Callable[[Manifest, list[torch.Tensor]], str | None] | None = None,
) -> RestoredState:
    """The newest state of ``store`` that verifies (and that ``accept`` does not refuse: it
    returns a reason to pass a state over, or None).

    Tries the roots LATEST names, newest first, then any other intact manifest in
    manifests/ (a damaged or missing LATEST still leaves them). Damaged files met on the way
    are moved to ``damaged/``. Raises :class:`NoCheckpointError` when the directory holds no
    state at all, :class:`CheckpointFormatError` when every state is of a newer format, and
    :class:`CheckpointCorruptError` listing every problem when none could be used.
    """
    notes: list[str] = []
    problems: list[str] = []  # the roots tried and passed over, newest first
    try:
        roots = store.committed_roots()
    except NoCheckpointError:
        roots = []
    except CheckpointCorruptError as e:
        roots = []
        notes.append(str(e))
    roots = roots + intact_manifests(store.layout, exclude=roots, problems=notes)
    if not roots and not notes:
        raise NoCheckpointError(f"no checkpoint in {store.directory} yet")
    format_errors: list[CheckpointFormatError] = []
    for root in roots:
        try:
            manifest = store.load_manifest(root)
            tensors = store.load_tensors(manifest)
        except CheckpointFormatError as e:
            format_errors.append(e)
            problems.append(str(e))
            continue
        except NoCheckpointError:
            problems.append(f"state {root.hex()[:16]} named by LATEST has no manifest")
            continue
        except CheckpointCorruptError as e:
            problems.append(str(e))
            continue
        refused = accept(manifest, tensors) if accept is not None else None
        if refused is not None:
            problems.append(f"the checkpoint of epoch {manifest.epoch}: {refused}")
            continue
        return RestoredState(manifest, tensors, problems, notes)
    if format_errors and len(format_errors) == len(roots):
        raise format_errors[0]
    problems = notes + problems
    raise CheckpointCorruptError(
        f"no usable checkpoint in {store.directory}: " + "; ".join(problems)
        if problems
        else f"no usable checkpoint in {store.directory}"
    )
