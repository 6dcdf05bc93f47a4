"""Exceptions of the training layer: each names what went wrong and what the user can do."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointDirInUseError",
    "CheckpointError",
    "CheckpointFormatError",
    "ManifestError",
    "NoCheckpointError",
    "NoDonorError",
    "StateDownloadError",
    "StateError",
    "StateMismatchError",
]


class StateError(Exception):
    """Base class of every training-state error."""


class StateMismatchError(StateError, ValueError):
    """A state (from a checkpoint or a donor) does not fit the local model/optimizer.

    The message names the first mismatch (tensor name, shape or dtype), so the user can tell a
    wrong ``--prefix`` or model config from a version skew.
    """


class ManifestError(StateError, ValueError):
    """A manifest's bytes are malformed, oversized or fail validation (untrusted input)."""


class CheckpointError(StateError):
    """A checkpoint directory cannot be read or written."""


class CheckpointDirInUseError(CheckpointError):
    """Another running peer uses this checkpoint directory: two peers writing one directory
    overwrite each other's state. ``path`` is the directory, ``pid`` the holder's process id
    (None if unknown)."""

    def __init__(self, message: str, *, path: object = None, pid: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The checkpoint directory holds no committed checkpoint yet."""


class CheckpointFormatError(CheckpointError):
    """The checkpoint was written in a format version this moshpit does not know."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated or its bytes do not match their hash."""


class NoDonorError(StateError, TimeoutError):
    """Nobody served a state under this prefix within the time limit."""


class StateDownloadError(StateError):
    """Donors were found but the state could not be fetched completely (all failed)."""
