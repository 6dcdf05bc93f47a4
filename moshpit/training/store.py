"""Checkpoints: a directory of content-addressed chunks plus manifests, committed atomically.

The directory's layout and file formats are ``store_format``'s (chunks named by their
SHA-256, small ones in packs, manifests named by their root, a checksummed ``LATEST``); this
module writes them durably and reads them back verified.

A commit is a chain of write-new, fsync, rename steps: chunks, then the manifest, then
``LATEST``; a crash (or ``kill -9``) at any point leaves ``LATEST`` naming either the previous
or the new manifest, and everything that manifest names is already on disk. Old chunks are
garbage-collected only after the new ``LATEST`` is durable. Packs are invisible through the
API (:meth:`StateStore.read_chunk` etc. work by digest). On Linux a save flushes everything
with one ``syncfs`` instead of an fsync per file.

Everything read back is verified against its hash, so a damaged disk gives
:class:`CheckpointCorruptError` naming the tensor, never a silently wrong model.

One writer process per directory (several threads and several :class:`StateStore` objects of
one process may share it). Readers in other processes are fine.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from moshpit.critical import CriticalLock
from moshpit.training.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    ManifestError,
    NoCheckpointError,
)
from moshpit.training.manifest import (
    DEFAULT_CHUNK_BYTES,
    DIGEST_BYTES,
    DTYPES,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkRef,
    Manifest,
    TensorSpec,
    build_manifest,
    dtype_name,
    tensor_bytes,
)
from moshpit.training.store_format import (
    DAMAGED_DIR,
    PACK_COUNT,
    PACK_ENTRY,
    PACK_MAGIC,
    PACK_MIN_CHUNKS,
    STORE_FORMAT_VERSION,
    TMP_PREFIX,
    CheckpointLayout,
    DamagedPack,
    PackEntry,
    check_digest,
    check_state_layout,
    chunk_sizes,
    format_latest,
    manifest_file_intact,
    pack_entries,
    pack_groups,
    pack_header,
    packable,
    read_latest,
    read_manifest,
    read_pack_header,
    tmp_writer_pid,
)

__all__ = [
    "PACK_COUNT",  # the pack format, for tests that take packs apart
    "PACK_ENTRY",
    "PACK_MAGIC",
    "STORE_FORMAT_VERSION",
    "RestoredState",
    "StateStore",
    "load_newest_intact",
    "load_state",
    "save_state",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Work is cut into batches of about this many bytes (and at most this many files), so that many
# small tensors do not cost one thread hand-off each while big states still spread over threads.
BATCH_BYTES = 4 << 20
BATCH_FILES = 64
IOV_MAX = 1024

_pool_lock = CriticalLock()
_pool: ThreadPoolExecutor | None = None
_POOL_THREADS = min(8, max(4, os.cpu_count() or 1))  # fsync waits, so more threads than cores


def _executor() -> ThreadPoolExecutor:
    """One process-wide pool: hashlib, file reads/writes and fsync all release the GIL."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_POOL_THREADS, thread_name_prefix="moshpit-store")
        return _pool


@dataclass
class _Shared:
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
_shared: dict[str, _Shared] = {}
_in_flight: set[str] = set()  # names of this process's tmp files being written (random, unique)
_in_flight_lock = CriticalLock()


def _shared_for(key: str) -> _Shared:
    with _shared_lock:
        return _shared.setdefault(key, _Shared())


_generation = 0  # bumped in a forked child: store objects then look their _Shared up again


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


def _fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Buffer = bytes | bytearray | memoryview


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
        return libc.syncfs
    except (OSError, AttributeError):
        return None


_SYNCFS = _syncfs_function()


def _syncfs(path: pathlib.Path) -> None:
    assert _SYNCFS is not None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")
    finally:
        os.close(fd)


def _write_atomic(final: str | os.PathLike, data: Buffer | Sequence[Buffer], sync: bool) -> None:
    """Write ``data`` (one buffer or a list of parts) to a tmp file next to ``final``, fsync it
    if ``sync``, rename it over ``final``.

    The caller fsyncs the directory (once for many files) before relying on the rename.
    """
    name = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    tmp = os.path.join(os.path.dirname(final), name)
    with _in_flight_lock:
        _in_flight.add(name)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data if isinstance(data, (list, tuple)) else [data])
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


