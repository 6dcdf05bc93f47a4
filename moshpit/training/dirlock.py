"""One running peer per checkpoint directory (torch-free: the CLI checks it before joining)."""

from __future__ import annotations

import os
import pathlib

from dht.filelock import ExclusiveFileLock
from moshpit.training.errors import CheckpointDirInUseError, CheckpointError

__all__ = ["CheckpointDirLock"]


class CheckpointDirLock(ExclusiveFileLock):
    """One running peer per checkpoint directory: a lock on ``<dir>/LOCK`` (see
    :mod:`dht.filelock`; the kernel drops it when the holder dies, so a killed peer's restart
    is never blocked)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = pathlib.Path(directory)
        super().__init__(self.directory / "LOCK", create=True)

    def acquire(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {e.strerror or e}"
            ) from e
        super().acquire()

    def open_error(self, error: OSError) -> Exception:
        return CheckpointError(
            f"cannot lock checkpoint directory {self.directory}: {error.strerror or error}"
        )

    def in_use_error(self, pid: int | None) -> Exception:
        if pid == os.getpid():
            who = f"a peer in this process (pid {pid}): shut it down first, or"
        else:
            who = f"another running process{f' (pid {pid})' if pid else ''}: stop it, or"
        return CheckpointDirInUseError(
            f"checkpoint directory {self.directory} is in use by {who} give this peer a "
            "directory of its own (--checkpoint-dir / checkpoint_dir): two peers in one "
            "directory overwrite each other's state",
            path=self.directory,
            pid=pid,
        )
