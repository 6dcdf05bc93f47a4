"""How the checkpoint store gets bytes onto the disk durably, and the process-wide state that
needs.

Kept apart from ``store.py`` (what a commit is) and ``store_format.py`` (what the files look
like) because this is the part that depends on the operating system and on the process: atomic
writes (write a ``.tmp-<pid>-<random>`` file, fsync it, rename it over the final name), fsync of
directories, Linux's ``syncfs`` (one flush for everything written), telling a dead writer's tmp
file from one still being written, the thread pool the store hashes and writes in, and the
per-directory state that every :class:`~moshpit.training.store.StateStore` of this process
shares. After a ``fork`` the child starts all of that afresh (the parent's threads, and any lock
one of them held, are not in the child).
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import secrets
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from moshpit.critical import CriticalLock
from moshpit.training.store_format import TMP_PREFIX, PackEntry, tmp_writer_pid

__all__ = [
    "BATCH_BYTES",
    "BATCH_FILES",
    "Buffer",
    "Shared",
    "batches",
    "executor",
    "fsync_dir",
    "generation",
    "remove_if_stale_tmp",
    "results",
    "shared_for",
    "stale_tmp",
    "syncfs",
    "syncfs_available",
    "write_atomic",
]

T = TypeVar("T")

Buffer = bytes | bytearray | memoryview

# Work is cut into batches of about this many bytes (and at most this many files), so that many
# small tensors do not cost one thread hand-off each while big states still spread over threads.
BATCH_BYTES = 4 << 20
BATCH_FILES = 64
IOV_MAX = 1024

_pool_lock = CriticalLock()
_pool: ThreadPoolExecutor | None = None
_POOL_THREADS = min(8, max(4, os.cpu_count() or 1))  # fsync waits, so more threads than cores


def executor() -> ThreadPoolExecutor:
    """One process-wide pool: hashlib, file reads/writes and fsync all release the GIL."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="moshpit-store")
        return _pool


@dataclass
class Shared:
    """What every StateStore of one directory in this process shares."""

    commit_lock: threading.RLock = field(default_factory=threading.RLock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: set[bytes] = field(default_factory=set)  # put_chunk()ed, not yet committed
    dirty_dirs: set[str] = field(default_factory=set)  # renamed into, dir not yet fsynced
    # False until this process's first commit has flushed the whole directory: files another
    # (killed) process left may not be durable yet, and a save reuses them instead of writing
    flushed_once: bool = False
    # the pack index: file names seen in packs/ (valid or not), entries of the valid ones,
    # digest -> (pack, offset, size), and packed copies that failed verification
    pack_names: frozenset[str] = frozenset()
    packs: dict[str, tuple[PackEntry, ...]] = field(default_factory=dict)
    where: dict[bytes, tuple[str, int, int]] = field(default_factory=dict)
    bad: set[tuple[str, bytes]] = field(default_factory=set)

    def rebuild_where(self) -> None:
        """Call with ``lock`` held."""
        self.bad = {(p, d) for p, d in self.bad if p in self.packs}
        self.where = {}
        for name, entries in self.packs.items():
            for digest, offset, size in entries:
                if (name, digest) not in self.bad:
                    self.where.setdefault(digest, (name, offset, size))


_shared_lock = CriticalLock()
_shared: dict[str, Shared] = {}
_in_flight: set[str] = set()  # names of this process's tmp files being written (random, unique)
_in_flight_lock = CriticalLock()


def shared_for(key: str) -> Shared:
    """The shared state of the directory whose real path is ``key``."""
    with _shared_lock:
        return _shared.setdefault(key, Shared())


_generation = 0  # bumped in a forked child: store objects then look their Shared up again


def generation() -> int:
    """Changes in a forked child: a :class:`Shared` looked up before belongs to the parent."""
    return _generation


def _reset_after_fork() -> None:
    """A forked child has none of the parent's threads: a lock one of them held would stay
    locked and the pool's workers are gone, so the child starts with fresh ones."""
    global _pool, _pool_lock, _shared_lock, _shared, _in_flight, _in_flight_lock, _generation
    _generation += 1
    _pool, _pool_lock = None, CriticalLock()
    _shared_lock, _shared = CriticalLock(), {}
    _in_flight, _in_flight_lock = set(), CriticalLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    """Write every part, in order, with as few syscalls as writev allows."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + IOV_MAX])
        while written and i < len(views):
            if written >= len(views[i]):
                written -= len(views[i])
                i += 1
            else:
                views[i] = views[i][written:]
                written = 0


def _syncfs_function() -> Callable[[int], int] | None:
    """libc's syncfs (Linux): one call makes every file written so far durable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function: Callable[[int], int] = libc.syncfs
        return function
    except (OSError, AttributeError):
        return None


_SYNCFS = _syncfs_function()


def syncfs_available() -> bool:
    """Whether :func:`syncfs` works here (Linux); elsewhere every file is fsynced instead."""
    return _SYNCFS is not None


def syncfs(path: pathlib.Path) -> None:
    """Flush the whole file system ``path`` is on (call only if :func:`syncfs_available`)."""
    assert _SYNCFS is not None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")
    finally:
        os.close(fd)


def write_atomic(final: str | os.PathLike[str], parts: Sequence[Buffer], sync: bool) -> None:
    """Write ``parts`` (one after the other) to a tmp file next to ``final``, fsync it if
    ``sync``, rename it over ``final``.

    The caller fsyncs the directory (once for many files) before relying on the rename.
    """
    name = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    tmp = os.path.join(os.path.dirname(final), name)
    with _in_flight_lock:
        _in_flight.add(name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, parts)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        with _in_flight_lock:
            _in_flight.discard(name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_tmp(path: str) -> bool:
    """A tmp file is stale when its writer is gone: another, dead process, or an earlier
    process that had our pid (containers restart as pid 1) and is not in our in-flight set."""
    name = os.path.basename(path)
    pid = tmp_writer_pid(name)
    if pid is None:
        return True
    if pid == os.getpid():
        with _in_flight_lock:
            return name not in _in_flight
    return not _pid_alive(pid)


def remove_if_stale_tmp(path: str) -> int:
    """Delete a tmp file whose writer is gone; returns the number of files removed (0 or 1)."""
    if not stale_tmp(path):
        return 0
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


def batches(sizes: Sequence[int]) -> list[range]:
    """Split items with these byte sizes into contiguous index ranges for the pool."""
    out: list[range] = []
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= BATCH_BYTES or i + 1 - start >= BATCH_FILES:
            out.append(range(start, i + 1))
            start, acc = i + 1, 0
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


def results(futures: Iterable[Future[T]]) -> Iterator[T]:
    """Results in order; on an error, wait for the rest before raising (no stray writers)."""
    futures = list(futures)
    error: BaseException | None = None
    for future in futures:
        try:
            result = future.result()
        except BaseException as e:
            if error is None:
                error = e
            continue
        if error is None:
            yield result
    if error is not None:
        raise error