def _stale_tmp(path: str) -> bool:
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


def _batches(sizes: Sequence[int]) -> list[range]:
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


def _results(futures: Iterable[Future[T]]) -> Iterator[T]:
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


class StateStore:
    """A checkpoint directory: chunks/<2 hex>/<64 hex> files named by SHA-256 (small ones in
    packs/), manifests/<root hex>, and a LATEST pointer file naming the committed root. Doubles
    as a donor's serving store.

    ``keep`` committed states are kept; chunks referenced by none of them are deleted on the
    next commit, except chunks :meth:`put_chunk` stored since (a download in progress).
    ``durable=False`` skips every fsync: still safe against a killed process (the page cache
    survives it), not against a power cut; meant for tests and scratch runs.
    """

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 2, durable: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1 (the committed state itself)")
        self.directory = pathlib.Path(directory)
        self.keep = keep
        self.durable = durable
        self.layout = CheckpointLayout(self.directory)
        self._chunks = self.layout.chunks
        self._packs = self.layout.packs
        self._manifests = self.layout.manifests
        self._latest = self.layout.latest
        try:
            self._create_dirs()
        except OSError as e:
            raise CheckpointError(
                f"cannot create checkpoint directory {self.directory}: {e}"
            ) from e
        self._key = os.path.realpath(self.directory)
        self._shared_cache = (_generation, _shared_for(self._key))

    @property
    def _shared(self) -> _Shared:
        generation, shared = self._shared_cache
        if generation != _generation:  # forked since: the parent's locks are not ours
            shared = _shared_for(self._key)
            self._shared_cache = (_generation, shared)
        return shared

    def _create_dirs(self) -> None:
        if (self._chunks / "ff").is_dir() and self._manifests.is_dir() and self._packs.is_dir():
            return
        for path in (self.directory, self._chunks, self._manifests, self._packs):
            path.mkdir(parents=True, exist_ok=True)
        for i in range(256):
            (self._chunks / f"{i:02x}").mkdir(exist_ok=True)
        if self.durable:
            for path in (self._chunks, self.directory, self.directory.parent):
                _fsync_dir(path)

    def __repr__(self) -> str:
        return f"StateStore({str(self.directory)!r}, keep={self.keep})"

    # ------------------------------------------------------------------ the pack index

    def _refresh_packs(self) -> None:
        """Bring the in-memory pack index up to date with packs/ (another process may write)."""
        try:
            names = frozenset(n for n in os.listdir(self._packs) if not n.startswith(TMP_PREFIX))
        except FileNotFoundError:
            names = frozenset()
        shared = self._shared
        with shared.lock:
            if names == shared.pack_names:
                return
            known = shared.pack_names
        added = {name: self._read_pack_header(name) for name in names - known}
        with shared.lock:
            for name in list(shared.packs):
                if name not in names:
                    del shared.packs[name]
            shared.packs.update({n: e for n, e in added.items() if e is not None})
            shared.pack_names = names
            shared.rebuild_where()

    def _read_pack_header(self, name: str) -> tuple[PackEntry, ...] | None:
        """A pack's entries, or None (logged) if its header is damaged: its chunks are then
        missing, which loading reports per tensor and a download repairs."""
        path = self._packs / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                header = read_pack_header(f, size)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("pack %s in %s is unusable: %s", name[:16], self.directory, e)
            return None
        try:
            return pack_entries(header, name, size)
        except DamagedPack as e:
            logger.warning("pack %s in %s %s: ignored", name[:16], self.directory, e)
            return None

    def _packed(self, digest: bytes) -> tuple[str, int, int] | None:
        with self._shared.lock:
            return self._shared.where.get(digest)

    def _present(self, digest: bytes, size: int | None = None) -> bool:
        """Stored loose or packed (the pack index as of the last refresh). With ``size``, a
        chunk file of another size (cut short by a crash) counts as absent, to be rewritten."""
        try:
            st = os.stat(self._chunk_path(digest))
        except FileNotFoundError:
            return self._packed(digest) is not None
        return size is None or st.st_size == size or self._packed(digest) is not None

    def _mark_bad(self, name: str, digest: bytes) -> None:
        with self._shared.lock:
            self._shared.bad.add((name, digest))
            self._shared.rebuild_where()

    # ------------------------------------------------------------------ chunks

    def _chunk_path(self, digest: bytes) -> str:
        return self.layout.chunk_path(digest)

    def has_chunk(self, digest: bytes) -> bool:
        check_digest(digest)
        if os.path.isfile(self._chunk_path(digest)):
            return True
        self._refresh_packs()
        return self._packed(digest) is not None

    def read_chunk(self, digest: bytes) -> bytes | None:
        """A chunk's bytes, or None if absent. A chunk whose bytes do not match its digest is
        moved aside, or forgotten if it is in a pack (and None returned): the network path must
        never serve corrupt bytes."""
        check_digest(digest)
        path = self._chunk_path(digest)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                data = f.read(MAX_CHUNK_BYTES + 1) if size <= MAX_CHUNK_BYTES else None
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            data = inode = None
        except OSError as e:
            raise CheckpointError(
                f"cannot read chunk {digest.hex()} in {self.directory}: {e}"
            ) from e
        if inode is not None:
            if data is not None and hashlib.sha256(data).digest() == digest:
                return data
            logger.warning(
                "chunk %s in %s does not match its digest (damaged disk?): moved to %s",
                digest.hex()[:16],
                self.directory,
                DAMAGED_DIR,
            )
            self._discard_corrupt(path, inode)
        self._refresh_packs()
        location = self._packed(digest)
        if location is None:
            return None
        buffer = bytearray(location[2])
        problem = self._read_packed(digest, location, memoryview(buffer), {})
        return bytes(buffer) if problem is None else None

    def _read_packed(
        self,
        digest: bytes,
        location: tuple[str, int, int],
        target: memoryview,
        fds: dict[str, int],
    ) -> str | None:
        """Read a packed chunk into ``target`` (its exact size) and verify it; returns what is
        wrong, or None. A bad copy is forgotten (logged). ``fds`` caches open packs."""
        name, offset, size = location
        try:
            fd = fds.get(name)
            if fd is None:
                fd = fds[name] = os.open(self._packs / name, os.O_RDONLY | os.O_CLOEXEC)
            got = 0
            while got < size:
                n = os.preadv(fd, [target[got:]], offset + got)
                if n == 0:
                    break
                got += n
        except FileNotFoundError:
            return "is missing (its pack was removed)"
        except OSError as e:
            return f"cannot be read ({e})"
        if got != size:
            problem = "is cut short in its pack"
        elif hashlib.sha256(target).digest() != digest:
            problem = "does not match its digest (damaged)"
        else:
            return None
        logger.warning(
            "chunk %s in pack %s of %s %s: not used",
            digest.hex()[:16],
            name[:16],
            self.directory,
            problem,
        )
        self._mark_bad(name, digest)
        return problem

    def _discard_corrupt(self, path: str, inode: int) -> None:
        """Move a corrupt chunk file aside unless a good copy was renamed over it meanwhile."""
        try:
            if os.stat(path).st_ino == inode:
                self._set_aside(path, f"chunk-{os.path.basename(path)}")
        except FileNotFoundError:
            pass

    @property
    def damaged_dir(self) -> pathlib.Path:
        """Where damaged files go (kept for inspection; delete them by hand when done)."""
        return self.layout.damaged

    def _set_aside(self, path: str | os.PathLike, label: str) -> None:
        """Move a damaged file out of the checkpoint's way into :attr:`damaged_dir` (a rename:
        nothing is copied, and a damaged file is never deleted without a trace)."""
        target = (
            self.damaged_dir / f"{label}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(3)}"
        )
        try:
            self.damaged_dir.mkdir(exist_ok=True)
            os.replace(path, target)
        except FileNotFoundError:
            return
        except OSError as e:  # a read-only or full disk: leave it where it is
            logger.warning("could not move damaged %s aside: %s", path, e)
            return
        logger.debug("moved damaged %s to %s", path, target)

    def put_chunk(self, digest: bytes, data: bytes | bytearray | memoryview) -> None:
        """Store one chunk (a downloader's path): verified, atomic, no-op if already present.

        The chunk is protected from garbage collection until a manifest referencing it is
        committed (or this process ends).
        """
        check_digest(digest)
        if hashlib.sha256(data).digest() != digest:
            raise ValueError(f"chunk bytes do not hash to {digest.hex()}")
        with self._shared.lock:  # before the existence check: see _collect_garbage
            self._shared.pending.add(digest)
        if self.has_chunk(digest):
            return
        self._write_loose(digest, data, self.durable)

    def _write_loose(self, digest: bytes, data: Buffer, sync: bool) -> None:
        path = self._chunk_path(digest)
        try:
            _write_atomic(path, data, sync)
        except OSError as e:
            raise CheckpointError(
                f"cannot write chunk {digest.hex()} into {self.directory}: {e}"
            ) from e
        if self.durable:
            with self._shared.lock:
                self._shared.dirty_dirs.add(os.path.dirname(path))

    def _write_packs(self, items: Sequence[tuple[bytes, Buffer]], sync: bool) -> None:
        """Write small chunks as pack files (store_format.pack_groups) and index them."""
        for indices in pack_groups([len(data) for _, data in items]):
            group = items[indices.start : indices.stop]
            header, name, entries = pack_header([(digest, len(data)) for digest, data in group])
            try:
                _write_atomic(self._packs / name, [header, *(d for _, d in group)], sync)
            except OSError as e:
                raise CheckpointError(f"cannot write a pack into {self.directory}: {e}") from e
            with self._shared.lock:
                self._shared.packs[name] = entries
                self._shared.pack_names = self._shared.pack_names | {name}
                for digest, off, size in entries:
                    self._shared.where.setdefault(digest, (name, off, size))
                if self.durable:
                    self._shared.dirty_dirs.add(str(self._packs))

    def missing_chunks(self, manifest: Manifest) -> dict[bytes, int]:
        """The chunks of ``manifest`` this store lacks, with their sizes."""
        self._refresh_packs()
        return {d: s for d, s in manifest.chunk_refs().items() if not self._present(d)}

    # ------------------------------------------------------------------ commits

    def _store_new(
        self,
        pieces: Sequence[Buffer],
        full_chunk: int,
        expected: Sequence[tuple[bytes, int]] | None = None,
    ) -> list[bytes]:
        """Hash ``pieces`` (in the pool) and store those this store lacks; returns digests.

        With ``expected`` ((digest, size) per piece), a piece that does not match raises
        ValueError. Full-size chunks are written loose by the workers right after hashing;
        short ones are packed if there are many. On Linux every file is made durable by one
        syncfs at the end, elsewhere by an fsync per file plus the directories at commit.
        """
        self._refresh_packs()
        batch_sync = self.durable and _SYNCFS is not None
        sync_each = self.durable and not batch_sync

        def work(batch: range) -> list[bytes]:
            out = []
            for i in batch:
                piece = pieces[i]
                digest = hashlib.sha256(piece).digest()
                if expected is not None and (digest, len(piece)) != expected[i]:
                    raise ValueError(
                        f"chunk {expected[i][0].hex()} given to save() does not match its "
                        "digest or size: was a tensor modified while it was being saved?"
                    )
                if not packable(len(piece), full_chunk) and not self._present(digest, len(piece)):
                    self._write_loose(digest, piece, sync_each)
                out.append(digest)
            return out

        digests: list[bytes] = []
        pool = _executor()
        sizes = [len(p) for p in pieces]
        for part in _results([pool.submit(work, b) for b in _batches(sizes)]):
            digests.extend(part)
        small: dict[bytes, Buffer] = {}
        for digest, piece in zip(digests, pieces, strict=True):
            if (
                packable(len(piece), full_chunk)
                and digest not in small
                and not self._present(digest, len(piece))
            ):
                small[digest] = piece
        if len(small) >= PACK_MIN_CHUNKS:
            self._write_packs(list(small.items()), sync_each)
        else:
            for digest, piece in small.items():
                self._write_loose(digest, piece, sync_each)
        if batch_sync:
            with self._shared.lock:  # syncfs covers every rename done before it
                written = bool(self._shared.dirty_dirs)
                self._shared.dirty_dirs.clear()
            if not written:  # nothing new (an unchanged state): no flush to wait for
                return digests
            try:
                _syncfs(self.directory)
            except OSError as e:
                raise CheckpointError(f"cannot flush {self.directory} to disk: {e}") from e
            self._shared.flushed_once = True  # the whole file system, older files included
        return digests

    def save(self, manifest: Manifest, chunks: Mapping[bytes, bytes | memoryview]) -> None:
        """Write the chunks this store lacks (each verified), then commit ``manifest``."""
        with self._shared.commit_lock:
            history = self._history_for_write()
            refs = manifest.chunk_refs()
            self._refresh_packs()
            todo = [d for d in refs if not self._present(d, refs[d])]
            for digest in todo:
                if digest not in chunks:
                    raise CheckpointError(
                        f"chunk {digest.hex()} of the manifest is neither in the store nor in "
                        "the chunks given to save()"
                    )
            self._store_new(
                [chunks[d] for d in todo], manifest.chunk_bytes, [(d, refs[d]) for d in todo]
            )
            self._commit_locked(manifest, history)

    def commit(self, manifest: Manifest) -> None:
        """Commit a manifest whose chunks are all present already (a finished download)."""
        with self._shared.commit_lock:
            history = self._history_for_write()
            missing = self.missing_chunks(manifest)
            if missing:
                first = next(iter(missing)).hex()
                raise CheckpointError(
                    f"cannot commit state {manifest.root.hex()[:16]}: {len(missing)} of its "
                    f"chunks are not in {self.directory} (first: {first})"
                )
            self._commit_locked(manifest, history)

    def _commit_locked(
        self, manifest: Manifest, history: list[bytes], *, checked: bool = False
    ) -> None:
        """Chunks durable -> manifest durable -> LATEST replaced -> garbage collection.

        ``history`` is :meth:`_history_for_write`, read before any chunk was written.
        ``checked``: the caller built the manifest from tensors it validated (save_state).
        """
        root = manifest.root
        shared = self._shared
        if not checked:  # what cannot be read back must not be committed
            try:
                Manifest.from_bytes(manifest.to_bytes())
            except ManifestError as e:
                raise CheckpointError(f"this state cannot be checkpointed: {e}") from None
        elif len(manifest.to_bytes()) > MAX_MANIFEST_BYTES:
            raise CheckpointError(
                f"this state cannot be checkpointed: its manifest would be "
                f"{len(manifest.to_bytes())} bytes, over the {MAX_MANIFEST_BYTES}-byte limit "
                "(use a larger chunk_bytes)"
            )
        try:
            if self.durable and not shared.flushed_once:
                self._flush_everything()
            if self.durable:
                with shared.lock:
                    dirty, shared.dirty_dirs = shared.dirty_dirs, set()
                for _ in _results([_executor().submit(_fsync_dir, d) for d in sorted(dirty)]):
                    pass
            _write_atomic(self._manifests / root.hex(), manifest.to_bytes(), self.durable)
            if self.durable:
                _fsync_dir(self._manifests)
            history = [root] + [r for r in history if r != root]
            history = history[: self.keep]
            _write_atomic(self._latest, format_latest(history), self.durable)
            if self.durable:
                _fsync_dir(self.directory)
        except OSError as e:
            raise CheckpointError(f"cannot commit a checkpoint into {self.directory}: {e}") from e
        refs = manifest.chunk_refs()
        with self._shared.lock:
            self._shared.pending.difference_update(refs)
        logger.debug("committed state %s (epoch %d)", root.hex()[:16], manifest.epoch)
        try:
            self._collect_garbage(history, {root: manifest})
        except (OSError, CheckpointError) as e:  # the commit stands; leftovers go next time
            logger.warning("garbage collection in %s failed: %s", self.directory, e)

    def _flush_everything(self) -> None:
        """Make every chunk and pack in the directory durable, once per process: a killed
        writer's files are complete (renamed only when written) but maybe not on disk yet, and
        this process's saves reuse them."""
        if _SYNCFS is not None:
            _syncfs(self.directory)
        else:  # files were fsynced before their rename; their directories may not have been
            dirs = [str(self._packs), *self.layout.chunk_dirs()]
            for _ in _results([_executor().submit(_fsync_dir, d) for d in dirs]):
                pass
        self._shared.flushed_once = True

    def _history_for_write(self) -> list[bytes]:
        """The committed roots; when LATEST is absent or damaged, the intact manifests found
        in manifests/ (newest epoch first), so that a commit after a damaged LATEST does not
        garbage-collect the older states that still verify. A damaged LATEST is moved aside.

        A LATEST of a newer store format is never overwritten: that moshpit's checkpoints
        would become unreadable to it.
        """
        try:
            return self._read_latest()
        except NoCheckpointError:
            return self._intact_manifests()[: self.keep]
        except CheckpointCorruptError as e:
            logger.warning("%s; the next commit replaces it (the damaged copy is kept)", e)
            self._set_aside(self._latest, "LATEST")
            return self._intact_manifests()[: self.keep]

    def _intact_manifests(
        self, exclude: Iterable[bytes] = (), problems: list[str] | None = None
    ) -> list[bytes]:
        """Roots of the manifests in manifests/ that verify, newest epoch first (then newest
        file): what LATEST would name, for a directory whose LATEST is gone or damaged. Why
        the others do not verify is added to ``problems``."""
        skip = set(exclude)
        found: list[tuple[int, int, bytes]] = []
        try:
            entries = list(os.scandir(self._manifests))
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
                manifest = self.load_manifest(root)
                mtime = entry.stat().st_mtime_ns
            except (CheckpointError, OSError) as e:
                if problems is not None:
                    problems.append(str(e))
                continue
            found.append((manifest.epoch, mtime, root))
        found.sort(reverse=True)
        return [root for _, _, root in found]

    def _collect_garbage(self, history: list[bytes], known: dict[bytes, Manifest]) -> None:
        """Delete manifests not in ``history``, chunks none of them reference (unless pending),
        packs with no such chunk, and tmp files whose writer is gone; repack packs that are
        mostly garbage."""
        live: set[bytes] = set()
        for root in history:
            manifest = known.get(root)
            if manifest is None:
                try:
                    manifest = self.load_manifest(root)
                except CheckpointError as e:
                    logger.warning("older checkpoint %s unreadable, not kept: %s", root.hex(), e)
                    continue
            live.update(manifest.chunk_refs())
        keep_names = {r.hex() for r in history}
        removed_chunks = removed_other = 0
        for entry in os.scandir(self._manifests):
            if entry.name.startswith(TMP_PREFIX):
                removed_other += self._remove_if_stale_tmp(entry.path)
            elif entry.name not in keep_names:
                if manifest_file_intact(entry.path, entry.name):
                    os.unlink(entry.path)
                else:
                    self._set_aside(entry.path, f"manifest-{entry.name}")
                removed_other += 1
        for entry in os.scandir(self.directory):
            if entry.name.startswith(TMP_PREFIX):
                removed_other += self._remove_if_stale_tmp(entry.path)
        for sub in os.scandir(self._chunks):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                name = entry.name
                if name.startswith(TMP_PREFIX):
                    removed_other += self._remove_if_stale_tmp(entry.path)
                    continue
                try:
                    digest = bytes.fromhex(name)
                except ValueError:
                    continue  # not ours; leave it
                if digest in live:
                    continue
                with self._shared.lock:  # put_chunk adds to pending under this lock first
                    if digest in self._shared.pending:
                        continue
                    try:
                        os.unlink(entry.path)
                        removed_chunks += 1
                    except FileNotFoundError:
                        pass
        removed_other += self._collect_packs(live)
        if removed_chunks or removed_other:
            logger.debug(
                "collected %d chunks and %d other files in %s",
                removed_chunks,
                removed_other,
                self.directory,
            )

    def _collect_packs(self, live: set[bytes]) -> int:
        """Delete packs without a live chunk; copy the live chunks of packs that are less than
        half live into a new pack (durable first), then delete those. Returns files removed."""
        removed = 0
        for entry in os.scandir(self._packs):
            if entry.name.startswith(TMP_PREFIX):
                removed += self._remove_if_stale_tmp(entry.path)
        self._refresh_packs()
        with self._shared.lock:
            packs = dict(self._shared.packs)
            wanted = live | self._shared.pending
        dead, sparse = [], []
        for name, entries in packs.items():
            live_bytes = sum(size for digest, _, size in entries if digest in wanted)
            if not any(digest in wanted for digest, _, _ in entries):
                dead.append(name)
            elif 2 * live_bytes < sum(size for _, _, size in entries):
                sparse.append(name)
        if sparse:
            kept = {d for name, e in packs.items() if name not in sparse for d, _, _ in e}
            moved: dict[bytes, Buffer] = {}
            fds: dict[str, int] = {}
            try:
                for name in sparse:
                    for digest, offset, size in packs[name]:
                        if digest not in wanted or digest in kept or digest in moved:
                            continue
                        if os.path.isfile(self._chunk_path(digest)):
                            continue
                        buffer = memoryview(bytearray(size))
                        if self._read_packed(digest, (name, offset, size), buffer, fds) is None:
                            moved[digest] = buffer
            finally:
                for fd in fds.values():
                    os.close(fd)
            if moved:
                self._write_packs(list(moved.items()), self.durable)
                if self.durable:
                    _fsync_dir(self._packs)
            dead += sparse
        with self._shared.lock:
            damaged = {name for name, _ in self._shared.bad}
        for name in dead:
            if name in damaged:  # holds a chunk that failed verification: keep it aside
                self._set_aside(self._packs / name, f"pack-{name}")
                removed += 1
                continue
            try:
                os.unlink(self._packs / name)
                removed += 1
            except FileNotFoundError:
                pass
        if dead:
            self._refresh_packs()
        return removed

    @staticmethod
    def _remove_if_stale_tmp(path: str) -> int:
        if not _stale_tmp(path):
            return 0
        try:
            os.unlink(path)
        except FileNotFoundError:
            return 0
        return 1

    # ------------------------------------------------------------------ reading

    def _read_latest(self) -> list[bytes]:
        return read_latest(self.layout)

    def committed_roots(self) -> list[bytes]:
        """The roots of the committed states, newest first (at most ``keep``)."""
        return self._read_latest()

    def latest(self) -> Manifest:
        """The newest committed manifest."""
        roots = self._read_latest()
        try:
            return self.load_manifest(roots[0])
        except NoCheckpointError:
            raise CheckpointCorruptError(
                f"{self._latest} names state {roots[0].hex()} but its manifest is missing"
            ) from None

    def load_manifest(self, root: bytes) -> Manifest:
        """A committed manifest by its root, verified against it."""
        return read_manifest(self.layout, root)

    def load_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        """Every tensor of ``manifest``, in order, each chunk verified against its digest.

        Chunks are read straight into one preallocated buffer per tensor. A missing or corrupt
        chunk raises :class:`CheckpointCorruptError` naming the tensor (a corrupt chunk is
        moved aside or forgotten, so that :meth:`missing_chunks` reports it and a download can
        replace it).
        """
        self._refresh_packs()
        buffers = [torch.empty(spec.nbytes, dtype=torch.uint8) for spec in manifest.tensors]
        jobs: list[tuple[int, int, ChunkRef]] = []  # (tensor index, offset, chunk)
        for index, spec in enumerate(manifest.tensors):
            offset = 0
            for ref in spec.chunks:
                jobs.append((index, offset, ref))
                offset += ref.size
        views = [memoryview(b.numpy()).cast("B") if b.numel() else None for b in buffers]

        def read(batch: range) -> None:
            fds: dict[str, int] = {}
            try:
                for j in batch:
                    index, offset, ref = jobs[j]
                    view = views[index]
                    target = (
                        view[offset : offset + ref.size] if view is not None else memoryview(b"")
                    )
                    problem = self._read_verified(ref, target, fds)
                    if problem is not None:
                        spec = manifest.tensors[index]
                        raise CheckpointCorruptError(
                            f"tensor {spec.name!r} of the checkpoint in {self.directory} "
                            f"(epoch {manifest.epoch}) cannot be restored: chunk "
                            f"{ref.digest.hex()} {problem}; load an older checkpoint or "
                            "download the state from peers"
                        )
            finally:
                for fd in fds.values():
                    os.close(fd)

        pool = _executor()
        sizes = [ref.size for _, _, ref in jobs]
        for _ in _results([pool.submit(read, b) for b in _batches(sizes)]):
            pass
        return [
            flat.view(DTYPES[spec.dtype]).reshape(spec.shape)
            for flat, spec in zip(buffers, manifest.tensors, strict=True)
        ]

    def _read_verified(self, ref: ChunkRef, target: memoryview, fds: dict[str, int]) -> str | None:
        """Read one chunk into ``target`` from its file or its pack; returns what is wrong
        with it, or None. A corrupt chunk file is moved aside (a packed copy may still serve)."""
        path = self._chunk_path(ref.digest)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
        except OSError as e:
            return f"cannot be read ({e})"
        problem = "is missing"
        if fd is not None:
            try:
                st = os.fstat(fd)
                if st.st_size != ref.size:
                    problem = f"is {st.st_size} bytes, expected {ref.size}"
                else:
                    got = 0
                    while got < ref.size:
                        n = os.readv(fd, [target[got:]])
                        if n == 0:
                            break
                        got += n
                    if got != ref.size:
                        problem = f"is shorter than {ref.size} bytes"
                    elif hashlib.sha256(target).digest() != ref.digest:
                        problem = "does not match its digest (damaged)"
                    else:
                        return None
            except OSError as e:
                return f"cannot be read ({e})"
            finally:
                os.close(fd)
            logger.warning(
                "chunk %s in %s: %s; moved to %s",
                ref.digest.hex()[:16],
                self.directory,
                problem,
                DAMAGED_DIR,
            )
            self._discard_corrupt(path, st.st_ino)
            problem += f" (moved to {DAMAGED_DIR}/)"
        location = self._packed(ref.digest)
        if location is None:
            return problem
        if location[2] != ref.size:
            return f"is {location[2]} bytes in its pack, expected {ref.size}"
        packed_problem = self._read_packed(ref.digest, location, target, fds)
        return None if packed_problem is None else packed_problem


