"""One file, one live holder: an exclusive ``flock`` that dies with its process.

Two peers must not share a key file (one PeerID answering from two places) or a checkpoint
directory (each overwriting the other's state). Both are guarded the same way: an exclusive
advisory lock (``flock``) on a file, held while the process uses it. The kernel drops the lock
when its holder exits however it dies, so a SIGKILLed peer never blocks its own restart. The
holder writes its pid beside the file (best effort) so that a refused process can name it; a
stale pid file from a dead holder is ignored and overwritten. Forked children close their copy
of the descriptor, so they never keep the lock alive after their parent is gone. Without
``fcntl`` (Windows) the lock is a no-op.

Subclasses say what the file is: :meth:`ExclusiveFileLock.in_use_error` and
:meth:`ExclusiveFileLock.open_error` build the exceptions a user reads.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import weakref
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

__all__ = ["ExclusiveFileLock"]

_held_locks: weakref.WeakSet[ExclusiveFileLock] = weakref.WeakSet()


class ExclusiveFileLock:
    """Lock ``path`` (created when ``create`` is set) for this process; see the module docs."""

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False) -> None:
        self.path = Path(path)
        self.pid_path = self.path.with_name(self.path.name + ".pid")
        self.create = create
        self._fd: int | None = None
        self._owner_pid: int | None = None
        self._wrote_pid = False

    # ------------------------------------------------------------------ what subclasses say

    def in_use_error(self, pid: int | None) -> Exception:
        """The error for a file another holder has (``pid``: the holder's, if known; it is
        this process's own pid when another object of this process holds it)."""
        holder = f" (pid {pid})" if pid is not None else ""
        return RuntimeError(f"{self.path} is in use by another process{holder}")

    def open_error(self, error: OSError) -> Exception:
        return OSError(f"cannot open {self.path}: {error.strerror or error}")

    # ------------------------------------------------------------------ the lock

    def acquire(self) -> None:
        """Lock the file; :meth:`in_use_error` if another open description already holds it."""
        if self._fd is not None:
            raise RuntimeError(f"the lock on {self.path} is already held")
        if fcntl is None:
            logger.debug("no fcntl on this platform: %s is not locked", self.path)
            return
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self.in_use_error(self._holder_pid()) from None
        except OSError as e:  # e.g. ENOLCK on a network filesystem without locking
            os.close(fd)
            logger.warning(
                "cannot lock %s (%s): make sure no other running peer uses it",
                self.path,
                e.strerror or e,
            )
            return
        self._fd, self._owner_pid = fd, os.getpid()
        _held_locks.add(self)
        self._write_pid()

    def release(self) -> None:
        """Unlock (idempotent); removes the pid file this process wrote."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held_locks.discard(self)
        if self._owner_pid != os.getpid():  # a child forked without the fork hook: hands off
            return
        if self._wrote_pid:  # before unlocking: the next holder's pid file must survive
            with contextlib.suppress(OSError):
                self.pid_path.unlink()
            self._wrote_pid = False
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # even if some child still shares the descriptor
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> ExclusiveFileLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _open(self) -> int:
        flags = os.O_RDWR | (os.O_CREAT if self.create else 0)
        try:  # read-write: flock emulated over NFS needs it for an exclusive lock
            return os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise self.open_error(e) from None
        try:  # a read-only file (mode 0400, a read-only mount): flock works on this too
            return os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise self.open_error(e) from None

    def _write_pid(self) -> None:
        try:
            self.pid_path.write_text(f"{os.getpid()}\n")
        except OSError as e:  # a read-only directory: the lock still works, unnamed
            logger.debug("cannot write %s (%s): skipping the pid file", self.pid_path, e)
            return
        self._wrote_pid = True

    def _holder_pid(self) -> int | None:
        """The pid in the pid file, if that process is alive (else the file is stale)."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        if pid <= 0:
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        return pid


def _forget_locks_in_child() -> None:
    """After fork: close the child's copies, so only the parent's death releases the lock."""
    for lock in list(_held_locks):
        fd, lock._fd = lock._fd, None
        lock._wrote_pid = False
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # not LOCK_UN: that would unlock the parent's lock too
    _held_locks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks_in_child)