# ---------------------------------------------------------------------- convenience


def save_state(
    store: StateStore,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    epoch: int,
    metadata: Mapping[str, Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Manifest:
    """Checkpoint CPU tensors: the same manifest as :func:`build_manifest`, committed to
    ``store``.

    Hashing and writing run together in the store's thread pool, each full chunk written
    right after it is hashed and only if the store lacks it (small ones go into a pack). The
    tensors must not change until this returns (pass a snapshot).
    """
    named = list(named_tensors)
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}]")
    check_state_layout(named)
    # metadata is validated by build_manifest on no tensors (cheap), keeping one rule set
    empty, _ = build_manifest([], epoch, metadata, chunk_bytes)
    pieces: list[memoryview] = []
    layout: list[tuple[str, str, tuple[int, ...], int]] = []  # name, dtype, shape, n chunks
    for name, tensor in named:
        data = tensor_bytes(tensor)
        sizes = chunk_sizes(len(data), chunk_bytes)
        offset = 0
        for size in sizes:
            pieces.append(data[offset : offset + size])
            offset += size
        layout.append((name, dtype_name(tensor.dtype), tuple(tensor.shape), len(sizes)))

    with store._shared.commit_lock:
        history = store._history_for_write()
        digests = store._store_new(pieces, chunk_bytes)
        specs = []
        position = 0
        for name, dtype, shape, count in layout:
            refs = tuple(
                ChunkRef(digests[i], len(pieces[i])) for i in range(position, position + count)
            )
            position += count
            specs.append(TensorSpec(name, dtype, shape, refs))
        manifest = Manifest(empty.epoch, tuple(specs), chunk_bytes, empty.metadata)
        store._commit_locked(manifest, history, checked=True)
    return manifest


def load_state(store: StateStore) -> tuple[Manifest, list[torch.Tensor]]:
    """The newest committed state of ``store``: its manifest and verified tensors (strict:
    a damaged newest state raises; :func:`load_newest_intact` walks back instead)."""
    manifest = store.latest()
    return manifest, store.load_tensors(manifest)


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
        roots = store._read_latest()
    except NoCheckpointError:
        roots = []
    except CheckpointCorruptError as e:
        roots = []
        notes.append(str(e))
    roots = roots + store._intact_manifests(exclude=roots, problems=notes)
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
